#!/usr/bin/env python3
"""Steps that call the model twice before the backward pass, against the budget (docs/BENCHMARKS.md, "Several
calls before one backward pass").

The model: python/tests/test_hf.py's paired_llama(128, 6): a Llama of 6 layers, width 128 (4 heads, 2 key-value
heads, MLP 512), vocabulary 128, random weights, fp32 on the CPU. A step (test_hf.two_calls) calls it on a batch
of 8 sequences of 256 tokens with labels and on a second batch (sequence 256, or as --second says), then runs
the backward passes in an order:

- one: one backward pass for the first loss plus half the second;
- second first, first first: a backward pass for each loss, in that order.

remat.hf.enable(model, offload=True, groups=True) profiles on the first step; each row is then one step at a
budget (1, 1.5 and 2.5 times the least feasible budget remat names): the plan, the prediction, the measured
peak above the bytes alive before the first call (remat's CPU meter), and that peak as a share of the budget.
Every step is checked bitwise against the plain run's.

    python bench/calls_before_backward.py [--second 128] [--order "one,second first,first first"]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402

import remat  # noqa: E402
import remat.hf  # noqa: E402
import test_hf as T  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--second", type=int, default=256, help="the second call's sequence length")
    ap.add_argument("--order", default="one,second first,first first")
    args = ap.parse_args()
    meter = remat.cpu_meter()
    print(f"remat {remat.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"second call's sequence {args.second}")
    print(f"{'order':<13} {'x least':>7} {'budget':>11} {'predicted':>11} {'measured':>11} {'/budget':>8}  plan")
    for order in args.order.split(","):
        model = T.paired_llama(128, 6)
        plain_model = copy.deepcopy(model)
        plain = [T.two_calls(plain_model, k, order, meter, 8, 256, args.second) for k in range(4)]
        lp = remat.hf.enable(model, budget=1 << 40, offload=True, groups=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            T.same(plain[0], T.two_calls(model, 0, order, meter, 8, 256, args.second))
            least = lp.min_budget_bytes
            for k, times in enumerate((1.0, 1.5, 2.5), start=1):
                try:
                    lp.set_budget(int(times * least))
                    got = T.two_calls(model, k, order, meter, 8, 256, args.second)
                except remat.InfeasibleBudget as e:
                    print(f"{order:<13} {times:>7} refused: {str(e)[:120]}")
                    continue
                T.same(plain[k], got)
                print(f"{order:<13} {times:>7} {lp.budget_bytes:>11} {lp.predicted_peak_bytes:>11} {got[2]:>11} "
                      f"{got[2] / lp.budget_bytes:>8.3f}  {' '.join(lp.choices)}")


if __name__ == "__main__":
    main()
