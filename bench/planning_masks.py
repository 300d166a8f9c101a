#!/usr/bin/env python3
"""The per-layer program's planning time with masks taken by some layers (docs/BENCHMARKS.md, "Planner speed").

A profile saved by bench/offload_cuda.py (its JSON's chain and context: by default BERT-large's on the H200,
bench/results/2026-12-04-h200/offload-bert.json) is planned with offloading at a budget (by default the JSON's
peak of Hugging Face's per-layer checkpointing), its context's masks (StepContext.taken_bytes, taken_by,
taken_saved_by) replaced by one of four patterns of masks (1 MiB each, or --mask-bytes) that no layer's graph
saves: none; one taken by every layer; two taken by alternate layers (a Gemma-2's sliding and global masks);
four, each taken by every fourth layer (the program's most states: 16 sets of masks held). Each row: the median
of --rounds calls of remat.plan_step, the least budget's search (remat.min_step_budget, once), the least budget
and the plan's predicted time, and a digest of the plan's text, which a change that only prunes must leave as it
was.

    python bench/planning_masks.py
    python bench/planning_masks.py --json bench/results/2026-12-04-h200/offload-llama.json --rounds 5
    python bench/planning_masks.py --mask-bytes 2147483648        # a real Gemma-2's masks at sequence 8,192
    python bench/planning_masks.py --budget 28000000000 --patterns none --rounds 1
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import remat
from remat import _core


def context(figures: dict, n: int, patterns, mask_bytes: int = 1 << 20) -> _core.StepContext:
    """The JSON's step context with the masks of `patterns` (per mask, which of the n layers take it), each of
    `mask_bytes`."""
    ctx = _core.StepContext()
    for key, value in figures.items():
        if key.startswith("taken") or not hasattr(ctx, key):
            continue
        setattr(ctx, key, value)
    ctx.taken_bytes = [mask_bytes] * len(patterns)
    ctx.taken_by = [[bool(p(i)) for i in range(n)] for p in patterns]
    ctx.taken_saved_by = [[False] * n for _ in patterns]
    ctx.before_saved_bytes = max(ctx.before_saved_bytes, sum(ctx.taken_bytes))  # the masks are part of it
    return ctx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench/results/2026-12-04-h200/offload-bert.json")
    ap.add_argument("--budget", type=int, help="bytes (default: the JSON's peaks.hf)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mask-bytes", type=int, default=1 << 20, help="each mask's bytes (default 1 MiB)")
    ap.add_argument("--patterns", default="none,one,two-alternating,four-disjoint",
                    help="which patterns of masks, comma-separated")
    a = ap.parse_args()
    with open(a.json) as f:
        d = json.load(f)
    chain = remat.Chain.from_json(json.dumps(d["chain"]))
    n = len(chain.stages)
    budget = a.budget if a.budget is not None else d["peaks"]["hf"]
    cases = {
        "none": [],
        "one": [lambda i: True],
        "two-alternating": [lambda i: i % 2 == 0, lambda i: i % 2 == 1],
        "four-disjoint": [lambda i, r=r: i % 4 == r for r in range(4)],
    }
    print(f"{a.json}: {n} layers, budget {budget} bytes, masks of {a.mask_bytes} bytes, median of {a.rounds}")
    for name in a.patterns.split(","):
        if name not in cases:
            raise SystemExit(f"planning_masks.py: --patterns: no pattern '{name}' (those known: {', '.join(cases)})")
        patterns = cases[name]
        ctx = context(d["context"], n, patterns, a.mask_bytes)
        times = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            planned = remat.plan_step(chain, ctx, budget, "per-layer", offload=True)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        least = remat.min_step_budget(chain, ctx, "per-layer", offload=True)
        least_s = time.perf_counter() - t
        digest = hashlib.sha1(planned.plan.to_string().encode()).hexdigest()[:10]
        print(f"{name:16s} plan {statistics.median(times):6.3f} s  least {least_s:6.3f} s  least={least}  "
              f"ms={planned.step_time_ms:.3f}  plan {digest}", flush=True)


if __name__ == "__main__":
    main()
