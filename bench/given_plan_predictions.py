#!/usr/bin/env python3
"""Predicted against measured step peaks of random per-layer plans, each way mixed with the others, on the test
suite's Llama (docs/BENCHMARKS.md, "Random per-layer plans predicted to the byte").

The model is python/tests/test_hf.py's Llama (4 layers, width 64, batch 4, sequence 64; random weights, CPU),
profiled once by remat.hf.enable(offload=True, groups=True, offload_min_bytes=16 KiB). Each plan gives each
layer one way drawn at random: kept (Fa), kept with what it saves on the host (Fa@host), streamed with its
window or none (Fa@stream, Fa@stream0), under the matmuls policy (Fk[matmuls]) on the device or the host,
checkpointed (Fc) with or without its input on the host, or a random assignment of its saved groups
(Fk{khr...}). The planner's answer is replaced by that plan (LayerPlan.choose_plan, as the tests do), and one step
is measured with remat's CPU meter twice: copies made at once, their sources held until waited for (the
planned layers' own engine on the CPU since 2026-12-06, CopyEngine(hold=True); before, let go of at once), and
copies carried out only when waited for (a delayed engine, as a GPU's copies may land late). Each step is
checked bitwise against the plain run's. Each row: the plan, the prediction, both measured peaks and their errors
(measured less predicted, over predicted: negative where the model overstates).

    python bench/given_plan_predictions.py                 # 24 plans, seed 0
    python bench/given_plan_predictions.py --plans 40 --seed 3
    python bench/given_plan_predictions.py --stack         # the Linear-ReLU stack, each way on every layer

--stack runs instead python/tests/test_offload.py's 4-layer stack of Linear(128, 128) then ReLU (batch 256,
loss the mean square; profiled with offload_min_bytes=64 KiB), whose layers save only their own input and
output, under each way on every layer. With --phases, each way's delayed step is also measured phase by phase
(each layer's forward, the loss with its backward, each layer's backward, marked by module and gradient hooks
that allocate nothing) beside the prediction's peak for that phase (remat/planner/timeline.h's points).

    python bench/given_plan_predictions.py --stack --phases

--compiled runs instead test_hf.py's GPT-2 (4 layers, width 64, no dropout) with its middle two layers compiled
one by one (layer.compile(), inductor) and its first and last eager, profiled as the Llama: the compiled layers
are drawn among the ways they run inside their graphs (kept, checkpointed, the matmuls policy, each on the
device or on the host: their Offload opened around the compiled call), the eager ones among all of WAYS, so that
compiled layers offloaded around their graphs run beside streamed layers and group assignments.

    python bench/given_plan_predictions.py --compiled --plans 40

--stack --every runs every plan of the stack's eight ways on its four layers (test_offload.py's STACK_WAYS,
those of WAYS but the group assignments: 4,096 plans, each step with copies made at once and delayed, about 30 s)
and counts, per engine, the steps above their prediction (each named) and those within 0.01% of it.

    python bench/given_plan_predictions.py --stack --every
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import warnings
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402

import remat  # noqa: E402
import remat.hf  # noqa: E402
from remat.offload import CopyEngine  # noqa: E402
from conftest import forwards_plan, give_plan  # noqa: E402
from test_hf import _compiled_gpt2, make, same, step  # noqa: E402
from test_offload import STACK_WAYS, Phases, predicted_phases, relu_stack, same_step, stack_step  # noqa: E402

# The ways a layer compiled on its own runs inside its graph (no streaming, no group assignment: those run
# eagerly, and the profile has no figures for them there).
COMPILED_WAYS = ["Fa{i}", "Fa{i}@host", "Fk{i}[matmuls]", "Fk{i}[matmuls]@host", "Fc{i}", "Fc{i}@host"]
WAYS = ["Fa{i}", "Fa{i}@host", "Fa{i}@stream", "Fa{i}@stream0", "Fk{i}[matmuls]", "Fk{i}[matmuls]@host", "Fc{i}",
        "Fc{i}@host", "groups", "groups"]


def offered(way: str, st) -> bool:
    """Whether the chain's stage `st` has the figures the way needs (a stage whose graph is gone before the backward
    pass has no offload figures and no groups: remat.measure_step.unsent). Every way where it has them all, so
    that a draw over such stages is the one made before this check."""
    if way == "groups":
        return bool(st.groups)
    if "@stream" in way:
        return st.offload is not None and st.offload.can_stream()
    if not way.endswith("@host"):
        return True
    if way.startswith("Fc"):
        return st.checkpoint_offload is not None
    if way.startswith("Fk"):
        return any(p.offload is not None for p in st.policies)
    return st.offload is not None


def draw(chain, rng: random.Random, compiled=frozenset()) -> tuple[str, list[int]]:
    """A random per-layer plan's text and its stream windows (the chain's where streamed with one); the stages
    in `compiled` drawn among COMPILED_WAYS."""
    fwd = []
    for i, st in enumerate(chain.stages):
        ways = [w for w in (COMPILED_WAYS if i in compiled else WAYS) if offered(w, st)]
        way = rng.choice(ways)
        if way == "groups":
            way = "Fk{i}{{" + "".join(rng.choice("khr") for _ in st.groups) + "}}"
        fwd.append(way.format(i=i))
    ops, windows = forwards_plan(chain, fwd)
    return " ".join(ops), windows


def compiled_gpt2():
    """test_hf.py's compiled GPT-2 (no dropout) with its middle two layers compiled one by one, the others
    eager."""
    model, spec = _compiled_gpt2(None)
    for layer in model.transformer.h[1:3]:
        layer.compile()
    return model, spec


def checked_stack_peak(model, x, plain) -> int:
    """One step of the stack, checked bitwise against the plain run's: its peak."""
    got = stack_step(model, x)
    same_step(plain, got)
    return got[2]


