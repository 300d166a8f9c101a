"""The step's measurement: what one training step of planned layers reads (its base, peaks and times, what the
layers take and hand on), the profiling step that profiles the layers where they run and measures what surrounds
them, and what is known per input shape (its profile, step context and plan)."""
from __future__ import annotations

import contextlib
import gc
import time
import warnings
import weakref
from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from . import _core, oom
from .compiled import compiled_call_of, compiled_entry, forced_choice
from .meter import PeakWindow
from .layer_calls import (layer_key, layer_output, taken_mappings, taken_tensors, tensor_ids, tensors_in,
                          tensors_put)
from .policies import CHECKPOINT, checkpoint_region, run_layer
from .profile import StageFn, profile
from .progress import PhaseTimes, progress_bar

if TYPE_CHECKING:
    from .layer_plan import LayerPlan

__all__ = ["Gathered", "RETIMED_STEPS", "Shape", "Step", "TrainingCall", "measure_planned_step", "profiling_call",
           "step_context"]


def queue_at_backward_end(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class _Token:
    """What a training call leaves in its graph (TrainingCall.tag): alive as long as the graph is."""


class LateWatch:
    """Whether gradients arriving in one layer's backward (a profiling step's, the layer checkpointed) came after
    that backward's peak: a window on the meter opened once the recompute has run (at the first of the layer's
    nodes done after its forward's second call began, so that neither the recompute's peak, which a kept layer
    does not have, nor that node's own counts: read low, the safe side), its peak read and the window restarted
    as each gradient arrives, and read once more as the layer's input has its gradient (the backward done). A
    gradient arrived late where nothing after it went above the peak before it (its own arrival included): the
    same operations follow it whatever the layer's way, and the layer's profiled backward peak, measured
    without that gradient, is the peak then."""

    __slots__ = ("meter", "recomputing", "finished", "window", "arrivals", "peaks")

    def __init__(self, meter):
        self.meter = meter
        self.recomputing = False
        self.finished = False  # (done or closed: a hook that outlives the step opens nothing)
        self.window = None
        self.arrivals: list[int] = []  # the side storages arrived, in order
        self.peaks: list[int] = []  # the window's peak before each arrival (from the last), then to the end

    def node_done(self) -> None:
        if self.recomputing and self.window is None and not self.finished:
            self.window = self.meter.window()

    def arrived(self, k: int) -> None:
        if self.window is not None and k not in self.arrivals:
            self.arrivals.append(k)
            self.peaks.append(self.window.peak())
            self.window.restart()

    def done(self) -> dict[int, bool]:
        """Per storage arrived: whether it came after the backward's peak."""
        late = {}
        if self.window is not None and self.arrivals:
            peaks = [*self.peaks, self.window.peak()]
            late = {k: max(peaks[m + 1:]) <= max(peaks[:m + 1]) for m, k in enumerate(self.arrivals)}
        self.close()
        return late

    def close(self) -> None:
        if self.window is not None:
            self.window.close()
        self.window, self.finished = None, True
        self.arrivals, self.peaks = [], []


class TrainingCall:
    """One training call of the model (under grad, in training mode), open from its forward until a backward pass
    reaches one of its outputs, or until its graph is freed without one (its outputs dropped). A call that
    begins while an earlier one is open runs inside that call's step (LayerPlan._step_begins). A backward pass
    that reached it and raised (out of memory in a recompute) leaves it closed: the graph that the error holds
    is not run again."""

    __slots__ = ("reached", "step", "_graph", "_waiting")

    def __init__(self):
        self.reached = False  # a backward pass has reached one of the call's outputs
        self.step: Step | None = None  # the call's Step; None for a call inside an earlier one's
        self._graph = None  # a weak reference to the _Token the call's graph holds
        self._waiting: list[Callable[[], None]] = []

    def tag(self, t) -> None:
        """Marks the graph of `t`, one of the call's outputs: a token in its autograd node's metadata (one token
        for all of the call's outputs), and a hook that closes the call when a backward pass reaches it. Tensors
        without a graph are left as they are."""
        if not isinstance(t, torch.Tensor) or t.grad_fn is None:
            return
        token = self._graph() if self._graph is not None else None
        if token is None:
            token = _Token()
            self._graph = weakref.ref(token)
        t.grad_fn.metadata["remat_call"] = token
        t.register_hook(self._reached)

    def _reached(self, g):
        if not self.reached:
            self.reached = True
            queue_at_backward_end(self._end)
        return g

    def _end(self):
        waiting, self._waiting = self._waiting, []
        for fn in waiting:
            fn()

    def when_ended(self, fn: Callable[[], None]) -> None:
        """Runs fn at the end of the backward pass that reaches this call (never, where its graph is dropped
        without one, or that pass raises)."""
        self._waiting.append(fn)

    def open(self) -> bool:
        """Whether the call's graph is alive and no backward pass has reached it."""
        return not self.reached and self._graph is not None and self._graph() is not None


def storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() or id(t)
    except RuntimeError:  # a tensor without storage (a wrapper subclass)
        return id(t)

def sharded_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of `module` (itself included) that FSDP2 shards (FSDPModule), in module order; [] where this
    torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def fsdp1_sharded(model: nn.Module) -> str | None:
    """Where FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) shards `model`: the name of a module of it
    FSDP1 wraps ("the model" for itself), "its parameters" where they are FSDP1's flat parameters or views of
    them while it runs (use_orig_params=True: not leaves); None where neither (no FSDP1 found)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    for name, m in model.named_modules():
        if isinstance(m, FullyShardedDataParallel):
            return f"module {name}" if name else "the model"
    for p in model.parameters():
        if getattr(p, "_is_flat_param", False) or not p.is_leaf:
            return "its parameters"
    return None


class Gathered:
    """While profiling: every FSDP2-sharded layer's parameters all-gathered (FSDPModule.unshard()), so that a
    layer's forward can run outside its module call, and resharded after (reshard()). A transient of
    profiling's own, as its other runs are: the window restarts after it."""

    def __init__(self, layers: Sequence[nn.Module], meter):
        self.meter = meter
        self.per_layer = [sharded_modules(layer) for layer in layers]
        self.modules = [m for ms in self.per_layer for m in ms]
        self.gathered = [0] * len(layers)  # per layer: the bytes its all-gathered parameters take (measured)

    def __enter__(self):
        # Each module resharded first (the running layer is gathered now) and gathered again, its bytes read
        # as the meter's count rises: the all-gathered parameters, in the dtype FSDP2 gathers them in. At least
        # the bytes of the layer's gathered parameters' storages: the count is the process's, and a free on
        # another thread while a module gathers (a collective's buffers let go of by its worker thread) would
        # lower it. (Found 2026-12-07: once, on a loaded machine, a layer's reading came out below zero and the
        # profile was refused, "negative fwd_tmp_bytes". When quiet the two agree: 246,272 bytes a layer of the
        # tests' Llama.)
        for j, ms in enumerate(self.per_layer):
            for m in ms:
                m.reshard()
                before = self.meter.count()
                m.unshard()
                self.gathered[j] += self.meter.count() - before
            if ms:
                storages = {storage_key(p): storage_bytes(p) for m in ms for p in m.parameters()}
                self.gathered[j] = max(self.gathered[j], sum(storages.values()))
        return self

    def __exit__(self, *exc):
        for m in reversed(self.modules):
            m.reshard()
        return False

def local_bytes(p: torch.Tensor) -> int:
    """A parameter's bytes on this rank: its local shard's for a DTensor (FSDP2), else its own."""
    to_local = getattr(p, "to_local", None)
    return to_local().nbytes if callable(to_local) else p.nbytes


def stage_layers(lp: "LayerPlan", shape) -> list[nn.Module]:
    """The modules of `shape`'s chain's stages, in order: lp.layers, or the layers its steps call (Shape.stages)."""
    stages = shape.stages
    return list(lp.layers) if stages is None else [lp.layers[j] for j in stages]


def layer_grads_bytes(layers: Sequence[nn.Module], grads_none, sizes: dict[int, int] | None = None) -> list[int]:
    """Per layer, the bytes of the parameter gradients its backward makes: those of its parameters that need a
    gradient and whose ids are in `grads_none` (None when the step began), this rank's shard's under FSDP2 (or
    `sizes`' entry for its id: unsynced_grad_bytes); a parameter that two layers use at the later one, which the
    backward pass meets first."""
    grads, seen = [0] * len(layers), set()
    sizes = sizes or {}
    for j in reversed(range(len(layers))):
        for p in layers[j].parameters():
            if id(p) in grads_none and id(p) not in seen:
                seen.add(id(p))
                grads[j] += sizes.get(id(p), local_bytes(p))
    return grads


def _fsdp2_params(sharded: Sequence[nn.Module], syncing: bool):
    """Of the FSDP2-sharded modules `sharded`, those whose gradient sync is on (`syncing`) or off, each of their
    FSDP parameters (FSDP2's internals: a module's parameter group, its `reduce_grads` and `fsdp_params`, as they
    are on torch 2.11 and 2.15; a module where they are not found is taken as syncing and holding nothing)."""
    for m in sharded:
        state = getattr(m, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        if group is not None and bool(getattr(group, "reduce_grads", True)) == syncing:
            yield from getattr(group, "fsdp_params", ())


def _holds_unsharded_grad(fp) -> bool:
    """Whether FSDP2 parameter `fp` holds an unsharded gradient left by a step with the sync off (on its unsharded
    parameter; on 2.11 with a reduce dtype, in its accumulated gradient)."""
    unsharded = getattr(fp, "_unsharded_param", None)
    return (unsharded is not None and unsharded.grad is not None
            or getattr(fp, "unsharded_accumulated_grad", None) is not None)


def unsynced_grad_bytes(sharded: Sequence[nn.Module]) -> dict[int, int]:
    """Under FSDP2 with its gradient sync off (`set_requires_gradient_sync(False)`: gradient accumulation without
    communication, as Accelerate's accumulation runs its micro-batches but the last), a module's backward leaves
    each parameter's gradient unsharded, held until a step that syncs reduces it: per sharded parameter (by id)
    of the modules among `sharded` (sharded_modules') whose sync is off, the bytes its backward leaves held as a
    step begins now: the unsharded gradient's (its full size, in the larger of the dtypes FSDP2 may hold it in:
    the reduce dtype, the gathered parameters' and the parameter's own), or 0 where an unsharded gradient of an
    earlier step is held (the new one is added to it). {} where FSDP2 has none of its internals (_fsdp2_params)."""
    out: dict[int, int] = {}
    for fp in _fsdp2_params(sharded, syncing=False):
        p = getattr(fp, "sharded_param", None)
        if p is None or not p.requires_grad:
            continue
        dtypes = [d for d in (getattr(fp, "reduce_dtype", None), getattr(fp, "param_dtype", None), p.dtype) if d]
        out[id(p)] = 0 if _holds_unsharded_grad(fp) else p.numel() * max(d.itemsize for d in dtypes)
    return out


def unsharded_grads_reduced(sharded: Sequence[nn.Module]) -> bool:
    """Whether a step beginning now lets go of unsharded gradients held from earlier steps: a module among
    `sharded` (sharded_modules') holds some (left by steps with its gradient sync off, unsynced_grad_bytes) and
    syncs in this one, reducing them."""
    return any(_holds_unsharded_grad(fp) for fp in _fsdp2_params(sharded, syncing=True))


class ParamsUsed(TorchFunctionMode):
    """The parameters a forward hands to a torch function (a call, an operator, a method), by id, put into `used`: a
    parameter among a call's arguments, its keywords or a list or tuple among them; reading an attribute (its
    dtype, its shape) is not a use. Run over each layer's forward in a profiling step (profiling_call), where
    it tells a parameter the forward used and the backward gave no gradient (a DSA indexer's, whose scores only
    choose indices) from one it did not use (an expert no token reached), which a later step may use."""

    def __init__(self, used: set[int]):
        super().__init__()
        self.used = used

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) != "__get__":
            for a in (*args, *kwargs.values()):
                if isinstance(a, (list, tuple)):
                    self.used.update(id(b) for b in a if isinstance(b, nn.Parameter))
                elif isinstance(a, nn.Parameter):
                    self.used.add(id(a))
        return func(*args, **kwargs)


def storage_ref(t: torch.Tensor) -> StorageWeakRef | None:
    """A weak reference to t's storage (`.expired()` once it is freed), or None for a tensor without storage (a
    wrapper subclass)."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except RuntimeError:
        return None


def live_storages(device: torch.device) -> dict[int, StorageWeakRef]:
    """The storages on `device` of every plain tensor alive now as a Python object (the garbage collector's
    objects; parameters and other subclasses left out), by storage_key(), each with a weak reference to it. Read
    once per profiling step, at the first layer's call where it takes tensors beside its input: about 25 ms in a
    process with transformers loaded (370,000 objects). (Not the calling frames' locals: reading them from
    Python 3.11 or 3.12 holds what they refer to until the frame returns, which changed what the profiling step
    measured.)"""
    out: dict[int, StorageWeakRef] = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor:  # (type(), not isinstance(): an object's __class__ may be a property that
            # warns, as torch.distributed.reduce_op's does)
            try:
                if o.device != device:
                    continue
                k = storage_key(o)
                if k not in out:
                    ref = storage_ref(o)
                    if ref is not None:
                        out[k] = ref
            except RuntimeError:
                continue
    return out


def storage_is(t: torch.Tensor, ref: StorageWeakRef) -> bool:
    """Whether t's storage is the one `ref` refers to (not another at the same address since)."""
    try:
        return StorageWeakRef(t.untyped_storage()) == ref
    except RuntimeError:
        return False


def storage_users(t: torch.Tensor | StorageWeakRef) -> int | None:
    """How many owners t's storage has (its use count: each tensor sharing it, less the reference this read
    takes: a tensor's storage handle, a weak reference's lock; 0 where a weak reference's storage was freed), or
    None where that is not known (a tensor without storage, a torch that does not tell)."""
    try:
        if isinstance(t, StorageWeakRef):
            return max(0, int(torch._C._storage_Use_Count(t.cdata)) - 1)
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata)) - 1
    except (RuntimeError, AttributeError, TypeError):
        return None


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except RuntimeError:
        return t.nbytes

