"""Selective checkpointing with three outcomes for each operator call: its output kept on the device, sent to
host memory, or recomputed.

    def policy(ctx, op, *args, **kwargs):
        if op in remat.MATMUL_OPS:
            return remat.MUST_CPU_OFFLOAD      # to the host as the forward makes it, back for the recompute
        if op is torch.ops.aten.native_layer_norm.default:
            return CheckpointPolicy.MUST_SAVE  # kept on the device
        return CheckpointPolicy.PREFER_RECOMPUTE
    with remat.offload.offload(model) as o:      # the host pool, the copy engine, what stays (parameters)
        y = remat.checkpoint(block, x, policy=policy, offload=o)

A policy answers as ``torch.utils.checkpoint``'s selective policies do (``CheckpointPolicy``, or a bool: True
is MUST_SAVE), with PyTorch's words for the third outcome: ``MUST_CPU_OFFLOAD`` or ``PREFER_CPU_OFFLOAD``.
PyTorch 2.15 has those two words but its eager checkpoint recomputes what they name; 2.11 lacks them:
``remat.MUST_CPU_OFFLOAD`` and ``remat.PREFER_CPU_OFFLOAD`` are torch's where it has them, remat's own where it
does not, and either is accepted.

The mechanism is remat's own pair of dispatch modes for ``torch.utils.checkpoint``'s ``context_fn`` (the shape of
PyTorch's selective checkpointing, on any torch from 2.4): in the forward pass each call's output is kept
(detached, its version recorded), packed by a ``remat.offload.Offload`` (which starts its copy to the host
at once, and releases the device bytes when the copy has landed: never while it reads them), or forgotten; in
the recompute, a kept output is handed back (autograd's error if written in place since), one sent to the host
comes back through the Offload (every one of the region's is started when the recompute begins, each waited for
before it is read), and the rest is recomputed from them. What an Offload decides itself applies to what it
packs: below its ``min_bytes``, a parameter, a view with gaps or a storage another saved tensor keeps on the
device stays on the device (its ``kept_on_device`` and the pool's bound count those it refuses).

Where an output goes, by the answer:

- ``MUST_SAVE``: kept on the device, always.
- ``PREFER_SAVE`` or True: kept on the device; but a region checkpointed inside an Offload's context (the
  plan's ``Fk[name]@host``, which runs the layer so; or a user's ``with offload(...)``) sends it to the host
  with everything else the region saves, as that Offload sends what autograd saves around it.
- ``MUST_CPU_OFFLOAD``, ``PREFER_CPU_OFFLOAD``: to the host, through the Offload given to the checkpoint, or
  else the enclosing one; with neither, ValueError naming the operator.
- ``MUST_RECOMPUTE``, ``PREFER_RECOMPUTE`` or False: recomputed.

The C++ library's operator policies answer the same words with the same meaning (remat/policy.h's
remat::CheckpointPolicy; there the enclosing Offload is the remat::Offload scope open around the checkpoint).

Outputs that alias an input (views, in-place operators) hold no bytes of their own: a host answer for one
recomputes it (its bytes are its base's, whose own answer decides where they are). Operators with an ordered
effect that torch says it can cache are kept whatever the answer, as PyTorch's eager selective checkpointing
does.
"""
from __future__ import annotations

import enum
import inspect
from collections import defaultdict

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
import torch.utils.checkpoint as _ckpt
from torch.utils.checkpoint import CheckpointPolicy

from .saved import Kept, SavedAs, autograd_saved, storage_of, version_of

__all__ = ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD", "KEEP", "TO_HOST", "RECOMPUTE", "outcome", "SelectiveCache",
           "selective_contexts", "call_name", "CallNames", "GroupPolicy", "IGNORED"]


class _HostWord(enum.Enum):
    """The host words for a torch whose CheckpointPolicy lacks them (before 2.15)."""
    MUST_CPU_OFFLOAD = 4
    PREFER_CPU_OFFLOAD = 5