def run_given(lp, chain, ops, windows, run_step) -> tuple[int, list[int]]:
    """The plan of `ops` in place of the planner's: its prediction, and run_step()'s peak with copies made at
    once and with copies delayed until waited for."""
    _, predicted = give_plan(lp, ops, stream_windows=windows, policies=list(chain.policies))
    cpu = torch.device("cpu")
    peaks = []
    for engine in (CopyEngine(cpu, hold=True), CopyEngine(cpu, delay=100)):
        lp.offloads.engines[cpu] = engine
        peaks.append(run_step())
    return predicted, peaks


def stack(phases: bool = False) -> int:
    model, layers, x, plain, lp = relu_stack()
    chain = lp.chain
    run_step = partial(checked_stack_peak, model, x, plain)

    print(f"torch {torch.__version__}; test_offload.py's Linear-ReLU stack, 4 layers")
    print(f"{'every layer':<22} {'predicted':>10} {'at once':>10} {'error':>7} {'delayed':>10} {'error':>7}")
    for way in ("Fa{i}", "Fa{i}@host", "Fa{i}@stream", "Fa{i}@stream0", "Fk{i}[matmuls]", "Fk{i}[matmuls]@host"):
        ops = [way.format(i=i).replace("@stream0", "@stream") for i in range(4)] + ["L", "B3", "B2", "B1", "B0"]
        windows = [st.offload.window_bytes if way.endswith("@stream") else 0 for st in chain.stages]
        predicted, (now, late) = run_given(lp, chain, ops, windows, run_step)
        print(f"{way.format(i=''):<22} {predicted:>10} {now:>10} {now / predicted - 1:>+7.2%} {late:>10} "
              f"{late / predicted - 1:>+7.2%}", flush=True)
        if phases:  # copies delayed still (run_given's last engine)
            marks = Phases(layers, remat.cpu_meter())
            got = stack_step(model, x)
            same_step(plain, got)
            measured, expected = marks.done(), predicted_phases(lp.timeline())
            print("    " + "  ".join(f"{name} {measured[name]}/{expected[name]}" for name in measured))
    return 0


