"""Measuring a model's stages as a Chain: the figures the C++ profiler (remat::profile_chain) gives.

For stage i, on its input: output_bytes is its output's size; saved_bytes is what running it with grad leaves alive:
its output plus the storages its autograd graph saved, counted exactly with saved-tensor hooks, each storage once,
its input, its parameters and buffers and the tensors it was given not counted (they are alive anyway);
fwd_tmp_bytes is the meter's peak above that during the forward; fwd_nosave_tmp_bytes is the meter's peak above its
output during its forward without saving, the larger of that under no-grad and under torch.utils.checkpoint (as a
checkpointed layer runs; what the checkpoint holds after it, its generators' state, not counted); bwd_tmp_bytes is
the meter's peak during its backward above its input, what it saved, its output and the output's gradient (the
parameter gradients pre-allocated, as after a first step), less its input's gradient up to the bytes the chain
counts for that input (the chain's input, or stage i - 1's output: `inputs` larger than that output keep the rest of
their gradient in the peak; an input that takes no gradient, those bytes, which the step's model charges all the
same). Where its graph saves its output, bwd_output_freed_bytes is how much lower that peak is with the graph alone
holding the output (its backward run again so). With policies, each stage also runs under
torch.utils.checkpoint with that selective policy, and what that leaves alive (the meter's count) is its
PolicyCost's saved_bytes. Times are medians of `repeats` runs after `warmup`, each run taking the stages in the
order of a training step: a forward pass without saving (fwd_nosave_ms), then from the last stage to the first its
forward with saving and its backward (fwd_ms, bwd_ms), then every stage under torch.utils.checkpoint and the
backward through them (checkpoint_fwd_ms, checkpoint_bwd_ms), then the same under each policy. Profiling holds what
checkpointing every stage holds plus one stage's saved tensors, never a plain step's activations, and leaves the
model as it was: gradients, buffers and the random generators are put back.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from . import _core
from ._state import AttributesSeen, RestoreAttributes, RestoreModules, RngState, each_once, kept_walk
from .meter import PeakWindow, meter_for
from .offload import HostPool, Offload, measure_bandwidth, offloadable
from .progress import Reporter, progress_bar
from .policies import CHECKPOINT, KEEP, POLICY_OFFLOAD, autocast_cache_off, checkpoint_region, is_groups, policy_fn
from .selective import IGNORED, TO_HOST, CallNames, GroupPolicy, _info, call_name, outcome
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StageFn", "stages_of", "stages", "profile", "Restore"]


@dataclass
class StageFn:
    """One stage: fn(x) returns its output tensor. module, when given, is the module whose parameters and
    buffers the stage uses: profiling puts their gradients and buffers back, and recomputes restore the
    buffers."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    name: str = ""
    module: nn.Module | None = None
    # A stage that runs compiled: compiled(how, x) runs it as its compiled graph does under choice `how` (KEEP,
    # CHECKPOINT or a policy's name) and returns its output tensor. Its kept, checkpointed and policy passes run
    # through it, so that its figures are the compiled graph's; what runs outside the graph (offloaded choices,
    # saved groups) is not profiled for it, and the planner offers it none.
    compiled: Callable[[str, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, x):
        return self.fn(x)


def _attributes_kept(stage: StageFn, attributes_bytes: list[int], i: int, walks: dict,
                     buffers_bytes: list[int]) -> StageFn:
    """`stage` (stage i) with each run of its function leaving its module's tensor attributes as it found them
    (RestoreAttributes, over the stage's Walk kept in walks[i]: kept_walk), and the most bytes of tensors a run
    left in those it reassigned, other than on its output's storage, noted in attributes_bytes[i], and of the
    buffers it wrote in place in buffers_bytes[i] (their sum is profile's `attributes_bytes`: a checkpointed run
    holds those values and a copy of those buffers from its forward to its recompute; a run under a policy, its
    count after its forward holds the copies already); a stage without a module as it is. The profile
    runs a stage many times, each on a leaf of its own: a layer that keeps a tensor of its forward on itself
    (RecurrentGemma's last recurrent state) kept the last run's, whose graph holds that run's leaf (its
    AccumulateGrad node) until the next run assigns another, so that the next run's count let go of a tensor
    alive at its base and read the stage's saved bytes one input low (found 2026-12-07: RecurrentGemma's
    recurrent layers' `matmuls` policy 65,536 bytes low, a hidden state, and its plans that keep so one hidden
    state above their predictions)."""
    if stage.module is None:
        return stage
    module, fn = stage.module, stage.fn

    def kept(*args):
        w = kept_walk(walks, i, module)
        restore, seen = RestoreAttributes(w), AttributesSeen(w)
        with restore:
            # The buffers it writes in place, as a checkpointed run finds them (their copies, which it holds from
            # its forward to its recompute: AttributesSeen's `found`, over this Walk's runs as over a layer's).
            with seen:
                out = fn(*args)
            but = _storage_key(out) if isinstance(out, torch.Tensor) else None
            attributes_bytes[i] = max(attributes_bytes[i], restore.reassigned_bytes(but))
            buffers_bytes[i] = max(buffers_bytes[i], sum(c.nbytes for _, c in seen.found or ()))
        return out

    return replace(stage, fn=kept)


def input_needs_grad(before: bool, stage: StageFn) -> bool:
    """Whether the output of `stage`, the next stage's input, needs a gradient: where its own input does
    (`before`), where its module has a parameter that requires grad, or where it has no module (what it reads is
    not known). Otherwise the stage is frozen on an input that needs none: run with grad, it makes no graph and
    saves nothing, and the stages after it take an input that needs no gradient. The plan executor builds each
    stage's graph by this rule and the profiler measures by it."""
    return before or stage.module is None or any(p.requires_grad for p in stage.module.parameters())


def stages_of(seq: nn.Sequential) -> list[StageFn]:
    """The children of an nn.Sequential as stages, named "i:Type"."""
    if not isinstance(seq, nn.Sequential):
        raise TypeError(f"remat.stages_of: expected an nn.Sequential, got {type(seq).__name__}")
    return [StageFn(m, f"{i}:{type(m).__name__}", m) for i, m in enumerate(seq)]


def stages(modules: Iterable[nn.Module], call: Callable | None = None, names: Sequence[str] | None = None
           ) -> list[StageFn]:
    """Stages from modules (an nn.ModuleList, a list): stage i runs call(module_i, x), or module_i(x) when call
    is None; e.g. call=lambda layer, x: layer(x, mask) for layers that take an attention mask."""
    mods = list(modules)
    if names is not None and len(names) != len(mods):
        raise ValueError(f"remat.stages: {len(names)} names for {len(mods)} modules")
    out = []
    for i, m in enumerate(mods):
        fn = m if call is None else (lambda x, m=m: call(m, x))
        out.append(StageFn(fn, names[i] if names else f"{i}:{type(m).__name__}", m))
    return out


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector off while profiling runs, as timeit does, and back as it was after (also when a
    stage raises): a collection that ran inside a timed run was charged to that stage (with Transformers
    imported, a full collection took about 190 ms on the CI machine, and one that fell in a Llama layer's 3 ms
    forward made keeping that layer look slower than checkpointing it at any budget). Refcounting still frees
    what profiling lets go of; what only the collector frees waits until profiling ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Restore:
    """Puts back, on exit, the gradients of the modules' parameters, their buffers and tensor attributes
    (RestoreModules), and the CPU and CUDA random generators. fresh_grads=True: for a step that accumulates into
    the gradients (a whole training step), each existing gradient is replaced by zeros for the step (a tensor as
    large, alive beside it) and the original put back untouched; a parameter without one still has none."""

    def __init__(self, modules: Sequence[nn.Module], device: torch.device, fresh_grads: bool = False):
        self.params = each_once(p for m in modules for p in m.parameters())
        self.modules_state = RestoreModules(modules)
        self.device = device
        self.fresh_grads = fresh_grads

    def __enter__(self):
        self.grads = [p.grad for p in self.params]
        if self.fresh_grads:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad = torch.zeros_like(p.grad)
        self.modules_state.__enter__()
        self.rng = RngState()
        return self

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.grads = None
        self.modules_state.__exit__(*exc)
        self.rng.restore()
        return False


class _SeedGradient(torch.autograd.Function):
    """A scalar root whose backward hands `out` a gradient of ones made there: held by autograd alone, freed
    once its user has run, as the gradient a training step hands a layer is (a tensor of ones handed to
    backward() would be held by the caller through the whole backward)."""

    @staticmethod
    def forward(ctx, out, keep=None):
        ctx.like = (out.shape, out.dtype, out.device)
        ctx.keep = keep
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.like
        made = torch.ones(shape, dtype=dtype, device=device)
        if ctx.keep is not None:  # held through the backward, as a residual path outside the stage holds it
            ctx.keep.append(made)
        return made, None


class _GradsPeak:
    """While a stage's backward runs with its parameters' gradients pre-allocated (_ZeroGrads): the peak it would
    have reached had it made those gradients (none before it, as after zero_grad(set_to_none=True)), above
    `before` (bytes). Each parameter's gradient, once accumulated into the one pre-allocated, is freed where,
    made, it would stay alive (taken as the parameter's .grad): a post-accumulate hook marks that moment. So the
    count that backward would read is this one plus the gradients accumulated so far, and its peak the most, over
    the stretches between hooks, of each stretch's peak plus what had been accumulated before it. (Before
    (found 2026-12-07), a gradient was counted as made from the hook before its accumulation, while it was still
    alive in this count: a Linear stack of width 256 on 16 rows had each layer's backward charged 240 KiB
    high, a weight's gradient held twice.)"""

    def __init__(self, meter, params, before: int):
        self.meter, self.params, self.before = meter, params, before
        self.made = 0  # the bytes of the gradients handed over so far
        self.most = 0
        self.window = None
        self.handles = []

    def _hook(self, nbytes):
        self._close_stretch()
        self.made += nbytes

    def _close_stretch(self):
        self.most = max(self.most, self.window.peak() - self.before + self.made)
        self.window.restart()

    def __enter__(self):
        self.window = self.meter.window().__enter__()
        self.handles = [p.register_post_accumulate_grad_hook(lambda _, n=p.nbytes: self._hook(n))
                        for p in self.params]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        self._close_stretch()
        self.window.__exit__(*exc)
        return False

    def peak(self) -> int:
        return self.most


class _StandInParams:
    """While the profile runs, each parameter that requires grad of the given modules replaced in its module by a
    stand-in: a new leaf Parameter on its data (one for parameters tied across modules), into which the profile's
    backward passes make their gradients. `params` (per stage, its parameters that require grad) is set to the
    stand-ins; the parameters are put back on exit. A hook on a parameter's gradient accumulation (DDP's, the
    user's) does not see the profile's passes: under DDP with find_unused_parameters=True a parameter given a
    gradient while the model's forward runs is taken as used in that step, and one that the step's backward then
    gives none (a layer whose output nothing reads) had its gradient, None, allreduced: a RuntimeError
    ("Encountered gradient which is undefined") in remat.enable's profiling step before (found 2026-12-07)."""

    def __init__(self, stages, swap: list[bool], params: list[list[torch.Tensor]]):
        self.stages, self.swap, self.params = stages, swap, params

    def __enter__(self):
        made: dict[int, nn.Parameter] = {}
        self.swapped = []
        for i, s in enumerate(self.stages):
            if not self.swap[i] or s.module is None:
                continue
            for mod in s.module.modules():
                for name, p in list(mod._parameters.items()):
                    if p is None or not p.requires_grad:
                        continue
                    stand_in = made.get(id(p))
                    if stand_in is None:
                        stand_in = made[id(p)] = nn.Parameter(p.detach(), requires_grad=True)
                    mod._parameters[name] = stand_in
                    self.swapped.append((mod, name, p))
            self.params[i] = [made.get(id(p), p) for p in self.params[i]]
        return self

    def __exit__(self, *exc):
        for mod, name, p in reversed(self.swapped):
            mod._parameters[name] = p
        self.swapped = []
        return False


class _ZeroGrads:
    """Zeroed gradients for one stage's parameters while its backward runs (as after a first training step, so
    that the backward's peak does not include allocating them), and theirs put back after: one stage's
    gradients at a time, never the whole model's."""

    def __init__(self, params):
        self.params = params

    def __enter__(self):
        self.saved = [p.grad for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.grad = torch.zeros_like(p)
        return self

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.saved):
            p.grad = g
        self.saved = None
        return False


class _CallTimes(TorchDispatchMode):
    """Each operator call of a forward pass, as remat's selective checkpointing names it ("aten::addmm#2"):
    its outputs' storages (pointer -> bytes) unless it aliases an input, and its time alone (ms, the clock's
    timed_call())."""

    def __init__(self, clock: "_Clock"):
        super().__init__()
        self.clock = clock
        self.names = CallNames()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func in IGNORED:
            return func(*args, **kwargs)
        with self.clock.timed_call() as t:
            out = func(*args, **kwargs)
        ms = t.ms
        call = self.names.next(func)
        storages, outs = {}, []
        if _groupable(func, call_name(func), args, kwargs):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
                    st = t.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
                    outs.append((t, t._version))
        self.calls.append((call, storages, ms, outs))
        return out


class _PeaksBefore(TorchDispatchMode):
    """Each operator call of a forward pass, named as _CallTimes names it: the forward's peak so far as the call
    begins, above `before` (bytes; the meter's window, opened as the forward begins). It holds no tensor, so
    that the forward holds what a plain one does."""

    def __init__(self, window, before: int):
        super().__init__()
        self.window, self.before = window, before
        self.names = CallNames()
        self.at: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func in IGNORED:
            return func(*args, **kwargs)
        self.at[self.names.next(func)] = max(0, self.window.peak() - self.before)
        return func(*args, **kwargs)


class _PeaksAfter(TorchDispatchMode):
    """The calls of a forward pass without saving named in `wanted` (named as _CallTimes names them): the
    forward's peak above `before` from when it lets go of the first of a call's outputs on `device` (not of
    the `alive` storages) until its end, read by finish() (SavedGroup.fwd_peak_after_bytes). Frees are looked
    for as each call begins (between calls is where a forward drops a tensor); the peak is kept per stretch
    between calls' starts. It holds only weak references, so that the forward holds what one without saving
    does."""

    def __init__(self, meter, window, before: int, wanted: set[str], alive: set[int], device: torch.device):
        super().__init__()
        self.meter, self.window, self.before, self.device = meter, window, before, device
        self.wanted, self.alive = wanted, alive
        self.names = CallNames()
        self.stretches: list[int] = []  # the peak of each stretch between calls' starts, above `before`
        self.refs: dict[str, list] = {}  # per call made, weak references to its outputs' storages
        self.freed: dict[str, int] = {}  # per call let go of: the first stretch after it

    def _settle(self) -> None:
        self.stretches.append(self.window.peak() - self.before)
        self.window.restart()
        for name in [n for n, refs in self.refs.items() if any(r.expired() for r in refs)]:
            self.freed[name] = len(self.stretches)
            del self.refs[name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func in IGNORED:
            return func(*args, **kwargs)
        name = self.names.next(func)
        self._settle()
        out = func(*args, **kwargs)
        if name in self.wanted:
            refs = [StorageWeakRef(t.untyped_storage()) for t in torch.utils._pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.device == self.device
                    and t.untyped_storage().nbytes() > 0 and t.untyped_storage().data_ptr() not in self.alive]
            if refs:
                self.refs[name] = refs
        return out

    def finish(self, out, bytes_of: dict[str, int]) -> dict[str, int]:
        """Once the forward has returned `out` (held here, as a forward's end holds it): each call's figure
        (`bytes_of`: each call's bytes). A call whose outputs are all still alive (held by something outside the
        forward) is read as let go of there, less its own bytes, which the count there holds."""
        self._settle()
        end = max(0, self.meter.count() - self.before)
        figures = {}
        for name in self.wanted:
            if name in self.freed:
                figures[name] = max([end] + self.stretches[self.freed[name]:])
            elif name in self.refs:
                figures[name] = max(0, end - bytes_of.get(name, 0))
        return figures


def _groupable(func, name: str, args, kwargs) -> bool:
    """Whether a call's outputs can be a saved group: as the C++ policies' askable calls, outputs that alias
    no input, no argument written, a tensor among its arguments, and not a factory (empty_like, new_zeros),
    whose fresh result a later in-place operator fills."""
    info = _info(func)
    if getattr(func, "_schema", None) is None or info.aliases or info.writes:
        return False
    if not any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves((args, kwargs))):
        return False
    return not (name.endswith("_like") or name.startswith("aten::new_") or name == "aten::_unsafe_view")


def _measure_groups(fn, leaf, alive: set[int], clock: "_Clock", repeats: int, offload_min_bytes: int | None = None,
                    params: set[int] = frozenset(), meter=None) -> list[tuple[str, int, float, int, int, int, int]]:
    """The candidate groups of fn(leaf): (call name, bytes, ms, unsaved bytes, stays bytes, the plain forward's
    peak before the call, the forward without saving's peak from when it lets go of the call's outputs on; the
    last two -1 without `meter`) of the calls with
    outputs of their own (not views, not fn's output, not `alive` storages), whether or not autograd saves them (a
    group kept or sent is a call the recompute skips; of its bytes, those autograd does not save), those a recompute
    that stops early makes (made before autograd's last save), in the forward's order; the planner's fit_groups
    chooses among them. Outputs that hold no bytes on leaf's device (an attention kernel's random seed on the host,
    an empty tensor) are left out. Profiling for offloading (offload_min_bytes), the stays bytes are those of the
    outputs an Offload would keep on the device (remat.offload's offloadable: dense, at least that large, not a
    parameter's): sent, the group leaves them there (an attention kernel's log-sum-exp beside its output; before
    2026-12-05 such a call was no group, and the Llama's attention on the H200 was always recomputed). With
    `meter`, one more forward, plain, measures the peak before each call (SavedGroup.fwd_peak_before_bytes:
    what a group assignment's recompute holds part way is that beside the groups it has not reached yet), and
    one without saving the peak after each call's outputs are let go of (SavedGroup.fwd_peak_after_bytes: a
    group assignment's forward holds the groups it keeps or sends beyond that)."""
    saved: set[int] = set()
    # How many calls the forward had made when autograd last saved a tensor: a recompute that stops early
    # (torch.utils.checkpoint's, remat's) stops there, and never makes the calls after it again. (Autograd
    # saves a call's inputs before the call reaches the dispatch mode and its outputs after it returns: the
    # calls made before that save are those the recompute makes.)
    last = {"rec": None, "calls": -1}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            saved.add(t.untyped_storage().data_ptr())
        if last["rec"] is not None:
            last["calls"] = len(last["rec"].calls)
        # Detached: a saved output handed back as itself would hold its own grad_fn (a reference cycle
        # through autograd's C++ that Python's collector cannot see, and no backward pass runs here to break
        # it): the forward's graph, and all it saved, would stay alive after the measurement.
        return t.detach()

    times: dict[str, list[float]] = {}
    found = None
    for _ in range(repeats):
        rec = last["rec"] = _CallTimes(clock)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec:
            out = fn(leaf)
        last["rec"] = None
        out_key = out.untyped_storage().data_ptr()
        if found is None:
            found = []
            # The calls after the last save: no recompute makes them again, so keeping them saves nothing.
            for name, _, _, outs in rec.calls[:max(0, last["calls"])]:
                held = [(t, v) for t, v in outs if t.device == leaf.device and t.untyped_storage().nbytes() > 0]
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t, _ in held}
                own = {p: nb for p, nb in storages.items() if p not in alive and p != out_key}
                # Written in place later in the forward pass (an in-place activation): its outputs cannot be
                # handed back as they were.
                written = any(t._version != v for t, v in held)
                stays = {} if offload_min_bytes is None else {
                    t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t, _ in held
                    if not offloadable(t, offload_min_bytes, params)}
                if own and not written and len(own) == len(storages):
                    found.append((name, sum(own.values()), sum(nb for p, nb in own.items() if p not in saved),
                                  sum(stays.values())))
        for name, _, ms, _ in rec.calls:
            times.setdefault(name, []).append(ms)
        del out, rec
    peaks: dict[str, int] = {}
    after: dict[str, int] = {}
    if meter is not None and found:  # (no forward more where there is no group to read it for)
        before = meter.count()
        with meter.window() as window:
            with _PeaksBefore(window, before) as rec:
                fn(leaf)  # (its graph let go of at once)
            peaks = rec.at
        # And one without saving, as a group assignment's forward runs what it does not keep or send: its
        # peak after each group's call lets go of its outputs (SavedGroup.fwd_peak_after_bytes).
        before = meter.count()
        with meter.window() as window:
            rec = _PeaksAfter(meter, window, before, {name for name, *_ in found}, alive, leaf.device)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda _: None), rec:
                after = rec.finish(fn(leaf), {name: nbytes for name, nbytes, *_ in found})
            del rec
    return [(name, nbytes, _median(times[name]), unsaved, stays, peaks.get(name, -1), after.get(name, -1))
            for name, nbytes, unsaved, stays in found]


