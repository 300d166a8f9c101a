#!/usr/bin/env python3
"""What Python's cycle collector costs a checkpointed training loop (docs/BENCHMARKS.md, "Python's garbage
collector in a checkpointed step"): a chain of Transformers Llama decoder layers (width 64, 4 heads, 2 key-value
heads, sequence 16, batch 1, CPU bf16 autocast), stepped --steps times after --warmup, each way in a process of
its own, with and without `gc.freeze()` after the warm-up. Per way: the step's median and mean (ms), and the
collections of each generation with the time they took (gc.callbacks).

A checkpointed step holds the Python objects its saved-tensor hooks make from the forward pass to the backward
(torch.utils.checkpoint's holders, remat's records and Offloads): they outlive the young collections the step's
allocations trigger and are moved to the oldest generation, and once enough have been moved since the last full
collection, Python collects every object of the process (a model's and its libraries': about 400,000 here),
which a median of step times leaves out and a mean does not. `gc.freeze()` moves what exists then (the model,
the libraries) out of the collector's reach, so that a full collection reads only what came after.

Ways: `plain` (the layers kept), `torch` (torch.utils.checkpoint around each layer, as Hugging Face's
gradient_checkpointing_enable() runs it), and remat.enable with a given plan of one choice for every layer
(`checkpoint`, `checkpoint@host`, `keep@host`: offload=True).

    taskset -c 1 python bench/gc_cost.py [--layers 32] [--steps 300] [--ways plain,torch,checkpoint,checkpoint@host]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time


class Collections:
    """Python's collections that begin while `on`, by generation (2: the full ones): their counts and time (ms),
    read by gc.callbacks. A median of step times leaves them out, a mean does not (docs/BENCHMARKS.md, "Python's
    garbage collector in a checkpointed step"; bench/hf_compare.py's paired rounds read the full ones)."""

    def __init__(self, on: bool = False):
        self.on, self.count, self.ms, self._t0 = on, [0, 0, 0], [0.0, 0.0, 0.0], None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter() if self.on else None
        elif self._t0 is not None:
            g = info["generation"]
            self.count[g] += 1
            self.ms[g] += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)
        return False


def one(way: str, layers: int, steps: int, warmup: int, freeze: bool) -> dict:
    import torch
    import transformers
    from torch.utils.checkpoint import checkpoint

    import remat
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from checkpoint_overhead import _Layers, per_layer_plan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers, vocab_size=100,
                                   max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randn(1, 16, 64, requires_grad=True)
    pos = model.model.rotary_emb(x, torch.arange(16)[None])
    chain = _Layers(model.model.layers, pos)
    if way == "torch":
        def f(h):
            for layer in model.model.layers:
                h = checkpoint(lambda t, m=layer: m(t, position_embeddings=pos), h, use_reentrant=False)
            return h
    elif way == "plain":
        f = chain
    else:
        remat.enable(chain, list(model.model.layers), plan=per_layer_plan([way] * layers), offload="@" in way,
                     offload_min_bytes=1 << 10)
        f = chain

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = f(x)
        y.sum().backward()

    for _ in range(warmup):
        step()
    gc.collect()
    if freeze:
        gc.freeze()
    times = []
    with Collections(on=True) as collections:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return dict(way=way, freeze=freeze, median_ms=statistics.median(times), mean_ms=statistics.mean(times),
                tracked_objects=len(gc.get_objects()) + (gc.get_freeze_count() if freeze else 0),
                collections={g: dict(count=collections.count[g], ms=collections.ms[g]) for g in range(3)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ways", default="plain,torch,checkpoint,checkpoint@host")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "way:freeze", run in this process (the parent's child)
    args = ap.parse_args()
    if args.one:
        way, freeze = args.one.rsplit(":", 1)
        print(json.dumps(one(way, args.layers, args.steps, args.warmup, freeze == "1")))
        return 0
    import torch
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, Python "
          f"{sys.version.split()[0]}; {args.layers} layers, {args.steps} steps after {args.warmup}, one thread")
    print(f"{'way':18} {'gc.freeze':>9} {'median ms':>10} {'mean ms':>9} {'full collections':>17} {'their ms':>9} "
          f"{'younger ms':>10} {'objects':>8}")
    rows = []
    for way in args.ways.split(","):
        for freeze in ("0", "1"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", f"{way}:{freeze}",
                                  "--layers", str(args.layers), "--steps", str(args.steps), "--warmup",
                                  str(args.warmup)], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            c = row["collections"]
            print(f"{way:18} {'yes' if row['freeze'] else 'no':>9} {row['median_ms']:10.2f} {row['mean_ms']:9.2f} "
                  f"{c['2']['count']:17d} {c['2']['ms']:9.0f} {c['0']['ms'] + c['1']['ms']:10.0f} "
                  f"{row['tracked_objects']:8d}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
