"""What remat's saved-tensor hooks record of a tensor autograd saves, and the check they make when they hand it
back: that it was not written in place since it was saved, which autograd checks of the tensors it keeps itself
but not of those hooks hand back. Where remat hands back a tensor it did not copy (one an Offload leaves on the
device; one torch.utils.checkpoint's recompute saved and then wrote, running past the write), a written tensor
raises autograd's own error rather than giving a gradient of the values written (the C++ library's
src/runtime/saved.cpp makes the same check)."""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["SavedAs", "Kept", "storage_of", "version_of", "modified_error", "version_checked"]


def storage_of(t: torch.Tensor) -> int | None:
    """The address of a tensor's storage, or None (a tensor without one: a wrapper subclass, an empty one)."""
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def autograd_saved(saved: "dict[int, StorageWeakRef]", key: int | None) -> bool:
    """Whether a storage at address `key` is one of version_checked's saved_storages (`saved`): saved there,
    and still that storage (not a later one at a freed storage's address)."""
    ref = saved.get(key)
    return ref is not None and not ref.expired()


def version_of(t: torch.Tensor) -> int:
    """A tensor's version counter (0 for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return 0


class SavedAs:
    """A saved tensor as autograd saved it: its view (dtype, shape), its version, and what autograd's error for a
    tensor written in place since names (its grad_fn's name and output number)."""

    __slots__ = ("dtype", "shape", "version", "grad_fn", "output_nr")

    def __init__(self, t: torch.Tensor, version: int | None = None):
        """`version`: t's version where the caller has read it already."""
        self.dtype, self.shape = t.dtype, t.shape
        self.version = version_of(t) if version is None else version
        fn = t.grad_fn
        self.grad_fn = type(fn).__name__ if fn is not None else None
        self.output_nr = t.output_nr if fn is not None else 0

    def check(self, t: torch.Tensor, why: str) -> torch.Tensor:
        """t itself, or autograd's error (RuntimeError) when it is not at the version saved; `why`: what handed it
        back, for the error."""
        now = version_of(t)
        if now != self.version:
            raise modified_error(t, self, now, why)
        return t


def modified_error(t: torch.Tensor, saved: SavedAs, now: int, why: str, of: str | None = None) -> RuntimeError:
    """Autograd's error for a saved tensor written in place since it was saved (its words, so that it reads as the
    plain run's), then what handed it back. `of`: what the error says made the tensor, in place of the grad_fn
    `saved` names."""
    if of is None:
        of = f", which is output {saved.output_nr} of {saved.grad_fn}," if saved.grad_fn else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t.type()} {list(saved.shape)}]{of} is at version {now}; expected version {saved.version} instead. "
        f"({why} hands saved tensors back through saved-tensor hooks, where autograd does not check their "
        "versions; remat does.) Clone the tensor before the in-place operation, or make that operation out of "
        "place")


class Kept(SavedAs):
    """A saved tensor hooks leave as it is, held as autograd would keep it: detached (so that it holds no graph:
    a tensor holding its own grad_fn through its saved self is a reference cycle, freed only by Python's cycle
    collector), and checked for in-place writes when it is handed back."""

    __slots__ = ("tensor",)

    def __init__(self, t: torch.Tensor, kept: torch.Tensor):
        super().__init__(t)
        self.tensor = kept


def top_hooks():
    """The innermost saved-tensor hooks on this thread, (pack, unpack), or None (none, or a torch without the
    call that reads them)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(True)
    except TypeError:  # an older signature, without ignore_is_tracing
        return top()


class _Hooks:
    """version_checked's hooks in front of `below` (the hooks in force when they were pushed). Marked as
    torch.utils.checkpoint's own (its `_checkpoint_internal`, with the user's hooks below them in `_user_hooks`
    while they are on the stack), so that selective checkpointing with respect_saved_tensors_hooks sends what a
    policy keeps to the user's hooks (an Offload), not to these. The object itself is the pack hook."""

    __slots__ = ("owner", "pack_below", "unpack_below", "_user_hooks")
    _checkpoint_internal = True

    def __init__(self, owner: "version_checked", below):
        self.owner = owner
        self.pack_below, self.unpack_below = below
        hooks = below  # the user's hooks, as torch finds them below its own
        while hooks is not None and getattr(hooks[0], "_checkpoint_internal", False):
            hooks = getattr(hooks[0], "_user_hooks", None)
        self._user_hooks = hooks