RETIMED_STEPS = 3  # planned steps that time the rest of the step again

_checkpoint_states: dict[tuple[str, int | None], int] = {}  # per device, checkpoint_state_bytes as measured


def checkpoint_state_bytes(meter, device: torch.device) -> int:
    """What a layer run checkpointed (checkpoint_region, as the runtime runs it) holds beside its input and output
    until its backward is done (StepContext.checkpoint_state_bytes), measured once per device by `meter`: the
    count's rise over a checkpointed call on a one-element tensor (one that saves it: a checkpoint that saves
    nothing keeps nothing), less its output. It is the random generators' states the checkpoint saves to replay
    its draws: host tensors, so 0 on a CUDA device, the CPU generator's state (5,056 bytes) where the device is
    the CPU."""
    key = (device.type, device.index)
    if key not in _checkpoint_states:
        with torch.enable_grad():  # read where a backward pass ends, in its callback
            x = torch.zeros(1, device=device, requires_grad=True)
            before = meter.count()
            y = checkpoint_region(lambda t: t * t, (x,))  # saves its input: the checkpoint's state is kept
            _checkpoint_states[key] = max(0, meter.count() - before - storage_bytes(y))
            del y, x
    return _checkpoint_states[key]


class Shape:
    """What is known of one input shape: its profile, what surrounds the layers, the plan."""

    def __init__(self, key: tuple | None = None):
        self.key = key  # the step's key (None: a given plan's, for every shape)
        self.layer_keys: list[tuple] | None = None  # each layer call's layer_key in the profiling step
        self.warned = False  # a call off these shapes was warned of
        self.gathered: list[int] = []  # per layer, FSDP2's all-gathered parameters' bytes (0: not sharded)
        self.chain: _core.Chain | None = None
        # Per layer, every call the profile measured as a candidate saved group (profile's `saved_calls`), or None.
        self.saved_calls: list[list[_core.SavedGroup]] | None = None
        # Per layer, the storages its plain forward's graph saved tensors of (profile's `saved_storages`; an entry
        # None where not read), or None.
        self.saved_storages: list[set[int] | None] | None = None
        # Per layer, the bytes a run of it left in the attributes it reassigns (profile's `attributes_bytes`).
        self.attributes_bytes: list[int] = []
        self.context: _core.StepContext | None = None
        self.plan: _core.Plan | None = None
        self.choices: list[str] | None = None
        self.points: tuple[list, list] | None = None  # the plan's offload schedule per layer (layer_points)
        self.predicted = -1
        self.last_peak = -1
        self.prediction_error: float | None = None  # the last planned step's (_core.check_prediction's error)
        self.replanned = False  # planned again for a step that held more than predicted (once per shape)
        self.said_below = False  # a step that held less than predicted was warned of (once per shape)
        self.lowered = 0  # what that took off the budget (bytes): every plan for this shape is made below it
        self.profiling_steps = 0
        self.skipped_profiles = 0  # steps that were to profile it and did not, a layer skipped (LayerDrop)
        self.profiling_time: dict[str, float] = {}  # where its profile's time went: seconds by phase
        self.rest_retimed = 0  # planned steps that took the rest's time again (the first RETIMED_STEPS do)
        self.error: Exception | None = None
        # A device budget's (budget="auto", "90%"): what the device had, (free, held, total, lost) bytes, read in
        # the profiling step, and the budget in bytes made from it.
        self.room: tuple[int, int, int, int] | None = None
        self.budget = -1
        # The plans made for this shape's chain (LayerPlan._planned), by budget and figures, oldest first.
        self.planned_chain: _core.Chain | None = None
        self.planned_at: dict = {}
        # No layer's output needed a gradient in its profiling step (every layer frozen): they run as they are.
        self.no_backward = False
        # The planned shape whose plan (and the profile it was made from) this one runs, not profiled (a shape
        # that covers it: LayerPlan.borrow_plans); None for a shape profiled itself.
        self.borrowed_from: Shape | None = None
        # The layers' parameter gradients a step of this shape begins without, per layer (bytes: layer_grads_bytes),
        # then the indices of the parameters outside the layers it begins without a gradient for (a frozenset:
        # LayerPlan._grads_state), as the step the plan in force is for began (None before a plan); per such state
        # planned, what its plan charges: the gradients of the layers' backward (StepContext.stage_grads_bytes:
        # gradient accumulation's first micro-batch makes them, the others add to them), then those outside them
        # beyond the profiling step's (LayerPlan._outside_more); and whether the rest of the step makes the layers'
        # gradients before their backward (a paired loss: profiling_call), so that no state's plan charges them.
        self.grads_key: tuple | None = None
        self.charged: dict[tuple, list[int]] = {}
        self.grads_in_rest = False
        # Of the parameters outside the layers, the indices of those whose gradients were None when its profiling
        # step began (Shape.grads_key's last entry there; None: not read, a pickle from before), against which a
        # step in another state is charged (LayerPlan._outside_more).
        self.measured_outside: frozenset | None = None
        # Their gradients' bytes, by index (LayerPlan._outside_sizes; None: a pickle from before, their own sizes).
        self.measured_outside_sizes: dict[int, int] | None = None
        # The layers a step of this shape calls, as indices into LayerPlan.layers in order, where that is not every
        # layer (a vision-language model's text-only batches, which call no vision layer): its chain's stages are
        # these layers', and its plan's choices theirs (None: every layer, stage k layer k). Taken where two
        # profiling attempts in a row called the same layers (`tried`: the last one's, a frozenset).
        self.stages: tuple[int, ...] | None = None
        self.tried: frozenset | None = None
        # Profiled on an example batch (LayerPlan._run_whole), whose step holds the model's outputs through its
        # backward pass: a training step held below its prediction has the shape profiled again
        # (LayerPlan._check_prediction).
        self.from_example = False

    def stage_of(self, i: int) -> int | None:
        """The stage of layer i (an index into LayerPlan.layers) in this shape's chain, or None where its steps do
        not call it (stages)."""
        if self.stages is None:
            return i
        try:
            return self.stages.index(i)
        except ValueError:
            return None

    def layer_of(self, k: int) -> int:
        """The layer (an index into LayerPlan.layers) of this shape's stage k."""
        return k if self.stages is None else self.stages[k]

    def offloads(self) -> bool:
        """Whether its plan sends some layer to the host (its offload schedule has points: layer_points)."""
        return self.points is not None and any(map(any, self.points))

    def profiled(self) -> bool:
        """Profiled in a training step of its own (LayerPlan.profiled_shapes counts these; C++'s Shape::profiled)."""
        return self.chain is not None and self.borrowed_from is None

    def __setstate__(self, state):
        """From a copy or a pickle, perhaps one an earlier remat saved (torch.save of a planned model): fields it
        lacks take their defaults."""
        self.__init__(state.get("key"))
        self.__dict__.update(state)
        if self.grads_key is None and self.context is not None and self.choices is not None:
            # Saved before plans followed the gradients: its plan is for what its profiling step charged.
            self.grads_key = tuple(self.context.stage_grads_bytes)
            self.charged = {self.grads_key: list(self.context.stage_grads_bytes)}