def _measure_stream(fn, leaf, backward, meter, min_bytes: int, alive: set[int], window: int,
                    input_sent: bool = False) -> tuple[int, int, int, int, int] | None:
    """fn(leaf) run streamed: what it saves sent to the host as it is made, each copy waited for at once
    (remat.offload.Offload with window 0, never the `alive` storages), then backward(out) (the profile's
    timed_backward: (ms, its peak above the bytes before it, that peak had it made its parameters' gradients
    or None)), each tensor brought back where it is used, the leaf (held here) found on the device. Returns
    (the forward's peak above the bytes before it, the backward's, the backward's with its gradients made or -1
    unmeasured, what the runtime's prefetch() brings back ahead with `window`: Offload.ahead_bytes, the layer's
    input and output perhaps found on the device, and with `input_sent` (the stage saves its input) how much
    higher the backward's peaks are where the input comes back from the host: OffloadCost.stream_bwd_input_bytes,
    else -1), or None when it has no backward (its output needs no gradient)."""

    def run(x):
        o = Offload(pool=HostPool(), min_bytes=min_bytes, lookahead=0, window=0).keep_on_device(storages=alive)
        before = meter.count()
        with meter.window() as peak:
            with o:
                out = fn(x)
            o.finish_copies()
            fwd = peak.peak() - before
        return o, out, fwd

    o, out, fwd = run(leaf)
    if not out.requires_grad:
        return None
    ahead = o.ahead_bytes(window, maybe_found=(leaf, out))
    _, bwd, grads = backward(out)
    del out
    o.pool.release()
    back = -1
    if input_sent:
        # Again, its input a copy of the leaf let go of once the forward is done, as a step lets go of a layer's
        # input that nothing but the layer saves: its backward brings that input back from the host rather than
        # find it on the device (the copy's gradient flows to the leaf, as the leaf's own would).
        x = leaf.clone()
        o, out, _ = run(x)
        del x
        _, bwd_back, grads_back = backward(out)
        del out
        o.pool.release()
        back = bwd_back - bwd
        if grads is not None and grads_back is not None:
            back = max(back, grads_back - grads)
        back = min(max(0, back), leaf.untyped_storage().nbytes())
    return max(0, fwd), max(0, bwd), -1 if grads is None else max(0, grads), ahead, back


