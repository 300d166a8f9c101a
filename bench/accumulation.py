#!/usr/bin/env python3
"""Gradient accumulation against the budget (docs/BENCHMARKS.md, "Gradient accumulation").

The model: python/tests/test_hf.py's paired_llama(128, 6): a Llama of 6 layers, width 128 (4 heads, 2 key-value
heads, MLP 512), vocabulary 128, random weights, fp32 on the CPU. An optimizer step accumulates two micro-batches
of 4 sequences from gradients set to None: the first micro-batch's backward makes the parameter gradients, the
second's adds to them. The micro-batches' lengths alternate from step to step (256 then --short, then --short
then 256), so that the short shape is first profiled at a second micro-batch, with the gradients present, and
later runs first, without them (borrow_plans=False: each length is profiled on its own).

remat.hf.enable(model, budget) at --share of the plain step's measured peak (the 256-token micro-batch's, with
the gradients made); each row is one micro-batch after the profiling steps: whether its step began with the
gradients None, the plan in force, its prediction, the measured peak above the bytes alive when the model was
called (remat's CPU meter), their difference as a share of the prediction, and the peak as a share of the budget.
Every step is checked bitwise against the plain run's accumulated gradients.

    python bench/accumulation.py [--short 128] [--share 0.6] [--steps 4]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402

import remat  # noqa: E402
import remat.hf  # noqa: E402
import test_hf as T  # noqa: E402


def micro(model, ids, meter):
    """One micro-batch's forward and backward; the peak above the bytes alive at the call."""
    base = meter.active()
    meter.reset_peak()
    model(input_ids=ids, labels=ids).loss.backward()
    return meter.peak() - base


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=128, help="the second length (tokens)")
    ap.add_argument("--share", type=float, default=0.6, help="the budget as a share of the plain peak")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps after the two that profile")
    a = ap.parse_args()
    meter = remat.cpu_meter()
    torch.manual_seed(0)
    batches = {n: torch.randint(0, 128, (4, n)) for n in (256, a.short)}
    plain = T.paired_llama(128, 6)
    model = copy.deepcopy(plain)
    plain.zero_grad(set_to_none=True)
    plain_peak = micro(plain, batches[256], meter)
    budget = int(a.share * plain_peak)
    lp = remat.hf.enable(model, budget=budget, borrow_plans=False)
    print(f"plain peak {plain_peak / 2**20:.2f} MiB; budget {budget / 2**20:.2f} MiB ({a.share:.0%})")
    print(f"{'step':>4} {'micro':>5} {'tokens':>6} {'grads None':>10} {'predicted MiB':>13} {'measured MiB':>12} "
          f"{'off':>7} {'of budget':>9}  plan")
    warnings.simplefilter("ignore")
    for step in range(2 + a.steps):
        order = [256, a.short] if step % 2 == 0 else [a.short, 256]
        grads, rows = [], []
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            for k, n in enumerate(order):
                torch.manual_seed(100 * step + k)
                none = next(m.parameters()).grad is None
                micro(m, batches[n], meter)
                if m is model and step >= 2:  # the plan that ran this micro-batch, and its step's peak
                    rows.append((k, n, none, lp.predicted_peak_bytes, lp.last_peak_bytes, str(lp.plan)))
            grads.append([p.grad for p in m.parameters()])
        assert all(torch.equal(g, h) for g, h in zip(*grads)), f"step {step}: gradients differ from the plain run's"
        for k, n, none, pred, got, plan in rows:
            print(f"{step:>4} {k:>5} {n:>6} {str(none):>10} {pred / 2**20:>13.3f} {got / 2**20:>12.3f} "
                  f"{(got - pred) / pred:>+7.2%} {got / budget:>9.1%}  {plan}")


if __name__ == "__main__":
    main()
