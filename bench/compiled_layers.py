#!/usr/bin/env python3
"""Layers compiled one by one under remat's plans, beside torch.compile's activation_memory_budget on the whole
model, at the same memory (issue 32's compiled-layers table in docs/BENCHMARKS.md).

One process, GPT-2 small's width from its config (random weights, CPU), every way's step measured with remat's
CPU meter (the peak above the bytes alive before the forward, gradients pre-allocated) and timed:

  none              the plain eager step (every ratio's denominator, paired step by step)
  layers            each layer compiled (layer.compile()), nothing checkpointed
  layers+hf         each layer compiled, with gradient_checkpointing_enable() (non-reentrant): every layer
                    checkpointed inside its compiled graph
  compile:B         the step's forward under torch.compile with activation_memory_budget B (hf_compare.py's)
  remat@compile:B   each layer compiled, remat.hf.enable planned at compile:B's measured peak (profiled once:
                    the profiling step runs the layers eagerly; set_budget re-plans, the layers recompile)

Rounds as in hf_compare.py: each way's ratio in a round is the median of its steps over the median of the
plain steps paired with them; the table gives the median of the rounds' ratios and the measured peaks.

    python bench/compiled_layers.py --layers 6 --batch 8 --seq 128 --rounds 3 --json out/compiled.json
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import remat  # noqa: E402
import remat.hf  # noqa: E402
import transformers  # noqa: E402
from hf_compare import (add_common_args, build, compiled, grads_ready, measure, remat_at_peaks,  # noqa: E402
                        remat_rounds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, layers=6)
    args = ap.parse_args()
    if remat.hf.wraps_whole_call():
        sys.exit(f"compiled_layers.py: transformers {transformers.__version__} checkpoints a layer's whole call, "
                 "around its compiled graph (before 5.23), where remat.hf.enable refuses layers compiled on their "
                 "own (docs/python.md, Limits); run it with transformers 5.23 or later")
    meter = remat.cpu_meter()
    base, batch, loss_of, _ = build("gpt2", args)

    def eager(model):
        return model, (lambda: loss_of(model(**batch)))

    def layers_compiled():
        m = copy.deepcopy(base)
        for layer in m.transformer.h:
            layer.compile()
        return m

    ways = {"none": eager(base), "layers": eager(layers_compiled())}
    hf = layers_compiled()
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ways["layers+hf"] = eager(hf)
    for b in args.compile:
        ways[f"compile:{b}"] = (base, compiled(base, batch, loss_of, b))
    for model, _ in ways.values():
        grads_ready(model)

    peaks, first_s = {}, {}
    for w, (model, run) in ways.items():
        t0 = time.perf_counter()
        measure(model, run, meter, 1)
        first_s[w] = time.perf_counter() - t0
        _, peaks[w] = measure(model, run, meter, 1)
        print(f"{w}: peak {peaks[w] / 2**20:.1f} MiB (first step {first_s[w]:.1f} s)", file=sys.stderr, flush=True)

    rm = layers_compiled()
    lp, plans, profile_s = remat_at_peaks(rm, batch, loss_of, meter,
                                          {w: p for w, p in peaks.items() if w.startswith("compile:")})
    rows, results, plain_all = remat_rounds(ways, rm, lp, plans, batch, loss_of, meter, args)

    print(f"\ngpt2: {args.layers} layers, batch {args.batch}, seq {args.seq}; eager plain step "
          f"{statistics.median(plain_all):.0f} ms, peak {peaks['none'] / 2**20:.1f} MiB; remat's profiling step "
          f"{profile_s:.1f} s")
    print(f"{'way':<22} {'peak MiB':>9} {'time/none':>9}  rounds")
    for r in rows:
        ratios = results[r]["ratios"]
        extra = ""
        if r.startswith("remat@"):
            extra = f"  predicted {plans[r[6:]]['predicted'] / 2**20:.1f} MiB, {plans[r[6:]]['plan']}"
        print(f"{r:<22} {results[r]['peak'] / 2**20:9.1f} {statistics.median(ratios):9.2f}  "
              + ", ".join(f"{v:.2f}" for v in ratios) + extra)
    for w, p in plans.items():
        if "infeasible" in p:
            print(f"remat@{w:<16} infeasible: least budget {p['infeasible'] / 2**20:.1f} MiB")
    if args.json:
        out = dict(layers=args.layers, batch=args.batch, seq=args.seq, rounds=args.rounds, steps=args.steps,
                   eager_plain_ms=statistics.median(plain_all), first_step_s=first_s, remat_profile_s=profile_s,
                   plans=plans, peaks=peaks,
                   rows={r: dict(peak_bytes=results[r]["peak"], ratio=statistics.median(results[r]["ratios"]),
                                 ratios=results[r]["ratios"], ms=results[r]["ms"]) for r in rows},
                   torch=torch.__version__)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
