"""Running one layer as a plan says: kept whole, checkpointed, or checkpointed under a selective policy.

All three use ``torch.utils.checkpoint.checkpoint`` (non-reentrant, RNG state preserved, so dropout masks are
replayed); a policy runs as remat's selective checkpointing (remat/selective.py: PyTorch's shape, with a third
outcome, the host), as its ``context_fn``. A
recompute must not update a module's state a second time (BatchNorm's running statistics: PyTorch's recompute
alone updates them twice), so every recompute runs inside a context that puts the layer's buffers back as the
forward pass left them.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Sequence

import torch
import torch.utils.checkpoint as _torch_checkpoint_module

from ._state import AttributesSeen, RestoreBuffers, RestoreModules, walk
from .saved import version_checked
from .selective import GroupPolicy, selective_contexts

try:  # torch 2.4 and later
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
except ImportError as e:  # pragma: no cover - the package requires torch >= 2.4
    raise ImportError(f"remat needs torch 2.4 or later (selective checkpointing), this is {torch.__version__}") from e

__all__ = ["KEEP", "CHECKPOINT", "HOST", "STREAM", "STREAM_NO_WINDOW", "POLICY_OFFLOAD", "split_choice", "is_streamed",
           "MATMUL_OPS", "matmuls", "POLICIES", "policy_fn", "RestoreBuffers", "checkpoint_context", "run_layer",
           "checkpoint", "checked_checkpoint", "checkpoint_region", "torch_checkpoint"]

KEEP = "keep"
CHECKPOINT = "checkpoint"
# A choice offloaded (the plan's @host): "keep@host", "checkpoint@host", "matmuls@host".
HOST = "@host"
# A layer kept whole, streamed (the plan's Fa3@stream): "keep@stream". What it saves goes to host memory as its
# forward makes it and comes back tensor by tensor, each just ahead of its use (remat.offload.Offload's window).
STREAM = "@stream"
# Streamed with no window (the plan's Fa3@stream with Plan.stream_windows 0): "keep@stream0". Each copy to the host
# is waited for as the forward makes it and each tensor is brought back when the backward asks for it: the layer
# holds its working set only, and nothing hides the copies' time. The planner chooses it where memory is tightest.
STREAM_NO_WINDOW = "@stream0"

# Whether a policy's kept tensors can be offloaded (the plan's Fk[name]@host). Always true since remat runs
# selective checkpointing with its own dispatch modes (remat/selective.py), which send them through the layer's
# Offload on any torch; before, only a torch.utils.checkpoint with respect_saved_tensors_hooks (PyTorch 2.15)
# could. Kept, true, for the code that reads it.
POLICY_OFFLOAD = True


def torch_checkpoint(fn: Callable, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint(fn, *args, **kwargs), closed when fn raises.

    Before PyTorch 2.13 (2.11 is what the lent GPU machines run), the non-reentrant checkpoint runs its pre- and
    post-forward steps as a generator and does not close it when fn raises: while anything holds the exception's
    traceback (`except ... as e` kept, pytest.raises, a notebook's sys.last_traceback), the generator stays
    suspended inside its `with`, and the checkpoint's saved-tensor hooks (and a selective policy's dispatch mode)
    stay installed. Every tensor the next step saves then goes to the failed call's frame: its backward recomputes
    the failed call from its old inputs (measured: torch's CheckpointError on the next step after an out of memory
    in a checkpointed layer's forward). Here the generator is closed as the exception leaves torch's checkpoint,
    which pops what it installed, as PyTorch 2.13 and later do themselves. Every torch.utils.checkpoint remat
    runs eagerly goes through this."""
    try:
        return _torch_checkpoint_module.checkpoint(fn, *args, **kwargs)
    except BaseException as e:
        close_failed_checkpoint(e.__traceback__)
        raise


_CHECKPOINT_CODE = inspect.unwrap(_torch_checkpoint_module.checkpoint).__code__


def close_failed_checkpoint(tb) -> int:
    """Closes every generator that a torch.utils.checkpoint frame in traceback `tb` left suspended (see
    torch_checkpoint), the innermost first, so that what each installed is popped in the order it was pushed
    (a checkpoint nested in a layer, run by torch.utils.checkpoint directly, is closed too). Returns how many."""
    left = []
    while tb is not None:
        if tb.tb_frame.f_code is _CHECKPOINT_CODE:
            gen = tb.tb_frame.f_locals.get("gen")
            if inspect.isgenerator(gen) and inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED:
                left.append(gen)
        tb = tb.tb_next
    for gen in reversed(left):
        gen.close()
    return len(left)