class _Indexed:
    """What the hooks below packed, with its index among the forward's saves: _Forward's record where the packed
    object's identity cannot stand for the index (another object packed before it in this forward had that
    identity)."""

    __slots__ = ("inner", "i")

    def __init__(self, inner, i: int):
        self.inner, self.i = inner, i


class _Forward(_Hooks):
    """The forward pass's hooks: each saved tensor packed by the hooks below, with its index among the forward's
    saves; checked when those hand it back. A saved tensor's record is what the hooks below packed, itself, its
    index kept by its identity (the owner's `index`), nothing more: it is made for every tensor autograd saves,
    and what only the error needs is found when it is raised (docs/BENCHMARKS.md, "The version check's hooks
    cut"). Before 2026-12-07 the record was a tuple (what was packed, the index): an object a saved tensor that
    Python's collector tracks, 38 of the 48 a Llama layer made beside torch.utils.checkpoint's 194, which bring
    on its full collections sooner (docs/BENCHMARKS.md, "Python's garbage collector in a checkpointed step").
    Where the identity was met before in this forward (the hooks below handed one object for two saves, or a
    packed object died and another took its identity), or what was packed is itself an _Indexed (an enclosing
    checkpoint's hooks below these), the record is an _Indexed."""

    __slots__ = ()

    def __call__(self, t):
        owner = self.owner
        i = owner.saves
        owner.saves = i + 1
        saved = owner.saved_storages
        if saved is not None:
            key = storage_of(t)
            if key is not None and not autograd_saved(saved, key):
                saved[key] = StorageWeakRef(t.untyped_storage())
        packed = self.pack_below(t)
        index = owner.index
        if id(packed) in index or type(packed) is _Indexed:  # (an _Indexed of hooks below: another checkpoint's)
            return _Indexed(packed, i)
        index[id(packed)] = i
        return packed

    def unpack(self, packed):
        if type(packed) is _Indexed:
            inner, i = packed.inner, packed.i
        else:
            inner, i = packed, self.owner.index[id(packed)]
        t = self.unpack_below(inner)  # the checkpoint's recompute runs here, when it has not yet
        versions = self.owner.versions
        if i < len(versions):
            try:  # (version_of, inlined: a call per saved tensor is a step's time on a small layer)
                now = t._version
            except RuntimeError:  # an inference tensor
                now = 0
            if now != versions[i]:
                raise self.owner.written_error(t, i)
        return t


class _Recompute(_Hooks):
    """A recompute's hooks: the version of each tensor it saves, in order (the forward's order: the checkpoint
    matches its saves to the forward's by that order too), and a weak reference to the tensor until the recompute
    ends (see version_checked.written_in_recompute)."""

    __slots__ = ()

    def __call__(self, t):
        owner = self.owner
        owner.versions.append(t._version)  # autograd refuses an inference tensor before its hooks see it
        owner.recomputed.append(weakref.ref(t))
        return self.pack_below(t)  # may end the recompute (early stopping)

    def unpack(self, packed):
        return self.unpack_below(packed)


