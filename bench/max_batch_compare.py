#!/usr/bin/env python3
"""The largest batch within a budget: remat.max_batch against accelerate's find_executable_batch_size (issue
44's comparison in docs/BENCHMARKS.md).

One Hugging Face BertModel from its config (random weights; --layers, --hidden, --seq), on the CPU. A device
of `--budget` bytes for the step (above the bytes alive when the forward is called) is emulated with remat's
CPU meter: a step whose measured peak is over the budget raises the CPU allocator's out-of-memory message after
its backward pass (a real device raises it where the allocation fails, so each failed try here runs a whole
step: accelerate's time is an upper bound of a real device's by that much). The ways:

  accelerate        find_executable_batch_size(starting_batch_size=--start) on the plain model: the batch
                    starts there and shrinks by a tenth on each out-of-memory error
  accelerate+hf     the same with model.gradient_checkpointing_enable()
  remat             remat.max_batch(model, make_batch, budget): profiles at batches 2 and 4, predicts, and
                    confirms with a profiling and a planned step

Each row: the batch found, the seconds and training steps the search took, whether a step at that batch then
trains within the budget (remat's with remat.hf.enable at that budget: a profiling step, then planned steps),
and the median time per sample of --steps steps at that batch.

    python bench/max_batch_compare.py --budget 192MiB --json out/max-batch.json

On a GPU (--device cuda) nothing is emulated: the device runs out where it runs out, accelerate catches the
allocator's errors, remat plans for --budget (bytes, or "auto": what the GPU has free), and "trains" is a step
that raised no out-of-memory error. Issue 44's GPU row, seed 001's BERT-large at sequence 512 (not yet run):

    python bench/max_batch_compare.py --device cuda --layers 24 --hidden 1024 --seq 512 --budget auto \
        --start 512 --json out/max-batch-cuda.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import remat
import remat.hf


def build(args):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                                  max_position_embeddings=512)
    model = transformers.BertModel(cfg, add_pooling_layer=False).to(args.device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # as after a first step: the peaks are the activations'
    return model


def make_batch(args):
    def make(n):
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, 30522, (n, args.seq), generator=g).to(args.device)
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    return make


def loss_of(out):
    return out.last_hidden_state.square().mean()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step(model, batch, meter):
    """One training step; its peak above the bytes alive at the forward's call (remat's meter)."""
    base = meter.active()
    meter.reset_peak()
    loss_of(model(**batch)).backward()
    sync()
    return meter.peak() - base


def trains(model, batch, meter, budget):
    """A step's peak, and whether it trained: within the emulated budget (CPU), without running out (GPU)."""
    try:
        peak = step(model, batch, meter)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=False)
        return -1, False
    return peak, budget is None or peak <= budget


def oom_if_over(peak, budget):
    if budget is not None and peak > budget:
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: the step needed {peak} bytes of an "
                           f"emulated device of {budget}")


def ms_per_sample(model, batch, n, meter, steps):
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step(model, batch, meter)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times) / n


def emulated(args):
    """The emulated device's budget (bytes) on the CPU; None on a GPU, which runs out on its own."""
    return args.budget if args.device == "cpu" else None


def run_accelerate(args, hf_ckpt, meter, make):
    from accelerate.utils import find_executable_batch_size
    model = build(args)
    if hf_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    model.train()
    steps = 0

    @find_executable_batch_size(starting_batch_size=args.start)
    def search(batch_size):
        nonlocal steps
        steps += 1
        oom_if_over(step(model, make(batch_size), meter), emulated(args))
        return batch_size

    t = time.perf_counter()
    found = search()
    seconds = time.perf_counter() - t
    peak, ok = trains(model, make(found), meter, emulated(args))
    return dict(way="accelerate+hf" if hf_ckpt else "accelerate", batch=found, seconds=seconds, steps=steps,
                peak=peak, trains=ok,
                ms_per_sample=ms_per_sample(model, make(found), found, meter, args.steps))


def run_remat(args, meter, make):
    model = build(args)
    t = time.perf_counter()
    found = remat.max_batch(model, make, args.budget, loss=loss_of)
    seconds = time.perf_counter() - t
    lp = remat.hf.enable(model, budget=args.budget)
    batch = make(found.batch)
    trains(model, batch, meter, None)  # the profiling step
    peak, ok = trains(model, batch, meter, emulated(args))
    row = dict(way="remat", batch=found.batch, seconds=seconds, steps=found.steps, peak=peak,
               trains=ok and lp.last_peak_bytes <= found.budget_bytes, budget_bytes=found.budget_bytes,
               predicted_peak=found.predicted_peak_bytes, choices=found.choices,
               ms_per_sample=ms_per_sample(model, batch, found.batch, meter, args.steps))
    remat.hf.disable(model)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget", default="192MiB",
                    help="bytes or a size; on a GPU also a device budget (auto, 90%%), remat's only")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--start", type=int, default=128, help="accelerate's starting_batch_size (its default)")
    ap.add_argument("--steps", type=int, default=3, help="steps timed at the found batch")
    ap.add_argument("--ways", default="accelerate,accelerate+hf,remat")
    ap.add_argument("--json")
    args = ap.parse_args()
    if remat._core.parse_device_fraction(args.budget) is None:
        args.budget = remat.parse_size(args.budget)
    elif args.device == "cpu":
        ap.error("a device budget (auto, N%) needs --device cuda")
    meter = remat.meter_for(args.device)
    make = make_batch(args)
    rows = []
    for way in args.ways.split(","):
        row = run_remat(args, meter, make) if way == "remat" else run_accelerate(args, way == "accelerate+hf", meter,
                                                                                 make)
        rows.append(row)
        print(f"{row['way']:>14}: batch {row['batch']:4d}, search {row['seconds']:7.1f} s in {row['steps']:2d} steps, "
              f"peak {row['peak'] / 2**20:7.1f} MiB (trains: {'yes' if row['trains'] else 'no'}), "
              f"{row['ms_per_sample']:.2f} ms/sample", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