def every_stack_plan() -> int:
    """Every plan of the stack's ways (test_offload.py's STACK_WAYS: WAYS without the group assignments, which
    the stack is not profiled for), each step with copies made at once and delayed: the steps above their
    prediction, and how many are within 0.01% of it."""
    model, layers, x, plain, lp = relu_stack()
    chain = lp.chain
    run_step = partial(checked_stack_peak, model, x, plain)

    errors, above = {"at once": [], "delayed": []}, []
    for combo in itertools.product(STACK_WAYS, repeat=len(chain.stages)):
        ops, windows = forwards_plan(chain, [w.format(i=i) for i, w in enumerate(combo)])
        predicted, peaks = run_given(lp, chain, ops, windows, run_step)
        for name, peak in zip(errors, peaks):
            errors[name].append(peak / predicted - 1)
            if peak > predicted:
                above.append(f"{name}: {' '.join(combo).format(i='')} held {peak}, predicted {predicted}")
    print(f"torch {torch.__version__}; test_offload.py's Linear-ReLU stack, every plan of {len(STACK_WAYS)} ways "
          f"on {len(chain.stages)} layers ({len(errors['delayed'])} plans)")
    for name, e in errors.items():
        print(f"{name}: errors from {min(e):+.2%} to {max(e):+.2%}; {sum(x > 0 for x in e)} above the prediction; "
              f"{sum(abs(x) < 1e-4 for x in e)} of {len(e)} within 0.01%")
    for line in above:
        print("above:", line)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=int, default=24, help="how many random plans")
    ap.add_argument("--seed", type=int, default=0, help="the plans' random seed")
    ap.add_argument("--stack", action="store_true", help="the Linear-ReLU stack, each way on every layer")
    ap.add_argument("--phases", action="store_true",
                    help="with --stack: each phase's peak, measured/predicted (copies delayed)")
    ap.add_argument("--compiled", action="store_true",
                    help="GPT-2 with its middle two layers compiled one by one (inductor), beside eager ones")
    ap.add_argument("--every", action="store_true",
                    help="with --stack: every plan of its ways mixed, counted (about 30 s)")
    args = ap.parse_args(argv)
    if (args.phases or args.every) and not args.stack:
        ap.error("--phases and --every are for --stack")
    warnings.simplefilter("ignore")
    if args.stack and args.every:
        return every_stack_plan()
    if args.stack:
        return stack(args.phases)
    meter = remat.cpu_meter()
    make_model, what = (compiled_gpt2, "test_hf.py's GPT-2, layers 1 and 2 compiled,") if args.compiled \
        else (partial(make, "llama"), "test_hf.py's Llama,")
    model, spec = make_model()
    plain = [step(model, spec, k, meter) for k in range(2)]
    model, spec = make_model()
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10, groups=True)
    profiled = step(model, spec, 0, meter)
    if not args.compiled:  # the profiling step runs compiled layers eagerly: equal to rounding only
        same(plain[0], profiled)
    chain = lp.chain
    compiled = frozenset(lp.compiled_layers)
    if args.compiled:
        assert compiled == {1, 2}, lp.compiled_layers
    rng = random.Random(args.seed)
    print(f"torch {torch.__version__}; {what} {len(chain.stages)} layers, "
          f"{[len(st.groups) for st in chain.stages]} saved groups")
    print(f"{'plan':<92} {'predicted':>10} {'at once':>10} {'error':>7} {'delayed':>10} {'error':>7}")
    errors = {"at once": [], "delayed": []}
    for _ in range(args.plans):
        text, windows = draw(chain, rng, compiled)
        ops = text.split()

        def run_step() -> int:
            got = step(model, spec, 1, meter)
            same(plain[1], got)
            return got[2]

        predicted, peaks = run_given(lp, chain, ops, windows, run_step)
        row = []
        for name, peak in zip(errors, peaks):
            errors[name].append(peak / predicted - 1)
            row += [peak, errors[name][-1]]
        forward = " ".join(ops[: len(chain.stages)])
        print(f"{forward:<92} {predicted:>10} {row[0]:>10} {row[1]:>+7.2%} {row[2]:>10} {row[3]:>+7.2%}", flush=True)
    for name, e in errors.items():
        print(f"{name}: errors from {min(e):+.2%} to {max(e):+.2%}; "
              f"{sum(abs(x) < 1e-4 for x in e)} of {len(e)} within 0.01%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
