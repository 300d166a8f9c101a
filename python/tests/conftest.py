"""Shared helpers of the Python package's tests: models, a training step, and the plain run to compare with."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import remat

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # pytorch_reference.py: the BERT the C++ library defines too


def _threads() -> int:
    """Torch's intra-op threads for the tests: $REMAT_TEST_THREADS, else two (or the cores, if fewer). ./test's
    ctest runs the test files side by side, one per core, and sets it to 1 (tests/CMakeLists.txt): two OpenMP
    teams spinning on the same two cores made test_seq2seq.py take 102 s beside test_hf.py against 13 s with one
    thread each (15 s alone with two; measured 2026-12-04)."""
    given = os.environ.get("REMAT_TEST_THREADS")
    if given is None:
        return max(1, min(2, os.cpu_count() or 1))
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"conftest: REMAT_TEST_THREADS must be a positive number of threads, not {given!r}")
    return int(given)


torch.set_num_threads(_threads())


@pytest.fixture(autouse=True)
def _collected():
    """Garbage from earlier tests is collected before each test: freed during a measured step, it would lower
    the step's measured peaks (seen when several test files share one process)."""
    import gc
    gc.collect()
    yield


@pytest.fixture(scope="session")
def meter():
    return remat.cpu_meter()


def block(width=64, hidden=256, dropout=0.1, norm="layer"):
    """A residual-MLP-like block: two linears, GELU, dropout, a norm (LayerNorm, or BatchNorm1d)."""
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, width),
                         nn.LayerNorm(width) if norm == "layer" else nn.BatchNorm1d(width))


def mlp(depth=6, width=64, hidden=256, seed=0, norm="layer"):
    torch.manual_seed(seed)
    return nn.Sequential(*[block(width, hidden, norm=norm) for _ in range(depth)])