class _SavedStorages:
    """Saved-tensor hooks that count, once per storage, the bytes of what autograd saves, minus `excluded`
    storages (alive anyway): of the saves whose graph is alive when read (sizes, offloaded, kept, packed), so
    that a call the stage's output does not take (RWKV's attention updates its state once more after its last
    output), whose graph and saves go as its result is let go of, is not counted, as a step does not hold it."""

    def __init__(self, excluded: set[int], offload_min_bytes: int | None = None, alive: set[int] = frozenset()):
        self.excluded = excluded
        # With offload_min_bytes: the storages offloading hooks would send to the host (remat.offload's
        # predicate; `alive`, the parameters and buffers, never), each with whether the tensor covers it all;
        # and the storages some saved tensor keeps on the device (one the hooks would not send: a view with gaps,
        # a small one): the hooks offload nothing of them, as remat.offload.Offload does not.
        self.offload_min_bytes = offload_min_bytes
        self.alive = alive
        # Per save: a weak reference to what autograd holds (the tensor, detached), its storage's key and bytes,
        # and how offloading hooks would take it ("sent" whole or not, "kept", or None).
        self._saves: list[tuple] = []

    def pack(self, t):
        if not (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta):
            return t
        st = t.untyped_storage()
        how = None
        if self.offload_min_bytes is not None:
            if offloadable(t, self.offload_min_bytes, self.alive):
                how = ("sent", t.storage_offset() == 0 and t.nbytes == st.nbytes())
            elif st.data_ptr() and st.data_ptr() not in self.alive:
                how = ("kept", False)
        # Detached (as _measure_groups' pack): a saved output handed back as itself holds its own grad_fn, a
        # reference cycle through autograd's C++ that Python's collector cannot see, which only the backward of
        # the call that saved it breaks, and that backward never reaches a call the stage's output does not
        # take. Before (found 2026-12-06), such calls' graphs, the stage's input among what they hold, outlived
        # the profile: RWKV's profiling step held its layers' outputs a step longer than the plain run, read them
        # as held to the step's end (outputs_held_to_end), and charged every backward a hidden state a layer
        # high. (Counted only while alive: a let-go save's storage key may be a later allocation's.)
        held = t.detach()
        self._saves.append((weakref.ref(held), st.data_ptr(), st.nbytes(), how))
        return held

    def _live(self):
        return [(key, nb, how) for ref, key, nb, how in self._saves if ref() is not None]

    @property
    def sizes(self) -> dict[int, int]:
        """Bytes per storage saved (its key), less `excluded`."""
        return {key: nb for key, nb, _ in self._live() if key and key not in self.excluded}

    @property
    def packed(self) -> set[int]:
        """Every storage a saved tensor is on, `excluded` ones too (whether a stage saves its input:
        Stage.saves_input)."""
        return {key for key, _, _ in self._live()}

    @property
    def offloaded(self) -> dict[int, tuple[int, bool]]:
        out: dict[int, tuple[int, bool]] = {}
        for key, nb, how in self._live():
            if how is not None and how[0] == "sent":
                out[key] = (nb, how[1] or out.get(key, (0, False))[1])
        return out

    @property
    def kept(self) -> set[int]:
        return {key for key, _, how in self._live() if how is not None and how[0] == "kept"}

    def offload_cost(self, input_key: int, output_key: int, most: int,
                     after_forward: bool = False) -> "_core.OffloadCost":
        """What offloading this stage's saved tensors moves (remat/planner/chain.h's OffloadCost): the storages freed
        besides its input and output (those a saved tensor covers whole; at most `most` bytes), and whether its
        input and output are among what it saves: the input where it is sent, the output where it is saved at all
        (sent, or kept on the device as a small tensor or a view with gaps: the stage holds it either way, which
        the step's model reads; a kept one's copy is then over-counted). after_forward: its copies start once its
        forward has run (OffloadCost.after_forward: a compiled stage's, whose graph saves its tensors at its end)."""
        c = _core.OffloadCost()
        c.after_forward = after_forward
        kept = self.kept  # (derived from the live saves: read once)
        sent = {key: v for key, v in self.offloaded.items() if key not in kept}
        c.bytes = min(most, sum(nb for key, (nb, whole) in sent.items() if whole and key not in (input_key, output_key)))
        c.input = input_key in sent
        c.output = output_key in sent or output_key in kept
        return c

    @staticmethod
    def unpack(t):
        return t


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