class Step:
    """One training step's measurements."""

    def __init__(self, meter, grads_none: set[int] | None):
        self.meter = meter
        # (layer, where, key): a mapping a layer was handed that it put a tensor into (profiling_call; warned of at
        # the last layer, warn_of_graph_state).
        self.mapping_puts: list[tuple[int, str, object]] = []
        # (layer, bytes): tensors that require a gradient and have no grad_fn, made in a layer's forward (leaves_made;
        # warned of at the last layer, warn_of_graph_state).
        self.leaves_made: list[tuple[int, int]] = []
        # (layer, "module.attribute", its nodes): the tensors of the step's graph the layers keep in attributes
        # (graph_state), their graphs' nodes watched from the last layer for their run in the backward
        # (`graph_watch`: by id, (node, [whether it ran], the hook's handle); warn_of_graph_state), warned of at its
        # end where a node it did not run holds saved tensors (graph_state_not_run).
        self.graph_state: list[tuple[int, str, list]] = []
        self.graph_watch: dict[int, tuple] = {}
        # remat's own window on the device's count: the step's peak, without resetting what the user reads.
        self.window = meter.window()
        self.base = meter.count()
        self.true_peak = self.base  # the step's own peak (profiling's transients left out)
        self.profiling_peak = self.base  # the peak of profiling's own runs in the step
        self.grads_none = grads_none  # ids of parameters whose .grad was None when the step began
        # Their gradients' bytes where a step makes them other than at their own (local) size, by id, read as it
        # began (unsynced_grad_bytes: FSDP2's unsharded gradients with its sync off).
        self.grad_sizes: dict[int, int] = {}
        # Profiling: the ids of the parameters the layers' forward used (ParamsUsed), those of them in grads_none
        # watched for a gradient (their hooks' handles, removed at the step's end), and those given one.
        self.params_used: set[int] = set()
        self.grads_watched: dict[int, object] = {}
        self.grads_made: set[int] = set()
        self.grads_in_rest = False  # the rest of the step made the layers' gradients (profiling_call's at_out)
        # Profiling: of the parameters outside the layers (by index in LayerPlan._params), where the backward
        # accumulated each one's gradient (watch_outside: "rest", "between" or "before"), and the hooks' handles.
        self.outside_phase: dict[int, str] = {}
        self.outside_watched: list = []
        self.shape: Shape | None = None
        self.calls: list = []  # profiling: (fn, args, x) per layer
        self.at_layer0 = 0
        self.before_peak = 0
        self.rest: tuple[int, float] | None = None  # (the rest's peak count, its time in ms)
        self.at_return = 0
        self.after_first_backward = False  # first_backward_done() has run
        self.at_output_grad = 0
        self.output_grad_bytes = 0
        self.output_grad_storage_bytes = -1
        self.output_freed = 0  # StepReadings.output_freed_bytes
        self.peak_after_backward = -1
        self.input_in_base = False
        # The storages of the tensors the model was called with, alive before the base was read: a first layer
        # that takes one of them (an nn.Sequential called on the batch) has its input in the base.
        self.given: set[int] = set()
        self.input_bytes = 0
        # Whether the layers' input was alive once the first layer's backward was done (StepReadings'
        # input_held_in_backward): held unless read otherwise.
        self.input_held = True
        # Whether the layers' input, alive when the last layer returned, was freed by the time the rest handed
        # the layers' output its gradient (StepReadings.input_freed_in_rest).
        self.input_freed_in_rest = False
        self.done = False
        self.measured = False  # a planned step whose measurement is set up (measure_planned_step)
        self.at_end_queued = False
        self.key: tuple | None = None  # the model call's shapes (call_key), when the step began there
        self.off_plan = False  # a layer's call had shapes its plan was not made for: the rest is checkpointed
        # A step the model's forward began (LayerPlan._step_begins), until that forward returns: the layers called
        # in it so far (dispatch: one called twice is refused).
        self.in_model_forward = False
        self.layers_called: set[int] = set()
        # The layers the model's forward did not call in this step (LayerDrop: dispatch, LayerPlan._forward_ends),
        # and whether this step, one that was to profile, profiles nothing for it (its layers from the first one
        # skipped run checkpointed; finished as the next step begins).
        self.skipped: list[int] = []
        self.abandoned = False
        # What the layers take or hand on beside their input and output (StepContext.side_bytes): the storages
        # the first layer takes (made before the layers: their gradients only are charged), and per storage
        # made during the layers, its bytes and its gradient's.
        self.before_chain: set[int] = set()
        # The storages of the tensors alive when the first layer is called (live_storages()): a storage a later
        # layer takes first that was among them (Gemma-2's full-attention mask, made before the layers with the
        # sliding one the first layer takes) is made before the layers too, and charged as before_chain's.
        self.alive_at_chain: dict[int, StorageWeakRef] = {}
        self.side: dict[int, int] = {}
        # Per storage the layers take beside their input with a gradient: the last layer that takes it (whose
        # backward its gradient arrives at: StepContext.side_grads_bytes) and the gradient's bytes.
        self.side_grads: dict[int, tuple[int, int]] = {}
        # Per side storage: a weak reference to it (where side_bytes charge it) and to its gradient once that is
        # whole (a hook on the tensor); what was found let go of: per layer the bytes found freed once its
        # backward was done (StepContext.side_freed_bytes), and each storage or gradient found freed already
        # (("s" or "g", key); found freed where what runs between two layers ran, it is between_held_bytes').
        self.side_refs: dict[int, StorageWeakRef] = {}
        # Of the storages made before the layers that they take (before_chain), those needing no gradient (masks),
        # by storage: [a weak reference to it, its bytes, the layers that take it, the layer once whose backward
        # it was found let go of (-1: where what runs between two layers had run; None: not yet)]
        # (StepContext.taken_bytes).
        self.taken: dict[int, list] = {}
        self.side_grad_refs: dict[int, StorageWeakRef | None] = {}
        # Per side storage with a gradient: where that gradient first arrives in the backward pass, if it arrives
        # as part of a larger storage (a view of a gradient made for more than it: Zamba2's hybrid layers
        # concatenate the embeddings to their input, and the concatenation's backward hands each part a view of
        # one gradient, which autograd holds whole until a second layer's gradient is summed in): the layer, a
        # weak reference to that storage and its bytes beyond the gradient's (watch_side_arrivals).
        self.side_arrived: dict[int, tuple[int, StorageWeakRef | None, int]] = {}
        # Of those first arrivals, which came after the peak of their layer's backward (StepContext.
        # side_grads_late_bytes): per layer watched (one taking something with a graph beside its input, where
        # the meter's windows are its own), whether its recompute has begun, the window open on its backward
        # since the first of its nodes done after that, and per first arrival at it the window's peak up to
        # then (LateWatch); per side storage, whether its first arrival was late (side_late).
        self.late_watch: dict[int, LateWatch] = {}
        self.side_late: dict[int, bool] = {}
        self.side_freed: dict[int, int] = {}
        self.side_gone: set[tuple[str, int]] = set()
        # Per storage a layer hands on that no layer has taken yet (GPT-J's and BLOOM's attention weights, which
        # their blocks return and the model's code drops unless it collects attentions; T5's position bias,
        # which the next block takes): a weak reference to it and its storage's bytes. Charged once a later layer
        # takes it, or where something still holds it when the rest's backward hands the layers their gradient
        # (charge_handed_side); else never (the model's code held it in a variable at most until the next
        # layer's call returned: not charged there, a limit).
        self.side_handed: dict[int, tuple[StorageWeakRef | None, int]] = {}
        # Of those, what was alive when the last layer returned (the last layer's, which the model's code holds
        # until its forward returns) and was let go of in the rest of the step: the rest's readings are taken
        # above a count that held it (at_return), and the model charges it nowhere (handed_freed_in_rest).
        self.handed_at_return: dict[int, int] = {}
        self.handed_freed_in_rest = 0
        self.reading = None  # a device budget's: what the device had when the step began (fit.read_device)
        self.device = None  # the device the step runs on
        # What runs between two layers in the model's code (StepContext.between_forward_held_bytes,
        # between_backward_peak_bytes, between_held_bytes): per layer i, its output's storage key, a weak
        # reference to it and its bytes (whether the next layer takes that output, whether it is freed in the
        # backward between), the count when it returned and its autograd node's sequence number;
        # the backward pass between layer i - 1 and i now running (i, the count when it began, the input
        # gradient's storage key, weak reference and bytes, whether layer i - 1's output was alive then, layer
        # i's input if what ran between made it); per layer the readings.
        self.out_refs: dict[int, LayerOut] = {}
        # The same, of a layer whose output takes no gradient (a frozen layer on an input that needs none: a
        # frozen vision tower's), whose backward window of what runs after it is read at the backward pass's end.
        self.out_refs_nograd: dict[int, LayerOut] = {}
        # Per layer whose output needs a gradient, a weak reference to the alias of its input its checkpoint
        # holds (alive while its graph is), and the layers whose graph was gone by the time the backward pass
        # reached the layers' output (`dead`: a layer whose output nothing the loss reads, Llava's last vision
        # layer under vision_feature_layer=-2; its backward never runs).
        self.graph_refs: dict[int, weakref.ref] = {}
        self.dead: list[int] = []
        self.between_open: OpenBetween | None = None
        self.between: dict[int, tuple[int, int]] = {}
        self.between_forward: dict[int, int] = {}
        # Per layer i >= 1 with something run between: whether it let go of layer i - 1's output, run
        # checkpointed (StepContext.between_frees_output: a way that holds its output keeps it beside layer i's
        # input).
        self.between_frees: dict[int, bool] = {}
        # The last layer's output (a weak reference to its storage, from its return in a profiling step), and
        # whether the model's forward had let go of it by its end (StepContext.rest_frees_output: a residual sum
        # over the last layer; a way that holds its output keeps it beside what the rest makes).
        self.chain_out_ref: StorageWeakRef | None = None
        self.rest_frees = False
        # The autograd nodes that made the last layer's input and its output (from its return in a profiling step),
        # and whether the rest of the model's forward took that input too (StepContext.rest_takes_last_input: its
        # graph reaches the input's node without passing through the output's; read at the forward's end).
        self.last_nodes: tuple | None = None
        self.rest_takes_input = True
        # Per layer i >= 1: whether the last layer's output was alive once layer i's backward was done (held
        # unless read otherwise: StepContext.outputs_held_in_backward).
        self.outputs_held: dict[int, bool] = {}
        # Per layer i >= 1 whose input (the last layer's output as handed on) takes no gradient: a weak reference
        # to its storage, read into outputs_held at the backward pass's end.
        self.inputs_without_grad: dict[int, StorageWeakRef] = {}
        # Per layer i >= 1: whether its input, the last layer's output object as handed on, was held past its
        # forward (StepContext.inputs_held_in_forward; held unless read). The layers' checkpoints and the
        # profiler's inputs take an alias of it (input_alias), so that only what else holds the object (the
        # model's code, a list, the autograd graph, which keeps the object alive) keeps it. Read at the next
        # layer's call: let go of where the object is dead by then and that layer takes the output of this one
        # as handed on (nothing ran between them, as the model of the step has it). The last layer's: let go of
        # where the object died before the count rose above its level at that layer's return (what ran while
        # it was alive held no more than that layer's forward did), held where it was alive at the end of the
        # model's forward (LayerPlan._forward_ends) or when the rest's backward began. A weak reference per
        # input not read yet, the last layer's output object's, and the last layer's input's with a callback.
        self.inputs_held: dict[int, bool] = {}
        self.input_objs: dict[int, weakref.ref] = {}
        # Per layer i >= 1 whose input what ran between made (a residual sum outside the layers: `x = x +
        # layer(x)`), nothing else sharing its storage at the call: a weak reference to that storage, its bytes,
        # and its owners once the layer's checkpoint and the profiler took their aliases (None once the layer's
        # return found more). Read as inputs_held: let go of where, at the next layer's call, its object is dead,
        # the storage's owners are those aliases only, and what ran between left held just that input less the
        # output it let go of (between_forward_held_bytes is the input's bytes beyond a_i:
        # input_let_go_extra_bytes() in the planner library). The last layer's, read as it dies (watch_last_input).
        self.made_inputs: dict[int, MadeInput] = {}
        # Whether the last layer's input, held past that layer's forward, died before the model's forward ended
        # (StepContext.last_input_let_go_in_rest; for one made by what ran between, with the rule above).
        self.last_in_rest = False
        # Per layer i: whether what takes its output after it handed that output its own path's gradient tensor
        # (StepContext.residual_grad_shared; shared unless read): between layers, the output's gradient is the
        # next layer's input's gradient tensor (read as the backward between ends); for the last layer, its
        # output has its input's dtype (a sum in another dtype casts the gradient it hands the output).
        self.grads_shared: dict[int, bool] = {}
        self.last_out_obj: weakref.ref | None = None
        self.last_input_watch: weakref.ref | None = None
        # The gradient the rest hands the layers' output (a weak reference to its storage), and per layer whether
        # it was alive once that layer's backward was done (StepContext.output_grad_held_in_backward: a skip from
        # an earlier layer's input to the head holds it in that input's gradient buffer), read as each layer's
        # input gradient is ready (the first layer's at the end of the backward pass, or of its own).
        self.out_grad_ref: StorageWeakRef | None = None
        self.out_grad_held: dict[int, bool] = {}
        # Per layer: whether its output was alive at the end of the backward pass (StepContext.outputs_held_to_end;
        # empty where not read).
        self.held_to_end: list[bool] = []
        # The calls of the model that ran inside this step (began while this step's call was open): the step
        # ends once they have (after_inside).
        self.inside: list[TrainingCall] = []

    def read_out_grad_held(self, i: int) -> None:
        """Layer i's backward is done: whether the layers' output gradient is alive still."""
        if self.out_grad_ref is not None and i not in self.out_grad_held:
            self.out_grad_held[i] = not self.out_grad_ref.expired()

    def read_input_past_forward(self, i: int, as_handed: bool = True) -> None:
        """Layer i's input, at the next layer's call, which takes layer i's output as handed on or not (the first
        layer's at the end of the model's forward)."""
        ref = self.input_objs.pop(i, None)
        made = self.made_inputs.pop(i, None)
        if ref is not None and made is not None:
            self.inputs_held[i] = ref() is not None or not self.made_input_gone(i, made, 1)
        elif ref is not None:
            self.inputs_held[i] = ref() is not None or not as_handed

    def made_input_gone(self, i: int, made: MadeInput, less: int) -> bool:
        """Whether layer i's input made by what ran between (its object dead) is gone but for the profiling
        step's aliases: its storage has `less` owners fewer than made.owners (the object's own, where it let go
        of it already), and what ran between left held that input less the output it let go of
        (Step.made_inputs)."""
        last = self.out_refs.get(i - 1)
        return (made.owners is not None and storage_users(made.ref) == made.owners - less
                and self.between_frees.get(i, False) and last is not None
                and self.between_forward.get(i) == made.nbytes - last.nbytes)

    def watch_last_input(self, i: int, x: torch.Tensor) -> None:
        """The last layer (i), returned, its input object `x`: read as it dies (at_return set)."""
        if self.input_objs.pop(i, None) is None:
            return
        made = self.made_inputs.pop(i, None)
        if made is not None and made.owners is not None:  # its owners now, the profiling step's calls let go of
            made = made._replace(owners=storage_users(x))

        def died(_, i=i, made=made):
            if i not in self.inputs_held:
                try:
                    # (A weak reference's callback runs before the object lets go of its storage: its owners
                    # are as they were.)
                    gone = made is None or self.made_input_gone(i, made, 0)
                    rose = self.peak() > self.at_return
                    self.inputs_held[i] = rose or not gone
                    self.last_in_rest = rose and gone
                except Exception:  # (a callback's exception is only printed)
                    self.inputs_held[i] = True

        self.last_input_watch = weakref.ref(x, died)

    def last_input_alive(self, i: int) -> None:
        """The end of the model's forward, or the rest's backward beginning: the last layer's input (i), not dead
        yet, held."""
        if self.last_input_watch is not None and i not in self.inputs_held:
            self.inputs_held[i] = True
        self.last_input_watch = None

    def note_side(self, i: int, taken: list[torch.Tensor], handed: tuple, outs: set[int], graded: set[int]):
        """What layer i took beside its input (`taken`) and handed on (`handed`), into side_bytes and the side
        figures; `outs`: the earlier layers' outputs' storage keys (layer_outputs()); `graded`: the storage keys
        of what it took with a graph to which its own graph hands a gradient (watch_side_arrivals)."""
        if i == 0:
            self.before_chain = {storage_key(t) for t in taken}
        else:
            # Made before the layers (alive, the same storage, when the first layer was called): charged as
            # the first layer's are, in before_saved_bytes (the step's count at the chain's start), not in
            # side_bytes too. Before (found 2026-12-04), Gemma-2's full-attention mask was charged twice.
            for t in taken:
                k = storage_key(t)
                ref = self.alive_at_chain.get(k)
                if ref is not None and not ref.expired() and k not in self.side and k not in outs \
                        and k not in self.side_handed and storage_is(t, ref):
                    self.before_chain.add(k)
        first = self.input_objs[0]() if self.input_objs.get(0) is not None else None
        chain_input = storage_key(first) if first is not None else None
        del first
        for t in taken:
            k = storage_key(t)
            # (With a gradient too: Zamba2's hybrid layers take a copy of the embeddings, let go of once the
            # model's forward returns where no layer's way holds it. Before (found 2026-12-06) only tensors
            # without one were, and the rest were charged to the step's end.)
            if k in self.before_chain and k != chain_input:
                entry = self.taken.get(k)
                if entry is None:
                    entry = self.taken[k] = [storage_ref(t), storage_bytes(t), set(), None]
                entry[2].add(i)
        # (Tuples walked: xLSTM's blocks hand on their state as one. Before (found 2026-12-06), only the tensors
        # at its top were looked at: the last block's state, which the model's code lets go of in the rest, was in
        # the rest's readings as if the rest had made it, and a 4-layer xLSTM's kept layers, whose saved tensors
        # hold that state's storage, were 0.17% above their predictions.)
        made = [t for t in tensors_in(handed) if storage_key(t) not in self.before_chain]
        taken_keys = {storage_key(t) for t in taken}
        for t in [*taken, *made]:
            k = storage_key(t)
            # (A tensor taken with a graph that no layer's graph uses has no gradient: Zamba2's Mamba layers take
            # the embeddings beside their input and do not use them.)
            uses = t.grad_fn is None or k in graded or k not in taken_keys
            grad = t.nbytes if t.requires_grad and uses else 0
            # An earlier layer's output (an encoder's, which a decoder's layers take) is the chain's output of
            # that stage, charged as such from that layer's forward on (and to the step's end where something
            # holds it there: outputs_held_to_end): only its gradient is charged here.
            held = grad if k in self.before_chain or k in outs else storage_bytes(t) + grad
            handed_only = k not in taken_keys and k not in self.side and k not in outs
            if handed_only:
                # Handed on, taken by no layer yet: charged where a later layer takes it or something holds it
                # once the rest's backward begins (side_handed). Before (found 2026-12-04) it was charged at
                # once with its gradient: GPT-J's and BLOOM's attention weights, which the model's code drops,
                # were charged from the chain's start through the last layer's backward (a 4-layer GPT-J's
                # plans were 17-31% below their predictions, BLOOM's 19-28%).
                ref = self.side_handed.get(k, (None, 0))[0]
                if ref is None or ref.expired():  # (a storage let go of, its address another's now)
                    ref = storage_ref(t)
                self.side_handed[k] = (ref, storage_bytes(t))
                continue
            self.side_handed.pop(k, None)
            self.side[k] = max(self.side.get(k, 0), held)
            if k in outs:  # its gradient is the chain's, that layer's output's (what runs between reads it)
                continue
            if held > grad and k not in self.side_refs:
                ref = storage_ref(t)
                if ref is not None:
                    self.side_refs[k] = ref
            if t.requires_grad and t.grad_fn is not None and k not in self.side_grad_refs:
                self.side_grad_refs[k] = None
                refs = self.side_grad_refs
                t.register_hook(lambda g, k=k, refs=refs: refs.__setitem__(k, storage_ref(g)))
        for t in taken:
            if t.requires_grad and t.grad_fn is None:  # (a leaf; one with a graph: watch_side_arrivals)
                self.note_side_grad(storage_key(t), i, t.nbytes)

    def note_side_grad(self, k: int, i: int, nbytes: int) -> None:
        """Layer i's backward hands side storage k a gradient of `nbytes` (side_grads)."""
        last, grad = self.side_grads.get(k, (-1, 0))
        self.side_grads[k] = (max(last, i), max(grad, nbytes))

    def charge_handed_side(self) -> None:
        """What the layers handed on that no layer took and something still holds now, as the rest's backward
        hands the layers their gradient (the caller's collected attentions), into side_bytes; the rest never
        held (side_handed)."""
        for k, (ref, size) in self.side_handed.items():
            if ref is None or not ref.expired():
                # Its storage: a gradient arrives at it inside its layer's backward, which the layer's profile
                # measures (GPT-J's attention weights, a matmul's input there); one the rest's backward makes is
                # among what the rest leaves held (rest_grads_bytes).
                self.side[k] = max(self.side.get(k, 0), size)
                if ref is not None:
                    self.side_refs[k] = ref
            elif k in self.handed_at_return:
                self.handed_freed_in_rest += self.handed_at_return[k]
        self.side_handed = {}

    def note_handed_at_return(self) -> None:
        """At the last layer's return: what of side_handed is alive now, by its storage's bytes."""
        self.handed_at_return = {k: size for k, (ref, size) in self.side_handed.items()
                                 if ref is not None and not ref.expired()}

    def note_side_freed(self, i: int | None) -> None:
        """What of side_bytes is found freed now, once layer i's backward is done (side_freed_bytes), or, with
        i None, where what runs between two layers has run (its reading has it); and which of the masks the
        layers take (`taken`) is found let go of now."""
        for entry in self.taken.values():
            if entry[3] is None and entry[0] is not None and entry[0].expired():
                entry[3] = -1 if i is None else i
        arrived = {k: ref for k, (_, ref, _) in self.side_arrived.items()}
        for kind, refs in (("s", self.side_refs), ("g", self.side_grad_refs), ("a", arrived)):
            for k, ref in refs.items():
                if ref is None or (kind, k) in self.side_gone or not ref.expired():
                    continue
                self.side_gone.add((kind, k))
                if i is None:
                    continue
                grad = self.side_grad_bytes(k)
                if kind == "a":
                    freed = self.side_arrived[k][2]
                else:
                    freed = grad if kind == "g" else self.side.get(k, 0) - grad
                self.side_freed[i] = self.side_freed.get(i, 0) + freed

    def watch_late(self, i: int, taken: list[torch.Tensor]) -> "LateWatch | None":
        """Before layer i's call in a profiling step: a LateWatch on its backward where it takes something with a
        graph beside its input and the meter's windows are its own (not on a CUDA meter without remat's
        library, which resets the allocator's statistics: there every gradient is charged at the peak)."""
        if not isinstance(self.window, PeakWindow) or not any(t.requires_grad and t.grad_fn is not None
                                                              for t in taken):
            return None
        watch = self.late_watch[i] = LateWatch(self.meter)
        return watch

    def late_done(self, i: int) -> None:
        """Layer i's input has its gradient: which of the gradients that arrived in its backward came late."""
        watch = self.late_watch.pop(i, None)
        if watch is not None:
            self.side_late.update(watch.done())

    def watch_side_arrivals(self, i: int, roots, stops, taken: list[torch.Tensor]) -> set[int]:
        """In a profiling step, after layer i's call: of what it takes beside its input (`taken`) with a graph,
        those to which its graph (from `roots`, not past the nodes `stops`) hands a gradient (side_grads), and
        hooks on the nodes that hand it, which read where that gradient first arrives (note_side_arrival)."""
        # Each by its node's id, the node held (graph_nodes: on 2.11 an id of a node nothing holds names none).
        nodes = [t.grad_fn if t.requires_grad else None for t in taken]
        targets = {(id(fn), t.output_nr): t for fn, t in zip(nodes, taken) if fn is not None}
        graded: set[int] = set()
        if not targets:
            return graded
        watch = self.late_watch.get(i)
        for node in graph_nodes(roots, stops, 20000):
            if node is None:  # (the walk cut short: each is read as taking a gradient from this layer, whole)
                for t in targets.values():
                    self.note_side_grad(storage_key(t), i, t.nbytes)
                if watch is not None:  # (and at its backward's peak)
                    self.late_watch.pop(i).close()
                return {storage_key(t) for t in targets.values()}
            if watch is not None and getattr(node, "variable", None) is None:  # (not a leaf's AccumulateGrad)
                node.register_hook(lambda grad_inputs, grad_outputs, watch=watch: watch.node_done())
            for j, (nxt, nr) in enumerate(node.next_functions):
                t = targets.get((id(nxt), nr)) if nxt is not None else None
                if t is not None:
                    # (Only a layer whose graph uses it hands it a gradient: before (found 2026-12-06), every layer
                    # that took it was read as one, Zamba2's Mamba layers among them, which take the embeddings
                    # and do not use them.)
                    self.note_side_grad(storage_key(t), i, t.nbytes)
                    graded.add(storage_key(t))
                    node.register_hook(partial(self.note_side_arrival, storage_key(t), i, j))
        return graded

    def note_side_arrival(self, k: int, i: int, j: int, grad_inputs, grad_outputs) -> None:
        """A node of layer i's graph handed side storage k's tensor its gradient (grad_inputs[j]): where it is the
        first to arrive, and part of a larger storage, that storage's bytes beyond its own are charged from layer
        i's backward on (side_grads_bytes, side_bytes) until that storage is let go of (side_freed_bytes)."""
        g = grad_inputs[j]
        if g is None or k in self.side_arrived:
            return
        extra = storage_bytes(g) - g.nbytes
        self.side_arrived[k] = (i, storage_ref(g) if extra > 0 else None, max(extra, 0))
        watch = self.late_watch.get(i)
        if watch is not None:
            watch.arrived(k)

    def side_grad_bytes(self, k: int) -> int:
        """The gradient of side storage k that side_grads_bytes charge: its bytes, at most what side_bytes hold
        for k; 0 where no layer takes it with a gradient."""
        return min(self.side_grads[k][1], self.side.get(k, 0)) if k in self.side_grads else 0

    def layer_outputs(self) -> set[int]:
        """The storage keys of the layers' outputs recorded so far (out_refs)."""
        return {o.key for o in self.out_refs.values()}

    def open_inside(self) -> "TrainingCall | None":
        """The first call that ran inside this step and is still open (no backward pass has reached it yet), or
        None."""
        return next((c for c in self.inside if c.open()), None)

    def after_inside(self, fn: Callable[[], None]) -> None:
        """Runs fn once a backward pass has reached every call that ran inside this step, at the end of that pass:
        now (it reached them in this call's own pass, or before), or at the end of the pass that reaches the last
        of them (a second call's, run after this call's own). A call whose graph is dropped without a backward
        pass holds nothing any more, and is not waited for."""
        pending = self.open_inside()
        if pending is None:
            fn()
        else:
            pending.when_ended(lambda: self.after_inside(fn))

    def peak(self) -> int:
        """The window's peak since its last reset()."""
        return self.window.peak()

    def note_peak(self):
        self.true_peak = max(self.true_peak, self.window.peak())

    def first_backward_done(self) -> None:
        """The first layer's backward is done (its input alias's backward ran): the window reads from here what
        runs after the layers' backward (StepContext.before_backward_peak_bytes), where the part before the
        layers' backward may begin before their input has its whole gradient. Gemma 4's per-layer inputs are
        made from the layers' input, so their backward, its per-layer embedding's gradient among it, runs
        first, and adds to that gradient: before (found 2026-12-06), the window was read from the input's
        gradient on, after that embedding's backward, and a 4-layer Gemma 4's every plan was 602,112 bytes
        (0.06%) above its prediction."""
        if not self.after_first_backward:
            self.after_first_backward = True
            self.reset()

    def reset(self):
        self.note_peak()
        self.window.restart()

    def watch_grads(self, layer: nn.Module) -> None:
        """Profiling, once the layer's forward ran: each of its parameters the forward used (params_used) whose
        gradient was None when the step began watched for the gradient its backward may make (grads_made)."""
        for p in layer.parameters():
            k = id(p)
            if k in self.params_used and self.grads_none and k in self.grads_none and k not in self.grads_watched:
                self.grads_watched[k] = p.register_post_accumulate_grad_hook(lambda _, k=k: self.grads_made.add(k))

    def gradless(self) -> set[int]:
        """Profiling, at the end of its backward: the ids of the parameters the layers' forward used and the step
        began without a gradient for, to which its backward gave none (watch_grads); the watches end."""
        out = {k for k in self.grads_watched if k not in self.grads_made and k in (self.grads_none or ())}
        self.unwatch_grads()
        return out

    def unwatch_grads(self) -> None:
        for h in self.grads_watched.values():
            h.remove()
        self.grads_watched = {}
        for h in self.outside_watched:
            h.remove()
        self.outside_watched = []

    def watch_outside(self, params: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
        """Profiling, as the step begins: each parameter outside the layers (params[i] for i in indices) that
        needs a gradient watched for where the backward accumulates it (outside_phase): in the rest's backward,
        before the layers' output has its gradient ("rest": a head's), during the layers' backward ("between":
        what runs between two layers) or after the first layer's ("before": an embedding's, and a weight tied to
        one, whose gradient is summed at its last use). Read whether or not it was None: a post-accumulate hook
        runs either way."""
        def made(i: int) -> None:
            if i not in self.outside_phase:
                self.outside_phase[i] = ("rest" if self.rest is None else
                                         "before" if self.after_first_backward else "between")
        for i in indices:
            p = params[i]
            if p.requires_grad:
                self.outside_watched.append(p.register_post_accumulate_grad_hook(lambda _, i=i: made(i)))

    def finish(self):
        self.note_peak()
        self.window.close()
        self.unwatch_grads()
        for *_, handle in self.graph_watch.values():  # (their flags read after: graph_state_not_run)
            handle.remove()
        for watch in self.late_watch.values():
            watch.close()
        self.late_watch = {}
        self.done = True

def unsent(st) -> None:
    """A stage whose graph was gone before the backward pass reached the layers (Step.dead: a layer whose output
    nothing the loss reads, as Llava's last vision layer under its default vision_feature_layer=-2): offered no
    way that sends anything to the host. What it saves goes with its output in the forward whatever its way, so
    a copy saves nothing, and the model, which charges the stage a backward, credited what such a way sends
    (its input, which what reads the layer before's output holds): before (found 2026-12-07), a tiny Llava's
    planned steps that streamed that layer held 0.57% above their predictions. Its kept and checkpointed ways
    stay as profiled: charged a backward that never runs, above what the step holds (safe, not exact)."""
    st.offload = None
    st.checkpoint_offload = None
    st.keep_offload = None
    for p in st.policies:
        p.offload = None
    st.groups = []


def add_to_stream(st, fwd: int = 0, bwd: int = 0) -> None:
    """Adds to a stage's streamed peaks (bytes) what FSDP2's gathering adds to its forward and backward
    transients, where the stage has them (its OffloadCost is a copy: written back)."""
    if st.offload is not None and st.offload.can_stream():
        o = st.offload
        o.stream_fwd_bytes += fwd
        o.stream_bwd_bytes += bwd
        if o.stream_bwd_grads_bytes >= 0:
            o.stream_bwd_grads_bytes += bwd
        st.offload = o

def sync(device: torch.device) -> None:
    """Waits for the device's work, so that a host clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def measure_planned_step(step: "Step", shape: "Shape", out: torch.Tensor | list[torch.Tensor],
                         measured: Callable[[], None] = None, retime: bool = True):
    """Measures a planned step from its last layer's output `out` on (or from the first of a list of the model's
    outputs the backward pass reaches): its peak (shape.last_peak, at the end of its backward pass, then
    measured() is called), and with `retime`, on the first planned steps, the rest of the step's time again."""
    step.measured = True

    def at_end():
        step.note_peak()
        shape.last_peak = step.true_peak - step.base
        step.finish()
        oom.over()  # the planned step is over: an error after it is not the plan's
        if measured is not None:
            measured()

    def hook(g):
        if not step.done and not step.at_end_queued:
            step.at_end_queued = True
            # The step ends with its backward pass, or later where a call inside it has its own after it.
            queue_at_backward_end(partial(step.after_inside, at_end))
        return g

    for t in out if isinstance(out, list) else [out]:
        t.register_hook(hook)
    if retime and shape.rest_retimed < RETIMED_STEPS and shape.context is not None:
        # The rest of the step timed again on the first planned steps (two synchronizations each): the
        # profiling step's reading includes what a step does the first time only (the allocator's first
        # requests for the rest's tensors, the libraries' first calls), and so, measured, did the first
        # planned step's on a CPU; later steps pay none of it. The least reading is the one the predicted
        # step time uses; no plan depends on it (every plan adds the same rest).
        shape.rest_retimed += 1
        device = out.device
        sync(device)
        t0 = time.perf_counter()

        def rest_timed(g):
            sync(device)
            shape.context.rest_ms = min(shape.context.rest_ms, (time.perf_counter() - t0) * 1e3)
            return g

        out.register_hook(rest_timed)

