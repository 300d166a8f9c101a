"""Per-layer plans applied to a model's own layers, planned in place for a budget.

``remat.enable(model, layers, budget=...)`` makes each of the model's layers run as a plan says: kept whole,
checkpointed (``torch.utils.checkpoint``, non-reentrant), or checkpointed under a selective policy (keep the
matrix multiplications), through each layer's forward (``remat.hf.enable`` uses Hugging Face's own
checkpointing hook instead). The model's forward is not changed: it calls its layers as before.

With a budget and no plan, the first training step (per input shape) profiles the layers where they run, on
their real inputs, and measures what surrounds them in the step (what runs before them, the rest of the
forward, the loss and the backward pass, and the gradients the backward pass allocates); at the end of that
step's backward pass it plans (remat.plan_step with the per-layer planner) for the budget, and the steps after
run the plan. The profiling step runs every layer checkpointed and gives the plain run's gradients.

The budget bounds the step's peak as the meter reads it above the bytes alive when the model's forward is
called (parameters, existing gradients, the batch, the optimizer's state are the base): what the layers keep,
what runs before and after them, and the gradients the step allocates are inside it.
"""
from __future__ import annotations

import gc
import time
import warnings
from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from . import _core
from .meter import meter_for
from .offload import CopyEngine, HostPool, Offload, storage_ptrs
from .policies import CHECKPOINT, KEEP, choices_of, is_groups, is_streamed, policy_fn, run_layer, split_choice
from .profile import StageFn, profile

__all__ = ["LayerPlan", "enable", "parse_budget"]


def parse_budget(budget, who: str) -> int:
    """A budget in bytes: an int, or a string with a unit ("300MiB", "1.5GiB"). Raises ValueError naming `who`
    and the value otherwise, or when it is not positive."""
    if isinstance(budget, bool):
        raise TypeError(f"{who}: the budget must be bytes (an int) or a size string such as '300MiB', got {budget!r}")
    if isinstance(budget, str):
        try:
            value = _core.parse_size(budget)
        except ValueError as e:
            raise ValueError(f"{who}: the budget '{budget}' is not a size ({e})") from None
    elif isinstance(budget, int):
        value = budget
    else:
        raise TypeError(f"{who}: the budget must be bytes (an int) or a size string such as '300MiB', got "
                        f"{type(budget).__name__} {budget!r}")
    if value <= 0:
        raise ValueError(f"{who}: the budget must be a positive number of bytes, got {budget!r}")
    return value


def _queue_at_backward_end(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _layer_output(out, who: str, i: int, layer: nn.Module) -> tuple[torch.Tensor, tuple]:
    """What a layer returned, split into the tensor the next layer takes (the output itself, or a tuple's first
    element, as Transformers' T5 blocks return it) and the rest it hands on. Raises TypeError otherwise."""
    if isinstance(out, torch.Tensor):
        return out, ()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], tuple(out[1:])
    raise TypeError(f"{who}: layer {i} ({type(layer).__name__}) returned {type(out).__name__}, not a tensor or a "
                    "tuple whose first element is one: remat plans layers whose output (or its first element) is "
                    "the next layer's input")


def _tensors_in(values, out: list) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            _tensors_in(v, out)


def _taken_tensors(fn, args) -> list[torch.Tensor]:
    """The tensors a layer's call takes besides its input (args[0]): the other positional arguments, and what
    the call's partials bind (keyword arguments such as T5's position bias or a decoder's encoder states)."""
    out: list[torch.Tensor] = []
    _tensors_in(args[1:], out)
    while isinstance(fn, partial):
        _tensors_in(fn.args, out)
        _tensors_in(fn.keywords.values(), out)
        fn = fn.func
    return out


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() or id(t)
    except RuntimeError:  # a tensor without storage (a wrapper subclass)
        return id(t)


def _compiled_module(m):
    """torch.compile(module)'s wrapper (an OptimizedModule): the module it compiles; anything else as it is."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return m
    return m._orig_mod if isinstance(m, OptimizedModule) else m


def _layer_key(fn, args) -> tuple:
    """A layer call's shapes: its input's, and those of every other tensor it takes (positional, or bound by the
    call's partials: a decoder's encoder states, an attention mask), with their dtypes."""
    return tuple((tuple(t.shape), t.dtype) for t in (args[0], *_taken_tensors(fn, args)))


def _describe(key: tuple) -> str:
    """A _layer_key for people: "[4, 32, 64] float32, [4, 1, 32, 32] float32"."""
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in key)


def _call_key(args, kwargs) -> tuple:
    """A model call's shapes: those of every tensor it takes, positional or keyword (in lists, tuples and dicts
    too), with their dtypes and where each was passed. A training step's plan is kept under it: a decoder's
    length (its labels') shows here, where the first layer's input (the encoder's) does not show it."""
    out: list = []

    def walk(v, where):
        if isinstance(v, torch.Tensor):
            out.append((where, tuple(v.shape), v.dtype))
        elif isinstance(v, (tuple, list)):
            for j, e in enumerate(v):
                walk(e, (where, j))
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k], (where, str(k)))

    walk(args, "args")
    walk(kwargs, "kwargs")
    return tuple(out)


# Compiled layers (layer.compile(), torch.compile(layer)): each planned layer carries its choices per step key as
# a plain attribute, with the key of the step in progress (STEP) and, per step key, the shapes the layer was
# profiled with, which the traced call reads (dynamo guards on their values, so layers with the same choice
# share one compiled graph and a new plan recompiles); None is the given plan's, for every shape.
CHOICES_ATTR = "_remat_choices"
STEP = "step"


