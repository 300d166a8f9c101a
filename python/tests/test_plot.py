"""A picture of the step: LayerPlan.timeline() is the planner library's predicted course of the planned step
(its peak the plan's predicted peak), LayerPlan.plot draws it, and `python -m remat plot` draws a saved chain's."""
import json
import subprocess
import sys

import pytest
import torch

import remat

from conftest import mlp, preallocate, train_step

WAYS = {"keep": "Fa", "checkpoint": "Fc", "matmuls": "Fk[matmuls]"}


@pytest.fixture(scope="module")
def planned():
    model = mlp(depth=4)
    preallocate(model)
    # Keep or checkpoint only (with the matmuls policy, a plan running every layer under it fits halfway as well).
    lp = remat.enable(model, list(model), budget=1 << 40, policies=())
    with pytest.raises(ValueError, match="no plan with its profile yet"):
        lp.timeline()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    train_step(model, x)
    # Some layers kept, some not: checkpointing made costly in the profile (these tiny layers' checkpointed runs
    # are timed as fast as their kept ones, faster under a loaded machine's noise), halfway between the least
    # budget and every layer kept (not the plan chosen for no budget, which that noise may checkpoint).
    for st in lp.chain.stages:
        st.checkpoint_fwd_ms = st.checkpoint_bwd_ms = 1e3
    every_kept = remat.step_peak_bytes(lp.chain, lp.context, remat.no_checkpoint(lp.chain))
    lp.set_budget((lp.min_budget_bytes + every_kept) // 2)
    train_step(model, x)
    return lp


def test_the_timeline_is_the_planned_steps_predicted_course(planned):
    t = planned.timeline()
    assert t["plan"] == str(planned.plan) and t["budget_bytes"] == planned.budget_bytes
    assert max(p["peak_bytes"] for p in t["points"]) == t["peak_bytes"] == planned.predicted_peak_bytes
    assert [s["way"] for s in t["stages"]] == [WAYS[c] for c in planned.choices]
    assert len(set(planned.choices)) > 1, planned.choices
    assert all(a["end_ms"] == b["start_ms"] for a, b in zip(t["points"], t["points"][1:]))
    assert t["points"][0]["op"] == "before" and t["points"][-1]["op"] == "B(before)"


def test_plot_draws_a_picture(planned, tmp_path):
    path = tmp_path / "step.png"
    planned.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_m_remat_plot_draws_a_saved_chain(planned, tmp_path):
    chain = tmp_path / "chain.json"
    chain.write_text(planned.chain.to_json())
    out, data = tmp_path / "chain.svg", tmp_path / "timeline.json"
    budget = remat.per_layer_min_budget(planned.chain) * 2
    run = subprocess.run([sys.executable, "-m", "remat", "plot", "--chain", str(chain), "--budget", str(budget),
                          "-o", str(out), "--timeline", str(data)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert out.read_text().lstrip().startswith("<?xml") and json.loads(data.read_text())["budget_bytes"] == budget
    low = subprocess.run([sys.executable, "-m", "remat", "plot", "--chain", str(chain), "--budget", "1", "-o",
                          str(out)], capture_output=True, text=True)
    assert low.returncode == 1 and "below the least feasible one" in low.stderr, low.stderr