def graph_state(layers: Sequence[nn.Module], tensors: bool = False) -> list[tuple]:
    """The tensors of the step's graph that the layers' modules keep in plain attributes past their call (not
    parameters or buffers): (layer index, "module.attribute") for each, with the tensor third where `tensors`,
    such as RecurrentGemma's recurrent states, which it keeps in training with use_cache=False too."""
    found = []
    for j, layer in enumerate(layers):
        for name, module in layer.named_modules():
            for attr, value in vars(module).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) \
                        and value.grad_fn is not None:
                    where = f"{name}.{attr}" if name else attr
                    found.append((j, where, value) if tensors else (j, where))
    return found


def leaves_made(out: torch.Tensor, stops, skip: set[int], most: int = 20000) -> list[torch.Tensor]:
    """The tensors that require a gradient and have no grad_fn (leaves, not parameters) that the autograd graph of
    a layer's output `out` reaches before the nodes `stops` (its input's and what it takes beside it; `skip`: the
    ids of those tensors and of what it hands on): tensors the layer's forward made so (MRA's attention on a CPU
    returns `torch.zeros_like(query).requires_grad_()`), whose gradient autograd accumulates into their `.grad` and
    holds while the step's graph lives. Up to `most` nodes visited (graph_nodes)."""
    found: list[torch.Tensor] = []
    for node in graph_nodes([out.grad_fn], stops, most):
        v = getattr(node, "variable", None)  # AccumulateGrad's leaf (None: the walk cut short)
        if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and id(v) not in skip:
            found.append(v)
    return found