MUST_CPU_OFFLOAD = getattr(CheckpointPolicy, "MUST_CPU_OFFLOAD", _HostWord.MUST_CPU_OFFLOAD)
PREFER_CPU_OFFLOAD = getattr(CheckpointPolicy, "PREFER_CPU_OFFLOAD", _HostWord.PREFER_CPU_OFFLOAD)

# The three outcomes.
KEEP, TO_HOST, RECOMPUTE = "keep", "host", "recompute"

_OUTCOMES = {CheckpointPolicy.MUST_SAVE: KEEP, CheckpointPolicy.PREFER_SAVE: KEEP,
             CheckpointPolicy.MUST_RECOMPUTE: RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE: RECOMPUTE,
             MUST_CPU_OFFLOAD: TO_HOST, PREFER_CPU_OFFLOAD: TO_HOST,
             _HostWord.MUST_CPU_OFFLOAD: TO_HOST, _HostWord.PREFER_CPU_OFFLOAD: TO_HOST}

# Operators PyTorch's selective checkpointing passes through uncounted (a recompute runs a different number of
# them: detach; metadata operators of subclasses).
IGNORED = getattr(_ckpt, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})
_CACHEABLE_EFFECT = getattr(_ckpt, "_is_cacheable_effect", None)
_HAS_OP_OUTPUT = "op_output" in inspect.signature(_ckpt.SelectiveCheckpointContext.__init__).parameters


def outcome(answer, op, who: str = "remat") -> str:
    """KEEP, TO_HOST or RECOMPUTE for a policy's answer for `op`. Raises TypeError naming the operator and the
    answer for anything else."""
    if isinstance(answer, bool):
        return KEEP if answer else RECOMPUTE
    try:
        return _OUTCOMES[answer]
    except (KeyError, TypeError):
        raise TypeError(f"{who}: a selective policy answered {answer!r} for {op}; the answers are "
                        "CheckpointPolicy's (MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE, PREFER_RECOMPUTE), "
                        "remat.MUST_CPU_OFFLOAD, remat.PREFER_CPU_OFFLOAD, or a bool") from None


def call_name(op) -> str:
    """An operator's qualified name as the C++ dispatcher gives it ("aten::addmm"), without the overload."""
    schema = getattr(op, "_schema", None)
    return schema.name if schema is not None else str(op)


class CallNames:
    """Names each operator call of one forward pass as a saved group names it: "aten::addmm#2", the operator's
    name and how many calls of it came before. The profiler's measurement and the runtime's cache both name
    calls here, so that a group measured is the call asked about."""

    def __init__(self):
        self.counts: dict[str, int] = defaultdict(int)

    def next(self, op) -> str:
        name = _info(op).name
        idx = self.counts[name]
        self.counts[name] = idx + 1
        return f"{name}#{idx}"


class GroupPolicy:
    """The policy of a group assignment (a plan's Fk3{khr}): the call named by group g of the stage
    (remat.SavedGroup.name, "aten::addmm#2": the operator, and which of its calls in the stage's forward pass)
    is kept on the device ('k': MUST_SAVE), sent to the host ('h': MUST_CPU_OFFLOAD) or recomputed ('r');
    every other call is recomputed. It reads the call's name from the context remat's selective checkpointing
    passes (ctx.call)."""

    def __init__(self, names, assignment: str):
        if len(names) != len(assignment) or set(assignment) - set("khr"):
            raise ValueError(f"remat: the group assignment '{assignment}' does not fit the stage's "
                             f"{len(names)} saved groups (one of k, h, r each)")
        words = {"k": CheckpointPolicy.MUST_SAVE, "h": MUST_CPU_OFFLOAD, "r": CheckpointPolicy.PREFER_RECOMPUTE}
        self.assignment = assignment
        self.answers = {name: words[a] for name, a in zip(names, assignment)}

    def __call__(self, ctx, op, *args, **kwargs):
        call = getattr(ctx, "call", None)
        if call is None:
            raise RuntimeError("remat: a group assignment's policy runs under remat's selective checkpointing "
                               "only (it reads which call it is asked about)")
        return self.answers.get(call, CheckpointPolicy.PREFER_RECOMPUTE)


