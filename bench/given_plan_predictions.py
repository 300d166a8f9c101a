#!/usr/bin/env python3
"""Predicted against measured step peaks of random per-layer plans, each way mixed with the others, on the test
suite's Llama (docs/BENCHMARKS.md, "Random per-layer plans predicted to the byte").

The model is python/tests/test_hf.py's Llama (4 layers, width 64, batch 4, sequence 64; random weights, CPU),
profiled once by remat.hf.enable(offload=True, groups=True, offload_min_bytes=16 KiB). Each plan gives each
layer one way drawn at random: kept (Fa), kept with what it saves on the host (Fa@host), streamed with its
window or none (Fa@stream, Fa@stream0), under the matmuls policy (Fk[matmuls]) on the device or the host,
checkpointed (Fc) with or without its input on the host, or a random assignment of its saved groups
(Fk{khr...}). The planner's answer is replaced by that plan (LayerPlan._planned, as the tests do), and one step
is measured with remat's CPU meter twice: copies made at once (the CPU's engine) and copies carried out only
when waited for (a delayed engine, as a GPU's copies may land late). Each step is checked bitwise against the
plain run's. Each row: the plan, the prediction, both measured peaks and their errors (measured less
predicted, over predicted: negative where the model overstates).

    python bench/given_plan_predictions.py                 # 24 plans, seed 0
    python bench/given_plan_predictions.py --plans 40 --seed 3
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402

import remat  # noqa: E402
import remat.hf  # noqa: E402
from remat.offload import CopyEngine  # noqa: E402
from test_hf import make, same, step  # noqa: E402

WAYS = ["Fa{i}", "Fa{i}@host", "Fa{i}@stream", "Fa{i}@stream0", "Fk{i}[matmuls]", "Fk{i}[matmuls]@host", "Fc{i}",
        "Fc{i}@host", "groups", "groups"]


def draw(chain, rng: random.Random) -> tuple[str, list[int]]:
    """A random per-layer plan's text and its stream windows (the chain's where streamed with one)."""
    n = len(chain.stages)
    fwd, bwd, windows = [], [], []
    for i, st in enumerate(chain.stages):
        way = rng.choice(WAYS)
        if way == "groups":
            way = "Fk{i}{{" + "".join(rng.choice("khr") for _ in st.groups) + "}}"
        op = way.format(i=i)
        windows.append(st.offload.window_bytes if op.endswith("@stream") else 0)
        fwd.append(op.replace("@stream0", "@stream"))
    for i in reversed(range(n)):
        if fwd[i].startswith("Fc"):
            bwd.append(f"Fa{i}")
        bwd.append(f"B{i}")
    return " ".join(fwd + ["L"] + bwd), windows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=int, default=24, help="how many random plans")
    ap.add_argument("--seed", type=int, default=0, help="the plans' random seed")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    meter = remat.cpu_meter()
    model, spec = make("llama")
    plain = [step(model, spec, k, meter) for k in range(2)]
    model, spec = make("llama")
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10, groups=True)
    same(plain[0], step(model, spec, 0, meter))
    chain = lp.chain
    cpu = torch.device("cpu")
    rng = random.Random(args.seed)
    print(f"torch {torch.__version__}; test_hf.py's Llama, {len(chain.stages)} layers, "
          f"{[len(st.groups) for st in chain.stages]} saved groups")
    print(f"{'plan':<92} {'predicted':>10} {'at once':>10} {'error':>7} {'delayed':>10} {'error':>7}")
    errors = {"at once": [], "delayed": []}
    for _ in range(args.plans):
        text, windows = draw(chain, rng)
        ops = text.split()
        plan = remat.Plan.from_json(json.dumps({"num_stages": len(chain.stages), "ops": ops,
                                                "stream_windows": windows, "policies": list(chain.policies)}))
        predicted = remat.step_peak_bytes(chain, lp.context, plan)
        lp._planned = lambda shape, ctx, budget, plan=plan, predicted=predicted: (plan, predicted)
        lp.set_budget(1 << 39)
        row = []
        for name, engine in (("at once", CopyEngine(cpu)), ("delayed", CopyEngine(cpu, delay=100))):
            lp.offloads.engines[cpu] = engine
            got = step(model, spec, 1, meter)
            same(plain[1], got)
            error = got[2] / predicted - 1
            errors[name].append(error)
            row += [got[2], error]
        forward = " ".join(ops[: len(chain.stages)])
        print(f"{forward:<92} {predicted:>10} {row[0]:>10} {row[1]:>+7.2%} {row[2]:>10} {row[3]:>+7.2%}", flush=True)
    for name, e in errors.items():
        print(f"{name}: errors from {min(e):+.2%} to {max(e):+.2%}; "
              f"{sum(abs(x) < 1e-4 for x in e)} of {len(e)} within 0.01%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