def preallocate(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def train_step(model, x, meter=None, seed=1, loss_fn=None, set_to_none=False):
    """One forward and backward pass from a fixed RNG state. Returns (loss, gradients, peak above the bytes
    alive at the forward's call, the next random draw, buffers)."""
    torch.manual_seed(seed)
    if set_to_none:
        model.zero_grad(set_to_none=True)
    else:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
    base = meter.active() if meter else 0
    if meter:
        meter.reset_peak()
    out = model(x)
    loss = loss_fn(out) if loss_fn else out.float().square().mean()
    loss.backward()
    peak = meter.peak() - base if meter else 0
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return (loss.detach(), grads, peak, torch.rand(4), [b.clone() for b in model.buffers()])


def assert_same_run(a, b):
    """Loss, every gradient, the next random draw and every buffer bitwise equal."""
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert len(a[1]) == len(b[1])
    for i, (g, h) in enumerate(zip(a[1], b[1])):
        assert (g is None) == (h is None), i
        if g is not None:
            assert torch.equal(g, h), f"gradient {i} differs: max {float((g - h).abs().max())}"
    assert torch.equal(a[3], b[3]), "the generator is not where the plain run leaves it"
    for i, (x, y) in enumerate(zip(a[4], b[4])):
        assert torch.equal(x, y), f"buffer {i} differs"


def cli():
    """The remat command of the C++ build of the same torch (the ./test --torch pypi phase sets REMAT_CLI)."""
    path = os.environ.get("REMAT_CLI")
    if not path or not Path(path).exists():
        if os.environ.get("REMAT_TEST_STRICT"):  # ./test: never skipped
            pytest.fail(f"REMAT_CLI is not the remat command: {path!r}")
        pytest.skip("REMAT_CLI is not set to the remat command (./test --torch pypi sets it)")
    return path


def groups_to_the_host_pay(chain):
    """Sets a profiled chain's times, in place, so that sending a layer's groups to the host is the fastest way
    to a budget, whatever this machine's timings: recomputing a layer costs 100 ms (half of it each group's
    call), keeping it whole 5 ms, keeping the matmuls policy's tensors 1 s (test_selective.py, test_cuda.py)."""
    for st in chain.stages:
        st.bwd_ms = st.checkpoint_fwd_ms = 1.0
        st.fwd_ms = 5.0
        st.checkpoint_bwd_ms = 101.0
        for g in st.groups:
            g.recompute_ms = 50.0
        # The group runtime's own times, which the profile measures, left out: a group assignment is charged from
        # the times above (Stage.group_fwd_ms, group_bwd_ms).
        st.groups_fwd_ms = st.groups_bwd_ms = None
        st.policies[0].fwd_ms = st.policies[0].bwd_ms = 1e3


def per_layer_ops(choices) -> list[str]:
    """The plan strings of the per-layer plan of `choices` (remat.choices_of's inverse): each "keep",
    "checkpoint" or a policy's name, with "@host" where offloaded; a checkpointed layer recomputed right before
    its backward."""
    ops = []
    for i, c in enumerate(choices):
        base, host = (c[: -len("@host")], "@host") if c.endswith("@host") else (c, "")
        ops.append({"keep": f"Fa{i}", "checkpoint": f"Fc{i}"}.get(base, f"Fk{i}[{base}]") + host)
    return ops + backward_ops(ops)


def backward_ops(forwards) -> list[str]:
    """What follows a per-layer plan's forwards (plan strings, one per layer): the loss, then each layer's
    backward, a checkpointed one (Fc) recomputed right before it."""
    ops = ["L"]
    for i in reversed(range(len(forwards))):
        ops += [f"Fa{i}"] * forwards[i].startswith("Fc") + [f"B{i}"]
    return ops


def forwards_plan(chain, forwards) -> tuple[list[str], list[int]]:
    """The per-layer plan whose forwards are `forwards` ("Fa0@stream", "Fa1@stream0", "Fc2@host", ...), as
    give_plan takes it: its plan strings (backward_ops after them) and its stream windows (the chain's window
    for "@stream", none for "@stream0", which runs as "@stream" with window 0)."""
    windows = [st.offload.window_bytes if op.endswith("@stream") else 0 for st, op in zip(chain.stages, forwards)]
    ops = [op.replace("@stream0", "@stream") for op in forwards]
    return ops + backward_ops(ops), windows


def per_layer_plan(choices):
    """The per-layer plan of `choices` (per_layer_ops), through the planner's JSON."""
    return remat.Plan.from_json(json.dumps({"num_stages": len(choices), "ops": per_layer_ops(choices)}))


def matmul_seeing_alignment(seen: list, modulus: int):
    """A torch.autograd.Function computing v @ w that appends to `seen` v's address modulo `modulus` bytes when it
    saves v and when autograd hands v back for its backward pass: whether a saved tensor comes back at its
    alignment (test_offload.py on the CPU, test_cuda.py on CUDA; C++'s tests/support.h has the same)."""

    class Saves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v, w):
            ctx.save_for_backward(v, w)
            seen.append(v.data_ptr() % modulus)
            return v @ w

        @staticmethod
        def backward(ctx, g):
            v, w = ctx.saved_tensors
            seen.append(v.data_ptr() % modulus)
            return None, v.t() @ g

    return Saves


def give_plan(lp, ops, **fields):
    """Has a profiled LayerPlan run the plan of `ops` (the plan strings; `fields`: more of the plan's JSON, as
    stream_windows and policies) in place of its planner's, through its choose_plan (what remat.enable's
    choose_plan= sets: the plan checked against the profile and predicted as remat's own), and sets a budget it
    fits, as the tests and bench/given_plan_predictions.py run a plan of their own in place: (the plan, its
    predicted step peak)."""
    plan = remat.Plan.from_json(json.dumps({"num_stages": len(lp.chain.stages), "ops": ops, **fields}))
    predicted = remat.step_peak_bytes(lp.chain, lp.context, plan)
    lp.choose_plan = lambda chain, context, budget: plan
    lp.set_budget(1 << 39)
    assert lp.predicted_peak_bytes == predicted and str(lp.plan) == str(plan), (str(lp.plan), str(plan))
    return plan, predicted