TIMINGS = ("synced", "pipelined")


def checked_timing(timing: str, what: str) -> str:
    """`timing` if it is one of TIMINGS; else ValueError "`what` must be one of ..., got ..." (`what` names the
    argument and its caller: "remat.profile: timing")."""
    if timing not in TIMINGS:
        raise ValueError(f"{what} must be one of {', '.join(TIMINGS)}, got {timing!r}")
    return timing


class _Timed:
    """A timed block's figures (ms): `ms`, what it is taken to cost; pipelined, also `host`, `slept`, `device`."""
    ms = host = slept = device = 0.0

    @property
    def reached(self) -> bool:
        """Pipelined: whether the device reached the block before the host had queued it."""
        return self.host >= self.slept

    @property
    def own(self) -> float:
        """Pipelined: the host's time in the block less what it waited for the sleep."""
        return self.host - self.slept if self.reached else self.host


class _Clock:
    """How the profiler times a stage's work (ms), by `timing`:

    - "synced": the device synchronized before and after, the host's time between. On a CPU device the only way
      (its work is done when the call returns). On CUDA it counts the host's time before the work's first kernel
      (and between kernels, where the host is slower than the device), which a training step spends while the
      device still runs the work before (the previous layer's): summed over layers, more than the step takes.
    - "pipelined" (CUDA): the device held busy (torch.cuda._sleep) for longer than the host takes to queue the
      work, then the work's own time on the device (CUDA events) and the host's time to queue it, the larger of
      the two: the time the work adds to a step where the host runs ahead of the device. Where the host does not
      finish queuing before the device reaches the work (a lead too short, or a call that waits for the device,
      such as a copy waited for), the device's time from its start, with whatever the host made it wait.

    The lead for stage i is four times the longest host time seen for its work so far (its first run's
    synchronized, which counts the device's time too: a lead rarely too short), at most ten times that first
    run's (at least 50 ms)."""

    def __init__(self, device: torch.device, timing: str):
        checked_timing(timing, "remat.profile: timing")
        self.device = device
        self.cuda = device.type == "cuda"
        self.pipelined = self.cuda and timing == "pipelined"
        self._cycles_per_ms: float | None = None
        self._host_ms: dict[int, float] = {}  # stage -> the longest host time seen for its work
        self._first_ms: dict[int, float] = {}  # stage -> its first run's, synchronized
        self._call_host_ms = 0.0  # the longest host time seen for one operator call (timed_call)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def first(self, i: int, fn: Callable[[], object]) -> None:
        """Pipelined: runs fn() once synchronized, its result let go of, for the host time stage i's leads start
        from (its first run, whose time the device's one-off costs may inflate: a longer lead, safe)."""
        if not self.pipelined:
            return
        with self._run(None) as t:
            out = fn()
        del out
        self._first_ms.setdefault(i, t.ms)
        self._host_ms[i] = max(self._host_ms.get(i, 0.0), t.ms)

    def _cycles(self, ms: float) -> int:
        if self._cycles_per_ms is None:  # the device's clock, measured once: torch.cuda._sleep counts cycles
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.sync()
            with torch.cuda.device(self.device):  # its current stream (the stages' device may not be current)
                a.record()
                torch.cuda._sleep(1 << 22)
                b.record()
            self.sync()
            self._cycles_per_ms = (1 << 22) / max(a.elapsed_time(b), 1e-3)
        return int(ms * self._cycles_per_ms)

    @contextlib.contextmanager
    def _run(self, lead_ms: float | None):
        """Runs the block after a synchronization. With no lead, `ms` is then the host's time to the device's next
        synchronization; with one, the device sleeps lead_ms first and `host` (the host's time in the block),
        `slept` and `device` (the device's time from the sleep's end to the block's end) are set."""
        t = _Timed()
        self.sync()
        if lead_ms is None:
            t0 = time.perf_counter()
            yield t
            self.sync()
            t.ms = (time.perf_counter() - t0) * 1e3
            return
        cycles = self._cycles(lead_ms)
        begin, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        stream = torch.cuda.current_stream(self.device)
        begin.record(stream)
        with torch.cuda.device(self.device):
            torch.cuda._sleep(cycles)
        start.record(stream)
        t0 = time.perf_counter()
        yield t
        t.host = (time.perf_counter() - t0) * 1e3
        end.record(torch.cuda.current_stream(self.device))
        self.sync()
        t.slept, t.device = begin.elapsed_time(start), start.elapsed_time(end)

    @contextlib.contextmanager
    def timed(self, i: int):
        """Times the block, stage i's work: its `ms` once the block has run (the device synchronized)."""
        lead = min(4.0 * self._host_ms.get(i, 25.0) + 1.0, max(50.0, 10.0 * self._first_ms.get(i, 5.0))) \
            if self.pipelined else None
        with self._run(lead) as t:
            yield t
        if lead is None:
            return
        # Where the device reached the work first, its time from there, and the host's less the sleep.
        t.ms = max(t.own, t.device)
        self._host_ms[i] = max(self._host_ms.get(i, 0.0), t.own)

    @contextlib.contextmanager
    def timed_call(self):
        """Times the block, one operator call of a saved group's (its `ms` once the block has run): synced, its
        time alone; pipelined, the device's time for it, which is what keeping its output saves a recompute that
        runs through remat's selective checkpointing (its host's time is spent there either way: the stage's
        groups_fwd_ms and groups_bwd_ms count it), after a lead of four times the longest host time seen for
        a call (0.2 ms more, at most 5 ms)."""
        lead = min(5.0, 0.2 + 4.0 * self._call_host_ms) if self.pipelined else None
        with self._run(lead) as t:
            yield t
        if lead is None:
            return
        t.ms = max(t.device, t.own) if t.reached else t.device
        self._call_host_ms = max(self._call_host_ms, t.own)


def _median(v: list[float]) -> float:
    return float(statistics.median(v)) if v else 0.0


def _policies(policies) -> dict[str, Callable]:
    if policies is None:
        return {}
    if isinstance(policies, Mapping):
        out = dict(policies)
    else:
        out = {name: policy_fn(name) for name in policies}
    for name, fn in out.items():
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-." for c in name):
            raise ValueError(f"remat.profile: '{name}' cannot name a policy (letters, digits, '_', '-', '.')")
        if not callable(fn):
            raise TypeError(f"remat.profile: policy '{name}' is not callable")
    return {name: _NoHostAnswers(name, fn) for name, fn in out.items()}


class _NoHostAnswers:
    """A policy as the profiler runs it: a host answer (MUST_CPU_OFFLOAD) is refused, since the chain has no
    figures for outputs a policy of one's own sends to the host itself (the planner's per-call choice goes
    through saved groups instead: profile(groups=True))."""

    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn

    def __call__(self, ctx, op, *args, **kwargs):
        answer = self.fn(ctx, op, *args, **kwargs)
        if outcome(answer, op, "remat.profile") == TO_HOST:
            raise ValueError(f"remat.profile: policy '{self.name}' answered {answer} for {op}; a policy that sends "
                             "calls' outputs to the host itself cannot be profiled or planned yet (run it with "
                             "remat.checkpoint(..., policy=..., offload=...)); plans offload what a policy keeps "
                             "with its '@host' choice")
        return answer