def _views_tracked():
    """ADInplaceOrView back in the keys below a dispatch mode, for a detach whose output shares its input's version
    counter (as a view does). A new guard each time: one object holds one C++ guard, and the forward and a
    backward thread's recompute may be inside theirs at once."""
    return torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False)


def _detached(x):
    # As PyTorch's selective checkpointing detaches what it caches: a view's version counter stays its base's,
    # and the cache holds no graph.
    if not isinstance(x, torch.Tensor):
        return x
    with _views_tracked():
        return x.detach()


class _OpInfo:
    """What the dispatch modes read of an operator on each call, read from it once (its schema, its tags): the
    dispatch modes run for every operator call of a checkpointed region, and their Python time is a step's time
    where a layer's device work is short (docs/BENCHMARKS.md, "remat's checkpoint against torch's, per layer")."""

    __slots__ = ("op", "name", "ignored", "aliases", "seeded", "writes", "cached_effect")

    def __init__(self, op):
        self.op = op  # held, so that the id keying _INFO stays this operator's
        schema = getattr(op, "_schema", None)
        self.name = call_name(op)
        self.ignored = op in IGNORED
        # Whether an output may alias an input (a view, an in-place or out= operator).
        self.aliases = schema is not None and any(r.alias_info is not None for r in schema.returns)
        self.seeded = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
        # The arguments it writes (in-place and out=): (position, name).
        self.writes = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write) if schema is not None else ()
        # An ordered effect that torch's selective checkpointing caches rather than replays (an operator's effect
        # is registered with it, before its first call).
        self.cached_effect = _CACHEABLE_EFFECT is not None and bool(_CACHEABLE_EFFECT(op))


_INFO: dict = {}


def _info(op) -> _OpInfo:
    info = _INFO.get(id(op))
    if info is None or info.op is not op:
        info = _INFO[id(op)] = _OpInfo(op)
    return info


_CONSUMED = object()
# What a call left whose kept or sent output the rest of the region's forward wrote in place, where autograd had not
# saved it (_Forward): let go of at the write, and made again in the recompute.
_WRITTEN = object()
# What a kept call that returned no tensor (None: an ordered effect, aten::_print) left: its recompute hands back
# None rather than running it again (a stored None means "recompute").
_RETURNED_NONE = object()


def _written(func, args, kwargs) -> list:
    """The tensors operator `func` writes (its in-place and out= arguments), from its schema (read once)."""
    names = _info(func).writes
    if not names:
        return []
    got = [args[i] if i < len(args) else kwargs.get(name) for i, name in names]
    return [t for t in got if isinstance(t, torch.Tensor)]


def _map(f, out, kind=torch.Tensor):
    """tree_map(f, out) over the leaves of type `kind` (tensors; what the cache stored for them: SavedAs), the rest
    as they are, without pytree for an operator's usual returns (one leaf; a tuple or list of them and None):
    pytree's walk costs more than the rest of a call's bookkeeping."""
    if isinstance(out, kind):
        return f(out)
    if type(out) in (tuple, list) and all(x is None or isinstance(x, kind) for x in out):
        return type(out)(f(x) if x is not None else None for x in out)
    return tree_map(lambda x: f(x) if isinstance(x, kind) else x, out)


def _leaves(out) -> list:
    """tree_leaves(out), as _map walks it."""
    if type(out) in (tuple, list) and all(x is None or isinstance(x, (torch.Tensor, SavedAs)) for x in out):
        return [x for x in out if x is not None]
    if isinstance(out, (torch.Tensor, SavedAs)):
        return [out]
    return torch.utils._pytree.tree_leaves(out)


def _enclosing_offload():
    """The remat.offload.Offload whose context is the innermost saved-tensor hooks here, or None."""
    from .offload import Offload
    from .saved import top_hooks

    top = top_hooks()
    owner = getattr(top[0], "__self__", None) if top is not None else None
    return owner if isinstance(owner, Offload) else None