def compiled_call(lp: "LayerPlan", layer: nn.Module, fn: Callable, args: tuple):
    """Layer `layer`'s call fn(*args) while torch.compile traces it: as its plan for this step's shapes says,
    through the checkpointing torch.compile traces (torch.utils.checkpoint, a policy as selective
    checkpointing's context), or, where the layer has no plan for them (the profiling step, an infeasible
    budget, a call whose shapes are not those the plan was made with), lp.dispatch outside the compiled graph
    (eager_dispatch, a graph break)."""
    choices = layer.__dict__.get(CHOICES_ATTR)
    how = None
    if choices is not None and args and isinstance(args[0], torch.Tensor):
        key = choices.get(STEP)
        how = choices.get(key) if key is not None else None
        if how is not None and choices.get(("layer", key)) != _layer_key(fn, args):
            how = None  # planned for other shapes: lp.dispatch decides
        if how is None:
            how = choices.get(None)
    if how is None or split_choice(how)[1] or is_groups(how):
        # No plan yet, an offloaded choice (saved-tensor hooks are not traced), or a group assignment (remat's
        # dispatch modes are not traced): outside the graph.
        return eager_dispatch(lp, layer, fn, args)
    if how == KEEP:
        return fn(*args)
    if how == CHECKPOINT:
        return checkpoint(fn, *args, use_reentrant=False)
    policy = choices.get(("policy", how))
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, policy))


@torch.compiler.disable
def eager_dispatch(lp: "LayerPlan", layer: nn.Module, fn: Callable, args: tuple):
    """lp.dispatch for `layer`, run outside torch.compile's graph (the profiling step of a compiled layer)."""
    return lp.dispatch(lp.index[id(layer)], fn, *args)


def _planned_forward(self: nn.Module, *args, **kwargs):
    """The forward remat.enable gives each layer (bound to it): the class's forward, run as the plan says. One
    function for every layer, so that torch.compile shares a graph between layers that run alike."""
    fn = partial(type(self).forward, self, **kwargs)
    lp = self.__dict__[LAYER_PLAN_ATTR]
    if torch.compiler.is_compiling():
        return compiled_call(lp, self, fn, args)
    return lp.dispatch(lp.index[id(self)], fn, *args)


LAYER_PLAN_ATTR = "_remat_layer_plan"


class _Gathered:
    """While profiling: every FSDP2-sharded layer's parameters all-gathered (FSDPModule.unshard()), so that a
    layer's forward can run outside its module call, and resharded after (reshard()). A transient of
    profiling's own, as its other runs are: the window restarts after it."""

    def __init__(self, layers: Sequence[nn.Module], meter):
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:
            FSDPModule = None  # noqa: N806
        self.meter = meter
        self.per_layer = [[m for m in layer.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]
                          for layer in layers]
        self.modules = [m for ms in self.per_layer for m in ms]
        self.gathered = [0] * len(layers)  # per layer: the bytes its all-gathered parameters take (measured)

    def __enter__(self):
        # Each module resharded first (the running layer is gathered now) and gathered again, its bytes read
        # as the meter's count rises: the all-gathered parameters, in the dtype FSDP2 gathers them in.
        for j, ms in enumerate(self.per_layer):
            for m in ms:
                m.reshard()
                before = self.meter.count()
                m.unshard()
                self.gathered[j] += self.meter.count() - before
        return self

    def __exit__(self, *exc):
        for m in reversed(self.modules):
            m.reshard()
        return False


def _local_bytes(p: torch.Tensor) -> int:
    """A parameter's bytes on this rank: its local shard's for a DTensor (FSDP2), else its own."""
    to_local = getattr(p, "to_local", None)
    return to_local().nbytes if callable(to_local) else p.nbytes


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except RuntimeError:
        return t.nbytes


_RETIMED_STEPS = 3  # planned steps that time the rest of the step again


class _Shape:
    """What is known of one input shape: its profile, what surrounds the layers, the plan."""

    def __init__(self, key: tuple | None = None):
        self.key = key  # the step's key (None: a given plan's, for every shape)
        self.layer_keys: list[tuple] | None = None  # each layer call's _layer_key in the profiling step
        self.warned = False  # a call off these shapes was warned of
        self.gathered: list[int] = []  # per layer, FSDP2's all-gathered parameters' bytes (0: not sharded)
        self.chain: _core.Chain | None = None
        self.context: _core.StepContext | None = None
        self.plan: _core.Plan | None = None
        self.choices: list[str] | None = None
        self.points: tuple[list, list] | None = None  # the plan's offload schedule per layer (_layer_points)
        self.predicted = -1
        self.last_peak = -1
        self.profiling_steps = 0
        self.rest_retimed = 0  # planned steps that took the rest's time again (the first RETIMED_STEPS do)
        self.error: Exception | None = None


class _Step:
    """One training step's measurements."""

    def __init__(self, meter, grads_none: set[int] | None):
        self.meter = meter
        # remat's own window on the device's count: the step's peak, without resetting what the user reads.
        self.window = meter.window()
        self.base = meter.count()
        self.true_peak = self.base  # the step's own peak (profiling's transients left out)
        self.grads_none = grads_none  # ids of parameters whose .grad was None when the step began
        self.shape: _Shape | None = None
        self.calls: list = []  # profiling: (fn, args, x) per layer
        self.at_layer0 = 0
        self.before_peak = 0
        self.rest: tuple[int, float] | None = None  # (the rest's peak count, its time in ms)
        self.at_return = 0
        self.at_output_grad = 0
        self.output_grad_bytes = 0
        self.peak_after_backward = -1
        self.input_in_base = False
        self.input_bytes = 0
        self.done = False
        self.key: tuple | None = None  # the model call's shapes (_call_key), when the step began there
        self.off_plan = False  # a layer's call had shapes its plan was not made for: the rest is checkpointed
        # What the layers take or hand on beside their input and output (StepContext.side_bytes): the storages
        # the first layer takes (made before the layers: their gradients only are charged), and per storage
        # made during the layers, its bytes and its gradient's.
        self.before_chain: set[int] = set()
        self.side: dict[int, int] = {}

    def note_side(self, i: int, taken: list[torch.Tensor], handed: tuple):
        if i == 0:
            self.before_chain = {_key(t) for t in taken}
        made = [t for t in handed if isinstance(t, torch.Tensor) and _key(t) not in self.before_chain]
        for t in [*taken, *made]:
            k = _key(t)
            grad = t.nbytes if t.requires_grad else 0
            held = grad if k in self.before_chain else _storage_bytes(t) + grad
            self.side[k] = max(self.side.get(k, 0), held)

    def peak(self) -> int:
        """The window's peak since its last reset()."""
        return self.window.peak()

    def note_peak(self):
        self.true_peak = max(self.true_peak, self.window.peak())

    def reset(self):
        self.note_peak()
        self.window.restart()

    def finish(self):
        self.note_peak()
        self.window.close()
        self.done = True


