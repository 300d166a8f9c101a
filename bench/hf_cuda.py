#!/usr/bin/env python3
"""Seed 001's configuration on CUDA: Hugging Face BertModel at BERT-large's size (24 layers, hidden 1024, 16
heads, intermediate 4096), sequence 512, batch 64, fp32. Hugging Face's gradient_checkpointing_enable(), the
same with PyTorch's selective checkpointing saving matmuls, and remat.hf.enable at each one's measured peak and
halfway between per-layer checkpointing's peak and the plain step's; peak CUDA memory (the caching allocator's
max_memory_allocated above memory_allocated before the forward pass) and step time (synchronized), each way's
steps paired with plain steps, medians of the rounds' ratios.

Before measuring, the first two steps of remat (the profiling one and a planned one) are compared with the plain
run's: the loss bitwise, and the gradients' largest difference beside that of two plain runs (CUDA's embedding
and attention backward kernels are not deterministic, so gradients are compared with that baseline).

    python bench/hf_cuda.py --json out/hf-cuda.json
"""
from __future__ import annotations

import argparse
import copy
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
from hf_compare import grads_of, max_diff  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--budgets", default="",
                    help="two more budgets for remat, in bytes, comma-separated (the C++ benchmark's Planned ones)")
    ap.add_argument("--compile", action="store_true",
                    help="also torch.compile with activation_memory_budget 0.5 (compile time reported)")
    ap.add_argument("--skip-mid", action="store_true", help="no remat row halfway between hf's and plain peaks")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = transformers.BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=args.heads, intermediate_size=args.intermediate,
                                  max_position_embeddings=max(512, args.seq))
    torch.manual_seed(0)
    base_model = transformers.BertModel(cfg, add_pooling_layer=False).to(dev).train()
    for p in base_model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(dev)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))

    def run(model):
        return model(**batch).last_hidden_state.square().mean()

    def measure(model, steps, seed=None):
        times, peak, loss_value = [], 0, None
        for _ in range(steps):
            model.zero_grad(set_to_none=False)
            if seed is not None:
                torch.manual_seed(seed)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = run(model)
            loss.backward()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
            loss_value = loss.detach()
            del loss
        return statistics.median(times), peak, loss_value

    ways = {"none": base_model}
    hf = copy.deepcopy(base_model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ways["hf"] = hf
    sac = copy.deepcopy(base_model)
    sac.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, matmuls)})
    ways["sac"] = sac
    compile_s = None
    if args.compile:
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = 0.5
        compiled = torch.compile(copy.deepcopy(base_model))
        t0 = time.perf_counter()
        measure(compiled, 1)
        compile_s = time.perf_counter() - t0
        print(f"compile: {compile_s:.1f} s", file=sys.stderr, flush=True)
        ways["compile"] = compiled
    peaks = {}
    for w, m in ways.items():
        measure(m, 1)
        peaks[w] = measure(m, 1)[1]
        print(f"{w}: peak {peaks[w] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    if not args.skip_mid:
        peaks["mid"] = (peaks["hf"] + peaks["none"]) // 2
    for k, b in enumerate(x for x in args.budgets.split(",") if x):
        peaks[f"b{k + 1}"] = int(b)

    # remat against the plain run: two steps each from the same weights and seeds.
    plain_a, plain_b = copy.deepcopy(base_model), copy.deepcopy(base_model)
    rm = copy.deepcopy(base_model)
    t0 = time.perf_counter()
    lp = remat.hf.enable(rm, budget=peaks.get("mid", peaks["sac"]))
    check = []
    for k in range(2):
        la = measure(plain_a, 1, seed=100 + k)[2]
        ga = grads_of(plain_a)
        lb = measure(plain_b, 1, seed=100 + k)[2]
        gb = grads_of(plain_b)
        lr = measure(rm, 1, seed=100 + k)[2]
        gr = grads_of(rm)
        if k == 0:
            profile_s = time.perf_counter() - t0
        check.append(dict(step=k, loss_equal=bool(torch.equal(la, lr)), plain_loss_equal=bool(torch.equal(la, lb)),
                          grad_max_diff=max_diff(ga, gr), plain_grad_max_diff=max_diff(ga, gb),
                          grad_max_abs=max(float(x.abs().max()) for x in ga)))
        print(f"check {check[-1]}", file=sys.stderr, flush=True)
    del plain_a, plain_b
    plans = {}
    for w in [w for w in peaks if w != "none"]:
        try:
            lp.set_budget(peaks[w])
        except remat.InfeasibleBudget as e:
            plans[w] = dict(infeasible=e.min_bytes)
            print(f"remat@{w}: infeasible, least {e.min_bytes / 2**30:.2f} GiB", file=sys.stderr, flush=True)
            continue
        plans[w] = dict(budget=peaks[w], choices=lp.choices, predicted=lp.predicted_peak_bytes)
        print(f"remat@{w}: {lp.choices}", file=sys.stderr, flush=True)

    rows = [w for w in ways if w != "none"] + [f"remat@{w}" for w in plans if "budget" in plans[w]]
    res = {r: dict(ratios=[], ms=[], peak=0, remat_peak=0) for r in rows}
    plain_ms = []
    for rnd in range(args.rounds):
        for r in rows:
            if r.startswith("remat@"):
                lp.set_budget(plans[r[6:]]["budget"])
                model = rm
            else:
                model = ways[r]
            measure(model, 1)
            ms, plain = [], []
            for _ in range(args.steps):
                plain.append(measure(base_model, 1)[0])
                t, p, _ = measure(model, 1)
                ms.append(t)
                res[r]["peak"] = max(res[r]["peak"], p)
                if r.startswith("remat@"):
                    res[r]["remat_peak"] = max(res[r]["remat_peak"], lp.last_peak_bytes)
            plain_ms.extend(plain)
            res[r]["ms"].append(statistics.median(ms))
            res[r]["ratios"].append(statistics.median(ms) / statistics.median(plain))
            print(f"round {rnd + 1} {r}: {statistics.median(ms):.0f} ms against {statistics.median(plain):.0f} ms",
                  file=sys.stderr, flush=True)
    print(f"\nBERT {args.layers}x{args.hidden}, seq {args.seq}, batch {args.batch}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; plain step {statistics.median(plain_ms):.0f} ms, "
          f"{peaks['none'] / 2**30:.2f} GiB; remat's profiling step {profile_s:.1f} s"
          + (f"; torch.compile {compile_s:.1f} s" if compile_s is not None else ""))
    print(f"{'way':<14} {'peak GiB':>9} {'time/none':>9}  rounds")
    for r in rows:
        extra = ""
        if r.startswith("remat@"):
            extra = (f"  (budget {plans[r[6:]]['budget'] / 2**30:.2f}, predicted {plans[r[6:]]['predicted'] / 2**30:.2f}, "
                     f"remat's own measure {res[r]['remat_peak'] / 2**30:.2f} GiB)")
        print(f"{r:<14} {res[r]['peak'] / 2**30:9.2f} {statistics.median(res[r]['ratios']):9.2f}  "
              + ", ".join(f"{v:.2f}" for v in res[r]["ratios"]) + extra)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), device=torch.cuda.get_device_name(), torch=torch.__version__,
                           transformers=transformers.__version__, plain_ms=statistics.median(plain_ms),
                           peaks=peaks, profile_s=profile_s, compile_s=compile_s, check=check, plans=plans,
                           rows=res), f, indent=1)


if __name__ == "__main__":
    main()