def profile(stages: Sequence[StageFn | Callable], example_input: torch.Tensor, *, policies=("matmuls",),
            warmup: int = 1, repeats: int = 3, inputs: Sequence[torch.Tensor] | None = None,
            excluded: Iterable[torch.Tensor] = (), offload_min_bytes: int | None = None,
            groups: bool = False, progress=None, timing: str = "synced",
            saved_calls: list | None = None, summed: Sequence[bool] | None = None,
            saved_storages: list | None = None, attributes_bytes: list | None = None,
            stand_in_params: bool = False) -> _core.Chain:
    """Profiles `stages` (StageFns, modules or callables x -> tensor) on `example_input` (the chain's input) and
    returns the Chain the planners take (see the module's documentation for what each field is).

    policies: selective policies to measure each stage under (names of remat's presets, "matmuls" by default,
    or a dict name -> policy function as create_selective_checkpoint_contexts takes); () for none.
    inputs: each stage's input, when known (planning in place records them); otherwise a forward pass without
    saving makes them from example_input. excluded: tensors the stages read that are alive anyway (an
    attention mask a closure holds), not counted as saved. offload_min_bytes: also profile for offloading
    (remat.offload with that threshold): each stage's OffloadCost kept whole (Stage.offload) and checkpointed
    (Stage.checkpoint_offload, its input), and the chain's bandwidths, measured by copying the largest tensor a
    stage saves (at most 64 MiB) to host memory and back; each stage's streamed peaks (Stage.offload's
    stream_fwd_bytes and stream_bwd_bytes: run with each saved tensor sent as it is made and brought back where it
    is used, a plan's Fa3@stream; stream_bwd_grads_bytes, that backward's had it made its gradients, on remat's
    meters) and window_bytes (the largest tensor it sends); under each policy, what offloading its kept tensors
    and its input moves (PolicyCost.offload, Fk[NAME]@host; remat's selective checkpointing passes them on any
    torch). groups: also each stage's saved groups (Stage.groups, a plan's Fk3{khr}): the calls of its forward
    pass with outputs of their own (not views, not its output, not what is alive anyway), whether or not autograd
    saves them, at most remat.chain's kMaxGroups (10) of them (fit_groups: the products, convolutions and
    attention kernels first, then the largest), each with its outputs' bytes and its time (the median of
    `repeats` runs, each call timed alone); with offload_min_bytes, also the bytes of its outputs an Offload
    would keep on the device were it sent (SavedGroup.stays_bytes: below that, or not dense); the plain
    forward's peak before each one's call (SavedGroup.fwd_peak_before_bytes: what a group assignment's recompute
    holds part way, beside the groups it has not reached); and the stage's
    forward and backward as a group assignment keeping every group runs them (Stage.groups_fwd_ms,
    groups_bwd_ms: remat's selective checkpointing costs time beside each call, which the planner charges). A
    policy that answers MUST_CPU_OFFLOAD is not profiled yet (the planner has no model for it): its first such
    answer raises ValueError naming it.

    Each stage runs with its input needing a gradient as in a training step: the first where example_input
    requires grad, a later one by input_needs_grad() (or where its given input requires grad). A stage frozen on
    an input that needs none (fine-tuning's lower layers) makes no graph, and is profiled so: its output alone
    saved, no backward (Stage.has_backward false: the per-layer planner keeps it).

    A StageFn with `compiled` (a layer compiled one by one, as remat.enable's profiling step gives it) runs its
    kept, checkpointed and policy passes through that call, after one untimed run of each (compiling); its
    offload figures are those of what its compiled function saves (what an Offload opened around its graph
    sends: keep@host, checkpoint@host, a policy's), their copies starting once its forward has run
    (OffloadCost.after_forward), and it gets no stream or group figures.

    progress: None (the default) draws a progress bar on stderr while profiling runs, erased when it ends and
    not drawn where stderr is not a terminal (remat.progress); False draws nothing; a callable is called
    with a remat.ProfileProgress after each run of one stage instead (its phase_ms summed by phase says where
    profiling's time goes). What it raises propagates, the model put back first.

    saved_calls: with groups, a list that receives per stage every call measured as a candidate group
    (remat.SavedGroup: its outputs' bytes, time, unsaved and staying bytes), those fit_groups chose for
    Stage.groups among them, in the forward's order (what a bound over every saved tensor reads:
    bench/offload_cuda.py); [] for a stage without them.

    saved_storages: a list that receives per stage the storages (data pointers) its plain forward's graph saved
    tensors of, `excluded` ones included (whether a stage's graph saves a mask it takes: StepContext.taken_saved_by),
    or None where not read (a compiled stage: taken as saving every one).

    attributes_bytes: a list that receives per stage the most bytes of tensors of their own (not on its output's
    storage) that a run of it left in the attributes of its module it reassigned: what a checkpointed run holds
    beside the values those attributes had (remat._state.AttributesSeen) from its forward to its recompute,
    which the profile's runs, each of which leaves the attributes as it found them, do not show (0 for a stage
    without a module or one that keeps nothing so), with the bytes of the buffers a run wrote in place, of which
    a checkpointed run holds a copy to its recompute likewise. A policy's saved bytes (PolicyCost.saved_bytes)
    include both.
    stand_in_params: the stages' parameters (but a compiled stage's) replaced by stand-ins on their data while
    the profile runs (_StandInParams), so that a hook on a parameter's gradient accumulation (DDP's) does not see
    the profile's backward passes; remat.enable's profiling step, which runs them inside the model's forward,
    sets it where no layer is sharded by FSDP2.

    summed: per stage, whether a residual sum outside the stages lets go of its output (`x = x + layer(x)`:
    what the step's model charges the held gradient at), or None (unknown: every stage). Each policy's backward
    is measured once more with the gradient it is handed held (PolicyCost.bwd_grad_held_bytes) only where true;
    elsewhere the figure is left unset, the stage's standing in (the step's model charges it nowhere else).
    remat.enable's profiling step passes what it read of its sums (the last layer's as true: it is read after
    the profile, once the rest's backward has run).

    timing: how each stage's work is timed (_Clock): "synced" (the default: the device synchronized before and
    after, the host's time between), or "pipelined", on CUDA only (on a CPU device the same as "synced"),
    experimental: the device held busy while the host queues the work, then the larger of the host's time to
    queue it and the device's time to run it, what the work adds to a step where the host runs ahead of the
    device (a synchronized run also counts the host's time before the first kernel, which a step overlaps with
    the work before); each call of a saved group, the device's time for it. ValueError for another.

    On CPU the peaks are read with remat's meter (remat.meter.cpu_meter(), built at first use), on CUDA from
    the bytes tensors request from the caching allocator; in peak windows either way, which reset no statistic
    the caller reads (remat.meter). Raises ValueError for no stages, warmup < 0, repeats < 1 or a bad policy, and
    TypeError naming the stage when one returns something other than a tensor.
    """
    # Per stage, the most bytes of tensors a run of it left in its modules' attributes and of the buffers it wrote
    # (_attributes_kept), and its module's Walk, kept across its runs (kept_walk).
    attributes_made, buffers_written = [0] * len(stages), [0] * len(stages)
    walks: dict = {}
    stage_list = [_attributes_kept(s if isinstance(s, StageFn) else
                                   StageFn(s, f"{i}:{type(s).__name__}", s if isinstance(s, nn.Module) else None),
                                   attributes_made, i, walks, buffers_written)
                  for i, s in enumerate(stages)]
    n = len(stage_list)
    if n == 0:
        raise ValueError("remat.profile: no stages")
    if not isinstance(example_input, torch.Tensor):
        raise TypeError(f"remat.profile: the example input must be a tensor, got {type(example_input).__name__}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"remat.profile: warmup must be >= 0 and repeats >= 1, got {warmup} and {repeats}")
    if inputs is not None and len(inputs) != n:
        raise ValueError(f"remat.profile: {len(inputs)} inputs for {n} stages")
    if summed is not None and len(summed) != n:
        raise ValueError(f"remat.profile: summed has {len(summed)} entries for {n} stages")
    pols = _policies(policies)
    policy_offload = offload_min_bytes is not None and POLICY_OFFLOAD
    device = example_input.device
    meter = meter_for(device)
    clock = _Clock(device, timing)
    sync = clock.sync

    modules = [s.module for s in stage_list if s.module is not None]
    params = [[p for p in s.module.parameters() if p.requires_grad] if s.module is not None else []
              for s in stage_list]
    # Alive anyway: never counted as saved.
    alive: set[int] = set()
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            alive.add(_storage_key(t))
    for t in excluded:
        if isinstance(t, torch.Tensor):
            alive.add(_storage_key(t))

    chain = _core.Chain()
    chain.input_bytes = example_input.nbytes
    names = [s.name or f"stage{i}" for i, s in enumerate(stage_list)]
    xs: list[torch.Tensor | None] = [None] * (n + 1)
    xs[0] = example_input.detach()
    if inputs is not None:
        for i in range(n):
            xs[i] = inputs[i].detach()
    # Whether each stage's input needs a gradient, as in a training step (input_needs_grad(), the plan
    # executor's rule; planning in place also where the recorded input requires grad). A frozen stage on an
    # input that needs none makes no graph, and is profiled so: nothing saved, no backward.
    input_grad = [False] * n

    def derive_input_grads():
        needs = example_input.requires_grad
        for i in range(n):
            if i > 0:
                needs = input_needs_grad(needs, stage_list[i - 1]) or (inputs is not None and inputs[i].requires_grad)
            input_grad[i] = (xs[i].is_floating_point() or xs[i].is_complex()) and needs

    own_bar = None  # the bar drawn here, erased however profiling ends
    if progress is None:
        progress = own_bar = progress_bar("remat: profiling")
    elif progress is False:
        progress = None
    elif not callable(progress):
        raise TypeError(f"remat.profile: progress must be None, False or a callable, got {type(progress).__name__}")
    compiled = [s.compiled is not None for s in stage_list]
    report = Reporter(progress, n, (warmup + repeats) * n * (4 + len(pols)) +
                      (n + 1 if offload_min_bytes is not None else 0) + (n if groups else 0) + sum(compiled))

    fields = [dict(fwd=[], bwd=[], nosave=[], ckpt_fwd=[], ckpt_bwd=[], out=0, saved=0, ftmp=0, ntmp=0, btmp=0,
                   pol={name: dict(fwd=[], bwd=[], saved=0) for name in pols}) for _ in range(n)]

    def check_out(i, out):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"remat.profile: stage {i} ('{names[i]}') returned {type(out).__name__}, not a tensor: "
                            "a stage's output must be one tensor (the next stage's input)")
        return out

    def leaf_of(i):
        leaf = xs[i].detach()
        if input_grad[i]:
            leaf.requires_grad_(True)
        return leaf

    def targets_of(i, leaf):
        return params[i] + ([leaf] if input_grad[i] else [])

    def run_as(i, how, leaf, counter=None, calls=None, groups=None):
        """Stage i on `leaf` as choice `how` runs it: compiled, inside its graph; else kept as it is, or under
        torch.utils.checkpoint (with the policy `how` names, or the group assignment "{khr}" over the saved
        groups named `groups`, through remat's selective checkpointing). With `calls` (a list), checkpointed:
        the meter's count appended to it at each call of the stage's function, its forward's and its
        recompute's."""
        st = stage_list[i]
        if compiled[i]:
            return check_out(i, st.compiled(how, leaf))
        if how == KEEP:
            return check_out(i, st(leaf))
        mods = kept_walk(walks, i, st.module) if st.module is not None else []

        def counted(*a):
            calls.append(meter.count())
            return st.fn(*a)

        fn = st.fn if calls is None else counted
        # As the runtime's checkpointed layers run; `counter`, when given, takes what is kept, as an Offload would.
        policy = None if how == CHECKPOINT else GroupPolicy(groups, how[1:-1]) if is_groups(how) else pols[how]
        return check_out(i, checkpoint_region(fn, (leaf,), mods, policy, counter, route_kept=counter is not None))

    def recompute_overhead():
        """What a checkpoint's recompute holds before it calls the stage's function again, whatever the stage
        (bytes): the count at that call above the backward's start (the gradient it is handed counted), for a
        function whose backward first reads what it saved (t * t). On the CPU, the generators' state the
        recompute saves while it replays the first, which the step's model charges apart
        (StepContext.checkpoint_state_bytes)."""
        x = torch.zeros(1, device=device, requires_grad=True)
        seen = []

        def square(t):
            seen.append(meter.count())
            return t * t

        y = checkpoint_region(square, (x,))
        g = torch.ones_like(y)
        start = meter.count()
        torch.autograd.backward(y, g)
        del y, g, x
        return seen[1] - start if len(seen) >= 2 else 0

    def timed_backward(out, targets, i, grads_peak=False, hold_grad=False, starts=None):
        """Stage i's backward from `out` with d = ones; returns its time and its peak above what was alive
        before it with d (d is made in the backward pass, held by autograd alone and freed once used, as a
        training step's gradient is: _SeedGradient), and with `grads_peak` (else None) that peak had the
        backward made its parameters' gradients (_GradsPeak). `out` may be a list holding the output alone:
        taken from it and let go of once the root is made, so that only the stage's graph holds the output
        through its backward (output_freed_in_backward). With `hold_grad`, d is held through the backward
        (grad_held_in_backward). With `starts` (a list), the count it reads its peak above is appended to it."""
        let_go = isinstance(out, list)
        if let_go:
            out = out.pop()
        kept = [] if hold_grad else None
        with _ZeroGrads(params[i]):
            root = _SeedGradient.apply(out, kept)
            seed = torch.zeros((), dtype=root.dtype, device=root.device)
            sync()
            before = meter.count() + out.nbytes
            if starts is not None:
                starts.append(before)
            if let_go:
                del out
            window = meter.window()
            # Windows nest on remat's meters only (not on the CUDA allocator's statistic it falls back to).
            grads_peak = grads_peak and isinstance(window, PeakWindow)
            with window, (_GradsPeak(meter, params[i], before) if grads_peak else contextlib.nullcontext()) as made:
                with clock.timed(i) as t:
                    torch.autograd.backward(root, seed, inputs=targets)
                peak = window.peak() - before
        return t.ms, peak, made.peak() if made is not None else None

    def measured_backward(out, targets, i, leaf, hold_grad=False):
        """timed_backward with both peaks, each less its input's gradient as the plan charges it apart (the
        chain's input, or the last stage's output: its bytes; an input made by code between two stages, larger
        than the output the chain counts, as a residual sum in fp32 on a layer's bf16 output under autocast,
        has the rest of its gradient left in the peak): (ms, with the gradients pre-allocated, had it made them
        or None) (bwd_tmp_bytes, bwd_grads_tmp_bytes and a policy's)."""
        ms, peak, grads_peak = timed_backward(out, targets, i, grads_peak=True, hold_grad=hold_grad)
        counted = chain.input_bytes if i == 0 else fields[i - 1]["out"]
        # A stage whose input takes no gradient (the model's own input, a frozen layer's output) makes none,
        # and the step's model charges one at its backward all the same: its peaks less those bytes too.
        d_in = (leaf.grad.nbytes if leaf.grad is not None else 0) if input_grad[i] else counted
        d_in = min(d_in, counted)
        return ms, max(0, peak - d_in), None if grads_peak is None else max(0, grads_peak - d_in)

    def output_freed_in_backward(i):
        """How much lower stage i's backward peaks (bwd_tmp_bytes, and with its gradients made) are where its
        graph alone holds its output, as in a step where nothing else does, than with the output held through
        (Stage.bwd_output_freed_bytes, for a stage whose graph saves its output: the graph lets go of it once
        the operations that saved it have run backward): the stage run again and its backward measured so;
        the lesser of the two drops, at most the output's bytes."""
        leaf = leaf_of(i)
        counter = _SavedStorages(alive | {_storage_key(leaf)})
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            box = [run_as(i, KEEP, leaf)]
        _, tmp, grads_tmp = measured_backward(box, targets_of(i, leaf), i, leaf)
        drops = [fields[i]["btmp"] - tmp]
        if grads_tmp is not None and "bgtmp" in fields[i]:
            drops.append(fields[i]["bgtmp"] - grads_tmp)
        return max(0, min(fields[i]["out"], *drops))

    def grad_held_in_backward(i, name=KEEP):
        """How much higher stage i's backward peak is, run as Fa (or under policy `name`), with the gradient it is
        handed held through it than let go of once used (Stage.bwd_grad_held_bytes, PolicyCost's): what a
        residual sum outside the layers adds, whose backward hands the output's gradient to the residual path
        too. The stage run so again and its backward measured with the gradient held; the larger of the two
        readings' differences (bwd_tmp_bytes, and bwd_grads_tmp_bytes where the backward makes the parameters'
        gradients: the step's model adds what making them adds to this, and under the matmuls policy a Linear
        last makes its bias's gradient before the peak the held gradient allows, after the one without it);
        within [0, its output's bytes]. 0 where its input takes no gradient (the model's own input, a frozen
        layer's output): a sum over it (`x + layer(x)`) hands that input nothing."""
        if not input_grad[i]:
            return 0
        f = fields[i] if name == KEEP else fields[i]["pol"][name]
        leaf = leaf_of(i)
        out = run_as(i, name, leaf)
        _, tmp, grads_tmp = measured_backward(out, targets_of(i, leaf), i, leaf, hold_grad=True)
        held = tmp - f["btmp"]
        if grads_tmp is not None and "bgtmp" in f:
            held = max(held, grads_tmp - f["bgtmp"])
        return max(0, min(fields[i]["out"], held))

    def policy_holds_output(i, name):
        """Whether stage i under policy `name` holds its output in what it keeps (PolicyCost.saves_output): the
        stage run so again, its output let go of with its graph held; held where that left the output's storage
        alive. A compiled stage's, and one whose output is its input or made no graph, as held."""
        if compiled[i]:
            return True
        leaf = leaf_of(i)
        out = run_as(i, name, leaf)
        key = _storage_key(out)
        if out.grad_fn is None or key in alive or key == _storage_key(leaf):
            return True
        nbytes = out.untyped_storage().nbytes()
        node = out.grad_fn
        sync()
        before = meter.count()
        del out
        freed = before - meter.count()
        del node, leaf
        return freed < nbytes

    # Autocast's cache off, as the runtime runs every layer (policies.autocast_cache_off); the stages' inputs
    # here are leaves that require grad, whose casts the cache would otherwise keep until the caller's autocast
    # region ends (in a profiling step, four bf16 copies of the last layer's input held through the rest of
    # its forward: what it read the rest to leave held was that much low).
    stand_ins = _StandInParams(stage_list, [not c for c in compiled], params) if stand_in_params else \
        contextlib.nullcontext()
    with collector_paused(), Restore(modules, device), autocast_cache_off(), stand_ins, \
            contextlib.closing(own_bar) if own_bar else contextlib.nullcontext():
        with torch.enable_grad():
            if warmup == 0:
                # With no warm-up run, the first stage's first call, untimed: a device's one-off costs at a
                # process's first call (cuBLAS's handle and workspace, kernels loaded) would otherwise be its
                # forward's time without saving (Stage.fwd_nosave_ms: 737 ms on the H200's Llama, whose layers
                # run that forward in 2.7 ms, found 2026-12-04).
                with torch.no_grad():
                    check_out(0, stage_list[0](xs[0]))
            for r in range(warmup + repeats):
                measure, keep = r == warmup, r >= warmup
                # A forward pass without saving (which makes the stages' inputs when they are not given).
                for i in range(n):
                    with torch.no_grad(), meter.window() as window:
                        if r == 0:  # pipelined timing: where stage i's leads start
                            clock.first(i, lambda i=i: check_out(i, stage_list[i](xs[i])))
                        base = meter.count()
                        with clock.timed(i) as t:
                            out = check_out(i, stage_list[i](xs[i]))
                        f = t.ms
                        if measure:
                            fields[i]["ntmp"] = max(fields[i]["ntmp"], window.peak() - base - out.nbytes)
                    # Its output's bytes (Stage.output_bytes: the next stage's input as the chain counts it),
                    # which the next stage's backward reads before this stage's runs (last stage first).
                    fields[i]["out"] = out.nbytes
                    if xs[i + 1] is None or (inputs is None and r == 0):
                        xs[i + 1] = out
                    if keep:
                        fields[i]["nosave"].append(f)
                    del out
                    report("forward without saving", names[i])
                if r == 0:
                    derive_input_grads()
                    # Each compiled stage run once under each choice, forward and backward, untimed: what compiles
                    # its graphs (a choice's graph is compiled at its first call, its backward's at the first
                    # backward through it) is not one of its timed runs.
                    for i in range(n):
                        if compiled[i]:
                            for how in (KEEP, CHECKPOINT, *pols):
                                leaf = leaf_of(i)
                                out = run_as(i, how, leaf)
                                targets = targets_of(i, leaf)
                                if out.requires_grad and targets:
                                    timed_backward(out, targets, i)
                                del out, leaf
                            report("compiling", names[i])
                # From the last stage to the first: its forward saving for backward, and its backward.
                for i in reversed(range(n)):
                    leaf = leaf_of(i)
                    counter = _SavedStorages(alive | {_storage_key(leaf)}, offload_min_bytes, alive)
                    base = meter.count()
                    with meter.window() as window:
                        with clock.timed(i) as t, \
                                torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                            out = run_as(i, KEEP, leaf)
                        f = t.ms
                        fwd_peak = window.peak() - base
                    if measure:
                        out_key = _storage_key(out)
                        sizes, packed = counter.sizes, counter.packed  # (derived from the live saves: read once)
                        saved = sum(sizes.values())
                        unsaved = out_key not in sizes and out_key not in alive and \
                            out_key != _storage_key(leaf)
                        if unsaved:
                            saved += out.untyped_storage().nbytes()
                        # Whether its graph saves its output (Stage.saves_output): a checkpointed layer's recompute,
                        # which stops early, never makes again one it does not. A compiled stage's saves are left
                        # as saved.
                        fields[i]["saves_out"] = compiled[i] or not unsaved
                        # Whether it saves its input (Stage.saves_input): a tensor on its storage. A layer whose
                        # Linear saves a cast of it (bf16 under autocast) does not: a step lets go of it once
                        # the layer's forward is done, where nothing else holds it. A compiled stage's, as saved.
                        fields[i]["saves_in"] = compiled[i] or _storage_key(leaf) in packed
                        # The storages its graph saves (saved_storages); a compiled stage's as unknown (None: every
                        # one taken as saved).
                        fields[i]["packed"] = None if compiled[i] else packed
                        # Whether it has a backward (Stage.has_backward): a stage whose output needs no gradient
                        # made no graph, and every way runs it as kept.
                        fields[i]["has_bwd"] = out.requires_grad
                        fields[i]["saved"] = max(out.nbytes, saved)
                        fields[i]["ftmp"] = max(0, fwd_peak - fields[i]["saved"])
                        # A compiled stage's too: the hooks see what its compiled function saves, as an Offload
                        # opened around its graph does (remat.dispatch.around_compiled).
                        if offload_min_bytes is not None:
                            fields[i]["offload"] = counter.offload_cost(
                                _storage_key(leaf), out_key, fields[i]["saved"] - out.nbytes, compiled[i])
                            fields[i]["largest"] = max([nb for nb, _ in counter.offloaded.values()] + [0])
                            ck = None
                            if offloadable(leaf.detach(), offload_min_bytes, alive):
                                ck = _core.OffloadCost()
                                ck.input = True
                                ck.after_forward = compiled[i]
                            fields[i]["ckpt_offload"] = ck
                    targets = targets_of(i, leaf)
                    b = 0.0
                    measured = out.requires_grad and targets and measure
                    if measured:
                        # above what was alive before it: the input, what the stage saved, its output and d
                        b, fields[i]["btmp"], grads_tmp = measured_backward(out, targets, i, leaf)
                        if grads_tmp is not None:
                            fields[i]["bgtmp"] = grads_tmp
                    elif out.requires_grad and targets:
                        b = timed_backward(out, targets, i)[0]
                    if keep:
                        fields[i]["fwd"].append(f)
                        fields[i]["bwd"].append(b)
                    del out, leaf
                    if measured and fields[i]["saves_out"] and not compiled[i]:
                        fields[i]["out_freed"] = output_freed_in_backward(i)
                    if measured and not compiled[i]:
                        fields[i]["grad_held"] = grad_held_in_backward(i)
                    report("forward and backward", names[i])
                # Every stage under torch.utils.checkpoint, then the backward pass through them (what
                # checkpointing every stage holds); then each stage under each policy, its backward right after
                # its forward (one stage's kept tensors at a time).
                leaves, outs, cf = [None] * n, [None] * n, [0.0] * n
                # Per stage, the count at each call of its function: its forward's, then its recompute's.
                calls = [[] for _ in range(n)]
                before_call = recompute_overhead() if measure else 0
                for i in range(n):
                    leaves[i] = leaf_of(i)
                    with meter.window() as window:
                        with clock.timed(i) as t:
                            outs[i] = run_as(i, CHECKPOINT, leaves[i], calls=calls[i] if measure else None)
                        cf[i] = t.ms
                        peak = window.peak()
                    if measure:
                        # Above what stays: its output and what the checkpoint holds for its recompute (the
                        # generators' state, which a step's context charges apart).
                        fields[i]["ntmp"] = max(fields[i]["ntmp"], peak - meter.count())
                    report("checkpointed", names[i])
                for i in reversed(range(n)):
                    targets = targets_of(i, leaves[i])
                    starts = []
                    cb = timed_backward(outs[i], targets, i, hold_grad=True, starts=starts)[0] \
                        if outs[i].requires_grad and targets else 0.0
                    if measure and starts and len(calls[i]) >= 2 and not compiled[i]:
                        # What its backward made before it asked for a tensor it did not keep, beyond the
                        # gradient it was handed, held through (as a residual sum holds it; where nothing does
                        # and the backward let go of it by then, the step is charged it all the same: safe)
                        # (Stage.grads_before_recompute_bytes): the count as the recompute called its function,
                        # above the one the backward began at.
                        fields[i]["early"] = max(fields[i].get("early", 0), calls[i][1] - starts[0] - before_call)
                    calls[i] = []
                    outs[i] = leaves[i] = None
                    if keep:
                        fields[i]["ckpt_fwd"].append(cf[i])
                        fields[i]["ckpt_bwd"].append(cb)
                    report("checkpointed", names[i])
                for name in pols:
                    for i in reversed(range(n)):
                        leaf = leaf_of(i)
                        # Offloading profiled: what the policy keeps passes through counting hooks (the
                        # checkpoint's input through them as hooks, what the policy keeps through remat's
                        # selective checkpointing), as through an Offload; a compiled stage's all through the hooks,
                        # around its graph, as its Offload is opened.
                        counter = (_SavedStorages(alive | {_storage_key(leaf)}, offload_min_bytes, alive)
                                   if policy_offload else None)
                        hooks = (torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)
                                 if counter else contextlib.nullcontext())
                        base = meter.count()
                        with clock.timed(i) as t, hooks:
                            out = run_as(i, name, leaf, counter)
                        f = t.ms
                        if measure:
                            # With what a run under it holds from its forward to its recompute that the
                            # profile's runs cannot show: the values its forward found in the tensor attributes it
                            # reassigns, for the recompute to see (remat._state.AttributesSeen), alive here anyway.
                            fields[i]["pol"][name]["saved"] = max(out.nbytes, meter.count() - base) + \
                                attributes_made[i]
                            if counter:
                                fields[i]["pol"][name]["offload"] = counter.offload_cost(
                                    _storage_key(leaf), _storage_key(out),
                                    fields[i]["pol"][name]["saved"] - out.nbytes, compiled[i])
                        del counter
                        targets = targets_of(i, leaf)
                        b = 0.0
                        out_grad = out.requires_grad
                        if out.requires_grad and targets and measure:
                            # Above what it keeps, its output and d: the recompute of what it does not keep
                            # included.
                            pol = fields[i]["pol"][name]
                            b, pol["btmp"], grads_tmp = measured_backward(out, targets, i, leaf)
                            if grads_tmp is not None:
                                pol["bgtmp"] = grads_tmp
                        elif out.requires_grad and targets:
                            b = timed_backward(out, targets, i)[0]
                        del out, leaf
                        if keep:
                            fields[i]["pol"][name]["fwd"].append(f)
                            fields[i]["pol"][name]["bwd"].append(b)
                        if measure and out_grad:
                            # Where offloading was profiled, its cost's `output` says it already (and the step's
                            # model reads that first); else the stage runs so once more.
                            pol = fields[i]["pol"][name]
                            pol["saves_out"] = pol["offload"].output if "offload" in pol and not compiled[i] \
                                else policy_holds_output(i, name)
                            if "btmp" in pol and not compiled[i] and (summed is None or summed[i]):
                                pol["grad_held"] = grad_held_in_backward(i, name)
                        report("policy " + name, names[i])
            if offload_min_bytes is not None:
                # Streamed (Fa3@stream): each stage's forward and backward peaks with what it saves sent as it is
                # made (each copy waited for at once) and brought back where it is used (none ahead); the plan adds
                # the window the runtime keeps in flight beside them.
                for i in range(n):
                    if compiled[i]:
                        report("offloading", names[i])
                        continue
                    leaf = leaf_of(i)
                    targets = targets_of(i, leaf)
                    sent = fields[i].get("offload")
                    fields[i]["stream"] = _measure_stream(
                        lambda t, i=i: check_out(i, stage_list[i](t)), leaf,
                        lambda out, i=i, targets=targets: timed_backward(out, targets, i, grads_peak=True),
                        meter, offload_min_bytes, alive, fields[i].get("largest", 0),
                        input_sent=sent is not None and sent.input) if targets else None
                    del leaf, targets
                    report("offloading", names[i])
            if groups:
                for i in range(n):
                    if compiled[i]:
                        fields[i]["groups"], fields[i]["fitted"] = [], []
                        report("groups", names[i])
                        continue
                    leaf = leaf_of(i)
                    fields[i]["groups"] = [_core.SavedGroup(*g) for g in _measure_groups(
                        lambda t, i=i: check_out(i, stage_list[i](t)), leaf,
                        alive | {_storage_key(leaf)}, clock, repeats, offload_min_bytes, alive, meter)]
                    # The planner library's choice, which the C++ profiler makes too: the products,
                    # convolutions and attention kernels first, then the largest.
                    fitted = fields[i]["fitted"] = _core.fit_groups(fields[i]["groups"])
                    targets = targets_of(i, leaf)
                    del leaf
                    # The stage as a group assignment runs it, every group kept (Stage.groups_fwd_ms,
                    # groups_bwd_ms): remat's selective checkpointing, a dispatch mode in Python, costs time
                    # beside every call of its forward and its recompute that the calls' own times leave out
                    # (2-3 ms a layer on an H200's Llama, whose layers run 3 ms forward).
                    if fitted and targets:
                        how, times = "{" + "k" * len(fitted) + "}", []
                        for r in range(warmup + repeats):
                            leaf = leaf_of(i)
                            with clock.timed(i) as t:
                                out = run_as(i, how, leaf, groups=[g.name for g in fitted])
                            f = t.ms
                            graph = out.requires_grad
                            b = timed_backward(out, targets_of(i, leaf), i)[0] if graph else None
                            del out, leaf
                            if not graph:
                                break
                            if r >= warmup:
                                times.append((f, b))
                        if times:
                            fields[i]["groups_ms"] = (_median([f for f, _ in times]), _median([b for _, b in times]))
                    del targets
                    report("groups", names[i])

    chain.policies = list(pols)
    if offload_min_bytes is not None:
        largest = max([f.get("largest", 0) for f in fields] + [0])
        with collector_paused():
            size = _core.bandwidth_probe_bytes(largest, device.type == "cpu")  # (both profilers' rule)
            chain.to_host_gb_per_s, chain.to_device_gb_per_s = measure_bandwidth(device, size)
        # Copies made at once as the hooks run, where the copy engine has no side stream (CopyEngine: CUDA's
        # alone has one; a CPU device's copies are the host's own memory copies): no computation hides them.
        chain.copies_at_once = device.type != "cuda"
        report("bandwidth")
    stages_out = []
    for i in range(n):
        s = _core.Stage()
        f = fields[i]
        s.name = names[i]
        s.output_bytes = f["out"]
        s.saved_bytes = f["saved"]
        s.saves_output = f.get("saves_out", True)
        s.saves_input = f.get("saves_in", True)
        s.has_backward = f.get("has_bwd", True)
        s.bwd_output_freed_bytes = f.get("out_freed", 0)
        s.bwd_grad_held_bytes = f.get("grad_held")
        s.grads_before_recompute_bytes = max(0, f.get("early", 0))
        s.fwd_tmp_bytes = f["ftmp"]
        s.fwd_nosave_tmp_bytes = max(0, f["ntmp"])
        s.bwd_tmp_bytes = f["btmp"]
        if "bgtmp" in f:
            s.bwd_grads_tmp_bytes = f["bgtmp"]
        s.fwd_ms = _median(f["fwd"])
        s.bwd_ms = _median(f["bwd"])
        s.fwd_nosave_ms = _median(f["nosave"])
        s.checkpoint_fwd_ms = _median(f["ckpt_fwd"])
        s.checkpoint_bwd_ms = _median(f["ckpt_bwd"])
        costs = []
        for name in pols:
            c = _core.PolicyCost()
            c.policy = name
            # What the policy keeps, as measured: it may keep more than keeping everything does (a Linear then
            # a ReLU: the policy keeps the product, which ReLU's saving its output leaves unsaved).
            c.saved_bytes = f["pol"][name]["saved"]
            c.fwd_ms = _median(f["pol"][name]["fwd"])
            c.bwd_ms = _median(f["pol"][name]["bwd"])
            if "btmp" in f["pol"][name]:
                c.bwd_tmp_bytes = f["pol"][name]["btmp"]
            if "bgtmp" in f["pol"][name]:
                c.bwd_grads_tmp_bytes = f["pol"][name]["bgtmp"]
            if "offload" in f["pol"][name]:
                c.offload = f["pol"][name]["offload"]
            c.saves_output = f["pol"][name].get("saves_out", True)
            c.bwd_grad_held_bytes = f["pol"][name].get("grad_held")
            costs.append(c)
        s.policies = costs
        if groups:
            s.groups = f["fitted"]
            if "groups_ms" in f:
                s.groups_fwd_ms, s.groups_bwd_ms = f["groups_ms"]
        if offload_min_bytes is not None:
            s.offload = f.get("offload")
            if s.offload is not None and f.get("stream") is not None:
                o = s.offload
                o.stream_fwd_bytes, o.stream_bwd_bytes, o.stream_bwd_grads_bytes, ahead, back = f["stream"]
                # Where it sends its input: what that input brought back adds to its backward (measured).
                o.stream_bwd_input_bytes = back if o.input else -1
                # The runtime's window: the largest tensor the stage sends (one copy in flight each way, or
                # one tensor ahead, beside the one in use); what it brings back ahead with it, within it.
                o.window_bytes = f.get("largest", 0)
                o.ahead_bytes = min(ahead, o.window_bytes)
                s.offload = o
            s.checkpoint_offload = f.get("ckpt_offload")
        stages_out.append(s)
    chain.stages = stages_out
    chain.validate()
    if saved_calls is not None:
        saved_calls[:] = [f.get("groups", []) for f in fields]
    if saved_storages is not None:
        saved_storages[:] = [f.get("packed") for f in fields]
    if attributes_bytes is not None:
        attributes_bytes[:] = [a + b for a, b in zip(attributes_made, buffers_written)]
    return chain
