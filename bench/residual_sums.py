#!/usr/bin/env python3
"""Predicted against measured step peaks of layers whose residual sum is the model's (`x = x + layer(x)`), under
CPU bf16 autocast (docs/BENCHMARKS.md, "Residual sums outside the layers under autocast").

The model is python/tests/test_prediction.py's _SumsOutside: four feed-forward layers (Linear 64 -> 256, GELU,
Linear 256 -> 64, and a last module: none, a sigmoid or a GELU), `x = x + layer(x)` between them, 256 rows; its
forward under CPU bf16 autocast (--fp32: without). Each variant is profiled once under remat.enable, then for
each trial its stages' times are drawn at random (so that other ways win) and it is planned again with
set_budget at a budget between the least and 1.6 times it; each new plan runs two steps, the last one measured
and checked bitwise (loss, gradients, the next random draw) against the plain model's step. Each row: the
variant, the plan, the prediction, the measured peak and the error (measured less predicted, over predicted:
negative where the model overstates).

    python bench/residual_sums.py [--trials 40] [--fp32]

--offload runs instead random per-layer plans with offloading on the same layers in fp32 (their last module
none, a sigmoid or a GELU; profiled with offload=True, offload_min_bytes 16 KiB, the matmuls policy offered):
each layer kept, kept on the host, streamed with its window or none, checkpointed with or without its input on
the host, or under the matmuls policy on the device or the host, drawn at random and given in place of the
planner's (LayerPlan.choose_plan, as the tests do); each plan's step measured with the planned layers' own copy
engine (copies made at once, their sources held until waited for) and with copies carried out only when waited
for, each checked bitwise. Per variant: the errors' range, how many within 0.01%, and each plan above its
prediction.

    python bench/residual_sums.py --offload [--trials 60]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402

import remat  # noqa: E402
from conftest import assert_same_run, train_step  # noqa: E402
from test_prediction import _SumsOutside  # noqa: E402

VARIANTS = {  # name: (the layers' last module, the policies offered)
    "linear-last": (None, ()),
    "linear-last-matmuls": (None, ("matmuls",)),
    "sigmoid-last": (torch.nn.Sigmoid, ()),
    "gelu-last-matmuls": (torch.nn.GELU, ("matmuls",)),
}


def run(name: str, trials: int, autocast: bool, meter) -> list[tuple[str, int, int, float]]:
    last, policies = VARIANTS[name]
    plain, m = (_SumsOutside(False, last=last, autocast=autocast) for _ in range(2))
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=policies, replan_on_overshoot=False)
    train_step(m, x, meter, seed=0, set_to_none=True)  # the profiling step
    rng = random.Random(0)
    rows, seen = [], set()
    for _ in range(trials):
        for st in lp.chain.stages:
            st.fwd_ms, st.bwd_ms, st.checkpoint_fwd_ms, st.checkpoint_bwd_ms = (rng.uniform(0.5, 4) for _ in range(4))
            for c in st.policies:
                c.fwd_ms, c.bwd_ms = rng.uniform(0.3, 2), rng.uniform(0.5, 3)
        lp.set_budget(int(lp.min_budget_bytes * rng.uniform(1.0, 1.6)))
        plan = str(lp.plan)
        if plan in seen:
            continue
        seen.add(plan)
        for s in (1, 2):
            ran = train_step(m, x, meter, seed=s, set_to_none=True)
        assert_same_run(train_step(plain, x, None, seed=2, set_to_none=True), ran)
        rows.append((plan, lp.predicted_peak_bytes, lp.last_peak_bytes, lp.prediction_error))
    return rows


OFFLOAD_WAYS = ["Fa{i}", "Fa{i}@host", "Fa{i}@stream", "Fa{i}@stream0", "Fc{i}", "Fc{i}@host", "Fk{i}[matmuls]",
                "Fk{i}[matmuls]@host"]


def run_offload(last, trials: int, meter) -> tuple[list[float], list[str]]:
    """--offload: `trials` random per-layer plans on _SumsOutside layers ending in `last`: the errors (both
    engines) and the plans above their predictions."""
    from conftest import backward_ops, give_plan
    from remat.offload import CopyEngine
    plain, m = (_SumsOutside(False, last=last) for _ in range(2))
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=("matmuls",), offload=True,
                      offload_min_bytes=16 << 10, replan_on_overshoot=False)
    train_step(m, x, meter, seed=0, set_to_none=True)  # the profiling step
    rng = random.Random(0)
    cpu = torch.device("cpu")
    errors, above = [], []
    for _ in range(trials):
        fw = [rng.choice(OFFLOAD_WAYS).format(i=i) for i in range(len(m.layers))]
        windows = [0 if w.endswith("@stream0") else st.offload.window_bytes for w, st in zip(fw, lp.chain.stages)]
        ops = [w.replace("@stream0", "@stream") for w in fw]
        give_plan(lp, ops + backward_ops(ops), stream_windows=windows, policies=["matmuls"])
        for engine in (CopyEngine(cpu, hold=True), CopyEngine(cpu, delay=100)):
            lp.offloads.engines[cpu] = engine
            ran = train_step(m, x, meter, seed=2, set_to_none=True)
            assert_same_run(train_step(plain, x, None, seed=2, set_to_none=True), ran)
            errors.append(lp.prediction_error)
            if lp.last_peak_bytes > lp.predicted_peak_bytes:
                above.append(f"{' '.join(fw)} ({'held' if engine.hold else 'late'}): {lp.last_peak_bytes:,} held, "
                             f"{lp.predicted_peak_bytes:,} predicted")
    return errors, above


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=40, help="budgets drawn per variant (default 40)")
    ap.add_argument("--fp32", action="store_true", help="without autocast")
    ap.add_argument("--offload", action="store_true", help="random per-layer plans with offloading (fp32)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    warnings.simplefilter("ignore", RuntimeWarning)  # the planned steps below their predictions say so
    meter = remat.cpu_meter()
    if a.offload:
        print(f"torch {torch.__version__}, fp32, {a.trials} random plans per variant, two copy engines each")
        print("| layers end in | steps | errors | within 0.01% | above |\n| --- | ---: | --- | ---: | ---: |")
        for name, last in (("a Linear", None), ("a sigmoid", torch.nn.Sigmoid), ("a GELU", torch.nn.GELU)):
            errors, above = run_offload(last, a.trials, meter)
            print(f"| {name} | {len(errors)} | {min(errors):+.2%} to {max(errors):+.2%} | "
                  f"{sum(abs(e) < 1e-4 for e in errors)} | {len(above)} |", flush=True)
            for line in above:
                print(f"    above: {line}")
        return 0
    print(f"torch {torch.__version__}, {'fp32' if a.fp32 else 'CPU bf16 autocast'}, {a.trials} trials per variant")
    print("| variant | plan | predicted | measured | error |\n| --- | --- | ---: | ---: | ---: |")
    for name in VARIANTS:
        rows = run(name, a.trials, not a.fp32, meter)
        for plan, predicted, measured, error in rows:
            print(f"| {name} | {plan} | {predicted:,} | {measured:,} | {error:+.2%} |")
        errors = [r[3] for r in rows]
        print(f"| {name} | {len(rows)} plans | | | {min(errors):+.2%} to {max(errors):+.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
