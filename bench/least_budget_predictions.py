#!/usr/bin/env python3
"""Predicted against measured step peaks at the least budget with offloading, on every Transformers architecture
the test suite builds (docs/BENCHMARKS.md, "A streamed layer's backward charged the gradients it made by its
peak", under "Streamed layers below per-layer checkpointing's peak").

Each model is the test suite's (python/tests/test_hf.py and test_seq2seq.py: BERT, GPT-2, Llama, T5, BART,
Whisper; GPT-NeoX of width 64, 4 layers, batch 4, sequence 64), built from a config with random weights on the
CPU and trained as a Trainer does (gradients set to none before each step). remat.hf.enable(offload=True,
offload_min_bytes=16 KiB) profiles it in one step; the budget is then set to the least feasible one
(LayerPlan.min_budget_bytes) and two planned steps are measured with remat's CPU meter. Each row: the first
layer's choice, whether the layers' input is read as held in the backward pass, the prediction, the larger
measured peak, their error (measured less predicted, over predicted: negative where the model overstates), and,
from the same profile and plan (not the plan those models chose), the prediction with each streamed backward
charged all of its layer's gradients (the model before OffloadCost.stream_bwd_grads_bytes) and without what runs
between two layers, the gradients of what the layers take beside their input charged from the first layer on,
and each layer's output held through its own backward (the model before the StepContext's between figures,
side_grads_bytes and outputs_held_in_backward), with the chain's output let go of twice where the rest of the
step let go of it (the model before StepReadings.output_freed_bytes: rest_grads_bytes less that output, as read
then, and output_held_in_backward true), and with what the layers take beside their input held to the chain's end
(the model before StepContext.side_freed_bytes; --all-checkpointed prints that column too).

    python bench/least_budget_predictions.py                   # every model
    python bench/least_budget_predictions.py bert whisper
    python bench/least_budget_predictions.py --top t5 bart whisper --labels 8
    python bench/least_budget_predictions.py --all-checkpointed

--top plans for no budget instead (every layer kept, offload=False: the plain step's peak), and --labels sets the
encoder-decoder models' label length (24 by default; test_seq2seq.py's step with longer labels starts at 8), to
read what runs between their encoder and decoder where it is the step's peak (docs/BENCHMARKS.md, "What runs
between the encoder and the decoder").

--all-checkpointed compares, for every layer checkpointed (the profiling step's own schedule, offload=False),
the peak the profiling step measured (StepContext.checkpoint_all_peak_bytes) with the model's prediction, and
with the prediction had every layer's output been charged as saved (Stage.saves_output true: the model before
it, whose recompute made the layer's output again).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import remat  # noqa: E402
import remat.hf  # noqa: E402
import test_hf  # noqa: E402
import test_seq2seq  # noqa: E402
from test_hf import step as hf_step  # noqa: E402

transformers = test_hf.transformers


def neox():
    cfg = transformers.GPTNeoXConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                     num_attention_heads=4, max_position_embeddings=128)
    return transformers.GPTNeoXForCausalLM(cfg), dict(batch=4, seq=64, vocab=1000, loss="lm")


NAMES = ["bert", "gpt2", "llama", "neox", "t5", "bart", "whisper"]


def seq2seq_batch(spec, k, labels: int):
    """test_seq2seq.batch with labels of the given length (the same draws at 24)."""
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(1, 1000, (4, labels), generator=g)
    if spec["name"] == "whisper":
        return dict(input_features=torch.randn(4, 16, 64, generator=g), labels=ids)
    return dict(input_ids=torch.randint(1, 1000, (4, 32), generator=g), labels=ids)


def without_offload_figure(lp, field: str) -> int:
    """The plan's predicted step peak with one figure of every stage's offload cost unset (-1: unmeasured)."""
    chain = remat.Chain.from_json(lp.chain.to_json())
    for st in chain.stages:
        if st.offload is not None:
            o = st.offload
            setattr(o, field, -1)
            st.offload = o
    return remat.step_peak_bytes(chain, lp.context, lp.plan)


def charged_all(lp) -> int:
    """The plan's predicted step peak with every streamed backward charged all of its layer's gradients."""
    return without_offload_figure(lp, "stream_bwd_grads_bytes")


def without_between(lp) -> int:
    """The plan's predicted step peak without what runs between two layers, with the gradients of what the
    layers take beside their input charged from the first layer on, and every layer's output held through its
    own backward (the StepContext's between figures, side_grads_bytes and outputs_held_in_backward cleared: the
    model before them)."""
    ctx = copy.deepcopy(lp.context)
    ctx.between_forward_held_bytes, ctx.between_backward_peak_bytes, ctx.between_held_bytes = [], [], []
    ctx.side_grads_bytes, ctx.outputs_held_in_backward, ctx.side_freed_bytes = [], [], []
    return remat.step_peak_bytes(lp.chain, ctx, lp.plan)


def side_to_the_end(chain, context, plan) -> int:
    """The plan's predicted step peak with what the layers take beside their input, and its gradients, held to the
    chain's end (side_freed_bytes cleared: the model before it)."""
    ctx = copy.deepcopy(context)
    ctx.side_freed_bytes = []
    return remat.step_peak_bytes(chain, ctx, plan)