def split_choice(how: str) -> tuple[str, bool]:
    """A layer's choice as (how it runs, whether what it saves goes to host memory): "keep@host" -> ("keep",
    True), "keep@stream" and "keep@stream0" -> ("keep", True)."""
    for suffix in (HOST, STREAM, STREAM_NO_WINDOW):
        if how.endswith(suffix):
            return how[:-len(suffix)], True
    return how, False


def is_streamed(how: str) -> bool:
    """Whether a layer's choice is streamed ("keep@stream" or "keep@stream0", a plan's Fa3@stream)."""
    return how.endswith((STREAM, STREAM_NO_WINDOW))

# The operators a "keep the matrix multiplications" policy saves, as PyTorch's selective checkpointing sees
# them (below autograd: linear is t + addmm, or a matmul then the bias; matmul is mm or bmm; conv2d is
# convolution). The C++ preset policy::matmuls() keeps the same products (linear, mm, addmm, bmm, baddbmm,
# addbmm, addmv, mv, dot, vdot, convolution) where LibTorch's dispatcher shows them, above autograd, where a
# linear is one call (its bias included): the same tensors kept, the same bytes (tests/test_profile.py
# compares the two profilers' Fk[matmuls] bytes on BERT and on a ResNet).
MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                        torch.ops.aten.baddbmm.default, torch.ops.aten.addbmm.default,
                        torch.ops.aten.addmv.default, torch.ops.aten.mv.default, torch.ops.aten.dot.default,
                        torch.ops.aten.vdot.default, torch.ops.aten.convolution.default})


def matmuls(ctx, op, *args, **kwargs):
    """The selective policy "matmuls": save what the matrix multiplications produce, recompute the rest. Its
    answer is a bool, as the C++ preset's: True is MUST_SAVE to torch.compile (as before), and to remat's eager
    selective checkpointing a keep an enclosing Offload may take to the host (the plan's Fk[matmuls]@host)."""
    return op in MATMUL_OPS


# Policies by the name a chain and a plan give them (Fk[matmuls]); the C++ library's preset of that name keeps
# the same calls at the level LibTorch's dispatcher shows them.
POLICIES: dict[str, Callable] = {"matmuls": matmuls}

# The C++ library's presets this package does not have: a chain or plan that names one is refused here (it is
# neither kept whole nor recomputed whole in its place).
CPP_ONLY_PRESETS = ("attention_core", "recompute_pointwise")


def policy_fn(name: str, policies: dict[str, Callable] | None = None) -> Callable:
    """The policy function named `name`, from `policies` first, then remat's presets. Raises ValueError naming
    it when there is none."""
    if policies and name in policies:
        return policies[name]
    if name in POLICIES:
        return POLICIES[name]
    cpp_only = (f"; '{name}' is a preset of the C++ library only (remat::policy::{name}), which keeps calls at "
                "the level of LibTorch's dispatcher above autograd: pass a function of your own under that name"
                if name in CPP_ONLY_PRESETS else "")
    raise ValueError(f"remat: the plan keeps with policy '{name}', which is neither given nor one of remat's "
                     f"presets ({', '.join(sorted(POLICIES))}){cpp_only}")


def checkpoint_context(modules: Sequence[torch.nn.Module], policy: Callable | None = None, offload=None,
                       route_kept: bool | None = None, autograd_saved: dict | None = None):
    """A context_fn for torch.utils.checkpoint: the recompute sees the modules' tensor attributes that the forward
    reassigned as the forward found them (AttributesSeen), and leaves their buffers and tensor attributes as it
    found them (RestoreModules: what the forward left); with `policy`, the forward and the recompute are also
    remat's selective checkpointing for that policy (remat/selective.py: each call's output kept, sent to the
    host through `offload`, or recomputed; `route_kept`: what it keeps (but MUST_SAVE) goes to the host too;
    None: when the checkpoint is inside an Offload's context; `autograd_saved`: the region's
    saved.version_checked's `saved_storages`, so that a kept output the forward writes in place after the call,
    and autograd did not save, is recomputed rather than refused)."""

    def context_fn():
        if modules:
            w = walk(modules)
            seen = AttributesSeen(w)
            restore = RestoreModules(w, seen=seen)
        else:
            seen, restore = contextlib.nullcontext(), contextlib.nullcontext()
        if policy is None:
            return seen, restore
        fwd, rec = selective_contexts(policy, offload, route_kept, autograd_saved=autograd_saved)
        return _Both(seen, fwd), _Both(restore, rec)

    return context_fn


