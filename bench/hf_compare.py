#!/usr/bin/env python3
"""Hugging Face models: PyTorch's checkpointing options, torch.compile's memory budget, and remat's per-layer
policies at each option's measured peak (issue 23's table in docs/BENCHMARKS.md).

For each model (BertModel at the headline's size, GPT-2 small, both from their configs with random weights), in
one process: every way's step is measured with remat's CPU meter (the peak above the bytes alive before the
forward; gradients pre-allocated, as after a first step, so that the peaks are the activations') and timed.
The ways:

  none              the plain step
  hf                model.gradient_checkpointing_enable() (per layer, non-reentrant)
  sac               per layer with PyTorch's selective checkpointing saving the matrix multiplications
                    (gradient_checkpointing_enable with context_fn=create_selective_checkpoint_contexts)
  seq:K             torch.utils.checkpoint.checkpoint_sequential over the layers in K segments (the last one
                    kept, as checkpoint_sequential does)
  compile:B         the step's forward under torch.compile with activation_memory_budget B (compile time, the
                    first call's, reported apart)
  remat@WAY         remat.hf.enable at WAY's measured peak (profiled once, re-planned per budget with
                    LayerPlan.set_budget)

First one measuring step per option gives the peaks remat plans for; then `--rounds` rounds, each running every
way in turn: `--warmup` steps, then `--steps` pairs of a plain step and a step of the way; the way's ratio in
a round is the median of its steps over the median of the plain steps paired with them (so that the machine's
drift over a round, seen at 30% here, cancels); the table gives the median of the rounds' ratios and the peaks
(the same in every round).

    python bench/hf_compare.py --model bert --rounds 3 --json out/hf-bert.json
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import types
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint_sequential, create_selective_checkpoint_contexts

import remat
import remat.hf
from remat.policies import matmuls

from gc_cost import Collections  # noqa: E402  (bench/: Python's collections while a way's steps run)


def build(name, args):
    import transformers
    torch.manual_seed(0)
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=args.layers,
                                      num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512)
        model = transformers.BertModel(cfg, add_pooling_layer=False)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
        batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
        loss = lambda out: out.last_hidden_state.square().mean()  # noqa: E731
        layers_attr = ("encoder", "layer")
    elif name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=args.layers)  # GPT-2 small: 768 wide, 12 heads, vocab 50257
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
        batch = dict(input_ids=ids, labels=ids)
        loss = lambda out: out.loss  # noqa: E731
        layers_attr = ("transformer", "h")
    else:
        sys.exit(f"hf_compare.py: unknown model '{name}' (bert, gpt2)")
    model.train()
    return model, batch, loss, layers_attr


class Segments(torch.nn.Module):
    """Stands in for a model's layer list: called once with the first layer's arguments, it runs all the layers
    through torch.utils.checkpoint.checkpoint_sequential in `segments` segments."""

    def __init__(self, layers, segments):
        super().__init__()
        self.inner = layers
        self.segments = segments

    def forward(self, hidden, *args, **kwargs):
        fns = [partial(_call, layer, args, kwargs) for layer in self.inner]
        return checkpoint_sequential(fns, self.segments, hidden, use_reentrant=False)


def _call(layer, args, kwargs, h):
    return layer(h, *args, **kwargs)


def grads_ready(model):
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def make_ways(name, args, meter):
    base_model, batch, loss_of, attr = build(name, args)
    ways = {}

    def eager(model):
        def run():
            return loss_of(model(**batch))
        return model, run

    ways["none"] = eager(base_model)
    hf = copy.deepcopy(base_model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ways["hf"] = eager(hf)
    sac = copy.deepcopy(base_model)
    sac.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, matmuls)})
    ways["sac"] = eager(sac)
    for k in args.segments:
        seg = copy.deepcopy(base_model)
        parent = getattr(seg, attr[0])
        layers = getattr(parent, attr[1])
        setattr(parent, attr[1], torch.nn.ModuleList([Segments(layers, k)]))
        ways[f"seq:{k}"] = eager(seg)
    for b in args.compile:
        ways[f"compile:{b}"] = (base_model, compiled(base_model, batch, loss_of, b))
    return ways, base_model, batch, loss_of


def compiled(model, batch, loss_of, budget):
    """The forward and loss under torch.compile with activation_memory_budget `budget`: a code object per
    budget (dynamo keeps compiled graphs per code object), compiled and run under its own budget."""
    def run():
        return loss_of(model(**batch))

    code = run.__code__.replace(co_name=f"run_budget_{str(budget).replace('.', '_')}")
    fn = torch.compile(types.FunctionType(code, run.__globals__, code.co_name, None, run.__closure__))

    def call():
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return fn()

    return call


def grads_of(model):
    """Copies of the parameters' gradients."""
    return [p.grad.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    """The largest difference between two lists of gradients."""
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(model, run, meter, steps):
    """`steps` steps; returns (median ms, peak above the bytes alive before the forward). On CUDA the device is
    synchronized around each step, so that the time is the step's work."""
    times, peak = [0.0], 0
    if steps > 0:
        times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        _sync()
        base = meter.active()
        meter.reset_peak()
        t0 = time.perf_counter()
        loss = run()
        loss.backward()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
        peak = max(peak, meter.peak() - base)
        del loss
    return statistics.median(times), peak


def add_common_args(ap, layers):
    """The arguments hf_compare.py and compiled_layers.py share."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compile", type=lambda s: [float(v) for v in s.split(",") if v], default=[1.0, 0.5, 0.2, 0.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default="")


def remat_at_peaks(rm, batch, loss_of, meter, targets):
    """remat.hf.enable on the model `rm`, profiled once (its first training step, on `batch`), planned for each
    of `targets` (way -> its measured peak). Returns (the LayerPlan, per way its plan or the least feasible
    budget, the profiling step's seconds)."""
    grads_ready(rm)
    t0 = time.perf_counter()
    lp = remat.hf.enable(rm, budget=1 << 62)  # profiled at any budget; planned for each target after
    measure(rm, lambda: loss_of(rm(**batch)), meter, 1)
    profile_s = time.perf_counter() - t0
    plans = {}
    for w, peak in targets.items():
        try:
            lp.set_budget(peak)
        except remat.InfeasibleBudget as e:
            print(f"remat@{w}: infeasible, least {e.min_bytes / 2**20:.1f} MiB", file=sys.stderr)
            plans[w] = dict(infeasible=e.min_bytes)
            continue
        plans[w] = dict(budget=peak, plan=str(lp.plan), choices=lp.choices, predicted=lp.predicted_peak_bytes)
        print(f"remat@{w}: {lp.choices}, predicted {lp.predicted_peak_bytes / 2**20:.1f} MiB", file=sys.stderr,
              flush=True)
    return lp, plans, profile_s


def remat_rounds(ways, rm, lp, plans, batch, loss_of, meter, args):
    """paired_rounds over every way but "none" and remat at each feasible plan's budget. Returns (the rows,
    the results, every plain step's time)."""
    rows = [w for w in ways if w != "none"] + [f"remat@{w}" for w in plans if "budget" in plans[w]]

    def way_of(r):
        if r.startswith("remat@"):
            lp.set_budget(plans[r[6:]]["budget"])
            return rm, (lambda: loss_of(rm(**batch)))
        return ways[r]

    results, plain_all = paired_rounds(rows, way_of, ways["none"], meter, args.rounds, args.steps, args.warmup)
    return rows, results, plain_all


def paired_rounds(rows, way_of, plain, meter, rounds, steps, warmup, after_round=None):
    """`rounds` rounds, each running every way of `rows` in turn (way_of(row) -> (model, run)): `warmup` steps,
    then `steps` pairs of a plain step (plain: (model, run)) and a step of the way. Returns per row its rounds'
    medians (ms), the paired plain steps' medians (plain_ms), their ratios and its largest peak, and every plain
    step's time (ms). A way's ratio in a round is the median of its steps over the median of the plain steps
    paired with them, so that the machine's drift over a round cancels. Per row also every step's time (step_ms,
    a list per round) and Python's full collections that began during its steps (full_collections, their
    full_collection_ms), which the medians leave out. after_round(results, plain_all), if given, is called after
    each round (to keep what is measured should the run be stopped)."""
    plain_model, plain_run = plain
    results = {r: dict(ratios=[], ms=[], plain_ms=[], peak=0, step_ms=[], full_collections=0, full_collection_ms=0.0)
               for r in rows}
    plain_all = []
    for rnd in range(rounds):
        for r in rows:
            model, run = way_of(r)
            measure(model, run, meter, warmup)
            ms, paired, peak = [], [], 0
            with Collections() as collections:
                for _ in range(steps):
                    paired.append(measure(plain_model, plain_run, meter, 1)[0])
                    collections.on = True
                    t, p = measure(model, run, meter, 1)
                    collections.on = False
                    ms.append(t)
                    peak = max(peak, p)
            results[r]["step_ms"].append(ms)
            results[r]["full_collections"] += collections.count[2]
            results[r]["full_collection_ms"] += collections.ms[2]
            results[r]["ms"].append(statistics.median(ms))
            results[r]["plain_ms"].append(statistics.median(paired))
            results[r]["ratios"].append(statistics.median(ms) / statistics.median(paired))
            results[r]["peak"] = max(results[r]["peak"], peak)
            plain_all.extend(paired)
            print(f"round {rnd + 1} {r}: {statistics.median(ms):.0f} ms against {statistics.median(paired):.0f} ms "
                  f"plain, {peak / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        if after_round is not None:
            after_round(results, plain_all)
    return results, plain_all


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bert")
    ap.add_argument("--segments", type=lambda s: [int(v) for v in s.split(",") if v], default=[2, 4, 6])
    add_common_args(ap, layers=12)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    meter = remat.cpu_meter()

    ways, base_model, batch, loss_of = make_ways(args.model, args, meter)
    for model, _ in ways.values():
        grads_ready(model)

    # The options' peaks (and compile times: the first call of each compiled step).
    peaks, compile_s = {}, {}
    for w, (model, run) in ways.items():
        t0 = time.perf_counter()
        _, peak = measure(model, run, meter, 1)
        if w.startswith("compile:"):
            compile_s[w] = time.perf_counter() - t0
        _, peaks[w] = measure(model, run, meter, 1)
        print(f"{w}: peak {peaks[w] / 2**20:.1f} MiB", file=sys.stderr, flush=True)

    # remat: profiled once (the first training step of remat.hf.enable, on the same batch), planned for each
    # option's peak.
    rm = copy.deepcopy(base_model)
    lp, plans, profile_s = remat_at_peaks(rm, batch, loss_of, meter, {w: p for w, p in peaks.items() if w != "none"})
    rows, results, plain_all = remat_rounds(ways, rm, lp, plans, batch, loss_of, meter, args)
    results["none"] = dict(ratios=[], ms=plain_all, plain_ms=[], peak=peaks["none"])
    results["none"]["ratios"] = [1.0]
    rows = ["none"] + rows

    eager_plain = statistics.median(results["none"]["ms"])
    compile_plain = statistics.median(results["compile:1.0"]["ms"]) if "compile:1.0" in results else None
    print(f"\n{args.model}: {args.layers} layers, batch {args.batch}, seq {args.seq}; eager plain step "
          f"{eager_plain:.0f} ms" + (f", compile's plain step (budget 1.0) {compile_plain:.0f} ms"
                                     if compile_plain else ""))
    print(f"{'way':<22} {'peak MiB':>9} {'time/none':>9}  rounds")
    for r in rows:
        ratios = results[r]["ratios"]
        print(f"{r:<22} {results[r]['peak'] / 2**20:9.1f} {statistics.median(ratios):9.2f}  "
              + ", ".join(f"{v:.2f}" for v in ratios))
    if args.json:
        out = dict(model=args.model, layers=args.layers, batch=args.batch, seq=args.seq, rounds=args.rounds,
                   steps=args.steps, eager_plain_ms=eager_plain, compile_plain_ms=compile_plain,
                   compile_s=compile_s, remat_profile_s=profile_s, plans=plans,
                   rows={r: dict(peak_bytes=results[r]["peak"], ratio=statistics.median(results[r]["ratios"]),
                                 ratios=results[r]["ratios"], ms=results[r]["ms"]) for r in rows},
                   torch=torch.__version__)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
