#!/usr/bin/env python3
"""remat's own cost at the same plan: remat.hf.enable running a given per-layer plan against PyTorch running the
same plan through Hugging Face's hook (issue 32's "no cost of its own", docs/BENCHMARKS.md).

Two pairs, each the same schedule run two ways on copies of one model (same weights, same batch):

  all-checkpoint   gradient_checkpointing_enable() (non-reentrant)  vs  remat.hf.enable(plan=every layer "C")
  all-matmuls      the same with selective checkpointing saving the   vs  remat.hf.enable(plan=every layer "M")
                   matrix multiplications (create_selective_checkpoint_contexts, remat.matmuls)

Steps alternate A, B, A, B, ... (which goes first alternates per pair too) after `--warmup` steps of each; a
pair's ratio is B's time over A's. The table gives the median ratio over `--pairs` pairs and a 95% interval of
that median (the order statistics of a binomial(n, 1/2)), so that a difference of 0.01 is resolved when the
interval is narrower than that.

    python bench/own_cost.py --model gpt2 --layers 6 --pairs 30 --json out/own-cost-gpt2.json
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from functools import partial

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import remat
import remat.hf
from remat.policies import matmuls

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_compare import build, grads_ready  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/../python/tests")
from conftest import per_layer_plan  # noqa: E402  (the test suite's per-layer plan of given choices)


def median_interval(xs):
    """The median and a 95% interval of it from order statistics (binomial(n, 1/2))."""
    xs = sorted(xs)
    n = len(xs)
    # the largest k with P(Binomial(n, 1/2) < k) <= 0.025
    cdf, k = 0.0, 0
    while True:
        p = math.comb(n, k) / 2 ** n
        if cdf + p > 0.025:
            break
        cdf += p
        k += 1
    lo, hi = xs[max(k - 1, 0)], xs[min(n - k, n - 1)]
    return statistics.median(xs), lo, hi


def step_time(model, run):
    model.zero_grad(set_to_none=False)
    t0 = time.perf_counter()
    loss = run()
    loss.backward()
    return (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base, batch, loss_of, _ = build(args.model, args)
    n = len(remat.hf.layers_of(base))

    def way(kind):
        m = copy.deepcopy(base)
        if kind == "hf":
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif kind == "sac":
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
                "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, matmuls)})
        else:
            remat.hf.enable(m, plan=per_layer_plan(["checkpoint" if kind == "C" else "matmuls"] * n))
        grads_ready(m)
        return m, (lambda m=m: loss_of(m(**batch)))

    out = {"model": args.model, "layers": n, "batch": args.batch, "seq": args.seq, "pairs": args.pairs,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": []}
    for name, a_kind, b_kind in (("all-checkpoint", "hf", "C"), ("all-matmuls", "sac", "M")):
        a, b = way(a_kind), way(b_kind)
        for _ in range(args.warmup):
            step_time(*a)
            step_time(*b)
        ratios, ta, tb = [], [], []
        for k in range(args.pairs):
            if k % 2 == 0:
                x = step_time(*a)
                y = step_time(*b)
            else:
                y = step_time(*b)
                x = step_time(*a)
            ta.append(x)
            tb.append(y)
            ratios.append(y / x)
        med, lo, hi = median_interval(ratios)
        row = dict(way=name, pytorch_ms=statistics.median(ta), remat_ms=statistics.median(tb), ratio=med,
                   ratio_lo=lo, ratio_hi=hi, ratios=ratios)
        out["rows"].append(row)
        print(f"{args.model} {name}: PyTorch {row['pytorch_ms']:.0f} ms, remat {row['remat_ms']:.0f} ms, "
              f"remat / PyTorch {med:.3f} (95% interval of the median {lo:.3f} to {hi:.3f}, {args.pairs} pairs)",
              flush=True)
        del a, b
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
