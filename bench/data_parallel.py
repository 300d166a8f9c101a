#!/usr/bin/env python3
"""remat.hf.enable under the data-parallel set-ups people train with (docs/BENCHMARKS.md, "Data parallelism"):
every step against the plain run's of the same set-up, bitwise, and each planned step's peak against its
prediction.

Two processes on Gloo (CPU, one thread each), a Llama-architecture model (width 64, 4 layers, vocabulary 1000),
batches of 2 sequences of 32 tokens, different on each rank. The ways:

    ddp            DistributedDataParallel, defaults (gradients set to None each step)
    ddp-static     static_graph=True
    ddp-bucket     gradient_as_bucket_view=True (gradients land in DDP's buckets, held across steps)
    ddp-accum      two micro-batches a step, the first under no_sync()
    fsdp2          fully_shard on each layer, then on the model (after enable, as accelerator.prepare shards)
    fsdp2-accum    two micro-batches a step, the first with set_requires_gradient_sync(False) (Accelerate's way)

Steps 0 to 3 (to 4 with -accum, ending with a first micro-batch, whose gradient state the budgets are taken in)
run under a budget of 1 TiB (profiled where remat profiles: the first step, or the first that can be measured);
then the profile's times are set to zero (plans follow the budget alone, not this machine's load) and
at each of three budgets (the least, and 0.3 and 1.0 of the way from it to the plan that keeps every layer) two
steps (two micro-batches each with -accum) run. Each row: the way, whether every step was bitwise, the planned
steps' prediction errors' range (measured less predicted, over predicted) by micro-batch (first, second; the same
for ways without accumulation), and the step that profiled.

    python bench/data_parallel.py                    # every way
    python bench/data_parallel.py --ways ddp-bucket,fsdp2-accum

Exits 1 where a step is not the plain run's bitwise or a planned step holds more than 2% above its prediction.
"""
import argparse
import contextlib
import os
import socket
import sys
import tempfile
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAYS = ["ddp", "ddp-static", "ddp-bucket", "ddp-accum", "fsdp2", "fsdp2-accum"]
SHARES = (0.0, 0.3, 1.0)


def llama():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attention_dropout=0.1)
    return transformers.LlamaForCausalLM(cfg).train()


def worker(rank: int, port: int, way: str, out: str):
    import remat.hf
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    warnings.simplefilter("ignore")
    accum = way.endswith("-accum")
    try:
        runs = {}
        for kind in ("plain", "remat"):
            model = llama()
            lp = remat.hf.enable(model, budget=1 << 40) if kind == "remat" else None
            if way.startswith("fsdp2"):
                for layer in model.model.layers:
                    fully_shard(layer)
                fully_shard(model)
                wrapped = model
            else:
                options = dict(static_graph=way == "ddp-static", gradient_as_bucket_view=way == "ddp-bucket")
                wrapped = torch.nn.parallel.DistributedDataParallel(model, **options)
            losses, rows, profiled = [], [], None
            k = 0

            def step(measured: bool):
                nonlocal k, profiled
                first = not accum or k % 2 == 0
                if first:
                    wrapped.zero_grad(set_to_none=True)
                if way == "fsdp2-accum":
                    model.set_requires_gradient_sync(k % 2 == 1)
                quiet = wrapped.no_sync() if way == "ddp-accum" and k % 2 == 0 else contextlib.nullcontext()
                torch.manual_seed(k)
                ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(10 * k + rank))
                with quiet:
                    loss = wrapped(input_ids=ids, labels=ids).loss
                    loss.backward()
                losses.append(loss.detach())
                if lp is not None:
                    if profiled is None and lp.is_planned():
                        profiled = k
                    if measured and lp.prediction_error is not None:
                        rows.append((k % 2 if accum else 0, lp.prediction_error))
                k += 1

            for _ in range(5 if accum else 4):  # (ending with a first micro-batch: the budgets are its state's)
                step(False)
            if lp is not None:
                for st in lp.chain.stages:
                    st.fwd_ms = st.bwd_ms = 0.0
                lp.set_budget(1 << 40)
                lo, hi = lp.min_budget_bytes, lp.predicted_peak_bytes
            for share in SHARES:
                if lp is not None:
                    lp.set_budget(int(lo + share * (hi - lo)))
                for _ in range(4 if accum else 2):
                    step(True)
            grads = [None if p.grad is None else (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                     .clone() for p in model.parameters()]
            runs[kind] = (losses, grads, rows, profiled)
            wrapped = model = lp = None
        (a, ga, _, _), (b, gb, rows, profiled) = runs["plain"], runs["remat"]
        same = (all(torch.equal(x, y) for x, y in zip(a, b))
                and all((g is None) == (h is None) and (g is None or torch.equal(g, h)) for g, h in zip(ga, gb)))
        gathered = [None, None]
        dist.all_gather_object(gathered, dict(same=same, rows=rows, profiled=profiled))
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def span(errors) -> str:
    return f"{min(errors):+.2%} .. {max(errors):+.2%}" if errors else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {','.join(WAYS)}")
    args = ap.parse_args()
    ways = args.ways.split(",")
    for w in ways:
        if w not in WAYS:
            ap.error(f"unknown way {w!r} (known: {', '.join(WAYS)})")
    bad = False
    print(f"torch {torch.__version__}; two Gloo processes; budgets at {', '.join(map(str, SHARES))} of the way")
    print("| way | bitwise | first micro-batch: error | second: error | profiled at step |")
    print("|---|---|---|---|---|")
    for way in ways:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.pt")
            mp.spawn(worker, args=(free_port(), way, out), nprocs=2, join=True)
            ranks = torch.load(out)
        same = all(r["same"] for r in ranks)
        errors = [[e for r in ranks for m, e in r["rows"] if m == part] for part in (0, 1)]
        profiled = sorted({r["profiled"] for r in ranks})
        bad |= not same or any(e > 0.02 for part in errors for e in part)
        second = span(errors[1]) if way.endswith("-accum") else "(one per step)"
        print(f"| {way} | {'yes' if same else 'NO'} | {span(errors[0])} | {second} | "
              f"{', '.join(map(str, profiled))} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