def warn_of_graph_state(lp: "LayerPlan", puts: Sequence[tuple[int, str, object]] = (),
                        leaves: Sequence[tuple[int, int]] = ()) -> None:
    """At a profiling step's last layer: watches the tensors of the step's graph that the layers keep in their
    modules' attributes, for whether the backward runs their nodes (warned of at its end where one did not:
    graph_state_not_run). Warns where a layer put a tensor into a mapping it was handed (`puts`, (layer, where,
    key)), which the layers share: held there past the layer's call, read by later layers beside their input,
    outside the chain of outputs and inputs that the plan's model follows, and holding a checkpointed layer's
    graph where it is part of it (found 2026-12-06: Gemma-3n's shared keys and values, `shared_kv_states`, its
    plans from 22% below to 20% above their predictions; bitwise all the same). And where a layer's forward made
    a leaf that requires a gradient (`leaves`, (layer, bytes): leaves_made), whose gradient is not charged."""
    def also(found, j: int) -> str:  # the other layers of `found` ((layer, ...) each) than j
        others = sorted({k[0] for k in found} - {j})
        return f"; so do layers {', '.join(map(str, others))}" if others else ""

    if puts:
        j, where, key = puts[0]
        warnings.warn(f"{lp.who}: layer {j} ({type(lp.layers[j]).__name__}) puts a tensor into the mapping it is "
                      f"handed as {where} (at {key!r}){also(puts, j)}: the layers share it, and a tensor held there "
                      "past the call, which later layers may read beside their input, is outside the chain of layers "
                      "the plan's model follows: the predicted peaks may not hold (docs/python.md, Limits)",
                      RuntimeWarning, stacklevel=4)
    if leaves:
        j, nbytes = leaves[0]
        warnings.warn(f"{lp.who}: layer {j} ({type(lp.layers[j]).__name__}) makes a tensor that requires a gradient "
                      f"and has no grad_fn ({_core.format_bytes(nbytes)}; MRA's attention on a CPU makes one)"
                      f"{also(leaves, j)}: "
                      "autograd accumulates a gradient into it, held while the step's graph lives, which the "
                      "plan's model does not charge, and the predicted peaks may not hold (docs/python.md, Limits)",
                      RuntimeWarning, stacklevel=4)
    step = lp._step
    for j, where, value in graph_state(lp.layers, tensors=True):
        nodes = []
        for node in graph_nodes([value.grad_fn], most=GRAPH_STATE_NODES):
            if node is None or len(step.graph_watch) >= GRAPH_STATE_NODES:
                break  # (the rest unwatched: taken as run)
            w = step.graph_watch.get(id(node))
            if w is None:
                ran = [False]
                w = step.graph_watch[id(node)] = (node, ran, node.register_hook(
                    lambda *_, ran=ran: ran.__setitem__(0, True)))
            nodes.append(w)
        step.graph_state.append((j, where, nodes))


GRAPH_STATE_NODES = 512  # the most nodes of the graphs that attributes keep watched in a profiling step


def _holds_saved(node) -> bool:
    """Whether autograd node `node` saved a tensor (a `_raw_saved_*` field: read without unpacking it, which would
    run a checkpoint's recompute)."""
    for name in dir(node):
        if name.startswith("_raw_saved_"):
            v = getattr(node, name, None)
            if isinstance(v, torch._C._autograd.SavedTensor) or \
                    (isinstance(v, (list, tuple)) and any(isinstance(e, torch._C._autograd.SavedTensor) for e in v)):
                return True
    return False


