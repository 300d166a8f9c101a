#!/usr/bin/env python3
"""How far remat's predicted step peaks are from the measured ones (issue 45's table in docs/BENCHMARKS.md).

Llama-architecture models built from a config (random weights, CPU), trained as a Trainer does (gradients set
to none before each step), planned with remat.hf.enable between Hugging Face's per-layer checkpointing peak
and the plain step's (LayerPlan.set_budget from one profiling step). For each budget: the plan, the
prediction, the step's measured peak (remat's CPU meter, the step after the plan's first), their error, and,
from the same profile, the prediction as the model made it before the profile measured each backward's peak
with its gradients made there and each policy's backward on its own (charged_all). `--amp bf16` runs the steps
under CPU bf16 autocast. `--plans` adds given per-layer plans (one letter a layer), each predicted from the
same profile and measured on a fresh model planned with it.

`--compiled` instead plans issue 45's GPT-2 (4 blocks of width 128, batch 8, sequence 128, dropout 0), each
block compiled (layer.compile()) after remat.hf.enable, at shares of the plain compiled step's peak (`--at`,
0.6 by default), twice in one run: with the layers profiled eagerly as before issue 45 (the profile's
compiled passes switched off) and profiled through their compiled graphs. Each row gives the profiling step's
time (compiling included), the plan, its prediction and measured peak, the median time of the planned steps
and the plan's predicted step time. `--offload` adds a third row per budget: planned with offload=True, the
layers' graphs offloaded where the plan says (their Offloads opened around the compiled calls); and the least
budget each way allows.

    python bench/prediction_error.py --amp fp32
    python bench/prediction_error.py --amp bf16 --plans cmmkmm cmkkkm
    python bench/prediction_error.py --compiled --at 0.5 0.6 0.8 --steps 15
    python bench/prediction_error.py --compiled --offload --at 0.46 0.5 0.6 --steps 9
    python bench/prediction_error.py --device cuda --amp fp16        # the GPU rows (scripts/gpu-session's
    python bench/prediction_error.py --device cuda --compiled --amp bf16   # "predictions" part)
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

import remat
import remat.hf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
from conftest import per_layer_plan  # noqa: E402  (the test suite's per-layer plan of given choices)


DEVICE = torch.device("cpu")
AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def step(model, batch, meter, seed, amp):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    base = meter.active()
    meter.reset_peak()
    with torch.autocast(DEVICE.type, dtype=AMP[amp] or torch.bfloat16, enabled=AMP[amp] is not None):
        loss = model(**batch).loss
    loss.backward()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return meter.peak() - base


def charged_all(lp):
    """The prediction of the plan in force from the same profile as the model made it before issue 45's figures:
    each backward charged all its gradients at its peak, a policy's backward as what it recomputes plus the kept
    layer's transient (each stage's bwd_grads_tmp_bytes and each policy's bwd_tmp_bytes and bwd_grads_tmp_bytes
    dropped)."""
    chain = remat.Chain.from_json(lp.chain.to_json())
    stages = list(chain.stages)
    for st in stages:
        st.bwd_grads_tmp_bytes = None
        policies = list(st.policies)
        for c in policies:
            c.bwd_tmp_bytes = c.bwd_grads_tmp_bytes = None
        st.policies = policies
    chain.stages = stages
    return remat.step_peak_bytes(chain, lp.context, lp.plan)


def mib(b):
    return f"{b / 2**20:.2f}"


def llama(args, meter):
    import transformers

    def make():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=args.width, intermediate_size=4 * args.width,
                                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=args.seq)
        m = transformers.LlamaForCausalLM(cfg).to(DEVICE)
        m.train()
        return m

    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    batch = dict(input_ids=ids, labels=ids)
    m = make()
    plain = [step(m, batch, meter, s, args.amp) for s in range(2)][1]
    del m
    gc.collect()
    m = make()
    if hasattr(m, "activation_checkpointing_enable"):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf = [step(m, batch, meter, s, args.amp) for s in range(2)][1]
    del m
    gc.collect()
    m = make()
    lp = remat.hf.enable(m, budget=plain)
    step(m, batch, meter, 0, args.amp)  # the profiling step
    print(f"llama width {args.width}, {args.layers} layers, batch {args.batch}, sequence {args.seq}, {args.amp}, "
          f"{DEVICE.type}, "
          f"torch {torch.__version__}: plain step {mib(plain)} MiB, Hugging Face's checkpointing {mib(hf)} MiB")
    print("| budget (between HF and plain) | plan | predicted MiB | measured MiB | error | before (as the model "
          "was) |")
    print("|---|---|---|---|---|---|")
    for where in args.at:
        budget = int(hf + where * (plain - hf))
        lp.set_budget(budget)
        measured = [step(m, batch, meter, s, args.amp) for s in (1, 2)][1]
        p, old = lp.predicted_peak_bytes, charged_all(lp)
        print(f"| {where:.1f} ({mib(budget)} MiB) | {' '.join(c[0] for c in lp.choices)} | {mib(p)} | "
              f"{mib(measured)} | {(measured / p - 1) * 100:+.2f}% | {mib(old)} MiB, "
              f"{(measured / old - 1) * 100:+.2f}% |")
    if args.plans:
        # Given per-layer plans (one letter a layer), predicted from the same profile and run on a fresh model
        # that remat.hf.enable(plan=...) plans with them: the cases a budget's plan may not reach in one run.
        chain, context = lp.chain, lp.context
        lp.remove()
        del m, lp
        gc.collect()
        print("| given plan | predicted MiB | measured MiB | error |")
        print("|---|---|---|---|")
        for letters in args.plans:
            plan = per_layer_plan([{"k": "keep", "c": "checkpoint", "m": "matmuls"}[c] for c in letters])
            p = remat.step_peak_bytes(chain, context, plan)
            m = make()
            remat.hf.enable(m, plan=plan)
            measured = [step(m, batch, meter, s, args.amp) for s in (1, 2)][1]
            print(f"| {' '.join(letters)} | {mib(p)} | {mib(measured)} | {(measured / p - 1) * 100:+.2f}% |")
            del m
            gc.collect()
    print("plan letters: k keep, c checkpoint, m matmuls (a measured error above 0: the step held more than "
          "predicted)")


def compiled_gpt2(args, meter):
    import time

    import transformers
    import remat.measure_step

    def make():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        m = transformers.GPT2LMHeadModel(cfg).to(DEVICE)
        m.train()
        return m

    def timed(m, s):
        t0 = time.perf_counter()
        peak = step(m, batch, meter, s, args.amp)
        return peak, (time.perf_counter() - t0) * 1e3

    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    batch = dict(input_ids=ids, labels=ids)
    m = make()
    for block in m.transformer.h:
        block.compile()
    runs = [timed(m, s) for s in range(3 + args.steps)]
    plain = runs[2][0]
    plain_ms = sorted(ms for _, ms in runs[3:])[args.steps // 2]
    del m
    gc.collect()
    print(f"compiled GPT-2 (4x128, batch {args.batch}, sequence {args.seq}, dropout 0, each block layer.compile()d "
          f"after remat.hf.enable), {args.amp}, {DEVICE.type}, torch {torch.__version__}: plain compiled step "
          f"{mib(plain)} MiB, {plain_ms:.1f} ms (median of {args.steps})")
    print("| budget (of plain) | profiled | profiling step s | plan | predicted MiB | measured MiB | error | "
          f"step ms (median of {args.steps}) | predicted step ms | least MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    as_compiled = remat.measure_step.compiled_stage
    for where in args.at:
        for profiled in ("eagerly", "compiled") + (("compiled, offload",) if args.offload else ()):
            # "eagerly": as before issue 45, each compiled layer profiled by its eager run.
            remat.measure_step.compiled_stage = as_compiled if profiled != "eagerly" else (lambda *a: None)
            torch._dynamo.reset()
            m = make()
            budget = int(where * plain)
            offload = dict(offload=True, offload_min_bytes=64 << 10) if profiled.endswith("offload") else {}
            lp = remat.hf.enable(m, budget=budget, **offload)
            for block in m.transformer.h:
                block.compile()
            try:
                profiling_s = timed(m, 0)[1] / 1e3
            except remat.InfeasibleBudget as e:  # below the least budget this way allows
                print(f"| {where:.2f} ({mib(budget)} MiB) | {profiled} | | infeasible | | | | | | "
                      f"{mib(e.min_bytes)} |")
            else:
                runs = [timed(m, s) for s in range(1, 3 + args.steps)]
                measured = runs[1][0]
                ms = sorted(t for _, t in runs[2:])[args.steps // 2]
                p = lp.predicted_peak_bytes
                print(f"| {where:.2f} ({mib(budget)} MiB) | {profiled} | {profiling_s:.1f} | "
                      f"{' '.join(letter(c) for c in lp.choices)} | {mib(p)} | {mib(measured)} | "
                      f"{(measured / p - 1) * 100:+.1f}% | {ms:.1f} | {lp.timeline()['time_ms']:.1f} | "
                      f"{mib(lp.min_budget_bytes)} |")
            lp.remove()
            del m, lp
            gc.collect()
    remat.measure_step.compiled_stage = as_compiled
    print("plan letters: k keep, c checkpoint, m matmuls, capitals on the host; profiling step s includes compiling "
          "the layers' graphs")


def letter(choice: str) -> str:
    """A layer's choice as the compiled table's one letter: k keep, c checkpoint, m matmuls; capital on the host."""
    from remat.policies import split_choice
    base, host = split_choice(choice)
    return base[0].upper() if host else base[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--amp", choices=list(AMP), default="fp32", help="autocast's dtype (fp16: CUDA only)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the GPU rows)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=None, help="default 4 (--compiled: 8)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--at", type=float, nargs="+", default=None,
                    help="budgets: between Hugging Face's peak and the plain one (default 0.2 0.5 0.8); with "
                    "--compiled, shares of the plain compiled peak (default 0.6)")
    ap.add_argument("--plans", nargs="+", default=[],
                    help="given per-layer plans of the Llama too, one letter a layer (k keep, c checkpoint, "
                    "m matmuls), e.g. cmmkmm")
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--steps", type=int, default=5, help="--compiled: planned steps timed per budget")
    ap.add_argument("--offload", action="store_true",
                    help="--compiled: also planned with offload=True (compiled layers offloaded around their graphs)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.amp == "fp16" and DEVICE.type != "cuda":
        ap.error("--amp fp16 runs on CUDA only (--device cuda)")
    if args.offload and not args.compiled:
        ap.error("--offload plans the compiled GPT-2 (--compiled) offloaded too")
    args.batch = args.batch or (8 if args.compiled else 4)
    for letters in args.plans:
        if len(letters) != args.layers or set(letters) - set("kcm"):
            ap.error(f"--plans {letters}: one of k, c, m per layer ({args.layers} layers)")
    meter = remat.meter_for(DEVICE)
    if args.compiled:
        if remat.hf.wraps_whole_call():
            import transformers
            sys.exit(f"prediction_error.py --compiled: transformers {transformers.__version__} checkpoints a layer's "
                     "whole call, around its compiled graph (before 5.23), where remat.hf.enable refuses layers "
                     "compiled on their own (docs/python.md, Limits); run it with transformers 5.23 or later")
        args.at = args.at or [0.6]
        compiled_gpt2(args, meter)
    else:
        args.at = args.at or [0.2, 0.5, 0.8]
        llama(args, meter)


if __name__ == "__main__":
    main()