class SelectiveCache:
    """One checkpointed region's cache: per operator, per call, what its forward left (a Kept, the Offload's
    handles, or None to recompute)."""

    def __init__(self, policy, offload=None, route_kept: bool | None = None, who: str = "remat",
                 autograd_saved: dict | None = None):
        if route_kept is None:
            enclosing = _enclosing_offload()
            route_kept = enclosing is not None
            if offload is None:
                offload = enclosing
        self.policy, self.offload, self.route_kept, self.who = policy, offload, route_kept, who
        self.who_cache = f"{who} (selective checkpointing's cache)"
        self.entries: dict = defaultdict(dict)
        self.names = CallNames()  # for ctx.call
        self.handles: list = []  # the Offload's handles, in the forward's order
        # What the forward kept or sent, by storage: ((op, call), the storage's weak reference) per storage; and the
        # calls whose storage the rest of the forward wrote in place (recomputed, not handed back: see _Forward).
        self.stored_at: dict = defaultdict(list)
        self.overwritten: set = set()
        # The storages the region's forward has had autograd save so far (saved.version_checked's), or None
        # where the region runs without it.
        self.autograd_saved = autograd_saved
        # Per (op, its call index) kept or sent that draws random numbers: where its device's generator stood
        # after it in the forward pass (_rng_after). The recompute, which starts from the forward's generator
        # state, does not run it: handing it back moves the generator on as the call did, so that a random call
        # after it that is recomputed (dropout) draws what it drew in the forward pass. Before (found on an H200
        # on 2026-12-04): an attention kernel with dropout kept and the dropout after it recomputed drew another
        # mask, and BERT-large's gradients were 5e-3 from the plain run's with its loss equal.
        self.rng_after: dict = {}

    def _store(self, op, info: _OpInfo, args, kwargs, out):
        ctx = (_ckpt.SelectiveCheckpointContext(is_recompute=False, op_output=out) if _HAS_OP_OUTPUT
               else _ckpt.SelectiveCheckpointContext(is_recompute=False))
        ctx.call = self.names.next(op)  # which call this is: "aten::addmm#2" (remat's addition)
        answer = self.policy(ctx, op, *args, **kwargs)
        how = outcome(answer, op, self.who)
        if how == RECOMPUTE and info.cached_effect and answer is not CheckpointPolicy.MUST_RECOMPUTE:
            how = KEEP  # as PyTorch: an ordered effect is cached, not replayed, unless told MUST_RECOMPUTE
        if how == KEEP and self.route_kept and answer is not CheckpointPolicy.MUST_SAVE:
            how = TO_HOST
        if how == TO_HOST and info.aliases:
            how = RECOMPUTE  # no bytes of its own
        if how == RECOMPUTE:
            return None
        if out is None:
            return _RETURNED_NONE
        if how == KEEP:
            with _views_tracked():
                return _map(lambda x: Kept(x, x.detach()), out)
        if self.offload is None:
            raise ValueError(f"{self.who}: a selective policy answered {how!r} (MUST_CPU_OFFLOAD or "
                             f"PREFER_CPU_OFFLOAD) for {op}, and the checkpoint was given no "
                             "remat.offload.Offload to send it with")

        def pack(x):
            # Under the views' key, so that what the Offload holds of x (its copy's source, its version holder)
            # shares x's version counter, as it does outside a dispatch mode: a write while a copy is in flight
            # then shows in the Offload's check. Before (found 2026-12-06), below the dispatch mode its detaches
            # had counters of their own, and a write the check should have refused went unseen.
            with _views_tracked():
                h = self.offload.pack(_detached(x))
            self.handles.append(h)
            return h

        return _map(pack, out)

    def _load(self, stored):
        def get(x):
            if isinstance(x, Kept):
                return x.check(x.tensor, self.who_cache)
            return self.offload.unpack(x)  # what the Offload packed: brought back, or its own Kept

        return _map(get, stored, SavedAs)

    def written(self, call) -> None:
        """The forward wrote in place the storage of what `call` ((op, its index)) left, where autograd had not
        saved it: the plain run is valid, and the recompute makes the call again rather than take the written
        values (_Recompute). Where remat's checkpoint tells which storages autograd saved, what the call left is
        let go of now: kept on the device it would be held to the recompute for nothing, and sent to the host its
        copy may be in flight, reading the written values (found 2026-12-06 on Gemma-3n, whose AltUp adds its
        input to a matrix product's output in place: with copies carried out late, as a GPU's may be, its
        gradients differed from the plain run's, silently). Without that knowledge a kept output waits for the
        recompute, which tells a write autograd would refuse by its version (_Recompute)."""
        op, idx = call
        calls = self.entries.get(op)
        stored = calls.get(idx) if calls is not None else None
        if stored is None or stored is _CONSUMED or stored is _WRITTEN:
            return
        leaves = _leaves(stored)
        if self.autograd_saved is None and all(isinstance(k, Kept) for k in leaves):
            self.overwritten.add(call)
            return
        sent = {id(k) for k in leaves if not isinstance(k, Kept)}
        if sent:
            self.handles = [h for h in self.handles if id(h) not in sent]
        calls[idx] = _WRITTEN