def output_twice(lp) -> int:
    """The plan's predicted step peak with the chain's output let go of twice where the rest of the step let go of
    it: rest_grads_bytes read net of it (the reading before output_freed_bytes) and output_held_in_backward true."""
    ctx = copy.deepcopy(lp.context)
    if not ctx.output_held_in_backward:
        ctx.rest_grads_bytes = max(0, ctx.rest_grads_bytes - lp.chain.stages[-1].output_bytes)
        ctx.output_held_in_backward = True
    return remat.step_peak_bytes(lp.chain, ctx, lp.plan)


def outputs_saved(chain) -> "remat.Chain":
    """The chain with every stage's output charged as saved (Stage.saves_output true)."""
    out = remat.Chain.from_json(chain.to_json())
    for st in out.stages:
        st.saves_output = True
    return out


def all_checkpointed(name, lp) -> None:
    """One row of --all-checkpointed."""
    chain, ctx = lp.chain, lp.context
    every = remat.checkpoint_all(chain)
    measured = ctx.checkpoint_all_peak_bytes
    now, before = remat.step_peak_bytes(chain, ctx, every), remat.step_peak_bytes(outputs_saved(chain), ctx, every)
    held = side_to_the_end(chain, ctx, every)
    unsaved = sum(not st.saves_output for st in chain.stages)
    print(f"| {name} | {unsaved} of {len(chain.stages)} | {measured} | {now} | {(measured - now) / now:+.2%} | "
          f"{before} ({(measured - before) / before:+.2%}) | {held} ({(measured - held) / held:+.2%}) |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help=f"of {', '.join(NAMES)} (default: every one)")
    ap.add_argument("--top", action="store_true", help="every layer kept (no budget, no offloading)")
    ap.add_argument("--labels", type=int, default=24, help="the encoder-decoder models' label length (default 24)")
    ap.add_argument("--all-checkpointed", action="store_true",
                    help="every layer checkpointed: the profiling step's measured peak against the model's")
    args = ap.parse_args()
    if args.labels < 1:
        ap.error(f"--labels must be >= 1, got {args.labels}")
    unknown = [m for m in args.models if m not in NAMES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(NAMES)}")
    warnings.simplefilter("ignore")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    meter = remat.cpu_meter()
    test_hf.MODELS["neox"] = neox
    if args.top and args.all_checkpointed:
        ap.error("--top and --all-checkpointed are two different plans: choose one")
    if args.all_checkpointed:
        print("| model | layers whose output is not saved | measured (bytes) | predicted (bytes) | error "
              "| every output charged as saved | side held to the end |")
        print("|---|---|---|---|---|---|---|")
    else:
        print("| model | first layer | input held | predicted (bytes) | measured (bytes) | error "
              "| all gradients charged | without the between figures, side_grads_bytes, outputs_held_in_backward "
              "| output let go of twice | side held to the end |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models or NAMES:
        if name in test_hf.MODELS:
            model, spec = test_hf.make(name)
            run = partial(lambda m, s, k: test_hf.step(m, s, k, meter)[2], model, spec)
        else:
            model = test_seq2seq.make(name)
            run = partial(lambda m, n, k: hf_step(m, dict(name=n, loss="lm"), k, meter, make_batch=partial(
                seq2seq_batch, labels=args.labels))[2], model, name)
        if args.all_checkpointed:
            lp = remat.hf.enable(model, budget=1 << 40)
            run(0)
            all_checkpointed(name, lp)
            lp.remove()
            continue
        if args.top:
            lp = remat.hf.enable(model, budget=1 << 40)
            run(0)
        else:
            lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
            run(0)
            lp.set_budget(lp.min_budget_bytes)
        got = max(run(k) for k in (1, 2))
        predicted = lp.predicted_peak_bytes
        before = charged_all(lp)
        alone, twice, held = without_between(lp), output_twice(lp), side_to_the_end(lp.chain, lp.context, lp.plan)
        print(f"| {name} | {lp.choices[0]} | {lp.context.input_held_in_backward} | {predicted} | {got} | "
              f"{(got - predicted) / predicted:+.2%} | {before} ({(got - before) / before:+.2%}) | "
              f"{alone} ({(got - alone) / alone:+.2%}) | {twice} ({(got - twice) / twice:+.2%}) | "
              f"{held} ({(got - held) / held:+.2%}) |", flush=True)
        lp.remove()


if __name__ == "__main__":
    main()
