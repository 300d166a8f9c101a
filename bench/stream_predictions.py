#!/usr/bin/env python3
"""Predicted against measured step peaks of the test suite's BERT between its least budget and its plain step,
with and without offloading, with and without output_hidden_states (docs/BENCHMARKS.md, "Streamed and kept
layers predicted to the byte").

The model is python/tests/test_hf.py's BERT (4 layers, width 64, batch 4, sequence 64; random weights, CPU), its
loss the square of last_hidden_state, which the caller holds to the step's end. remat.hf.enable(offload=...,
offload_min_bytes=16 KiB) profiles it in one step; for each budget, at a share of the way from the least feasible
one (LayerPlan.min_budget_bytes) to the plain step's measured peak, two planned steps are measured with remat's
CPU meter. Each row: the plan, the prediction, the larger measured peak, and the error (measured less predicted,
over predicted: negative where the model overstates). With --without-ahead, each prediction is also given as it
was with a streamed layer charged its whole window ahead of its backward (OffloadCost.ahead_bytes unset).

    python bench/stream_predictions.py
    python bench/stream_predictions.py --shares 0 0.3 0.6 --without-ahead
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import remat  # noqa: E402
import remat.hf  # noqa: E402
from least_budget_predictions import without_offload_figure  # noqa: E402
from test_hf import batch, make, step  # noqa: E402


def without_ahead(lp) -> int:
    """The plan's predicted step peak with no stage's ahead_bytes: each streamed tail charged its window."""
    return without_offload_figure(lp, "ahead_bytes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.3, 0.6, 1.0],
                    help="budgets, as shares of the way from the least budget to the plain step's peak")
    ap.add_argument("--without-ahead", action="store_true",
                    help="also predict each plan with every streamed tail charged its whole window")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    meter = remat.cpu_meter()
    plain_model, spec = make("bert")
    plain = max(step(plain_model, spec, k, meter)[2] for k in (0, 1))
    print(f"plain step: {plain:,} bytes")
    print("| hidden states | offload | share | plan | predicted | measured | error |"
          + (" window ahead |" if args.without_ahead else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.without_ahead else ""))
    for hidden_states in (False, True):
        def make_batch(s, k, hs=hidden_states):
            return dict(batch(s, k), output_hidden_states=hs)

        for offload in (False, True):
            model, spec = make("bert")
            lp = remat.hf.enable(model, budget=1 << 40, offload=offload, offload_min_bytes=16 << 10)
            step(model, spec, 0, meter, make_batch=make_batch)
            least = lp.min_budget_bytes
            for share in args.shares:
                lp.set_budget(int(least + share * (plain - least)))
                peak = max(step(model, spec, k, meter, make_batch=make_batch)[2] for k in (1, 2))
                predicted = lp.predicted_peak_bytes
                row = (f"| {'yes' if hidden_states else 'no'} | {'yes' if offload else 'no'} | {share:g} | "
                       f"`{lp.plan}` | {predicted:,} | {peak:,} | {(peak - predicted) / predicted:+.2%} |")
                if args.without_ahead:
                    old = without_ahead(lp)
                    row += f" {old:,} ({(peak - old) / old:+.2%}) |"
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