class _Forward(TorchDispatchMode):
    def __init__(self, cache: SelectiveCache):
        super().__init__()
        self.cache = cache
        self.counter: dict = defaultdict(int)  # per operator (by id): its calls so far

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        info = _info(func)
        if info.ignored:
            return func(*args, **kwargs)
        cache = self.cache
        if cache.stored_at and info.writes:
            # An output kept on the device, written in place later in the region's forward. Handed back, the
            # recompute would get the written values and write them again. Through a view that shares its
            # version counter, the check at the recompute raised autograd's error; through one that does not
            # (aten::_unsafe_view: torch.matmul's output on more than two dimensions, written by `scores += bias`
            # in transformers 4.53's T5 attention), nothing saw it (T5's gradients up to 7e-3 from the plain
            # run's, silently). Where autograd had not saved the storage, the plain run is valid: the call is
            # recomputed instead (_Recompute). Where it had, the plain run raises, and so does the check.
            for t in _written(func, args, kwargs):
                key = storage_of(t)
                if cache.autograd_saved is None or not autograd_saved(cache.autograd_saved, key):
                    for call, ref in cache.stored_at.get(key, ()):
                        if not ref.expired():  # (else a later tensor at a freed output's address)
                            cache.written(call)
        out = func(*args, **kwargs)
        counter = self.counter
        idx = counter[id(func)]
        counter[id(func)] = idx + 1
        stored = cache.entries[func][idx] = cache._store(func, info, args, kwargs, out)
        if stored is not None:
            if info.seeded:
                cache.rng_after[(func, idx)] = _rng_after(out)
            # Each output's storage: what stays on the device (kept, or left there by the Offload) stays alive with
            # it, and what went to the host may have its copy in flight (a GPU's, or the CPU's late engine), which a
            # later write reaches. Before (2026-12-06) only the former: the copy's values were taken as the saved.
            if stored is not _RETURNED_NONE:
                for t in _leaves(out):
                    if isinstance(t, torch.Tensor):
                        key = storage_of(t)
                        if key is not None and all(c != (func, idx) for c, _ in cache.stored_at[key]):
                            # With its storage's weak reference: an output sent to the host may be freed once its
                            # copy lands, and a later tensor of the forward take its address.
                            cache.stored_at[key].append(((func, idx), StorageWeakRef(t.untyped_storage())))
        return out


