"""The state a recompute or a measurement must leave as it found it: buffers, tensor attributes and random
generators."""
from __future__ import annotations

import operator
from itertools import chain, repeat
from typing import Iterable, Sequence

import torch
from torch import nn

__all__ = ["AttributesSeen", "RestoreAttributes", "RestoreBuffers", "RestoreModules", "RngState", "Walk", "kept_walk",
           "module_tensors", "walk"]


def each_module(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """`modules` and their submodules, each once, in named_modules()'s order (pre-order, children in order), read
    from each module's own dictionary of children (see module_tensors)."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = list(modules)
    stack.reverse()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        children = m.__dict__["_modules"]
        if children:
            stack.extend(reversed([c for c in children.values() if c is not None]))
    return out


def module_tensors(modules: Iterable[nn.Module], parameters: bool = True, buffers: bool = True) -> list[torch.Tensor]:
    """The parameters and/or buffers of `modules` and their submodules, each module visited once (a tensor shared
    by two modules may appear twice). What Module.parameters() and buffers() yield, read from each module's own
    dictionaries: those walk named_modules() with a generator per module and build each name, about four times the
    time (a 16-layer Llama's: 0.33 against 0.09 ms on the CI machine's CPU), which remat's per-step and
    per-layer paths would pay on every step."""
    out: list[torch.Tensor] = []
    for m in each_module(modules):
        d = m.__dict__
        if parameters:
            for t in d["_parameters"].values():
                if t is not None:
                    out.append(t)
        if buffers:
            for t in d["_buffers"].values():
                if t is not None:
                    out.append(t)
    return out


def each_once(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in order, each once (a parameter or buffer shared by several modules is met again)."""
    out, seen = [], set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class RestoreBuffers:
    """A context that puts the buffers of `modules` back as they were when it was entered (a recompute must not
    update BatchNorm's running statistics a second time; a measurement must not update them at all). The
    write goes through .data, so graphs that saved a buffer (BatchNorm's backward saves the statistics) see no
    version change."""

    __slots__ = ("buffers", "saved")

    def __init__(self, modules: "Iterable[nn.Module] | Walk", *, walked: bool = False):
        """modules: modules, or their Walk. walked (accepted as before: each_module's list walks to itself):
        `modules` is each_module's list already."""
        buffers = modules.buffers() if isinstance(modules, Walk) else module_tensors(modules, parameters=False)
        self.buffers = each_once(buffers) if len(buffers) > 1 else buffers
        self.saved = None

    def __enter__(self):
        if self.buffers:  # (none: no grad-mode context either, which costs more than the rest inside a step)
            with torch.no_grad():
                self.saved = [b.clone() for b in self.buffers]
        return self

    def __exit__(self, *exc):
        if self.buffers:
            with torch.no_grad():
                for b, s in zip(self.buffers, self.saved):
                    if b.shape == s.shape:
                        b.data.copy_(s)
        self.saved = None
        return False


_ABSENT = object()


def _tensor_or_none(v) -> bool:
    return v is None or isinstance(v, torch.Tensor)


# The attributes every nn.Module has (its dictionaries of parameters, buffers, submodules and hooks, `training`):
# never state. 221 of a Llama layer's 261 module attributes; an isinstance() on each took about 20 us.
_MODULE_KEYS = frozenset(nn.Module().__dict__)


def _state_keys(d: dict) -> list[str]:
    """The keys of module dictionary `d` whose values are a tensor or None, nn.Module's own aside."""
    return [k for k in d.keys() - _MODULE_KEYS if _tensor_or_none(d[k])]


def _put(d: dict, changes: list[tuple[str, object]]) -> None:
    for k, old in changes:
        if old is _ABSENT:
            d.pop(k, None)
        else:
            d[k] = old


class Walk:
    """`modules` and their submodules (each_module), with what the attribute contexts read of them: each one's
    dictionary, and per dictionary its size and the keys whose values were a tensor or None when last read (the
    attributes that can hold state; read again where the dictionary's size changed: an attribute made since, but
    not one made where another was deleted in the same call). A caller may keep it across calls while current():
    made again where a submodule was added, removed or replaced since."""

    __slots__ = ("modules", "dicts", "children", "child_dicts", "child_sizes", "buffer_dicts", "parameter_dicts",
                 "sizes", "keys", "all_keys", "flat_dicts", "flat_keys", "forwards", "written")

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        # AttributesSeen's: whether a forward of these modules has run under one, and the ids of the buffers a
        # forward wrote in place (whose values it clones at the start of the next ones).
        self.forwards, self.written = False, set()
        self.dicts = [m.__dict__ for m in modules]
        self.child_dicts = [d["_modules"] for d in self.dicts]
        self.buffer_dicts = [d["_buffers"] for d in self.dicts]
        self.parameter_dicts = [d["_parameters"] for d in self.dicts]
        self.child_sizes = list(map(len, self.child_dicts))
        self.children = list(chain.from_iterable(map(dict.values, self.child_dicts)))
        self.sizes = list(map(len, self.dicts))
        self.keys = list(map(_state_keys, self.dicts))
        self.all_keys = list(map(set, self.dicts))
        self._flatten()

    def _flatten(self) -> None:
        self.flat_dicts = [d for d, keys in zip(self.dicts, self.keys) for _ in keys]
        self.flat_keys = [k for keys in self.keys for k in keys]

    def buffers(self) -> list[torch.Tensor]:
        """The modules' buffers, now (a buffer shared by two modules twice)."""
        if not any(map(len, self.buffer_dicts)):  # (most layers have none: C's loops only)
            return []
        return [b for b in chain.from_iterable(map(dict.values, self.buffer_dicts)) if b is not None]

    def tensors(self) -> list[torch.Tensor]:
        """The modules' parameters and buffers, now (module_tensors' list, read in C's loops: a parameter swapped
        in since the walk, as FSDP2 swaps its unsharded ones in, is the one read)."""
        return [t for t in chain.from_iterable(map(dict.values, chain(self.parameter_dicts, self.buffer_dicts)))
                if t is not None]

    def buffer_names(self, buffers: Iterable[torch.Tensor]) -> list[str]:
        """The names of `buffers` ("BatchNorm2d.running_mean"), for an error."""
        ids = {id(b) for b in buffers}
        return [f"{type(m).__name__}.{k}" for m in self.modules for k, b in m.__dict__["_buffers"].items()
                if id(b) in ids]

    def current(self) -> bool:
        """Whether the modules are as walked (no submodule added, removed or replaced): C's loops only."""
        return list(map(len, self.child_dicts)) == self.child_sizes and \
            all(map(operator.is_, chain.from_iterable(map(dict.values, self.child_dicts)), self.children))

    def snapshot(self) -> tuple[list[int], list]:
        """The dictionaries' sizes and the tracked attributes' values, now (their keys read again first where a
        dictionary's size changed since they were)."""
        sizes = list(map(len, self.dicts))
        if sizes != self.sizes:
            for i, (d, n) in enumerate(zip(self.dicts, sizes)):
                if n != self.sizes[i]:
                    self.sizes[i] = n
                    self.keys[i] = _state_keys(d)
                    self.all_keys[i] = set(d)
            self._flatten()
        return sizes, list(map(dict.get, self.flat_dicts, self.flat_keys, repeat(_ABSENT)))

    def changes(self, snap: tuple[list[int], list]) -> list[list[tuple[str, object]]] | None:
        """Per dictionary, the attributes reassigned since `snap` (snapshot()): (name, its value then, or _ABSENT
        where it had none) for a tracked one whose value is another object now (or that was deleted), and for one
        made since that holds a tensor; None where none changed (found at once, in C's loops)."""
        sizes, values = snap
        now = list(map(dict.get, self.flat_dicts, self.flat_keys, repeat(_ABSENT)))
        if list(map(len, self.dicts)) == sizes and all(map(operator.is_, now, values)):
            return None
        out = []
        at = 0
        for i, (d, keys) in enumerate(zip(self.dicts, self.keys)):
            changed = [(k, old) for k, old, v in zip(keys, values[at:at + len(keys)], now[at:at + len(keys)])
                       if v is not old]
            at += len(keys)
            if len(d) != sizes[i]:  # (all_keys is the dictionary's keys at the snapshot, its size sizes[i])
                changed += [(k, _ABSENT) for k in d.keys() - self.all_keys[i] if isinstance(d[k], torch.Tensor)]
            out.append(changed)
        return out if any(out) else None


def walk(modules) -> Walk:
    """The Walk of `modules` (a Walk is returned as it is). A caller that runs the same modules again keeps its
    Walk while it is current (LayerPlan.walk_of: each layer's). Not kept here by module: a Walk holds the
    modules' dictionaries, one of which may hold its module (remat's planned forward does), and a cache keyed
    weakly by module would hold every model it saw (found 2026-12-07: the architecture sweep ran out of memory
    at its 75th model)."""
    if isinstance(modules, Walk):
        return modules
    return Walk(each_module(modules))


def kept_walk(walks: dict, key, module: nn.Module) -> Walk:
    """walks[key], the Walk of `module` that a caller keeps across calls, made where missing or no longer current
    (LayerPlan.walk_of's per layer, the profiler's per stage)."""
    w = walks.get(key)
    if w is None or not w.current():
        w = walks[key] = walk([module])
    return w


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values (one holding a NaN never does: taken as written, copied)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


class AttributesSeen:
    """A context around a checkpointed forward: on exit, of the tensor attributes of `modules` and their submodules
    that the forward reassigned (as RestoreAttributes reads them), the values they had when it began (`seen`, a
    list per module, or None), for its recompute to see (RestoreAttributes(..., seen=)). A layer that carries
    state across calls (reads `self.h` from its last call, then writes the new one) read its own new state in the
    recompute, and its gradients were the new state's, silently: torch.utils.checkpoint's recompute runs the
    module as it finds it (found 2026-12-07: a Linear-sigmoid layer adding its last call's mean, every gradient
    of its second step wrong). Holds those values until the recompute (the plain run lets go of one as the
    forward reassigns it; the profiling step charges what a layer leaves in them, StepContext's
    checkpoint_state_bytes). `modules`: modules, or their Walk.

    Likewise the buffers the forward writes in place (a running average it reads, an EMA codebook): `found`, each
    such buffer with a copy of its value when the forward began, which RestoreModules(..., seen=) sets for the
    recompute. A copy is made at the start of a forward of every buffer of the modules on the Walk's first
    forward, and of those a forward of it wrote since (Walk.written: its version moved, or at the first forward
    its values did: a write through `.data` or inside a kernel, as BatchNorm's statistics, moves no version); a
    buffer that a later forward writes by an in-place operator and its first did not write has no copy
    (`unkept`): its recompute raises rather than read the value written. One a later forward first writes
    through `.data` is not seen. (BatchNorm's statistics, written every training step and not read there, are
    copied too: a few floats.)"""

    __slots__ = ("walk", "before", "seen", "found", "unkept", "_buffers", "_versions", "_copies")

    def __init__(self, modules):
        self.walk = walk(modules)
        self.before = None
        self.seen: list[list[tuple[str, object]]] | None = None
        self.found: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.unkept: list[torch.Tensor] | None = None
        self._buffers = self._versions = self._copies = None

    def __enter__(self):
        w = self.walk
        self.before = w.snapshot()
        buffers = w.buffers()
        if buffers:
            self._buffers, self._versions = buffers, [b._version for b in buffers]
            if not w.forwards or w.written:
                with torch.no_grad():
                    self._copies = {id(b): b.clone() for b in buffers if not w.forwards or id(b) in w.written}
        return self

    def __exit__(self, *exc):
        before, self.before = self.before, None
        w = self.walk
        self.seen = w.changes(before)
        first = not w.forwards
        w.forwards = True
        if self._buffers is not None:
            unkept, copies = [], self._copies or {}
            for b, v in zip(self._buffers, self._versions):
                # Written: its version moved (an in-place operator), or, at the first forward, where every buffer
                # has its copy, its values did (a write through .data, or inside a kernel: BatchNorm's statistics).
                if b._version != v or (first and not _same(b, copies[id(b)])):
                    w.written.add(id(b))
                    if id(b) not in copies:
                        unkept.append(b)
            found = {id(b): (b, copies[id(b)]) for b in self._buffers if id(b) in w.written and id(b) in copies}
            self.found, self.unkept = list(found.values()) or None, unkept or None
            self._buffers = self._versions = self._copies = None
        return False


class RestoreAttributes:
    """A context that puts back, on exit, the plain attributes of `modules` and their submodules (the entries of
    each one's __dict__: not its parameters, buffers or submodules) that the code inside reassigned, where the
    attribute held a tensor or None when the modules were walked (Walk), or is made inside and holds a tensor: as
    they were on entry (one made inside is deleted). With `seen` (an AttributesSeen that ran around the forward
    this code recomputes), the attributes that forward reassigned are first set, on entry, to what it found. A
    layer that keeps a tensor of its forward on itself (RecurrentGemma's recurrent block, its last recurrent
    state: `self.recurrent_states = ...`) would otherwise keep the recompute's: a tensor whose graph, made by the
    recompute and never run backward, holds what the recompute saved (torch.utils.checkpoint's recompute hooks
    keep each saved tensor's storage in it) until the layer's next forward assigns another: through the
    optimizer's step and into the next step (found 2026-12-07: 3.16 MB a step held so on the sweep's
    RecurrentGemma, its four layers checkpointed, where the plain run holds 1 KiB). As the plain run has it, the
    attribute holds what the forward assigned. Other attributes (a counter, a flag, an object) are left as the
    code inside left them. About 1.4 us a Llama layer's entry and exit, its Walk kept (the CI machine's CPU; 27 us
    with the Walk made: LayerPlan keeps each layer's). `modules`: modules, or their Walk."""

    __slots__ = ("walk", "saved", "seen")

    def __init__(self, modules, seen: AttributesSeen | None = None):
        self.walk = walk(modules)
        self.saved = None
        self.seen = seen

    def __enter__(self):
        self.saved = self.walk.snapshot()
        seen = self.seen.seen if self.seen is not None else None
        if seen:
            for d, changes in zip(self.walk.dicts, seen):
                _put(d, changes)
        return self

    def reassigned_bytes(self, but: int | None = None) -> int:
        """Inside: the bytes of the tensors the code inside has put into the attributes it reassigned so far, each
        storage once, but the storage whose data pointer is `but`."""
        changes = self.walk.changes(self.saved) if self.saved is not None else None
        seen: set[int] = {but} if but is not None else set()
        total = 0
        for d, changed in zip(self.walk.dicts, changes or ()):
            for k, _ in changed:
                v = d.get(k)
                if isinstance(v, torch.Tensor):
                    try:
                        storage = v.untyped_storage()
                    except RuntimeError:  # no storage (a fake or sparse tensor)
                        continue
                    if storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        total += storage.nbytes()
        return total

    def __exit__(self, *exc):
        saved, self.saved = self.saved, None
        changes = self.walk.changes(saved)
        if changes:
            for d, changed in zip(self.walk.dicts, changes):
                _put(d, changed)
        return False


class RestoreModules:
    """RestoreBuffers and RestoreAttributes together, over one walk of the modules: what a recompute and a
    measurement leave as they found it (the random generators aside, RngState). `seen`: RestoreAttributes'."""

    __slots__ = ("buffers", "attributes")

    def __init__(self, modules, seen: AttributesSeen | None = None):
        """modules: modules, or their Walk."""
        w = walk(modules)
        self.buffers = RestoreBuffers(w)
        self.attributes = RestoreAttributes(w, seen=seen)

    def __enter__(self):
        self.buffers.__enter__()
        seen = self.attributes.seen
        if seen is not None and seen.unkept:
            names = ", ".join(self.attributes.walk.buffer_names(seen.unkept))
            self.buffers.__exit__(None, None, None)
            raise RuntimeError(
                f"remat: a checkpointed layer's forward wrote the buffer(s) {names} in place, which its first "
                "checkpointed forward did not write, so no copy of their value before the write was kept; the "
                "recompute would read the value written and its gradients would be wrong. Have its first forward "
                "write them, or keep the layer")
        if seen is not None and seen.found:
            with torch.no_grad():
                for b, value in seen.found:  # (through .data: graphs that saved the buffer see no new version)
                    if b.shape == value.shape:
                        b.data.copy_(value)
        self.attributes.__enter__()
        return self

    def __exit__(self, *exc):
        self.attributes.__exit__(*exc)
        self.buffers.__exit__(*exc)
        return False


class RngState:
    """The CPU generator's state and those of CUDA devices (`cuda_devices`, or every initialised one when None)."""

    def __init__(self, cuda_devices: Sequence[int] | None = None):
        self.cpu = torch.get_rng_state()
        if cuda_devices is None:
            cuda_devices = (range(torch.cuda.device_count())
                            if torch.cuda.is_available() and torch.cuda.is_initialized() else ())
        self.cuda = [(d, torch.cuda.get_rng_state(d)) for d in cuda_devices]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, s in self.cuda:
            torch.cuda.set_rng_state(s, d)
