#!/usr/bin/env python3
"""What remat's Python checkpoint costs beside torch.utils.checkpoint's, taken apart (docs/BENCHMARKS.md, "remat's
checkpoint against torch's, per layer"): one Transformers Llama decoder layer (width 64, 4 heads, 2 key-value
heads, sequence 16, batch 1) under CPU bf16 autocast, forward and backward, small enough that Python's costs
show. Ways, each run in turn so that each sample is paired with a torch.utils.checkpoint step run just before it:

- `plain`: the layer kept (the pair's difference is what torch's checkpoint adds);
- `remat`: remat's checkpoint_region (how the runtime runs a checkpointed layer);
- `context`: torch's checkpoint with remat's context function (the buffers put back for the recompute);
- `hooks`: torch's checkpoint around remat's version_checked (saved-tensor hooks that refuse a tensor written in
  place since it was saved, saved.py);
- `cache`: torch's checkpoint inside autocast_cache_off;
- `modes`: torch's checkpoint with two dispatch modes that only run each call (what any Python dispatch mode
  costs: the floor of selective checkpointing in Python);
- `sac`: torch's own selective checkpointing (create_selective_checkpoint_contexts), the matrix products kept;
- `selective`: remat's checkpoint_region under the policy `matmuls` (remat's selective cache: the matrix
  products kept, the rest recomputed; how a plan's Fk[matmuls] and group assignments run);
- `kept-all`: remat's checkpoint_region with every call kept (MUST_SAVE): the cache's dearest case;
- `plan-checkpoint`, `plan-host`: another copy of the layers under remat.enable with a given plan, every layer
  "checkpoint" or every layer "checkpoint@host" (offload=True: each layer's input to the host and back, as the
  runtime schedules it): remat's whole per-layer path, against torch's checkpoint of each layer (what Hugging
  Face's gradient_checkpointing_enable() runs);
- `plan-keep-host`: every layer "keep@host" (offload=True: all each layer saves to the host and back, no
  recompute): against `plain`, what sending a whole layer's saved tensors costs the host (the Offload's hooks, per
  saved tensor, and the waits for its copies), where a step bound by the host pays it in full;
- `plan-host-nowait`: `plan-host` with its copy engine's experimental `host_wait=False` (CUDA: waiting for a copy
  makes the current stream wait, not the host, and copies back do not wait for the current stream's queued
  work: remat.offload.CopyEngine); on the CPU the same as `plan-host`.

Each number is the median of the paired differences (ms), after --warmup runs of each unmeasured. Pin it to one
core (taskset) on a quiet machine.

    taskset -c 1 python bench/checkpoint_overhead.py [--pairs 2000] [--ways plain,remat,...]

On a GPU, a real layer size and a chain of layers (the device synchronized before and after each step, each layer
checkpointed on its own, so that Python's time beside a layer overlaps the device's work on the layers before
it, as in a whole step); scripts/gpu-session's `overhead` part runs the H200 Llama's layer (bench/offload_cuda.py's
`--model llama`):

    python bench/checkpoint_overhead.py --device cuda --hidden 2048 --heads 16 --kv-heads 8 \
        --intermediate 5632 --seq 4096 --batch 2 --chain 8 --pairs 40 --warmup 5 \
        --ways plain,remat,plan-checkpoint,plan-host,modes,sac,selective
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch import nn
import transformers

import remat
from remat.offload import CopyEngine
from remat.policies import autocast_cache_off, checkpoint_context, checkpoint_region, matmuls
from remat.saved import version_checked

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
from conftest import per_layer_plan  # noqa: E402  (the test suite's per-layer plan of given choices)


class _RunEach(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _kept_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


class _Layers(nn.Module):
    """The layers in a row, as a model's forward runs them (remat.enable wraps each layer's call)."""

    def __init__(self, layers, pos):
        super().__init__()
        self.layers = layers
        self.pos = pos

    def forward(self, x):
        for layer in self.layers:
            out = layer(x, position_embeddings=self.pos)
            x = out[0] if isinstance(out, tuple) else out
        return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--ways", default="plain,remat,context,hooks,cache,modes,sac,selective,kept-all",
                    help="the ways to pair with torch's checkpoint, comma-separated (also: plan-checkpoint, "
                    "plan-host, plan-keep-host, plan-host-nowait)")
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (one: the core it is pinned to)")
    ap.add_argument("--warmup", type=int, default=100, help="unmeasured runs of each way first")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chain", type=int, default=1, help="this many layers run in a row, each its own checkpoint")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                   num_hidden_layers=args.chain, vocab_size=100, max_position_embeddings=args.seq)
    model = transformers.LlamaForCausalLM(cfg).to(dev)
    x0 = torch.randn(args.batch, args.seq, args.hidden, device=dev, requires_grad=True)
    pos = model.model.rotary_emb(x0, torch.arange(args.seq, device=dev)[None])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    planned, nowait = {}, None
    for way, choice in (("plan-checkpoint", "checkpoint"), ("plan-host", "checkpoint@host"),
                        ("plan-keep-host", "keep@host"), ("plan-host-nowait", "checkpoint@host")):
        if way in args.ways.split(","):
            copy = transformers.LlamaForCausalLM(cfg).to(dev)
            runner = _Layers(copy.model.layers, pos)
            # What a layer sends: on the CPU's small layer (its hidden state 4 KiB at the defaults) what is 1 KiB or
            # more, so that the hooks' copies are made there too; on CUDA remat's default, 1 MiB.
            lp = remat.enable(runner, list(copy.model.layers), plan=per_layer_plan([choice] * args.chain),
                              offload=choice.endswith("@host"),
                              offload_min_bytes=1 << 20 if dev.type == "cuda" else 1 << 10)
            if way == "plan-host-nowait":
                # keyed by the device its tensors name (cuda:0, not the "cuda" given)
                lp.offloads.engines[x0.device] = CopyEngine(x0.device, hold=True, host_wait=False)
                nowait = lp
            planned[way] = runner

    def forward(way):
        if way in planned:
            return planned[way](x0)
        x = x0
        for layer in model.model.layers:
            x = one(way, layer, x)
        return x

    def one(way, layer, x):
        def fn(h):
            out = layer(h, position_embeddings=pos)
            return out[0] if isinstance(out, tuple) else out

        if way == "plain":
            return fn(x)
        if way == "torch":
            return checkpoint(fn, x, use_reentrant=False)
        if way == "remat":
            return checkpoint_region(fn, (x,), [layer])
        if way == "context":
            return checkpoint(fn, x, use_reentrant=False, context_fn=checkpoint_context([layer]))
        if way == "hooks":
            return checkpoint(version_checked(fn), x, use_reentrant=False)
        if way == "modes":
            return checkpoint(fn, x, use_reentrant=False, context_fn=lambda: (_RunEach(), _RunEach()))
        if way == "sac":
            return checkpoint(fn, x, use_reentrant=False,
                              context_fn=lambda: create_selective_checkpoint_contexts(matmuls))
        if way == "selective":
            return checkpoint_region(fn, (x,), [layer], policy=matmuls)
        if way == "kept-all":
            return checkpoint_region(fn, (x,), [layer], policy=_kept_all)
        with autocast_cache_off():  # "cache"
            return checkpoint(fn, x, use_reentrant=False)

    def run(way):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = forward(way)
        y.sum().backward()
        sync()
        return (time.perf_counter() - t0) * 1e3

    ways = args.ways.split(",")
    for _ in range(args.warmup):
        for w in ["torch"] + ways:
            run(w)
    if nowait is not None:  # the layers ran on the engine given them, not one of their own
        assert [e.host_wait for e in nowait.offloads.engines.values()] == [False], nowait.offloads.engines
    torch_ms, diffs = [], {w: [] for w in ways}
    for _ in range(args.pairs):
        for w in ways:
            base = run("torch")
            torch_ms.append(base)
            diffs[w].append(run(w) - base)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {where}; width {args.hidden}, "
          f"sequence {args.seq}, batch {args.batch}, {args.chain} layer(s); torch's checkpointed step "
          f"{statistics.median(torch_ms):.3f} ms (median of {len(torch_ms)})")
    for w in ways:
        print(f"{w:<8} {statistics.median(diffs[w]):+.3f} ms against torch's checkpoint (median of {args.pairs} pairs)")


if __name__ == "__main__":
    main()
