#!/usr/bin/env python3
"""What many input shapes cost a planned model (docs/BENCHMARKS.md, "Many input shapes"): batches padded to
their longest sequence (Hugging Face's DataCollatorWithPadding by default) give a new shape at almost every
step, and remat profiles each new shape in its first step; padded to a multiple of --multiple they give a few.

The model: python/tests/test_hf.py's paired_llama(128, 6) (a Llama of 6 layers, width 128, vocabulary 128,
random weights), fp32 on the CPU. --steps batches of 8 sequences, each sequence's length drawn from one fixed
generator (e to the power of a normal draw of mean 4 and deviation 0.6, about 55 tokens at the median, within
8 and 256 tokens: sentences of a fine-tuning set), padded with attention mask 0 and labels -100. Each way runs the
same batches with an SGD step: plainly, under Hugging Face's gradient_checkpointing_enable(), under
remat.hf.enable(model, budget=--budget) (a shape that a planned one covers runs its plan: borrow_plans), and
under it with borrow_plans=False (remat-each: every shape profiled); each with batches padded to their longest
sequence and to a multiple of --multiple, the ways in turn for --rounds rounds. Printed per way: the shapes, the
profiled shapes (LayerPlan.profiled_shapes), those that borrowed a plan (LayerPlan.borrowed_shapes), and the
medians over the rounds of the seconds of all steps (and as a share of the
plain way's, padded alike), of the steps that were each shape's first, and of the median step after those.
Times only: the tests check the gradients.

    python bench/many_shapes.py [--steps 60] [--multiple 64] [--budget 60MiB] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402

import remat  # noqa: E402
import remat.hf  # noqa: E402
import test_hf as T  # noqa: E402


def batches(steps: int, batch: int, multiple: int):
    """The same sequences each time: (input_ids, attention_mask, labels), padded to the batch's longest sequence
    rounded up to `multiple` (1: not rounded)."""
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        lengths = (4 + 0.6 * torch.randn(batch, generator=g)).exp().round().clamp(8, 256).long()
        ids = torch.randint(1, 128, (batch, int(lengths.max())), generator=g)
        width = -(-int(lengths.max()) // multiple) * multiple
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        padded = torch.zeros(batch, width, dtype=torch.long)
        padded[:, :ids.shape[1]] = ids
        padded *= mask
        yield padded, mask, padded.masked_fill(mask == 0, -100)


def run(way: str, steps: int, multiple: int, budget: str):
    model = T.paired_llama(128, 6)
    lp = None
    if way == "hf":
        model.gradient_checkpointing_enable()
    elif way in ("remat", "remat-each"):
        lp = remat.hf.enable(model, budget=budget, borrow_plans=way == "remat")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen, times, firsts = set(), [], []
    t_all = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ids, mask, labels in batches(steps, 8, multiple):
            t0 = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            (times if ids.shape in seen else firsts).append(time.perf_counter() - t0)
            seen.add(ids.shape)
    total = time.perf_counter() - t_all
    return len(seen), (lp.profiled_shapes if lp else 0), (lp.borrowed_shapes if lp else 0), total, statistics.median(times) if times else float("nan"), \
        sum(firsts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--multiple", type=int, default=64)
    ap.add_argument("--budget", default="60MiB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"remat {remat.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{args.steps} steps, batch 8, lengths 8 to 256; remat's budget {args.budget}; medians of {args.rounds} rounds")
    print(f"{'way':<10} {'padded to':<14} {'shapes':>6} {'profiled':>8} {'borrowed':>8} {'all steps s':>11} "
          f"{'/plain':>7} {'first steps s':>13} {'median later ms':>15}")
    ways = [(multiple, way) for multiple in (1, args.multiple) for way in ("plain", "hf", "remat", "remat-each")]
    runs = {w: [] for w in ways}
    for _ in range(args.rounds):  # the ways in turn, round after round
        for w in ways:
            runs[w].append(run(w[1], args.steps, w[0], args.budget))
    for multiple, way in ways:
        shapes, profiled, borrowed = runs[(multiple, way)][0][:3]
        total, median, firsts = (statistics.median(r[k] for r in runs[(multiple, way)]) for k in (3, 4, 5))
        plain = statistics.median(r[3] for r in runs[(multiple, "plain")])
        padded = "longest" if multiple == 1 else f"multiple of {multiple}"
        print(f"{way:<10} {padded:<14} {shapes:>6} {profiled:>8} {borrowed:>8} {total:>11.2f} {total / plain:>7.2f} "
              f"{firsts:>13.2f} {median * 1000:>15.0f}")


if __name__ == "__main__":
    main()