def graph_state_not_run(lp: "LayerPlan", step: Step) -> None:
    """The end of a profiling step's backward: warns where a layer keeps, in an attribute, a tensor of the step's
    graph whose graph has a node that the backward did not run and that saved a tensor (warn_of_graph_state
    watched them): what it saved outlives the step until the layer's next call replaces the tensor, held beside
    what the plan's model charges. Where every node that saved ran (RecurrentGemma's last recurrent state, on the
    way to its output; a view of an output, whose own node saves none), the backward let go of what they saved,
    as in the plain run: the recompute sees and leaves the attribute as the forward did
    (remat._state.AttributesSeen, RestoreAttributes), and what a checkpointed layer holds so is charged
    (StepContext.checkpoint_state_bytes, from profile's attributes_bytes). Before (found 2026-12-07), every such
    tensor was warned of, RecurrentGemma's planned
    steps from 67% below to 40% above their predictions: the recompute's tensor, and its graph with what the
    recompute saved, stayed in the attribute past the step."""
    watched, step.graph_state = step.graph_state, []
    watch, step.graph_watch = step.graph_watch, {}
    for _, _, handle in watch.values():
        handle.remove()
    found = [(j, where) for j, where, nodes in watched
             if any(not ran[0] and _holds_saved(node) for node, ran, _ in nodes)]
    if found:
        j, where = found[0]
        warnings.warn(f"{lp.who}: layer {j} ({type(lp.layers[j]).__name__}) keeps a tensor of the step's graph in "
                      f"an attribute ({where}{f', and {len(found) - 1} more' if len(found) > 1 else ''}) whose "
                      "graph the backward pass does not run all of: what that part saved outlives the step until the "
                      "layer's next call, beside what the plan charges, and the predicted peaks may not hold "
                      "(docs/python.md, Limits)", RuntimeWarning, stacklevel=3)


def without_module_hooks(fn, layer: nn.Module):
    """The call the profiler runs layer `layer` by, many times over: `fn` as remat was handed it, except where
    Hugging Face's hook handed remat the layer's whole module call (transformers 4.53 to 5.22 wrap
    GradientCheckpointingLayer.__call__: partial(nn.Module.__call__ bound to the layer, **kwargs)), whose module
    hooks would run at each of the profiler's runs. There it is the layer's forward with the same keywords, as
    5.23 and later hand remat. Measured with 5.17.0: output_hidden_states' capturing hooks recorded each profiling
    run's output, and the profiling step returned 25 hidden states, not BERT's 5 (its prediction 24-61% high); the
    profiler gathers FSDP2's parameters itself (Gathered), as for 5.23."""
    if (isinstance(fn, partial) and not fn.args and getattr(fn.func, "__self__", None) is layer
            and getattr(fn.func, "__func__", None) is nn.Module.__call__):
        return partial(layer.forward, **fn.keywords)
    return fn


def recompute_marked(fn, watch: LateWatch):
    """fn, marking `watch` recomputing as its second call (a checkpoint's recompute) begins."""
    calls = [0]

    def marked(*a):
        calls[0] += 1
        if calls[0] == 2:
            watch.recomputing = True
        return fn(*a)

    return marked


def profiling_call(lp: "LayerPlan", step: "Step", shape: "Shape", i: int, fn, args, x):
    """Layer i's call in a profiling step: run checkpointed; at the last layer, the layers profiled where they
    ran (once per shape) and the rest of the step measured, planned at the end of its backward pass
    (LayerPlan._plan_shape). i: the layer's stage in the shape's chain (Shape.stage_of)."""
    layers = stage_layers(lp, shape)
    n = len(layers)
    g = shape.layer_of(i)  # its index in lp.layers
    meter = step.meter
    if i == 0:
        step.note_peak()
        step.at_layer0 = meter.count()
        if storage_key(x) in step.given:
            step.input_in_base = True  # the model's own input, alive when its base was read
        step.before_peak = step.true_peak - step.base
    if i >= 1:
        last = step.last_out_obj() if step.last_out_obj is not None else None
        as_handed = last is not None and x is last
        del last
        if i >= 2:
            step.read_input_past_forward(i - 1, as_handed)  # now that this layer is called
        if as_handed:
            step.input_objs[i] = weakref.ref(x)
        elif storage_users(x) == 1:  # made by what ran between, its storage its own
            ref = storage_ref(x)
            if ref is not None:
                step.input_objs[i] = weakref.ref(x)
                step.made_inputs[i] = MadeInput(ref, storage_bytes(x), None)
    else:
        step.input_objs[0] = weakref.ref(x)  # read at the end of the model's forward
    if i >= 1 and x.requires_grad:
        x.register_hook(lambda g, i=i: step.read_out_grad_held(i))  # once this layer's backward is done
    elif i >= 1 and as_handed:
        # An input that takes no gradient (a frozen layer's output, as handed on): no hook marks this layer's
        # backward, and nothing it was made from runs a backward that could let go of it later, so whether
        # something holds it once this layer's backward is done is read at the backward pass's end
        # (StepContext.outputs_held_in_backward).
        ref = storage_ref(x)
        if ref is not None:
            step.inputs_without_grad[i] = ref
    # The layer and the profiler take an alias of its input (Step.inputs_held), the same tensor's data (the
    # first layer's call keeps the input itself, which the rest of the profiling step reads, until the layers
    # are profiled).
    # (The first layer's alias marks where its backward is done, where a part before the layers runs a backward
    # after the layers': Step.first_backward_done.)
    run_args = (input_alias(x, step.first_backward_done if i == 0 and x.grad_fn is not None else None), *args[1:])
    step.calls.append((fn, run_args, run_args[0]) if i >= 1 else (fn, args, x))
    aliased = storage_users(x) if i in step.made_inputs else None
    taken = taken_tensors(fn, args)
    if i == 0 and taken:  # (a layer that takes nothing beside its input: later ones are not looked at so)
        step.alive_at_chain = live_storages(x.device)
    # The count now, and what of it the layers take beside their input that was made since the last layer
    # returned (charged as side_bytes): what runs between the two is read without it (watch_between). An
    # earlier layer's output was made before then (and is charged as that layer's output).
    at_call = meter.count()
    outs = step.layer_outputs()
    side_made = sum(storage_bytes(t) for t in {storage_key(t): t for t in taken}.values()
                    if i > 0 and storage_key(t) not in step.before_chain and storage_key(t) not in step.side
                    and storage_key(t) not in step.side_handed and storage_key(t) not in outs)
    mappings = taken_mappings(fn, args)
    held = tensor_ids(mappings) if mappings else None
    watch = step.watch_late(i, taken)
    # (A compiled layer's forward is not looked into: a function mode would be traced into its graph. Its
    # parameters are charged a gradient each.)
    with ParamsUsed(step.params_used) if g not in lp.compiled_layers else contextlib.nullcontext():
        returned = run_layer(CHECKPOINT, fn if watch is None else recompute_marked(fn, watch), run_args,
                             [layers[i]], lp.policies)
    step.watch_grads(layers[i])
    if watch is not None and run_args[0].requires_grad:
        run_args[0].register_hook(lambda g, i=i: step.late_done(i))  # (its backward done)
    del watch
    alias = run_args[0]
    if alias.requires_grad or any(p.requires_grad for p in layers[i].parameters()):
        step.graph_refs[i] = weakref.ref(alias)
    del run_args
    if mappings:
        step.mapping_puts.extend((g, where, key) for where, key in tensors_put(mappings, held))
    del mappings, held
    if aliased is not None:  # its owners at the call, unless the layer's run took more
        made = step.made_inputs[i]
        step.made_inputs[i] = made._replace(owners=aliased if storage_users(x) == aliased else None)
    out, handed = layer_output(returned, lp.who, g, layers[i])
    step.last_out_obj = weakref.ref(out)
    if i == n - 1:
        step.grads_shared[i] = out.dtype == x.dtype
    graded = step.watch_side_arrivals(
        i, [out.grad_fn, *(t.grad_fn for t in tensors_in(handed))], [alias.grad_fn, *(t.grad_fn for t in taken)],
        taken)
    step.note_side(i, taken, handed, outs, graded)
    # (What it hands on is read as side tensors, their gradients charged: T5's zero position bias for its
    # cross-attention, made so under checkpointing, is one.)
    made = leaves_made(out, [alias.grad_fn] + [t.grad_fn for t in taken],
                       {id(x), id(alias), *map(id, taken), *map(id, tensors_in(handed))})
    if made:
        step.leaves_made.append((g, sum(local_bytes(t) for t in made)))
    del alias, made
    watch_between(step, i, n, x, out, at_call - side_made)
    if i < n - 1:
        return returned
    warn_of_graph_state(lp, step.mapping_puts, step.leaves_made)
    if not out.requires_grad:
        # No layer's output needs a gradient (their parameters frozen, and their input needs none): nothing of
        # theirs is in the backward pass, they save nothing for it, and there is nothing to plan. They run as
        # they are for this step key; freezing or unfreezing parameters makes another (LayerPlan._frozen).
        shape.no_backward = True
        step.calls = []
        step.finish()
        warnings.warn(f"{lp.who}: no layer's output needs a gradient (each layer's parameters require none, and "
                      "so does its input): the layers save nothing for a backward pass and run as they are, "
                      "unplanned; a plan is made once a layer has parameters that require grad", stacklevel=4)
        return returned
    shape.profiling_steps += 1
    if shape.chain is None:
        shape.layer_keys = [layer_key(f, a) for f, a, _ in step.calls]
        step.note_peak()
        stage_fns, inputs, excluded = [], [], []
        gathered = Gathered(layers, meter)
        for j, (f, a, xj) in enumerate(step.calls):
            rest = a[1:]
            f = without_module_hooks(f, layers[j])
            gj = shape.layer_of(j)
            stage_fns.append(StageFn(lambda t, f=f, rest=rest, gj=gj: layer_output(
                f(t, *rest), lp.who, gj, lp.layers[gj])[0], f"{gj}:{type(layers[j]).__name__}",
                layers[j], compiled_stage(lp, shape, j, f, rest, bool(gathered.per_layer[j]))))
            inputs.append(xj)
            excluded.extend(taken_tensors(f, a))
        bar = progress_bar(f"{lp.who}: profiling")
        times = PhaseTimes(bar)
        with gathered, contextlib.closing(bar):
            saved_calls: list = []
            saved_storages: list = []
            attributes_bytes: list = []
            # Which layers' outputs a residual sum outside them let go of (read as each layer was called; the
            # last one's is read later, once the rest's backward has run: taken as summed, one layer's figure).
            n = len(step.calls)
            summed = [step.between_frees.get(j + 1, False) for j in range(n - 1)] + [True]
            shape.chain = profile(stage_fns, inputs[0], policies=lp.policies, warmup=0,
                                  repeats=lp.repeats, inputs=inputs, excluded=excluded,
                                  offload_min_bytes=lp.offloads.min_bytes if lp.offloads.enabled else None,
                                  groups=lp.groups, progress=times, timing=lp.profile_timing,
                                  saved_calls=saved_calls, summed=summed, saved_storages=saved_storages,
                                  attributes_bytes=attributes_bytes, stand_in_params=not any(gathered.per_layer))
            shape.saved_calls = saved_calls if lp.groups else None
            shape.saved_storages = saved_storages
            shape.attributes_bytes = attributes_bytes
        shape.profiling_time = times.seconds
        shape.gathered = list(gathered.gathered)
        for st, g in zip(shape.chain.stages, gathered.gathered):
            st.fwd_tmp_bytes += g
            if st.fwd_nosave_tmp_bytes is not None:
                st.fwd_nosave_tmp_bytes += g
            if g:
                add_to_stream(st, fwd=g)
        del stage_fns, inputs, excluded
        step.profiling_peak = max(step.profiling_peak, step.window.peak())
        step.window.restart()  # profiling's own transients are not the step's
    # The layers' calls are not needed any more: holding their inputs would hold what the plain step frees.
    step.input_bytes = step.calls[0][2].nbytes
    x0 = step.calls[0][2]
    step.calls = []
    # The rest of the step: from here until the backward pass reaches this output.
    step.reset()
    step.at_return = meter.count()
    step.note_handed_at_return()
    step.watch_last_input(n - 1, x)
    device = x0.device
    sync(device)  # the rest of the step is timed from the moment the layers' work is done
    t0 = time.perf_counter()

    prefix_backward = x0.requires_grad and x0.grad_fn is not None
    # Whether anything but the layers holds their input through the layers' backward pass (the part before
    # them, what it saved, the caller): read as its storage's liveness once the first layer's backward is done
    # (every layer's checkpoint has dropped it by then), else at the step's end. (A variable of the model's
    # forward may hold it through the forward pass: the model charges it there whatever this reads.)
    input_ref = storage_ref(x0)  # None: held, as when not read

    def read_input_held():
        step.read_out_grad_held(0)  # the first layer's backward is done
        if input_ref is not None:
            step.input_held = not input_ref.expired()

    def finish_profiling():
        close_between_at_end(step)
        # From the layers' input gradient to the end: the backward pass of what ran before the layers.
        if not prefix_backward:
            read_input_held()
            # Nothing runs after the first layer's backward (the layers' input takes no gradient: frozen
            # embeddings, LoRA): what is let go of by now was let go of once it was done. Before (2026-12-06),
            # not read: such a step's masks first taken by the first layer were charged to the step's end.
            step.note_side_freed(0)
        # Which layers' outputs something holds to the step's end (StepReadings.outputs_held_to_end), the last
        # layer's (the layers' output: BERT's last_hidden_state, which the caller keeps) too, and one the later
        # layers take beside their input (BART's encoder output, which the caller's output holds too: side_bytes
        # charge only its gradient).
        for j, ref in step.inputs_without_grad.items():
            step.outputs_held.setdefault(j, not ref.expired())
        outs = [step.out_refs.get(j) for j in range(n - 1)]
        step.held_to_end = [o is not None and o.ref is not None and not o.ref.expired()
                            for o in outs] + [out_ref is not None and not out_ref.expired()]
        after = step.peak() if prefix_backward else -1
        if step.open_inside() is not None:
            # A call that ran inside this step has its backward pass still to come: its peak, after the layers'
            # backward pass, is this step's too (charged as the peak after the layers' backward).
            step.reset()
            step.after_inside(lambda: plan(max(after, step.peak())))
        else:
            plan(after)

    def plan(peak_after_backward: int):
        step.peak_after_backward = peak_after_backward
        step.note_peak()
        try:
            lp._plan_shape(step, shape)
        finally:
            step.finish()

    def at_x0(g):
        read_input_held()
        step.note_side_freed(0)
        if not step.after_first_backward:
            step.reset()
        queue_at_backward_end(finish_profiling)
        return g

    def at_out(g):
        step.dead = [j for j, ref in step.graph_refs.items() if ref() is None]
        step.last_input_alive(n - 1)
        step.charge_handed_side()
        step.out_grad_ref = storage_ref(g)
        step.note_peak()
        sync(device)
        # The rest's peak, its time, and what it leaves held through the layers' backward besides the
        # gradient it hands them (its parameters' gradients, a tied embedding's partial gradient, the outputs
        # the caller holds): the readings step_context() turns into the StepContext.
        step.rest = (step.peak(), (time.perf_counter() - t0) * 1e3)
        step.at_output_grad, step.output_grad_bytes = meter.count(), g.nbytes
        step.output_grad_storage_bytes = storage_bytes(g)  # less where expanded (a sum's backward's)
        # The layers' output, where the rest's backward let go of it (it saved it) and nothing else held it
        # (StepReadings.output_freed_bytes): the count is that much lower than what the rest leaves held.
        step.output_freed = out_bytes if out_ref is not None and out_ref.expired() else 0
        # The layers' input, where it is gone by now (the model's forward held it in a variable until it
        # returned, and nothing else did): the count has let go of it already (StepReadings.input_freed_in_rest).
        step.input_freed_in_rest = input_ref is not None and input_ref.expired()
        # The layers' parameter gradients that the rest's backward made: that of a call run inside this step
        # (a paired loss) which a backward pass reached before this one's layers (its own pass, or this one:
        # its nodes are later than this call's, so the engine runs its layers' backward first). They are in
        # the rest's count already (in .grad, or in the engine's buffer that this call's gradient is added to),
        # and the layers' backward adds into them as into gradients the step began with: not charged again.
        if step.grads_none and any(c.reached for c in step.inside):
            made = {id(p) for layer in layers for p in layer.parameters()}
            step.grads_none = {i for i in step.grads_none if i not in made}
            step.grads_in_rest = True
        step.reset()
        if not prefix_backward:
            queue_at_backward_end(finish_profiling)
        return g

    out_ref, out_bytes = storage_ref(out), storage_bytes(out)
    step.chain_out_ref = out_ref  # read at the model's forward's end (LayerPlan._forward_ends)
    step.last_nodes = (x.grad_fn, out.grad_fn) if x.grad_fn is not None and out.grad_fn is not None else None
    if out.requires_grad:
        out.register_hook(at_out)
        if prefix_backward:
            x0.register_hook(at_x0)
    del x0, out
    return returned