class _Recompute(TorchDispatchMode):
    def __init__(self, cache: SelectiveCache):
        super().__init__()
        self.cache = cache
        self.counter: dict = defaultdict(int)  # per operator (by id): its calls so far

    def __enter__(self):
        self.counter.clear()
        bring_back = getattr(self.cache.offload, "bring_back", None)
        if bring_back is not None and self.cache.handles:
            bring_back(self.cache.handles)  # every copy started; each waited for where it is read
        # The entries hold the handles from here on, each until handed out: a handle kept here would hold its
        # device copy until the region's graph is freed (a layer's sent outputs past its backward, measured).
        self.cache.handles = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        info = _info(func)
        if info.ignored:
            return func(*args, **kwargs)
        counter = self.counter
        idx = counter[id(func)]
        counter[id(func)] = idx + 1
        cache = self.cache
        calls = cache.entries.get(func)
        if calls is None or idx not in calls:
            raise RuntimeError(f"{cache.who}: the recompute called {func} (call {idx}), which the forward "
                               "pass did not; the checkpointed function must run the same operators each time "
                               "(it may depend on state that changed between the forward and the backward)")
        stored = calls[idx]
        if stored is _CONSUMED:
            raise RuntimeError(f"{cache.who}: a region under selective checkpointing was recomputed a second "
                               "time (a backward through it again, retain_graph); what it kept was handed out once")
        if stored is None:
            return func(*args, **kwargs)
        calls[idx] = _CONSUMED
        if stored is _RETURNED_NONE:
            return None
        if stored is _WRITTEN or cache.overwritten and (func, idx) in cache.overwritten and (
                cache.autograd_saved is not None or not any(
                    version_of(k.tensor) != k.version for k in _leaves(stored) if isinstance(k, Kept))):
            # Written after the call, where autograd had not saved it: the plain run is valid, and the call is
            # made again. Without knowing what autograd saved, only a write through an alias that does not
            # share its version counter (which autograd cannot see either); one that moved the version is
            # autograd's error (_load).
            if info.seeded:
                raise RuntimeError(
                    f"{cache.who}: selective checkpointing kept the output of {func} (call {idx}), which the "
                    "forward pass then wrote in place, and the operator draws random numbers, so it cannot be "
                    "recomputed in its place: have the policy recompute it, or write a copy of it")
            return func(*args, **kwargs)  # its kept values were written since: made again (see _Forward)
        if info.seeded:
            _set_rng(cache.rng_after.pop((func, idx), None))  # as the call moved it on in the forward pass
        return cache._load(stored)


def _rng_after(out):
    """The generator state of the device of `out`'s first tensor, now: (device, its bytes), or None without one.
    Held as Python bytes, not as the tensor get_rng_state returns: on a CPU device that tensor (5,056 bytes) would
    sit among the device's bytes until the backward, which no figure counts (found in bench/architectures.py's
    sweep: Phi-3's and Mixtral's steps 5,056 bytes above their predictions)."""
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            if t.device.type == "cpu":
                return t.device, torch.get_rng_state().numpy().tobytes()
            mod = getattr(torch, t.device.type, None)
            if mod is not None and hasattr(mod, "get_rng_state"):
                return t.device, mod.get_rng_state(t.device).numpy().tobytes()
            return None
    return None


def _set_rng(saved) -> None:
    if saved is None:
        return
    device, data = saved
    state = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        getattr(torch, device.type).set_rng_state(state, device)


def selective_contexts(policy, offload=None, route_kept: bool | None = None, who: str = "remat",
                       autograd_saved: dict | None = None):
    """The (forward, recompute) context pair for torch.utils.checkpoint's context_fn. `policy(ctx, op, *args, **kwargs)` answers for each operator call (see the module); `offload`, a
    remat.offload.Offload (or any object with its pack and unpack: the profiler passes counting hooks), sends
    the host answers' outputs (a host answer without one, nor an enclosing Offload, raises ValueError naming
    the operator); `route_kept`: the PREFER_SAVE (or True) answers' outputs go through it too (None: when
    called inside an Offload's context, which is then the offload where none is given). Call it where the
    region begins (torch.utils.checkpoint calls its context_fn there)."""
    cache = SelectiveCache(policy, offload, route_kept, who, autograd_saved)
    return _Forward(cache), _Recompute(cache)