class _Both:
    """Two contexts entered in order, left in reverse. A class of the module's, not one made per call: a class
    made inside context_fn is a reference cycle, which held selective checkpointing's cache (the tensors the
    policy keeps) until Python's cycle collector ran, above the plan's prediction (docs/BENCHMARKS.md, "Figures
    behind the code")."""

    def __init__(self, first, second):
        self.first, self.second = first, second
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.first)
        self.stack.enter_context(self.second)
        return self

    def __exit__(self, *exc):
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc)


def is_groups(how: str) -> bool:
    """Whether a layer's choice is a group assignment ("{khr}", a plan's Fk3{khr})."""
    return how.startswith("{")


def run_layer(how: str, fn: Callable, args: Sequence, modules: Sequence[torch.nn.Module],
              policies: dict[str, Callable] | None = None, offload=None, groups: Sequence[str] | None = None):
    """Runs fn(*args) as `how` says: "keep" plainly, "checkpoint" under torch.utils.checkpoint, or a policy's
    name under torch.utils.checkpoint with that selective policy; any of them with "@host" inside `offload` (a
    remat.offload.Offload, whose hooks send what the layer saves to host memory: kept whole, what its
    operators save; checkpointed, its input; under a policy, its input and what the policy keeps). A policy
    that answers MUST_CPU_OFFLOAD for some calls sends their outputs through `offload` whatever the choice
    (remat/selective.py). A group assignment ("{khr}") runs under GroupPolicy(groups, "khr"), `groups` the
    stage's saved groups' names (remat.Stage.groups), its sent groups through `offload`. `modules`: the modules
    whose buffers and tensor attributes a recompute leaves as it found them (checkpoint_context), or their Walk
    (remat._state.walk). Outside training with grad, plainly. Raises ValueError for an offloaded choice without
    an Offload (and, from the forward pass, for a host answer without one), and for a group assignment without
    the groups' names."""
    how, host = split_choice(how)
    if host and torch.is_grad_enabled():
        if offload is None:
            raise ValueError(f"remat: the choice '{how}{HOST}' offloads, and no remat.offload.Offload was given")
        with offload:  # what the policy keeps goes with it (remat/selective.py)
            return _run(how, fn, args, modules, policies, offload)
    return _run(how, fn, args, modules, policies, offload, groups=groups)


def _run(how: str, fn: Callable, args: Sequence, modules: Sequence[torch.nn.Module],
         policies: dict[str, Callable] | None, offload=None, route_kept: bool | None = None,
         groups: Sequence[str] | None = None):
    if not torch.is_grad_enabled():
        return fn(*args)
    if how == KEEP:
        with autocast_cache_off():
            return fn(*args)
    if is_groups(how):
        if groups is None:
            raise ValueError(f"remat: the group assignment '{how}' needs the stage's saved groups (its chain)")
        policy = GroupPolicy(groups, how[1:-1])
    else:
        policy = None if how == CHECKPOINT else policy_fn(how, policies)
    return checkpoint_region(fn, args, modules, policy, offload, route_kept)


class autocast_cache_off:
    """Autocast's cache of cast weights off inside, as it was after; as around every layer remat runs in
    training, kept or not (run_layer, the plan executor's stages, the profiler): a layer would otherwise leave
    its weights' low-precision copies in the cache until the caller's autocast region ends, past its backward
    where the caller runs the backward inside the region (every cast of a kept layer, held through the other
    layers' backward passes: 5.7% above the prediction on the tests' Llama, measured), and a checkpointed layer
    all of them. The values are the same; a weight used twice in one call is cast twice. A forward outside
    training (no grad: generation) keeps the caller's cache. A class, not a generator's context manager: it runs
    around every layer of every step."""

    __slots__ = ("was",)

    def __enter__(self):
        self.was = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        return self

    def __exit__(self, *exc):
        torch.set_autocast_cache_enabled(self.was)
        return False


def checked_checkpoint(fn: Callable, args: Sequence, modules: Sequence[torch.nn.Module] = (),
                       policy: Callable | None = None, offload=None, route_kept: bool | None = None):
    """fn(*args) under torch.utils.checkpoint (non-reentrant, RNG state preserved, torch_checkpoint), behind
    version_checked's hooks (a recompute that writes what it saved raises autograd's error: remat/saved.py), the
    modules' buffers restored for the recompute, under remat's selective checkpointing when `policy` is given,
    told what the forward's autograd saved (see checkpoint_context). The plan executor's Fk runs so."""
    checked = version_checked(fn, track_storages=policy is not None)
    return torch_checkpoint(checked, *args, use_reentrant=False, preserve_rng_state=True,
                            context_fn=checkpoint_context(modules, policy, offload, route_kept,
                                                          checked.saved_storages))