def _agree(chain, ctx) -> None:
    """Every rank plans from the same figures, every figure a plan depends on (the planner library's
    plan_figures(): times, bytes, the offload costs and the bandwidths), each the maximum over the ranks in
    that encoding (a bandwidth the smallest), so that every rank runs the same plan, one that fits each rank's
    measurements. A collective: every rank calls it at the same point (the end of the profiling step's backward
    pass)."""
    import torch.distributed as dist
    ints, reals = _core.plan_figures(chain, ctx)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t_int = torch.tensor(ints, dtype=torch.int64, device=device)
    t_real = torch.tensor(reals, dtype=torch.float64, device=device)
    sizes = torch.tensor([len(ints), len(reals)], dtype=torch.int64, device=device)
    low = sizes.clone()
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if not torch.equal(sizes, low):
        raise RuntimeError("remat: the ranks measured different numbers of figures (different models or "
                           "layer lists?); they cannot agree on one plan")
    dist.all_reduce(t_int, op=dist.ReduceOp.MAX)
    dist.all_reduce(t_real, op=dist.ReduceOp.MAX)
    _core.set_plan_figures(chain, ctx, t_int.tolist(), t_real.tolist())


def _add_to_stream(st, fwd: int = 0, bwd: int = 0) -> None:
    """Adds to a stage's streamed peaks (bytes) what FSDP2's gathering adds to its forward and backward
    transients, where the stage has them (its OffloadCost is a copy: written back)."""
    if st.offload is not None and st.offload.can_stream():
        o = st.offload
        o.stream_fwd_bytes += fwd
        o.stream_bwd_bytes += bwd
        st.offload = o


def _carry_out(points) -> None:
    """Carries out offload-schedule points: (action, Offload) each, "wait_to_host" (its copies to the host waited
    for, what they freed leaving the device) or "start_back" (what it holds on the host starts coming back)."""
    for action, offload in points:
        if action == "wait_to_host":
            offload.finish_copies()
        else:
            offload.prefetch()


def _carry_out_then(points, grad):
    """A gradient hook: carries out the points (the backward pass has reached a layer), lets the gradient
    through."""
    _carry_out(points)
    return grad


def _layer_points(plan) -> tuple[list, list]:
    """The plan's offload schedule (remat::offload_schedule: the one simulate() charges and the C++ executor
    carries out) per layer of a per-layer plan (choices_of's shape): after[i], the points carried out once layer
    i's forward has run (ops[i]); at_backward[i], those carried out when the backward pass reaches layer i's
    output (before its recompute or its backward), each (action, stage)."""
    before, after = _core.offload_schedule(plan)
    ops = list(plan.ops)
    loss = next(k for k, op in enumerate(ops) if op.kind == _core.OpKind.L)
    at_backward: list[list] = [[] for _ in range(plan.num_stages)]
    for k in range(loss + 1, len(ops)):
        at_backward[ops[k].stage].extend(before[k])
        if after[k]:  # a recompute that waits for copies: no per-layer plan has one
            raise RuntimeError(f"remat: internal error: plan '{plan}' waits for copies after operation {k}, "
                               "which the planned layers cannot carry out")
    return [list(after[i]) for i in range(plan.num_stages)], at_backward


