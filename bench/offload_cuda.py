#!/usr/bin/env python3
"""Offloading planned with checkpointing, against the other ways to fit (issue 33's GPU table): seed 001's
BertModel at BERT-large's size (fp32) or a Llama-architecture model built from a config (bf16 autocast). Ways:
the plain step, Hugging Face's gradient_checkpointing_enable(), the same saving matmuls (PyTorch's selective
checkpointing), Hugging Face's offload=True where the installed transformers has it, torch's save_on_cpu around
the whole step, and remat.hf.enable(..., offload=True) at gradient_checkpointing_enable()'s measured peak and at
two budgets between it and selective checkpointing's. Per way: the peak device memory above the bytes alive
before the forward pass (remat's meter window: on CUDA the bytes tensors request from the caching allocator,
followed through its trace, or torch.cuda.max_memory_allocated where the meter library is missing), the
synchronized step time paired with plain steps (medians of the rounds' ratios), for remat also the host pool's
peak, the measured bandwidth each way, and the predicted step time beside the measured one.

    python bench/offload_cuda.py --model bert --json out/offload-bert.json                  # BERT-large, fp32
    python bench/offload_cuda.py --model llama --seq 4096 --batch 2 --json out/offload-llama.json
    python bench/offload_cuda.py --device cpu --model bert --layers 2 --hidden 64 --heads 2 --intermediate 256 \\
        --seq 32 --batch 2 --rounds 1    # the script itself, on a CPU (a Llama: add --kv-heads 2)

Before measuring, remat's first two steps are compared with the plain run's (the loss, and the gradients'
largest difference beside two plain runs': CUDA's attention backward is not deterministic).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from functools import partial

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts
import transformers

import remat
import remat.hf
from remat.policies import matmuls

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from hf_compare import grads_of, max_diff, paired_rounds  # noqa: E402  (the paired rounds every benchmark of this kind shares)


def build(args, dev):
    torch.manual_seed(0)
    if args.model == "bert":
        cfg = transformers.BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, intermediate_size=args.intermediate,
                                      max_position_embeddings=max(512, args.seq))
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    else:
        cfg = transformers.LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                       intermediate_size=args.intermediate, max_position_embeddings=args.seq,
                                       vocab_size=args.vocab)
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(dev).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(dev)
    if args.model == "bert":
        batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
        loss_of = lambda out: out.last_hidden_state.square().mean()  # noqa: E731
    else:
        batch = dict(input_ids=ids, labels=ids)
        loss_of = lambda out: out.loss  # noqa: E731
    return model, batch, loss_of


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["bert", "llama"], default="bert")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="paired steps per way and round (bert 1, llama 3)")
    ap.add_argument("--min-bytes", type=int, default=1 << 20, help="offload_min_bytes")
    ap.add_argument("--skip", default="", help="ways not to run, comma-separated (hf-offload, save_on_cpu)")
    ap.add_argument("--groups", action="store_true",
                    help="remat plans each layer's saved groups too (remat.hf.enable(..., groups=True))")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    # BERT-large (seed 001: sequence 512, batch 64, fp32); a Llama of 886M parameters, bf16 autocast, sequence 4096.
    defaults = dict(bert=dict(layers=24, hidden=1024, heads=16, intermediate=4096, seq=512, batch=64, steps=1),
                    llama=dict(layers=16, hidden=2048, heads=16, kv_heads=8, intermediate=5632, seq=4096, batch=2,
                               steps=3))
    for k, v in defaults[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.model == "bert":  # no grouped heads
        if args.kv_heads not in (None, args.heads):
            ap.error(f"--kv-heads {args.kv_heads}: BERT has no grouped heads (leave it out, or give --heads)")
        args.kv_heads = args.heads
    if args.heads % args.kv_heads or args.hidden % args.heads:
        ap.error(f"--heads {args.heads} must divide --hidden {args.hidden} and be a multiple of --kv-heads "
                 f"{args.kv_heads} (the {args.model} default is {defaults[args.model]['kv_heads']}: give --kv-heads "
                 "with --heads)")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, remat.POLICY_OFFLOAD "
          f"{remat.POLICY_OFFLOAD}, {torch.cuda.get_device_name(dev) if cuda else 'CPU'}", file=sys.stderr, flush=True)
    meter = remat.meter_for(dev)
    base_model, batch, loss_of = build(args, dev)
    amp = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=args.model == "llama")

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def step(model, context=None, seed=None):
        """One step: (ms, peak bytes above the base, loss)."""
        model.zero_grad(set_to_none=False)
        if seed is not None:
            torch.manual_seed(seed)
        sync()
        base = meter.count()
        with meter.window() as window:
            t0 = time.perf_counter()
            with torch.autocast(**amp):
                if context is not None:
                    with context():
                        loss = loss_of(model(**batch))
                else:
                    loss = loss_of(model(**batch))
            loss.backward()
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            peak = window.peak() - base
        return ms, peak, loss.detach()

    ways = {"none": (base_model, None)}
    hf = copy.deepcopy(base_model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ways["hf"] = (hf, None)
    sac = copy.deepcopy(base_model)
    sac.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, matmuls)})
    ways["sac"] = (sac, None)
    skip = {w for w in args.skip.split(",") if w}
    unknown = skip - {"hf-offload", "save_on_cpu"}
    if unknown:
        ap.error(f"--skip: {sorted(unknown)} are not ways this script may skip (hf-offload, save_on_cpu)")
    try:
        if "hf-offload" in skip:
            raise RuntimeError("skipped (--skip)")
        hfo = copy.deepcopy(base_model)
        hfo.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True})
        step(hfo)
        ways["hf-offload"] = (hfo, None)
    except Exception as e:  # not in this transformers
        print(f"hf-offload: not available ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    if "save_on_cpu" not in skip:
        ways["save_on_cpu"] = (base_model, partial(torch.autograd.graph.save_on_cpu, pin_memory=cuda))
    peaks = {}
    for w, (m, ctx) in ways.items():
        step(m, ctx)
        peaks[w] = step(m, ctx)[1]
        print(f"{w}: peak {peaks[w] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    budgets = {"at-hf": peaks["hf"]}
    for k, f in ((1, 1 / 3), (2, 2 / 3)):
        budgets[f"b{k}"] = int(peaks["hf"] + f * (peaks["sac"] - peaks["hf"]))

    # Nothing freed by the cycle collector inside remat's profiling step (a free there lowers the count its peaks
    # are read against: a second BERT made in one process measured its floor 15.8 MB for 35.7 MB).
    gc.collect()
    plain_a, plain_b = copy.deepcopy(base_model), copy.deepcopy(base_model)
    rm = build(args, dev)[0]  # afresh, gradients allocated as the others' (a deep copy drops .grad: see BENCHMARKS)
    lp = remat.hf.enable(rm, budget=1 << 40, offload=True, offload_min_bytes=args.min_bytes,
                         groups=args.groups)  # planned per row below
    check = []
    t0 = time.perf_counter()
    for k in range(2):
        la, ga = step(plain_a, seed=100 + k)[2], grads_of(plain_a)
        lb, gb = step(plain_b, seed=100 + k)[2], grads_of(plain_b)
        lr, gr = step(rm, seed=100 + k)[2], grads_of(rm)
        if k == 0:
            profile_s = time.perf_counter() - t0
        check.append(dict(step=k, loss_equal=bool(torch.equal(la, lr)), grad_max_diff=max_diff(ga, gr),
                          plain_grad_max_diff=max_diff(ga, gb)))
        print(f"check {check[-1]}", file=sys.stderr, flush=True)
    del plain_a, plain_b
    chain = lp.chain
    bandwidth = dict(to_host_gb_per_s=chain.to_host_gb_per_s, to_device_gb_per_s=chain.to_device_gb_per_s)
    print(f"bandwidth: {bandwidth}", file=sys.stderr, flush=True)
    plans = {}
    for w, b in budgets.items():
        least = None
        try:
            lp.set_budget(b)
        except remat.InfeasibleBudget as e:
            print(f"remat@{w}: infeasible at {b / 2**30:.3f} GiB, least {e.min_bytes / 2**30:.3f} GiB",
                  file=sys.stderr, flush=True)
            if w != "at-hf":
                plans[w] = dict(budget=b, infeasible=e.min_bytes)
                continue
            # The row the first target is read at: measured at remat's least budget instead, and marked so.
            least, b = e.min_bytes, e.min_bytes
            lp.set_budget(b)
        plans[w] = dict(budget=b, asked=budgets[w], least=least, choices=lp.choices, predicted=lp.predicted_peak_bytes,
                        predicted_host=lp.predicted_host_bytes,
                        plan_ms=lp.plan.predicted.time_ms,
                        transfer_ms=lp.plan.predicted.transfer_ms)
        print(f"remat@{w}: {lp.choices}", file=sys.stderr, flush=True)

    rows = [w for w in ways if w != "none"] + [f"remat@{w}" for w in plans if "choices" in plans[w]]
    name = torch.cuda.get_device_name(dev) if cuda else "CPU"
    # The profiled chain and context, and every plan (text), to check the time model against the measured steps
    # afterwards; and the plain step as the model predicts it (every layer kept).
    for p in plans.values():
        if "choices" in p:
            lp.set_budget(p["budget"])
            p["plan"] = str(lp.plan)
    keep_all = remat.Plan.from_json(json.dumps(dict(num_stages=len(chain.stages), ops=[f"Fa{i}" for i in range(
        len(chain.stages))] + ["L"] + [f"B{i}" for i in reversed(range(len(chain.stages)))])))
    keep_plan_ms = remat.simulate(chain, keep_all).time_ms
    facts = dict(config=vars(args), device=name, torch=torch.__version__, transformers=transformers.__version__,
                 policy_offload=remat.POLICY_OFFLOAD, peaks=peaks, bandwidth=bandwidth, profile_s=profile_s,
                 check=check, plans=plans, chain=json.loads(chain.to_json()), profiled_rest_ms=lp.context.rest_ms)
    if args.json:  # what is known before the timed rounds, in case they do not finish
        with open(args.json, "w") as f:
            json.dump(dict(facts, stage="planned"), f, indent=1)
    host_peak = {r: 0 for r in rows}

    def run_of(model, ctx, row=None):
        def run():
            with torch.autocast(**amp):
                if ctx is None:
                    loss = loss_of(model(**batch))
                else:
                    with ctx():
                        loss = loss_of(model(**batch))
            if row is not None:  # remat's host pool: its peak is at the end of the forward pass
                host_peak[row] = max(host_peak[row], lp.host_pool.peak_bytes)
            return loss
        return run

    def way_of(r):
        if r.startswith("remat@"):
            lp.set_budget(plans[r[6:]]["budget"])
            lp.host_pool.peak_bytes = 0
            return rm, run_of(rm, None, r)
        model, ctx = ways[r]
        return model, run_of(model, ctx)

    res, plain_all = paired_rounds(rows, way_of, (base_model, run_of(base_model, None)), meter, args.rounds,
                                   args.steps, warmup=1)
    plain_ms = plain_all
    # Predicted step times: the plan's layers and copies, and the rest of the step as remat's first planned steps
    # timed it again (the profiling step's own reading includes first-time costs).
    rest_ms = lp.context.rest_ms
    keep_ms = keep_plan_ms + rest_ms
    for p in plans.values():
        if "choices" in p:
            p["predicted_ms"] = p["plan_ms"] + rest_ms
    facts.update(rest_ms=rest_ms, predicted_plain_ms=keep_ms)
    for r in rows:
        res[r]["host_peak"] = host_peak[r]
    print(f"\n{args.model} {args.layers}x{args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{'bf16 autocast' if amp['enabled'] else 'fp32'}, {name}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; plain step {statistics.median(plain_ms):.1f} ms, "
          f"{peaks['none'] / 2**30:.2f} GiB; bandwidth {bandwidth['to_host_gb_per_s']:.1f} GB/s to the host, "
          f"{bandwidth['to_device_gb_per_s']:.1f} back; remat's profiling step {profile_s:.1f} s; plain step "
          f"predicted {keep_ms:.1f} ms")
    print(f"{'way':<16} {'peak GiB':>9} {'host GiB':>9} {'time/none':>9}  rounds")
    for r in rows:
        extra = ""
        if r.startswith("remat@"):
            p = plans[r[6:]]
            extra = (f"  (budget {p['budget'] / 2**30:.2f}{' (least; asked ' + format(p['asked'] / 2**30, '.2f') + ')' if p['least'] else ''}, predicted {p['predicted'] / 2**30:.2f} GiB, "
                     f"host {p['predicted_host'] / 2**30:.2f}; predicted {p['predicted_ms']:.1f} ms, measured "
                     f"{statistics.median(res[r]['ms']):.1f})")
        print(f"{r:<16} {res[r]['peak'] / 2**30:9.2f} {res[r]['host_peak'] / 2**30:9.2f} "
              f"{statistics.median(res[r]['ratios']):9.2f}  " + ", ".join(f"{v:.2f}" for v in res[r]["ratios"])
              + extra)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(facts, stage="measured", plain_ms=statistics.median(plain_ms), rows=res), f, indent=1)


if __name__ == "__main__":
    main()