class _Alias(torch.autograd.Function):
    """Its input's data as another tensor object (a detached alias of its storage, its version counter shared),
    the gradient passed straight through; `at_backward`, where given, called as it is (the layer that took the
    alias has handed its input its gradient)."""

    @staticmethod
    def forward(ctx, x, at_backward):
        ctx.at_backward = at_backward
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        if ctx.at_backward is not None:
            ctx.at_backward()
        return g, None


def input_alias(x: torch.Tensor, at_backward: Callable[[], None] | None = None) -> torch.Tensor:
    """What a profiling step's checkpoint of a layer and the profiler take instead of the layer's input `x`: the
    same data and gradient, another object, so that whether anything else holds x's object is read from it
    (Step.inputs_held); `at_backward` called where the alias's backward runs, as the layer's own is done."""
    return _Alias.apply(x, at_backward) if x.requires_grad else x.detach()


class LayerOut(NamedTuple):
    """A profiled layer's output as watch_between reads it: its storage's key, a weak reference to it and its
    bytes, the count when the layer returned, and its autograd node's sequence number."""
    key: int
    ref: StorageWeakRef | None
    nbytes: int
    returned_at: int
    nr: int | None


class MadeInput(NamedTuple):
    """A profiled layer's input made by what ran between it and the layer before (Step.made_inputs): a weak
    reference to its storage, its bytes, and the storage's owners with the profiling step's aliases (None: more
    than those)."""
    ref: StorageWeakRef
    nbytes: int
    owners: int | None


class OpenBetween(NamedTuple):
    """The backward pass between layer i - 1 and layer i, while it runs: the count when it began, layer i's input
    gradient (its storage's key, weak reference and bytes), whether layer i - 1's output was alive then, and layer
    i's input where what ran between made it (its weak reference and bytes; None and 0 otherwise)."""
    i: int
    at: int
    g_key: int
    g_ref: StorageWeakRef | None
    g_bytes: int
    out_alive: bool
    x_ref: StorageWeakRef | None
    x_bytes: int


def sequence_nr(t: torch.Tensor) -> int | None:
    """The sequence number of the autograd node that made `t` (later nodes have higher ones), or None."""
    try:
        return None if t.grad_fn is None else int(t.grad_fn._sequence_nr())
    except (AttributeError, RuntimeError):
        return None