def checkpoint_region(fn: Callable, args: Sequence, modules: Sequence[torch.nn.Module] = (),
                      policy: Callable | None = None, offload=None, route_kept: bool | None = None):
    """checked_checkpoint with autocast's weight cache off (autocast_cache_off): how the runtime and the
    profiler run a checkpointed layer."""
    with autocast_cache_off():
        return checked_checkpoint(fn, args, modules, policy, offload, route_kept)


def checkpoint(fn: Callable, *args, policy: Callable | None = None, offload=None,
               modules: Sequence[torch.nn.Module] = ()):
    """fn(*args) checkpointed: nothing it saves is kept but its inputs, and the backward pass recomputes it
    (torch.utils.checkpoint, non-reentrant, RNG state preserved, a recompute that writes what it saved refused
    with autograd's error). With `policy` (a selective policy: CheckpointPolicy answers, remat.MUST_CPU_OFFLOAD
    among them), each operator call's output is kept on the device, sent to host memory through `offload` (a
    remat.offload.Offload), or recomputed (remat/selective.py). `modules`: whose buffers the recompute puts
    back as the forward left them (BatchNorm's running statistics updated once). Outside grad mode, fn(*args).
    Raises ValueError from the forward pass when the policy sends a call's output to the host and no offload
    was given, TypeError for an answer that is none of those."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint_region(fn, args, modules, policy, offload)


def stream_suffix(plan, i: int) -> str:
    """How a plan streams stage i: "@stream0" where its window (Plan.stream_windows) is 0, else "@stream"."""
    windows = plan.stream_windows
    return STREAM_NO_WINDOW if windows and windows[i] == 0 else STREAM


def stream_window(plan, chain, i: int) -> int:
    """The window (bytes) a streamed stage i runs with: the plan's (Plan.stream_windows), else the chain's."""
    windows = plan.stream_windows
    if windows and windows[i] >= 0:
        return windows[i]
    return chain.stages[i].offload.window_bytes


def choices_of(plan) -> list[str]:
    """The per-layer choice of each stage of a per-layer plan (remat.per_layer's shape: each stage's first
    forward is Fa, Fc, Fk[name] or Fk{groups}, no Fn, and a checkpointed stage is recomputed only right before
    its backward): "keep", "checkpoint" or the policy's name, with "@host" after it where the plan offloads it,
    "keep@stream" where it streams it ("keep@stream0" with no window: Plan.stream_windows 0), or a group
    assignment "{khr}". Raises ValueError for a plan of another shape (a full schedule: run it with
    remat.CheckpointedSequential)."""
    from . import _core

    n, ops = plan.num_stages, list(plan.ops)
    K = _core.OpKind
    out = []
    for i in range(n):
        op = ops[i] if i < len(ops) else None
        if op is None or op.stage != i or op.kind not in (K.Fa, K.Fc, K.Fk):
            raise ValueError(f"remat: plan '{plan}' is not a per-layer plan (its forward pass does not run each "
                             "stage once, in order, as Fa, Fc or Fk[NAME]): run it with "
                             "remat.CheckpointedSequential, or plan with remat.per_layer")
        if op.kind == K.Fk and op.groups:
            out.append("{" + op.groups + "}")
            continue
        if op.kind == K.Fk and op.policy < 0:
            raise ValueError(f"remat: plan '{plan}' keeps stage {i} with remat::keep tags, which only the C++ "
                             "library has; plan with policies instead")
        out.append((KEEP if op.kind == K.Fa else CHECKPOINT if op.kind == K.Fc else plan.policies[op.policy])
                   + (stream_suffix(plan, i) if op.stream else HOST if op.offload else ""))
    # Then the loss and each stage's backward, a checkpointed stage recomputed right before it.
    want = [(K.L, -1)]
    for i in reversed(range(n)):
        if split_choice(out[i])[0] == CHECKPOINT:
            want.append((K.Fa, i))
        want.append((K.B, i))
    if [(o.kind, o.stage) for o in ops[n:]] != want:
        raise ValueError(f"remat: plan '{plan}' is not a per-layer plan (it recomputes across stages): run it "
                         "with remat.CheckpointedSequential, or plan with remat.per_layer")
    return out