def _sync(device: torch.device) -> None:
    """Waits for the device's work, so that a host clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LayerPlan:
    """The layers of a model run per layer as a plan says; made by remat.enable and remat.hf.enable.

    Attributes and methods to read: is_planned(), plan (the Plan in force for the last input shape, its str()
    the C++ Plan::to_string()), choices ("keep", "checkpoint" or a policy's name, per layer), chain (the
    profile, a remat.Chain: chain.to_json() is the remat command's chain JSON), context (the StepContext
    measured), predicted_peak_bytes, last_peak_bytes (the step's measured peak above its base, after a planned
    step's backward pass; -1 for a given plan, which is run without measuring), profiling_steps.
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], *, budget=None, plan=None,
                 policies=("matmuls",), repeats: int = 1, exclude: Sequence[str] = (), agree=None,
                 offload: bool = False, max_host_bytes=None, offload_min_bytes: int = 1 << 20,
                 groups: bool = False, who: str = "remat.enable"):
        self.who = who
        if groups not in (True, False):
            raise ValueError(f"{who}: groups must be True or False, got {groups!r}")
        self.groups = groups
        if offload not in (True, False):
            raise ValueError(f"{who}: offload must be True or False, got {offload!r}")
        self.offload = offload
        if max_host_bytes is not None and not offload:
            raise ValueError(f"{who}: max_host_bytes bounds what offloading holds in host memory; it needs "
                             "offload=True")
        self.max_host_bytes = parse_budget(max_host_bytes, who) if max_host_bytes is not None else None
        if isinstance(offload_min_bytes, bool) or not isinstance(offload_min_bytes, int) or offload_min_bytes < 0:
            raise ValueError(f"{who}: offload_min_bytes must be a number of bytes >= 0, got {offload_min_bytes!r}")
        self.offload_min_bytes = offload_min_bytes
        self.host_pool = HostPool()  # the host memory of offloaded layers, reused from step to step
        self._engines: dict[torch.device, CopyEngine] = {}
        # This step's offloaded layers, (index, Offload) in order, and the storages they keep on the device.
        self._step_offloads: list[tuple[int, Offload]] = []
        self._keep_storages: set[int] | None = None
        if agree not in (None, True, False):
            raise ValueError(f"{who}: agree must be True, False or None (on when torch.distributed is "
                             f"initialized), got {agree!r}")
        self.agree = agree
        self.model = model
        # A layer given as torch.compile(layer)'s wrapper: its module, whose forward the wrapper's compiled
        # call runs (and traces, remat's call inside).
        self.layers = [_compiled_module(m) for m in layers]
        if not self.layers:
            raise ValueError(f"{who}: no layers")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"{who}: layer {i} is a {type(layer).__name__}, not an nn.Module")
        if len({id(m) for m in self.layers}) != len(self.layers):
            raise ValueError(f"{who}: a layer is listed twice")
        if (budget is None) == (plan is None):
            raise ValueError(f"{who}: give a budget (planned in place) or a plan (applied as it is), not "
                             f"{'both' if budget is not None else 'neither'}")
        self.budget = parse_budget(budget, who) if budget is not None else None
        if isinstance(policies, dict):
            self.policies = dict(policies)
        else:
            self.policies = {name: policy_fn(name) for name in (policies or ())}
        if repeats < 1:
            raise ValueError(f"{who}: repeats must be >= 1, got {repeats}")
        self.repeats = repeats
        self.exclude = list(exclude)
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self._shapes: dict[tuple, _Shape] = {}
        self._fixed: _Shape | None = None
        if plan is not None:
            if plan.num_stages != len(self.layers):
                raise ValueError(f"{who}: the plan is for {plan.num_stages} stages but there are "
                                 f"{len(self.layers)} layers")
            fixed = _Shape()
            fixed.plan = plan
            fixed.choices = choices_of(plan)
            fixed.points = _layer_points(plan)
            for c in fixed.choices:
                if is_groups(c):
                    raise ValueError(f"{who}: the plan runs a layer under a group assignment ('{c}'), whose groups "
                                     "only the chain it was planned from names; give a budget with groups=True "
                                     "(planned in place) instead")
                if is_streamed(c):
                    raise ValueError(f"{who}: the plan streams a layer ('{c}'), whose window only the chain it was "
                                     "planned from gives; give a budget with offload=True (planned in place) "
                                     "instead")
                c = split_choice(c)[0]
                if c not in (KEEP, CHECKPOINT) and c not in self.policies:
                    self.policies[c] = policy_fn(c)
            self._fixed = fixed
        self._last: _Shape | None = self._fixed
        self._step: _Step | None = None
        for layer in self.layers:
            layer.__dict__[CHOICES_ATTR] = {}
        if self._fixed is not None:
            self._publish(self._fixed)
        # First among the model's forward pre-hooks: the step's base is read before FSDP2's root all-gathers its
        # parameters (fully_shard prepends its hook too; _first_hook moves remat's back in front).
        self._begin_hook = model.register_forward_pre_hook(self._step_begins, prepend=True, with_kwargs=True)
        self._handles = [self._begin_hook]
        self._unmeasured = False  # this step runs every layer checkpointed, measuring nothing
        self._params = [p for p in model.parameters()]

    def _publish(self, shape: _Shape) -> None:
        """Hands shape's plan to the layers' compiled calls (compiled_call): each layer's choice under the shape's
        key, the shapes the layer was profiled with, and the policy functions the choices name."""
        for i, (layer, how) in enumerate(zip(self.layers, shape.choices or [None] * len(self.layers))):
            choices = layer.__dict__.setdefault(CHOICES_ATTR, {})
            if how is None:
                choices.pop(shape.key, None)
                choices.pop(("layer", shape.key), None)
                continue
            choices[shape.key] = how
            if shape.layer_keys is not None:
                choices[("layer", shape.key)] = shape.layer_keys[i]
            base = split_choice(how)[0]
            if base not in (KEEP, CHECKPOINT) and not is_groups(base):
                choices[("policy", base)] = policy_fn(base, self.policies)

    # -- copies: copy.deepcopy(model), pickle, torch.save(model) ---------------------------------------------------
    def __getstate__(self):
        """A copy carries the plans and what they were made from (chains, contexts, per step key), and what the
        copied model's layers need to run them; not the step in progress, the host pool's memory or the copy
        engines (a copy starts its own)."""
        state = dict(self.__dict__)
        state.update(_step=None, _step_offloads=[], _keep_storages=None, _engines={}, _unmeasured=False)
        del state["host_pool"], state["index"]  # a new pool; ids of the copy's layers
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("groups", False)  # a copy pickled before groups
        self.host_pool = HostPool()
        self.index = {id(m): i for i, m in enumerate(self.layers)}

    # -- what can be read ----------------------------------------------------------------------------------------
    def is_planned(self) -> bool:
        """Whether a plan is in force for the last input shape."""
        return self._last is not None and self._last.choices is not None

    @property
    def plan(self):
        return self._last.plan if self._last else None

    @property
    def choices(self):
        return list(self._last.choices) if self._last and self._last.choices else None

    @property
    def chain(self):
        return self._last.chain if self._last else None

    @property
    def context(self):
        return self._last.context if self._last else None

    @property
    def predicted_peak_bytes(self) -> int:
        return self._last.predicted if self._last else -1

    @property
    def predicted_host_bytes(self) -> int:
        """The host memory the plan in force holds at most (bytes: its offloaded layers'; 0 when it offloads
        none, -1 without a plan)."""
        plan = self.plan
        return plan.predicted.host_peak_bytes if plan is not None else -1

    @property
    def offload_stats(self) -> dict:
        """The last step's offloading, summed over its offloaded layers (remat.offload.Offload's counts):
        offloaded (tensors sent to the host), offloaded_bytes, brought_back (copies back to the device), prefetched
        (of them, started before the backward pass asked for the tensor), kept_on_device, found_on_device (still on
        the device when needed back: not copied)."""
        keys = ("offloaded", "offloaded_bytes", "brought_back", "prefetched", "kept_on_device", "found_on_device")
        return {k: sum(getattr(o, k) for _, o in self._step_offloads) for k in keys}

    @property
    def last_peak_bytes(self) -> int:
        return self._last.last_peak if self._last else -1

    @property
    def min_budget_bytes(self) -> int:
        """The least budget a plan exists for, for the last input shape (bytes; -1 before its profiling step):
        the step's predicted peak under the least-memory per-layer plan, or the profiling step's measured peak
        (every layer checkpointed) when that is lower."""
        shape = self._last
        if shape is None or shape.chain is None or shape.context is None:
            return -1
        # The measured every-layer-checkpointed peak (context.checkpoint_all_peak_bytes) counts, as in plan_step.
        return _core.min_step_budget(shape.chain, shape.context, "per-layer", self.exclude, **self._offload_options())

    @property
    def profiling_steps(self) -> int:
        return self._last.profiling_steps if self._last else 0

    def set_budget(self, budget) -> None:
        """Plans again for another budget (bytes, or a size string) from what was measured, without profiling
        again: every input shape already profiled gets its new plan at once. Raises remat.InfeasibleBudget
        naming the least feasible budget when one of them has none (that shape keeps no plan and its next
        training step raises the same error)."""
        if self._fixed is not None:
            raise ValueError(f"{self.who}: this LayerPlan runs a given plan; it has no budget to change")
        self.budget = parse_budget(budget, self.who)
        first_error = None
        for shape in self._shapes.values():
            if shape.chain is None or shape.context is None:
                continue
            shape.error = None
            try:
                self._plan_from(shape, shape.context)
            except _core.InfeasibleBudget as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def remove(self):
        """Stops planning: the hooks go; the layers' forward is what it was (remat.enable) ."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for layer in self.layers:
            layer.__dict__.pop(CHOICES_ATTR, None)

    # -- the step ------------------------------------------------------------------------------------------------
    def _training(self) -> bool:
        return torch.is_grad_enabled() and self.model.training

    def _first_hook(self) -> bool:
        """Moves remat's step-begin hook in front of the model's other forward pre-hooks (FSDP2, sharding after
        enable(), prepends its own); True when it was not first, and another hook ran before it this step."""
        hooks = self.model._forward_pre_hooks
        if next(iter(hooks), None) == self._begin_hook.id:
            return False
        hooks.move_to_end(self._begin_hook.id, last=False)
        return True

    def _step_begins(self, module, args, kwargs):
        self._unmeasured = False
        if self._fixed is not None or not self._training():
            self._step = None
            return
        if self._first_hook():
            # FSDP2 all-gathered the root's parameters before this step's base could be read: this step runs
            # every layer checkpointed and measures nothing; the next one profiles.
            self._unmeasured = True
            self._step = None
            return
        if not self._shapes or any(shape.chain is None for shape in self._shapes.values()):
            # A step that may profile: garbage in reference cycles is collected before the base is read. Collected
            # during the step, its tensors' frees would lower the count every reading is taken against (a
            # dropped BertModel collected in a second one's profiling step measured that step 15.8 MB for 35.7).
            gc.collect()
        meter = meter_for(self._device_of(args))
        grads_none = {id(p) for p in self._params if p.requires_grad and p.grad is None}
        self._step = _Step(meter, grads_none)
        self._step.key = ("model", _call_key(args, kwargs))
        self._set_step_key(self._step.key)

    def _set_step_key(self, key) -> None:
        """Tells the layers' compiled calls which step is in progress (compiled_call reads its choices)."""
        for layer in self.layers:
            choices = layer.__dict__.get(CHOICES_ATTR)
            if choices is not None and choices.get(STEP) != key:
                choices[STEP] = key

    def _device_of(self, args) -> torch.device:
        for a in args:
            if isinstance(a, torch.Tensor):
                return a.device
        for p in self._params:
            return p.device
        return torch.device("cpu")

    def dispatch(self, i: int, fn: Callable, *args):
        """Runs layer i's call fn(*args) (args[0] its input tensor) as the plan in force says, or profiles it."""
        layer = self.layers[i]
        if not (torch.is_grad_enabled() and layer.training):
            return fn(*args)
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(f"{self.who}: layer {i} ({type(layer).__name__}) was called without its input tensor "
                            "as the first positional argument; remat follows the tensor passed there from layer "
                            "to layer")
        if self._unmeasured or (i > 0 and self._step is not None and self._step.off_plan):
            # (The schedule's points for the layers before still hold: their copies are waited for and come back.)
            return self._run(i, CHECKPOINT, fn, args, self._step.shape if self._step is not None else None)
        if self._fixed is not None:  # a given plan: nothing to measure
            self._last = self._fixed
            return self._run(i, self._fixed.choices[i], fn, args, self._fixed)
        x = args[0]
        step = self._step
        if i == 0:
            if step is None or step.shape is not None:  # layers called outside the model's forward
                meter = meter_for(x.device)
                grads_none = {id(p) for p in self._params if p.requires_grad and p.grad is None}
                step = self._step = _Step(meter, grads_none)
                step.input_in_base = True  # the base is taken here, the layers' input alive
            if step.key is None:  # the layers called outside the model's forward: the first one's shapes
                step.key = ("layer 0", _layer_key(fn, args))
                self._set_step_key(step.key)
            key = step.key
            shape = self._shapes.setdefault(key, _Shape(key))
            step.shape = shape
            self._last = shape
            if shape.error is not None:
                raise shape.error
        if step is None or step.shape is None:
            raise RuntimeError(f"{self.who}: layer {i} ran before layer 0 in a training step; the layers must run "
                               "in the order given")
        shape = step.shape
        if shape.choices is not None:
            if shape.layer_keys is not None and _layer_key(fn, args) != shape.layer_keys[i]:
                return self._off_plan(step, shape, i, fn, args)
            out = self._run(i, shape.choices[i], fn, args, shape)
            if i == len(self.layers) - 1:
                main, _ = _layer_output(out, self.who, i, layer)
                if main.requires_grad:
                    self._measure_planned_step(step, shape, main)
            return out
        return self._profiling_call(step, shape, i, fn, args, x)

    def _off_plan(self, step: _Step, shape: _Shape, i: int, fn: Callable, args: tuple):
        """Layer i's call has shapes other than those the step's plan was made with (shapes that follow the
        values of the batch, or layers called outside the model's forward, whose step is keyed by the first
        layer's shapes only): a plan made for other shapes is not run. This layer and the rest of the step run
        checkpointed, measured by nothing."""
        step.off_plan = True
        if not shape.warned:
            shape.warned = True
            warnings.warn(
                f"{self.who}: layer {i} ({type(self.layers[i]).__name__}) was called with shapes "
                f"{_describe(_layer_key(fn, args))}, but this step's plan was made with "
                f"{_describe(shape.layer_keys[i])} (steps are told apart by the shapes of the model's inputs, or "
                "of the first layer's when the layers are called outside the model's forward); the rest of such "
                "a step runs every layer checkpointed, and its peak is not what was planned", stacklevel=3)
        return self._run(i, CHECKPOINT, fn, args, shape)

    # -- a planned step: running a layer, offloaded or not ------------------------------------------------------
    def _run(self, i: int, how: str, fn: Callable, args: tuple, shape: "_Shape | None" = None):
        """Layer i's call as its choice says. Offloaded ("...@host"): under its own Offload's hooks, on the host
        pool. With the step's shape, the plan's offload schedule is carried out (the planner's, which simulate()
        charges): typically the previous layer's copies to the host are waited for once this layer's forward has
        run, and when the backward pass reaches this layer's output the previous layer's tensors start coming
        back (so that their copies overlap this layer's backward)."""
        if i == 0:
            self._step_offloads = []
            self._keep_storages = None
        layer = self.layers[i]
        o = None
        groups = None
        if is_groups(how):
            # A group assignment: its sent groups go through the layer's Offload (not opened as hooks: the
            # layer's input and the rest stay, as the chain's group figures count them).
            groups = [g.name for g in shape.chain.stages[i].groups]
        if split_choice(how)[1] or (groups is not None and "h" in how):
            device = args[0].device
            engine = self._engines.get(device)
            if engine is None:
                engine = self._engines[device] = CopyEngine(device)
            # What the profile counted as alive anyway stays on the device: the parameters and buffers (their
            # storages found once a step) and the tensors the call takes beside its input (a mask, a position bias).
            if self._keep_storages is None:
                self._keep_storages = storage_ptrs([*self.model.parameters(), *self.model.buffers()])
            # Streamed ("keep@stream"): copies bounded by the chain's window each way, each tensor brought back
            # ahead of its use; otherwise the whole layer comes back at once (prefetch()).
            window = shape.chain.stages[i].offload.window_bytes if is_streamed(how) else None
            o = Offload(pool=self.host_pool, min_bytes=self.offload_min_bytes, lookahead=0, engine=engine,
                        window=window)
            o.keep_on_device(_taken_tensors(fn, args), storages=self._keep_storages)
        out = run_layer(how, fn, args, [layer], self.policies, offload=o, groups=groups)
        if o is not None:
            self._step_offloads.append((i, o))
        if shape is not None and shape.points is not None:
            # The plan's offload schedule: the copies to the host in flight beside this forward are waited for
            # now; what comes back when the backward pass reaches this layer's output starts then.
            after, at_backward = shape.points
            offloads = dict(self._step_offloads)
            _carry_out([(action, offloads[s]) for action, s in after[i] if s in offloads])
            points = [(action, offloads[s]) for action, s in at_backward[i] if s in offloads]
            if points:
                main, _ = _layer_output(out, self.who, i, layer)
                if main.requires_grad:
                    main.register_hook(partial(_carry_out_then, points))
        return out

    # -- a planned step: its measured peak --------------------------------------------------------------------
    def _measure_planned_step(self, step: _Step, shape: _Shape, out: torch.Tensor):
        def at_end():
            step.note_peak()
            shape.last_peak = step.true_peak - step.base
            step.finish()

        def hook(g):
            _queue_at_backward_end(at_end)
            return g

        out.register_hook(hook)
        if shape.rest_retimed < _RETIMED_STEPS and shape.context is not None:
            # The rest of the step timed again on the first planned steps (two synchronizations each): the
            # profiling step's reading includes what a step does the first time only (the allocator's first
            # requests for the rest's tensors, the libraries' first calls), and so, measured, did the first
            # planned step's on a CPU; later steps pay none of it. The least reading is the one the predicted
            # step time uses; no plan depends on it (every plan adds the same rest).
            shape.rest_retimed += 1
            device = out.device
            _sync(device)
            t0 = time.perf_counter()

            def rest_timed(g):
                _sync(device)
                shape.context.rest_ms = min(shape.context.rest_ms, (time.perf_counter() - t0) * 1e3)
                return g

            out.register_hook(rest_timed)

    # -- a profiling step -------------------------------------------------------------------------------------
    def _profiling_call(self, step: _Step, shape: _Shape, i: int, fn, args, x):
        n = len(self.layers)
        meter = step.meter
        if i == 0:
            step.note_peak()
            step.at_layer0 = meter.count()
            step.before_peak = step.true_peak - step.base
        step.calls.append((fn, args, x))
        returned = run_layer(CHECKPOINT, fn, args, [self.layers[i]], self.policies)
        out, handed = _layer_output(returned, self.who, i, self.layers[i])
        step.note_side(i, _taken_tensors(fn, args), handed)
        if i < n - 1:
            return returned
        shape.profiling_steps += 1
        if shape.chain is None:
            shape.layer_keys = [_layer_key(f, a) for f, a, _ in step.calls]
            step.note_peak()
            stage_fns, inputs, excluded = [], [], []
            for j, (f, a, xj) in enumerate(step.calls):
                rest = a[1:]
                stage_fns.append(StageFn(lambda t, f=f, rest=rest, j=j: _layer_output(
                    f(t, *rest), self.who, j, self.layers[j])[0], f"{j}:{type(self.layers[j]).__name__}",
                    self.layers[j]))
                inputs.append(xj)
                excluded.extend(_taken_tensors(f, a))
            with _Gathered(self.layers, meter) as gathered:
                shape.chain = profile(stage_fns, inputs[0], policies=self.policies, warmup=0,
                                      repeats=self.repeats, inputs=inputs, excluded=excluded,
                                      offload_min_bytes=self.offload_min_bytes if self.offload else None,
                                      groups=self.groups)
            shape.gathered = list(gathered.gathered)
            for st, g in zip(shape.chain.stages, gathered.gathered):
                st.fwd_tmp_bytes += g
                if g:
                    _add_to_stream(st, fwd=g)
            del stage_fns, inputs, excluded
            step.window.restart()  # profiling's own transients are not the step's
        # The layers' calls are not needed any more: holding their inputs would hold what the plain step frees.
        step.input_bytes = step.calls[0][2].nbytes
        x0 = step.calls[0][2]
        step.calls = []
        # The rest of the step: from here until the backward pass reaches this output.
        step.reset()
        at_return = step.at_return = meter.count()
        device = x0.device
        _sync(device)  # the rest of the step is timed from the moment the layers' work is done
        t0 = time.perf_counter()

        prefix_backward = x0.requires_grad and x0.grad_fn is not None

        def finish_profiling():
            # From the layers' input gradient to the end: the backward pass of what ran before the layers.
            step.peak_after_backward = step.peak() if prefix_backward else -1
            step.note_peak()
            try:
                self._plan_shape(step, shape)
            finally:
                step.finish()

        def at_x0(g):
            step.reset()
            _queue_at_backward_end(finish_profiling)
            return g

        def at_out(g):
            step.note_peak()
            _sync(device)
            # The rest's peak, its time, and what it leaves held through the layers' backward besides the
            # gradient it hands them (its parameters' gradients, a tied embedding's partial gradient, the outputs
            # the caller holds): the readings step_context() turns into the StepContext.
            step.rest = (step.peak(), (time.perf_counter() - t0) * 1e3)
            step.at_output_grad, step.output_grad_bytes = meter.count(), g.nbytes
            step.reset()
            if not prefix_backward:
                _queue_at_backward_end(finish_profiling)
            return g

        if out.requires_grad:
            out.register_hook(at_out)
            if prefix_backward:
                x0.register_hook(at_x0)
        del x0, out
        return returned

    def _plan_shape(self, step: _Step, shape: _Shape):
        # The readings of the profiling step, turned into a StepContext by the planner library's code, the
        # code remat::Planned uses (remat/step.h: step_context).
        r = _core.StepReadings()
        r.base = step.base
        r.input_in_base = step.input_in_base
        r.at_chain = step.at_layer0
        r.peak_before_chain = step.base + step.before_peak
        r.input_bytes = step.input_bytes
        r.at_return = step.at_return
        r.rest_peak, r.rest_ms = step.rest if step.rest is not None else (step.at_return, 0.0)
        r.at_output_grad = step.at_output_grad if step.rest is not None else step.at_return
        r.output_grad_bytes = step.output_grad_bytes
        r.peak_after_chain_backward = step.peak_after_backward
        r.step_peak = step.true_peak
        grads, seen = [0] * len(self.layers), set()
        for j in reversed(range(len(self.layers))):  # the backward pass meets the last layer first
            for p in self.layers[j].parameters():
                if step.grads_none is not None and id(p) in step.grads_none and id(p) not in seen:
                    seen.add(id(p))
                    grads[j] += _local_bytes(p)
        r.stage_grads_bytes = grads
        r.side_bytes = sum(step.side.values())
        ctx = _core.step_context(r)
        if any(shape.gathered) and ctx.checkpoint_all_peak_bytes >= 0:
            # FSDP2's backward transients (the running layer's gathered parameters, the next layer's prefetched
            # ones, its unsharded gradients and the reduce-scatter's buffers) are not in the profile, which ran
            # every layer gathered: the profiling step ran every layer checkpointed under FSDP2 and measured
            # them, so the difference between its measured peak and the model's for that schedule is charged
            # to each sharded layer's backward.
            model = _core.step_peak_bytes(shape.chain, ctx, _core.checkpoint_all(shape.chain))
            excess = ctx.checkpoint_all_peak_bytes - model
            if excess > 0:
                for st, g in zip(shape.chain.stages, shape.gathered):
                    if g:
                        st.bwd_tmp_bytes += excess
                        _add_to_stream(st, bwd=excess)
        if self._agreeing():
            _agree(shape.chain, ctx)
        shape.context = ctx
        self._plan_from(shape, ctx)

    def _agreeing(self) -> bool:
        if self.agree is False:
            return False
        import torch.distributed as dist
        on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.agree and not on:
            raise RuntimeError(f"{self.who}: agree=True needs an initialized torch.distributed process group")
        return on

    def _offload_options(self) -> dict:
        return dict(offload=self.offload,
                    max_host_bytes=self.max_host_bytes if self.max_host_bytes is not None else -1)

    def _plan_from(self, shape: _Shape, ctx):
        chain = shape.chain
        try:
            # Where the model refuses a budget that the profiling step's measured schedule (every layer
            # checkpointed) fits, plan_step falls back to that schedule (ctx.checkpoint_all_peak_bytes).
            planned = _core.plan_step(chain, ctx, self.budget, "per-layer", self.exclude, **self._offload_options())
        except _core.InfeasibleBudget as e:
            least = e.min_bytes
            err = _core.InfeasibleBudget(
                f"{self.who}: the budget of {_core.format_bytes(self.budget)} ({self.budget} bytes) is below the "
                f"least feasible one, {_core.format_bytes(least)} ({least} bytes): the step's peak "
                f"above the bytes alive when the model's forward is called, with every layer checkpointed (the "
                f"layers keep their inputs, {_core.format_bytes(chain.input_bytes)} each at the input's size; what "
                f"runs before them holds {_core.format_bytes(ctx.before_saved_bytes)}; the rest of the step peaks "
                f"at {_core.format_bytes(ctx.rest_peak_bytes)}; the backward pass allocates "
                f"{_core.format_bytes(sum(ctx.stage_grads_bytes) + ctx.rest_grads_bytes)} of gradients in the layers and after "
                "them)")
            err.budget_bytes = self.budget
            err.min_bytes = least
            shape.error = err
            shape.plan = shape.choices = shape.points = None
            shape.predicted = -1
            self._publish(shape)
            raise err from None
        shape.plan = planned.plan
        shape.choices = choices_of(planned.plan)
        shape.points = _layer_points(planned.plan)
        shape.predicted = planned.step_peak_bytes
        self._publish(shape)


