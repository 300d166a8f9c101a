#!/usr/bin/env python3
"""How far remat's predicted step peaks are from the measured ones (issue 45's table in docs/BENCHMARKS.md).

Llama-architecture models built from a config (random weights, CPU), trained as a Trainer does (gradients set
to none before each step), planned with remat.hf.enable between Hugging Face's per-layer checkpointing peak
and the plain step's (LayerPlan.set_budget from one profiling step). For each budget: the plan, the
prediction, the step's measured peak (remat's CPU meter, the step after the plan's first), their error, and,
from the same profile, the prediction as the model made it before the profile measured each backward's peak
with its gradients made there and each policy's backward on its own (charged_all). `--amp bf16` runs the steps
under CPU bf16 autocast.

`--compiled` instead plans issue 45's GPT-2 (4 blocks of width 128, batch 8, sequence 128, dropout 0), each
block compiled (layer.compile()) after remat.hf.enable at 0.6 of the plain compiled step's peak: the profile
is the eager profiling step's, so the prediction is the eager step's.

    python bench/prediction_error.py --amp fp32
    python bench/prediction_error.py --amp bf16
    python bench/prediction_error.py --compiled
"""
from __future__ import annotations

import argparse
import gc

import torch

import remat
import remat.hf


def step(model, batch, meter, seed, amp):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    base = meter.active()
    meter.reset_peak()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
        loss = model(**batch).loss
    loss.backward()
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
        m = transformers.LlamaForCausalLM(cfg)
        m.train()
        return m

    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
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
    print("plan letters: k keep, c checkpoint, m matmuls (a measured error above 0: the step held more than "
          "predicted)")


def compiled_gpt2(meter):
    import transformers

    def make():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        m = transformers.GPT2LMHeadModel(cfg)
        m.train()
        return m

    ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids, labels=ids)
    m = make()
    for block in m.transformer.h:
        block.compile()
    plain = [step(m, batch, meter, s, "fp32") for s in range(3)][2]
    del m
    gc.collect()
    m = make()
    budget = int(0.6 * plain)
    lp = remat.hf.enable(m, budget=budget)
    for block in m.transformer.h:
        block.compile()
    measured = [step(m, batch, meter, s, "fp32") for s in range(4)][3]
    p = lp.predicted_peak_bytes
    print(f"compiled GPT-2 (4x128, batch 8, sequence 128, dropout 0), torch {torch.__version__}: plain compiled "
          f"step {mib(plain)} MiB, budget {mib(budget)} MiB (0.6); plan {' '.join(lp.choices)}; predicted "
          f"{mib(p)} MiB, measured {mib(measured)} MiB, error {(measured / p - 1) * 100:+.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--amp", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--at", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    ap.add_argument("--compiled", action="store_true")
    args = ap.parse_args()
    meter = remat.cpu_meter()
    if args.compiled:
        compiled_gpt2(meter)
    else:
        llama(args, meter)


if __name__ == "__main__":
    main()