class version_checked:
    """fn, run behind saved-tensor hooks in front of those in force when it runs: torch.utils.checkpoint's, in a
    checkpoint's forward pass and in its recompute. The checkpoint hands back what its recompute saved, and a
    recompute that runs past an in-place write to a tensor it saved (sigmoid's output written by a later mul_;
    early stopping ends a recompute at its last save, not when saves follow the write) gave the gradient of the
    values written, where plain autograd raises. Each tensor the recompute hands back must be at the version the
    recompute saved it at, or the hooks raise autograd's error. One object per checkpoint call: its first run
    is the forward pass, later ones recomputes. Without hooks in force (no grad), fn runs as it is. A class, so
    that what holds it copies and pickles."""

    def __init__(self, fn, track_storages: bool = False):
        self.fn = fn
        self.saves = 0  # the forward pass's saves so far
        # The index among them of each object the hooks below packed, by its identity (_Forward's record: the
        # object stays alive while autograd holds it, and an identity met again is recorded apart, _Indexed).
        self.index: dict[int, int] = {}
        # With track_storages, the storages of what the forward pass's autograd saved, each by its address with a
        # weak reference to it (selective checkpointing reads it, autograd_saved(): a kept output written in
        # place after autograd saved it is autograd's error, as in the plain run; one written that autograd did
        # not save is recomputed); else None. Weak: a checkpointed forward lets go of what autograd saves, and a
        # later tensor may take a saved one's address. Before (found 2026-12-06 on Llama 4's MoE, whose shared
        # expert's product, written in place by `out.add_`, took the address of a tensor the forward had saved
        # and let go of), such a tensor read as saved: its kept values were handed back written (autograd's
        # error, on a valid program), or its copy to the host, in flight, refused; as addresses fell, by chance.
        self.saved_storages: dict[int, StorageWeakRef] | None = {} if track_storages else None
        self.versions: list[int] = []  # the last recompute's saved tensors' versions, in order
        # Weak references to the tensors the recompute saved, while it runs. Held, they were alive to its end
        # where the checkpoint lets go of them sooner: what the forward saved on a branch whose graph it let go of
        # (a router's scores, read only by a top-k; the checkpoint keeps no holder for those), 6.9 MB of a
        # DeepSeek-V4 layer's 15.3 MB (found 2026-12-07: its every-layer-checkpointed step 9.5% above its
        # prediction, the recompute's peak 32.5 MB against torch.utils.checkpoint's 25.6 alone).
        self.recomputed: list[weakref.ref] = []
        # Of those the recompute wrote after it saved them, by index: the name of each one's grad_fn after the
        # write, for the error. Read at the recompute's end: the grad_fn it had when saved (autograd's error names
        # that one) would be read of every tensor as it is saved, 1.7 us a tensor on the CI machine's CPU, where
        # the rest of these hooks cost about 5.
        self.now_made_by: dict[int, str] = {}
        self.ran = False

    def written_error(self, t: torch.Tensor, i: int) -> RuntimeError:
        """Autograd's error for t, the recompute's i-th saved tensor as handed back, written since it was saved."""
        saved = SavedAs.__new__(SavedAs)
        saved.dtype, saved.shape, saved.version = t.dtype, t.shape, self.versions[i]
        saved.grad_fn, saved.output_nr = None, 0
        now_by = self.now_made_by.get(i)
        of = f", whose grad_fn after the write is {now_by}," if now_by else None
        return modified_error(t, saved, version_of(t), "torch.utils.checkpoint's recompute", of)

    def written_in_recompute(self) -> None:
        """At a recompute's end: the grad_fn of each tensor it saved and then wrote, for the error (now_made_by),
        and the tensors let go of. A tensor written after this (by a backward function, through another saved
        alias of it) is refused all the same, its error without that name."""
        recomputed, self.recomputed = self.recomputed, []
        for i, ref in enumerate(recomputed):
            t = ref()
            if t is not None and t._version != self.versions[i]:
                fn = t.grad_fn
                if fn is not None:
                    self.now_made_by[i] = type(fn).__name__

    def __call__(self, *args, **kwargs):
        below = top_hooks() if torch.is_grad_enabled() else None
        if below is None:
            return self.fn(*args, **kwargs)
        recompute = self.ran
        if recompute:
            self.versions, self.now_made_by = [], {}
            hooks = _Recompute(self, below)
        else:
            self.ran = True
            hooks = _Forward(self, below)
        try:
            with torch.autograd.graph.saved_tensors_hooks(hooks, hooks.unpack):
                return self.fn(*args, **kwargs)
        finally:
            hooks._user_hooks = None  # only while on the stack (what torch's own hooks do): nothing held after
            if recompute:  # ended, or stopped early by the checkpoint's hook below (an exception through here)
                self.written_in_recompute()