def graph_nodes(roots, stops=(), most: int = 100000):
    """Each node of the autograd graph from the nodes `roots` once (depth first), not passing through the nodes
    `stops` (None among them ignored); past `most` nodes, None, and no more (the walk cut short). Nodes are told
    apart by their Python objects' ids, each held while it walks (the stops and those visited): PyTorch 2.11
    keeps a node's Python object only while something refers to it, and makes another at the next read (2.15
    keeps it while its graph lives), so that an id read of an object nothing holds names no node. Before (found
    2026-12-07 on 2.11, the GPU machines' PyTorch), the stops were passed as such ids: the walk went on through
    every earlier layer's graph, and what a layer takes beside its input with a graph (T5's position bias, an
    encoder's output) was read as given no gradient: T5's, BART's and Whisper's planned steps were up to 1.1%
    above their predictions there, a test's model 10%."""
    stop_nodes = [n for n in stops if n is not None]
    stop_ids = {id(n) for n in stop_nodes}
    seen: dict[int, object] = {}
    todo = [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if id(node) in stop_ids or id(node) in seen:
            continue
        seen[id(node)] = node
        if len(seen) > most:
            yield None
            return
        yield node
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


def graph_reaches(roots, target, stop, most: int = 100000) -> bool:
    """Whether the autograd graph from the nodes `roots` reaches the node `target` without passing through the
    node `stop`; True where it would visit more than `most` nodes (not known: the safe reading)."""
    return any(node is None or node is target for node in graph_nodes(roots, [stop], most))


def watch_between(step: "Step", i: int, n: int, x: torch.Tensor, out: torch.Tensor, at_call: int) -> None:
    """In a profiling step, after stage i's call of n (`at_call`: the count when it was called, less what the layers
    take beside their input that was made since the last one returned): where its input is not the last layer's
    output, something of the model's code ran between them (a decoder's embeddings between an encoder's layers
    and the decoder's), and is read (StepReadings.between_forward_held_bytes, between_backward_peak_bytes,
    between_held_bytes): what its forward left held (the count's rise from the last layer's return to this call),
    then in the backward pass, from this input's gradient to that output's, the peak above the count when it
    began (and above the bytes of the last layer's output, which the model holds for that gradient), and what it
    left held beyond what the model of the step holds. The model holds one gradient at the
    boundary from layer i's backward on (the input's, then the output's, made there), the last layer's output to
    that layer's backward, and this layer's input from its forward (what the forward between left held) to the
    end: the count's change is read without those (what is left: the gradients it makes for parameters outside
    the layers, less what it frees that its forward saved and the gradient of what the layers take beside their
    input; a tied embedding's pending gradient is freed and their sum made, which changes nothing)."""
    meter = step.meter
    if i >= 1 and x.requires_grad and x.grad_fn is not None:
        # What of side_bytes is let go of once this layer's backward is done: read as its input's gradient is
        # whole (StepReadings.side_freed_bytes).
        x.register_hook(lambda g, i=i: step.note_side_freed(i))
    prev = step.out_refs.get(i - 1) or step.out_refs_nograd.get(i - 1)
    if i >= 1 and x.requires_grad and prev is not None:
        # Whether anything holds the last layer's output once this layer's backward is done (every layer's
        # checkpoint has let go of its input then): StepReadings.outputs_held_in_backward.

        def read_held(g, i=i, out_ref=prev.ref):
            step.outputs_held[i] = out_ref is None or not out_ref.expired()
            return g

        x.register_hook(read_held)
        if not (storage_key(x) == prev.key and prev.ref is not None and not prev.ref.expired()):
            step.between_forward[i] = at_call - prev.returned_at  # negative where it freed more
            step.between_frees[i] = prev.ref is not None and prev.ref.expired()
            # This layer's input, made by what ran between (not before the last layer's output): held in the
            # model from here to the end, freed by this layer's backward.
            x_nr = sequence_nr(x)
            made = x_nr is not None and prev.nr is not None and x_nr > prev.nr
            x_ref, x_bytes = (storage_ref(x), storage_bytes(x)) if made else (None, 0)

            def began(g, i=i, out_ref=prev.ref, x_ref=x_ref, x_bytes=x_bytes):
                step.reset()
                out_alive = out_ref is not None and not out_ref.expired()
                step.between_open = OpenBetween(i, meter.count(), storage_key(g), storage_ref(g), storage_bytes(g),
                                                out_alive, x_ref, x_bytes)
                return g

            x.register_hook(began)
        elif at_call > prev.returned_at:
            # The last layer's output handed on as it was, and something made between and held (a tensor the
            # model's code keeps aside from a layer's input for later): held from this layer's forward on, as
            # what runs between leaves held (its backward, if any, runs in the rest's: nothing read there).
            step.between_forward[i] = at_call - prev.returned_at
            step.between[i] = (0, 0)
    if i < n - 1 and not out.requires_grad:
        # No gradient comes to this output: what runs between it and the next layer, where that takes a gradient
        # (a frozen vision tower's last layer, then the projector and the embeddings, trained), has its backward
        # window read at the end of the backward pass (close_between_at_end). Before (found 2026-12-07), it was
        # never read: a tiny Llava with its vision tower frozen held up to 10.8% above its predictions.
        step.out_refs_nograd[i] = LayerOut(storage_key(out), storage_ref(out), storage_bytes(out), meter.count(),
                                           None)
    if i < n - 1 and out.requires_grad:
        step.out_refs[i] = LayerOut(storage_key(out), storage_ref(out), storage_bytes(out), meter.count(),
                                    sequence_nr(out))

        def ended(g, i=i):
            # Read at the gradient of the output of the layer before the window (o.i - 1), or, where that output
            # gets none (a layer whose output nothing the loss reads: Llava's last vision layer under its default
            # vision_feature_layer=-2, the projector taking the layer before's), at the next earlier layer's
            # output gradient, which ends what ran between there. Before (found 2026-12-07) that window was never
            # read: its figures were 0, and a tiny Llava's planned steps held 3.6-3.8% above their predictions.
            o = step.between_open
            if o is not None and o.i >= i + 1:
                close_between(step, step.out_refs[o.i - 1], g)
            return g

        out.register_hook(ended)


def close_between_at_end(step: "Step") -> None:
    """The end of a profiling step's backward pass: a window of what runs between two layers still open, where the
    layer before it has an output that takes no gradient (Step.out_refs_nograd: no gradient comes to end it), is
    read now. Nothing runs after it there: a layer before whose output takes none has no backward, nor have those
    before it (their input takes none either)."""
    o = step.between_open
    if o is not None and o.i - 1 in step.out_refs_nograd:
        close_between(step, step.out_refs_nograd[o.i - 1], None)


def close_between(step: "Step", last: LayerOut, g: torch.Tensor | None) -> None:
    """Reads the backward window of what ran between layers o.i - 1 and o.i (Step.between_open) as it ends: at the
    gradient `g` of layer o.i - 1's output `last` (or of an earlier layer's), or, where no gradient comes to it
    (None), at the end of the backward pass."""
    o = step.between_open
    j = o.i - 1
    meter = step.meter
    step.note_side_freed(None)  # what it freed of side_bytes is in its reading
    held = meter.count() - o.at
    # The boundary's gradient: the input's, if it was freed here, is the model's until now, at the bytes of the
    # last layer's output (the chain's a_i; one made larger by what ran between, as a residual sum's fp32
    # gradient of a bf16 output that nothing before the layers takes, held the rest as what ran between: counted
    # back whole, the first layer's backward was charged that rest again, 2.5% high)...
    dx_freed = o.g_ref is not None and o.g_ref.expired()
    if dx_freed:
        held += min(o.g_bytes, last.nbytes)
    # ...and the output's, made here, is the model's from now on (none where no gradient comes to it).
    if g is not None and (dx_freed or storage_key(g) != o.g_key):
        held -= storage_bytes(g)
    # The last layer's output, freed here (by what saved it), the model frees at that layer's backward.
    if o.out_alive and last.ref is not None and last.ref.expired():
        held += last.nbytes
    # This layer's input, which its backward freed, the model holds until here; where what ran between let go of
    # the last layer's output (a residual sum outside the layers), the model holds that much of it as the last
    # layer's output (the chain's a_i), which it lets go of itself.
    if o.x_ref is not None and o.x_ref.expired():
        held -= o.x_bytes - (last.nbytes if step.between_frees.get(o.i, False) else 0)
    # The peak above the model's count, which holds the input's gradient at the bytes of the last layer's output
    # (the chain's a_i): one made larger by what ran between (a residual sum in fp32 on a bf16 output) held the
    # rest of it too.
    step.between[o.i] = (step.peak() - o.at + max(0, o.g_bytes - last.nbytes), held)
    if g is not None:
        step.grads_shared[j] = storage_key(g) == o.g_key
    step.between_open = None
    step.reset()


def compiled_stage(lp: "LayerPlan", shape: "Shape", j: int, fn, rest: tuple, sharded: bool):
    """Layer j's StageFn.compiled in the profiling step: the layer run through its compiled call (compiled_entry)
    under each choice the profiler asks for (forced_choice, the entries a plan with that choice publishes, so
    that the graph compiled here is the one its planned steps run), or None for a layer that runs eagerly. A
    compiled layer sharded by FSDP2 is profiled eagerly (its module call would reshard the parameters profiling
    holds gathered), and so is one compiled only inside a module around it (torch.compile of the whole model,
    which remat does not support) or whose call cannot be made again; each is warned of, since its prediction
    then overstates what the compiled layer holds (docs/python.md states them)."""
    g = shape.layer_of(j)  # (j: its stage in the shape's chain)
    if g not in lp.compiled_layers:
        return None
    found = None if sharded else compiled_entry(lp.model, lp.layers[g], fn)
    if found is None:
        if sharded:
            why = "it is sharded by FSDP2 (its module call would reshard the parameters profiling holds gathered)"
        elif compiled_call_of(lp.model, lp.layers[g]) is None:
            why = ("it is not compiled on its own but inside a compiled module around it (torch.compile of the "
                   "whole model, which remat does not support: compile the layers one by one, layer.compile() or "
                   "torch.compile(layer))")
        else:
            why = ("remat cannot make its call again (its forward reached remat through another call than "
                   "remat's or Hugging Face's)")
        warnings.warn(f"{lp.who}: layer {g} ({type(lp.layers[g]).__name__}) runs compiled but is profiled eagerly: "
                      f"{why}; its predicted memory and times are its eager run's, which may overstate the "
                      "compiled graph's", RuntimeWarning, stacklevel=2)
        return None
    entry, keywords = found
    layer, key, lkey = lp.layers[g], shape.key, shape.layer_keys[j]

    def run(how: str, t: torch.Tensor) -> torch.Tensor:
        with forced_choice(layer, key, lkey, how, lp.policies):
            return layer_output(entry(t, *rest, **keywords), lp.who, g, layer)[0]

    return run


def set_taken(ctx, step: "Step", shape: "Shape", n: int) -> None:
    """The masks the layers take into `ctx` (StepContext.taken_bytes, taken_by, taken_saved_by): each storage
    made before the layers that they take (but the chain's input), found let go of once the first layer
    that takes it had run its backward (every layer checkpointed in the profiling step, each one that takes it
    held it until then): nothing but the layers held it past the model's forward. Per layer, whether its plain
    forward's graph saves it (shape.saved_storages: where not read, a compiled layer's, taken as saved). Those
    taken and saved by the same layers are one entry (their bytes summed: held and let go of together, one
    state fewer for the per-layer program to carry); at most MAX_TAKEN_TENSORS entries, the largest first,
    together at most what the part before the layers holds (before_saved_bytes, where they are counted)."""
    saved = getattr(shape, "saved_storages", None)  # (a pickle from before it has none)
    saved = saved if saved is not None and len(saved) == n else None
    merged: dict[tuple, int] = {}
    for k, (_, nbytes, takers, freed_at) in step.taken.items():
        if not takers or freed_at is None or freed_at != min(takers):
            continue
        flags = (tuple(j in takers for j in range(n)),
                 tuple(j in takers and (saved is None or saved[j] is None or k in saved[j]) for j in range(n)))
        merged[flags] = merged.get(flags, 0) + nbytes
    taken = []
    for flags, nbytes in sorted(merged.items(), key=lambda e: -e[1])[:_core.MAX_TAKEN_TENSORS]:
        if sum(b for _, b in taken) + nbytes <= ctx.before_saved_bytes:
            taken.append((flags, nbytes))
    ctx.taken_bytes = [nbytes for _, nbytes in taken]
    ctx.taken_by = [list(by) for (by, _), _ in taken]
    ctx.taken_saved_by = [list(saved_by) for (_, saved_by), _ in taken]


def step_context(lp: "LayerPlan", step: "Step", shape: "Shape"):
    """The profiling step's readings, turned into a StepContext by the planner library's code (the code
    remat::Planned uses: remat/planner/step.h's step_context), with FSDP2's backward transients charged to the
    sharded layers' backward."""
    r = _core.StepReadings()
    r.base = step.base
    r.input_in_base = step.input_in_base
    r.at_chain = step.at_layer0
    r.peak_before_chain = step.base + step.before_peak
    r.input_bytes = step.input_bytes
    r.at_return = step.at_return - step.handed_freed_in_rest
    r.rest_peak, r.rest_ms = step.rest if step.rest is not None else (step.at_return, 0.0)
    r.at_output_grad = step.at_output_grad if step.rest is not None else step.at_return
    r.output_grad_bytes = step.output_grad_bytes
    r.output_grad_storage_bytes = step.output_grad_storage_bytes
    r.output_freed_bytes = step.output_freed
    if step.device is not None:
        # With what a checkpointed layer holds from its forward to its recompute beside the values of the
        # attributes its forward reassigns, for the recompute to see (remat._state.AttributesSeen): the most a
        # layer's run left in them (profile's attributes_bytes), charged to every layer checkpointed, a bound
        # exact for the one that keeps the most. 0 for layers that keep none; RecurrentGemma's recurrent layers
        # keep their last recurrent state (batch x lru_width floats, 1 KiB at the sweep's size; before, found
        # 2026-12-07, a checkpointed one held it unpredicted).
        r.checkpoint_state_bytes = checkpoint_state_bytes(step.meter, step.device) + \
            max(shape.attributes_bytes, default=0)
    r.peak_after_chain_backward = step.peak_after_backward
    r.step_peak = step.true_peak
    layers = stage_layers(lp, shape)
    n = len(layers)
    r.stage_grads_bytes = layer_grads_bytes(layers, step.grads_none or (), step.grad_sizes)
    side_grads = [0] * n
    for k, (last, _) in step.side_grads.items():
        side_grads[last] += step.side_grad_bytes(k)
    # The gradients that arrive as part of a larger storage, that storage's rest too (Step.side_arrived); and of
    # them, what arrived after its layer's backward's peak (Step.side_late): a storage's gradient and that rest,
    # where it first arrived at the last layer whose graph uses it.
    arrived = 0
    late = [0] * n
    for k, (i, ref, extra) in step.side_arrived.items():
        if k not in step.side_grads:
            continue
        extra = extra if ref is not None else 0
        side_grads[i] += extra
        arrived += extra
        if step.side_late.get(k) and step.side_grads[k][0] == i:
            late[i] += step.side_grad_bytes(k) + extra
    r.side_bytes = sum(step.side.values()) + arrived
    r.side_grads_late_bytes = late
    r.side_grads_bytes = side_grads
    r.side_freed_bytes = [step.side_freed.get(j, 0) for j in range(n)] if step.side_freed else []
    r.input_held_in_backward = step.input_held
    r.input_freed_in_rest = step.input_freed_in_rest
    r.outputs_held_in_backward = [step.input_held] + [step.outputs_held.get(j, True) for j in range(1, n)]
    r.inputs_held_in_forward = [step.inputs_held.get(j, True) for j in range(n)]
    r.output_grad_held_in_backward = [step.out_grad_held.get(j, False) for j in range(n)]
    r.between_forward_held_bytes = [step.between_forward.get(j, 0) if j in step.between else 0 for j in range(n)]
    r.between_backward_peak_bytes = [step.between.get(j, (0, 0))[0] for j in range(n)]
    r.between_held_bytes = [step.between.get(j, (0, 0))[1] for j in range(n)]
    r.between_frees_output = [j in step.between and step.between_frees.get(j, False) for j in range(n)]
    r.rest_frees_output = step.rest_frees
    r.rest_takes_last_input = step.rest_takes_input
    r.last_input_let_go_in_rest = step.last_in_rest
    r.residual_grad_shared = [step.grads_shared.get(j, True) for j in range(n)]
    if len(step.held_to_end) == n:
        r.outputs_held_to_end = step.held_to_end
    ctx = _core.step_context(r)
    set_taken(ctx, step, shape, n)
    for j in step.dead:
        unsent(shape.chain.stages[j])
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
                    add_to_stream(st, bwd=excess)
    return ctx