def enable(model: nn.Module, layers: Sequence[nn.Module], *, budget=None, plan=None, policies=("matmuls",),
           repeats: int = 1, exclude: Sequence[str] = (), agree=None, offload: bool = False, max_host_bytes=None,
           offload_min_bytes: int = 1 << 20, groups: bool = False) -> LayerPlan:
    """Runs `layers` (the model's own modules, called in this order by its forward, each with its input tensor
    as the first positional argument) per layer as planned: for `budget` (bytes, or a string such as "300MiB",
    the whole step's peak above the bytes alive when `model`'s forward is called; planned in place at the first
    training step per input shape), or as a given per-layer `plan` (remat.per_layer's). policies: the selective
    policies a layer may run under ("matmuls" by default; a dict name -> policy function for your own).
    Each layer's forward is wrapped (an instance attribute running the class's forward; LayerPlan.remove()
    puts it back). Layers compiled one by one (layer.compile(), torch.compile(layer)) run the plan inside their
    compiled graphs (the profiling step runs them eagerly). In eval mode or
    under no_grad the layers run plainly. Raises ValueError/TypeError for bad arguments; at the end of the
    profiling step's backward pass, remat.InfeasibleBudget naming the least feasible budget when none fits.
    agree: every rank of a torch.distributed process group plans from the same numbers (each figure's maximum
    over the ranks), so that all run the same plan, one that fits each (C++'s PlannedOptions::agree); None (the
    default) turns it on when a process group of more than one rank is initialized.
    offload=True: the planner may also offload a layer (its choice "keep@host", "checkpoint@host" or a policy's,
    "matmuls@host": what it saves, a checkpointed layer's input, or a policy's kept tensors and its input,
    copied to host memory while the next layer runs and brought back while the backward pass runs the layer
    after it; saved tensors of at least offload_min_bytes), where that
    is the fastest way to fit the budget; the profiling step also measures what each layer would offload and the
    copies' bandwidth each way. max_host_bytes (bytes, or a size string) bounds the host memory a plan holds
    (LayerPlan.predicted_host_bytes; the pool's own counts in LayerPlan.host_pool).
    groups=True: the profiling step also measures each layer's saved groups (the calls whose outputs autograd
    saves, remat.profile's groups), and the planner may run a layer under a group assignment (its choice
    "{khr}": each group kept on the device, sent to the host when offload=True, or recomputed, the rest of the
    layer recomputed); off by default until measured on a GPU."""
    lp = LayerPlan(model, layers, budget=budget, plan=plan, policies=policies, repeats=repeats, exclude=exclude,
                   agree=agree, offload=offload, max_host_bytes=max_host_bytes,
                   offload_min_bytes=offload_min_bytes, groups=groups)
    for i, layer in enumerate(lp.layers):
        if "forward" in layer.__dict__:
            lp.remove()
            raise ValueError(f"remat.enable: layer {i}'s forward is already wrapped (remat.enable twice, or "
                             "another library's wrapper?); remat runs the class's forward")
    for layer in lp.layers:
        layer.__dict__[LAYER_PLAN_ATTR] = lp
        layer.forward = partial(_planned_forward, layer)  # a partial (unlike a bound method) pickles

    lp._handles.append(_Unwrap(lp.layers))
    return lp


class _Unwrap:
    """A handle of remat.enable's: removing it gives the layers their class's forward back."""

    def __init__(self, layers):
        self.layers = layers

    def remove(self):
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop(LAYER_PLAN_ATTR, None)
