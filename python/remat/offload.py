"""Offloading what autograd saves to host memory, and bringing it back ahead of its backward use.

    pool = remat.offload.HostPool(max_bytes=8 << 30)          # reused across steps; pinned on CUDA
    with remat.offload.offload(pool=pool, min_bytes=1 << 20):  # every tensor saved for backward of 1 MiB or more
        loss = model(batch).loss
    loss.backward()

Inside the context, each tensor autograd saves (through ``torch.autograd.graph.saved_tensors_hooks``) of at least
``min_bytes`` goes to a block of the host pool: on CUDA, copied on a side stream after the producing stream's work
(an event orders them), the device tensor kept alive until the copy's event has completed, then released; on
the CPU (where "device" and "host" are one memory, so that the mechanism is testable without a GPU), copied at
once. Saved tensors that are parameters or buffers (alive anyway), or below the threshold, stay where they are,
and so does every saved tensor of a storage one of them keeps on the device (a view with gaps, such as a
slice of a padded key): copying it would free nothing. Dense views that are not contiguous (a transposed query or
attention output) are sent as their storage's bytes and come back as the same view. Bytes saved by several operators,
each through a view of its own (an input three projections save), are copied once, as are bytes saved within bytes
saved whole before them (one entry, brought back once). In the backward pass, unpacking a tensor brings it back
to the device, and starts bringing back the ``lookahead`` tensors saved before it (the backward pass meets them
next, in the reverse of the forward's order), so that its copy has overlapped the backward work between; a
tensor is never read before its copy has landed (the copy engine's event is waited on first). The device copy
is held until autograd drops the saved tensor; then its host block goes back to the pool (after the backward
pass, or with the graph). A saved tensor still alive on the device when it is needed back (another holder kept
it there, such as the layer before, whose output it is, or a tensor autograd saved outside the context) and not
written since (its version counter, which the entry shares through a tensor without storage) is handed out as
it is: no second copy on the device. What stays on the device is held detached (no reference cycle: it is freed with its
graph) and checked when handed back: written in place since it was saved, it raises autograd's own error
(remat/saved.py), which autograd does not raise behind hooks. Conjugate and negative views stay, with their bits.
Contexts end in the reverse order of their start; one that does not is refused.

The host bytes are the pool's: ``pool.in_use_bytes``, ``pool.peak_bytes`` (the most in use at once) and
``pool.reserved_bytes`` (allocated, kept for reuse); ``max_bytes`` bounds what it allocates, and a tensor that
would exceed it stays on the device (counted in ``Offload.kept_on_device``). Unpinned blocks (the CPU's) are
Python's memory, not torch's allocator's: on a machine whose "device" is the CPU, remat's CPU meter counts the
device's tensors and the pool counts the host's, apart.

With ``window`` (bytes), an Offload streams: at most that much of its copies to the host is in flight (the
oldest waited for past it; 0 waits for each at once), and in the backward pass the tensors saved before the one
asked for come back ahead of their use while those brought back and not yet asked for stay within that much
(in place of ``lookahead``; wherever they were saved: a tensor saved by two operators is asked for at the later
one's backward); ``prefetch()`` brings back that much. A layer's backward then holds its working set and a
window, not everything the layer saved (the plan's ``Fa3@stream``).

Planned offloading (``remat.enable(..., offload=True)``, remat/planner/plan.h's ``@host`` operations) runs each offloaded
layer under an Offload of its own with ``lookahead=0`` and calls ``finish_copies()`` and ``prefetch()`` at the
points the plan's memory model names. On the CPU the copies run in the caller's thread: they do not overlap
computation as on a GPU's side stream, so there the time model's hiding of copies does not hold (the CPU runs
exist for testing: what is moved, when it comes back, the gradients). docs/BENCHMARKS.md has the times
measured on a GPU against the predicted ones.
"""
from __future__ import annotations

import contextlib
import weakref
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .saved import Kept, SavedAs, modified_error, top_hooks, version_of

__all__ = ["HostPool", "CopyEngine", "Offload", "offload", "offloadable", "measure_bandwidth", "storage_ptrs"]

_ALIGN = 512


def _rounded(nbytes: int) -> int:
    return max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)


class HostPool:
    """Blocks of host memory (pinned when `pin`, the default on a machine with CUDA), reused by size: a block
    returned with give() serves the next take() of the same rounded size. max_bytes: the most it allocates
    (None: no bound). Counts in bytes: reserved_bytes (allocated), in_use_bytes, peak_bytes (of in_use)."""

    def __init__(self, max_bytes: int | None = None, pin: bool | None = None):
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"remat.offload.HostPool: max_bytes must be a number of bytes >= 0 or None, got "
                             f"{max_bytes!r}")
        self.max_bytes = max_bytes
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._free: dict[int, list[torch.Tensor]] = {}
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.peak_bytes = 0

    def _allocate(self, size: int) -> torch.Tensor | None:
        if self.max_bytes is not None and self.reserved_bytes + size > self.max_bytes:
            return None
        if self.pin:
            block = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            # Memory of Python's, not torch's allocator: on a machine whose "device" is the CPU (the tests), remat's
            # CPU meter, which counts torch's CPU allocations, counts the host's blocks apart (the pool's own counts).
            block = torch.frombuffer(bytearray(size), dtype=torch.uint8)
        self.reserved_bytes += size
        return block

    def reserve(self, nbytes: int, block_bytes: int) -> None:
        """Allocates blocks of block_bytes (rounded) until nbytes are reserved, for later take()s of that
        size. Raises ValueError beyond max_bytes."""
        size = _rounded(block_bytes)
        for _ in range(-(-nbytes // size)):
            block = self._allocate(size)
            if block is None:
                raise ValueError(f"remat.offload.HostPool.reserve: {nbytes} bytes exceed max_bytes={self.max_bytes}")
            self._free.setdefault(size, []).append(block)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A block of at least nbytes (uint8), or None when max_bytes does not allow one."""
        size = _rounded(nbytes)
        free = self._free.get(size)
        block = free.pop() if free else self._allocate(size)
        if block is None:
            return None
        self.in_use_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return block

    def give(self, block: torch.Tensor) -> None:
        self.in_use_bytes -= block.numel()
        self._free.setdefault(block.numel(), []).append(block)

    def release(self) -> None:
        """Frees the blocks not in use."""
        for blocks in self._free.values():
            self.reserved_bytes -= sum(b.numel() for b in blocks)
        self._free.clear()


def _plain_ptr(t, alive: set[int], also: "set[int] | frozenset[int]" = frozenset()) -> int:
    """The data pointer of a plain strided tensor's storage (not a parameter or a subclass), 0 for any other
    tensor and for a storage of `alive` or `also` (parameters, buffers)."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_meta:
        return 0
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0
    return 0 if ptr in alive or ptr in also else ptr


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one byte range without gaps or overlaps (contiguous, or a permutation of it)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def offloadable(t, min_bytes: int, alive: set[int]) -> bool:
    """Whether offloading hooks send this saved tensor to the host: a plain strided tensor (not a parameter or
    a subclass) of at least min_bytes, dense (its elements fill one byte range without gaps or overlaps:
    contiguous, or a permutation of contiguous such as an attention kernel's transposed query), not a conjugate
    or negative view (its bytes are not its values), whose storage is not one of `alive` (parameters,
    buffers)."""
    return _offloadable_ptr(t, min_bytes, alive) != 0


def _offloadable_ptr(t, min_bytes: int, alive: set[int], also: "set[int] | frozenset[int]" = frozenset()) -> int:
    """offloadable()'s rule, `also` a second set of storages alive (read in place, not merged into one set): the
    data pointer of t's storage where t is sent, else 0."""
    # Unlike the C++ library's rule, a leaf that requires grad is not excluded: the profile stands in a layer's
    # input (a non-leaf in the step) with such a leaf, and must see it go as the step's input would.
    ptr = _plain_ptr(t, alive, also)
    return ptr if ptr and t.nbytes >= min_bytes and _dense(t) and not t.is_conj() and not t.is_neg() else 0


def storage_ptrs(tensors) -> set[int]:
    """The data pointers of the tensors' storages (what Offload.keep_on_device keeps on the device)."""
    out = set()
    for t in tensors:
        try:
            out.add(t.untyped_storage().data_ptr())
        except RuntimeError:
            pass
    return out


def measure_bandwidth(device: torch.device, nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, float]:
    """The bandwidth of copies of nbytes from `device` to host memory (pinned where CUDA is) and back, as the
    copy engine makes them: (to the host, to the device) in GB/s (10^9 bytes per second), medians of `repeats`.
    On the CPU, a copy between two of its buffers."""
    import statistics
    import time
    nbytes = max(1 << 16, int(nbytes))
    pool = HostPool(pin=device.type == "cuda")
    host = pool.take(nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    engine = CopyEngine(device)
    times: dict[bool, list[float]] = {True: [], False: []}

    def timed(dst, s, to_host):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        done = engine.copy(dst, s)
        if done is not None:
            done.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[to_host].append(time.perf_counter() - t0)

    for r in range(repeats + 1):  # the first round warms up
        timed(host[:nbytes], src, True)
        timed(src, host[:nbytes], False)
        if r == 0:
            times = {True: [], False: []}
    pool.give(host)
    return tuple(nbytes / max(statistics.median(times[d]), 1e-9) / 1e9 for d in (True, False))


class _Done:
    """A copy in flight: query() says whether it has completed, wait() waits for it (the current stream too,
    on CUDA, so that its next work reads the copy). `at_once`: made already (the CPU), only its source held
    until waited on (CopyEngine's `hold`)."""

    def __init__(self, query, wait, at_once: bool = False):
        self.query, self.wait, self.at_once = query, wait, at_once


# What a copy made at once holds until waited on (CopyEngine's `hold`): its source, nothing else to wait for.
_HELD = _Done(lambda: False, lambda: None, at_once=True)


class CopyEngine:
    """Copies between the device and host blocks; copy() returns None when the copy has completed, else a
    _Done to query and wait on. The CPU engine copies at once; the CUDA engine on a side stream, after the
    current stream's work. `delay` (CPU, tests): a
    copy is carried out only when waited on or when `delay` later copies have been started, and holds only a
    weak reference to its source, so that reading a destination early, or releasing a source before its copy,
    shows (wrong values, or an error naming it). `hold` (CPU, with no delay): a copy to the host, made at once,
    still holds its source on the device until waited on (finish_copies(), a window's bound, the tensor brought
    back), as a GPU holds it while a copy that outlasts the work beside it is in flight; the planned layers'
    engines hold (layer_offload.py), so that on the CPU the device's bytes are what a plan's model charges and
    its tests check that charge. Before (2026-12-06) the source went at once there: a plan's peak beside a copy
    in flight read up to a layer's sent bytes below its prediction on the CPU. The values are copied at once
    either way, so a write in place after the copy is no error."""

    # The default of host_wait for engines made without it (the planned layers' own): True. Experimental, not yet
    # run on a GPU: bench/offload_cuda.py's --no-host-wait sets it False for a comparison.
    HOST_WAIT = True

    def __init__(self, device: torch.device, delay: int = 0, hold: bool = False, host_wait: bool | None = None):
        self.device = device
        self.delay = delay
        self.hold = hold and device.type == "cpu" and delay <= 0
        self._pending: list[list] = []
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CUDA: whether waiting for a copy also blocks the host until it has completed (True, as run on the GPUs
        # so far), or only makes the current stream wait for it (False, experimental), so that the host may
        # queue work ahead of the device past a layer whose copies it waits for. Without it, a copy back to
        # the device writes memory taken from the copy stream's own pool (allocation_stream()), so that it
        # need not wait for the work queued on the current stream, and the memory is marked as used by the
        # current stream, which reads it.
        if host_wait is not None and not isinstance(host_wait, bool):
            raise ValueError(f"remat.offload.CopyEngine: host_wait must be True, False or None, got {host_wait!r}")
        self.host_wait = bool(CopyEngine.HOST_WAIT) if host_wait is None else host_wait

    @property
    def allocates_apart(self) -> bool:
        """Whether a copy's device destination is allocated in allocation_stream() (else where the caller is)."""
        return self._stream is not None and not self.host_wait

    def allocation_stream(self):
        """The context to allocate a copy's device destination in: the copy stream's where copies back need not
        wait for the current stream's queued work (host_wait False, CUDA), else nothing."""
        if self._stream is not None and not self.host_wait:
            return torch.cuda.stream(self._stream)
        return contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> _Done | None:
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            # A copy to the host reads what the current stream's queued work makes; a copy back into memory of
            # the copy stream's own (host_wait False) waits for nothing of it.
            back_ahead = not self.host_wait and not src.is_cuda and dst.is_cuda
            if not back_ahead:
                self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            src.record_stream(self._stream) if src.is_cuda else None
            if back_ahead:
                dst.record_stream(current)  # its reader; freed, it waits for that stream's work
            elif dst.is_cuda:
                dst.record_stream(self._stream)
            host_wait = self.host_wait

            def wait_cuda():
                reader = torch.cuda.current_stream(self.device)  # the stream whose next work reads the copy
                reader.wait_event(event)
                if host_wait:
                    event.synchronize()  # the caller may release the source or reuse the block next
                elif back_ahead and reader != current:
                    dst.record_stream(reader)
            return _Done(event.query, wait_cuda)
        if self.delay <= 0:
            dst.copy_(src)
            return None
        entry = [dst, weakref.ref(src), False]
        self._pending.append(entry)
        while len(self._pending) > self.delay:
            self._complete(self._pending[0])

        return _Done(lambda: entry[2], lambda: self._complete(entry))

    def _complete(self, entry) -> None:
        if entry[2]:
            return
        src = entry[1]()
        if src is None:
            raise RuntimeError("remat.offload: a copy's source was released before the copy completed")
        entry[0].copy_(src)
        entry[2] = True
        self._pending = [e for e in self._pending if not e[2]]


class _Entry:
    """One offloaded byte range of a storage (the bytes a saved tensor covers): its host block, the copies in
    flight, and the device bytes once brought back. Saved tensors of one storage covering the same bytes (the
    views of one input that several operators save, each its own view object) share it."""

    __slots__ = ("block", "host", "align", "nbytes", "offset", "ptr", "device", "storage", "to_host_done", "source",
                 "originals", "device_copy", "to_device_done", "host_view", "handles", "version", "unpacked",
                 "aliased", "alias_of", "held_by", "counter", "__weakref__")

    def __init__(self):
        self.block = None
        self.host = None  # the block's first nbytes (the copy's bytes), while it holds the block
        self.align = ALIGNMENT  # _alignment() of the tensor saved (set as it is packed)
        self.source = None  # the device tensor, held until its copy to the host has completed
        self.storage = None  # a weak reference to its storage: alive, the same storage at that address
        self.originals: list[weakref.ref] = []  # the saved tensors, weakly: one alive is the storage on the device
        self.device_copy = None  # the bytes on the device (uint8), once brought back or found there
        self.to_device_done = None
        self.to_host_done = None
        self.host_view = None
        self.version = 0
        self.handles = 0
        self.unpacked = False
        self.aliased = False  # device_copy is the storage itself, found alive on the device
        self.alias_of = None  # then: the tensor it was found through (its version counter shows later writes)
        self.held_by = None  # a saved tensor left on the device that holds this storage too (not sent after all)
        self.counter = None  # a tensor without storage that shares the saved tensor's version counter

    def away(self) -> bool:
        """Whether its bytes are to be brought back or found (not yet dropped by autograd)."""
        return self.block is not None or self.held_by is not None

    def storage_alive(self) -> bool:
        """Whether the storage it was saved from is alive (the same storage at its address, not a later one)."""
        return self.storage is not None and not self.storage.expired()


class _Handle(SavedAs):
    """What autograd holds in place of an offloaded tensor (its entry, and the view it was saved as); its death
    returns the host block once no other handle holds it."""

    __slots__ = ("entry", "owner", "stride", "shift", "__weakref__")

    def __init__(self, entry: _Entry, owner: "Offload", t: torch.Tensor, shift: int = 0, version: int | None = None):
        super().__init__(t, version)
        self.stride = t.stride()  # within the entry's byte range (dense: its first element at the range's start)
        # Elements from the range's start to its first (a tensor saved within bytes saved whole before it).
        self.shift = shift
        self.entry = entry
        self.owner = owner
        entry.handles += 1

    def __del__(self):
        try:
            self.owner._drop(self.entry)
        except Exception:  # interpreter shutdown
            pass


def _version_holder(t: torch.Tensor) -> torch.Tensor:
    """A tensor with no storage that shares t's version counter: t's later in-place writes, through any tensor
    that shares the counter (its views, the tensors autograd saved of it), show in its _version, and it keeps
    none of t's bytes alive."""
    v = t.detach()
    version = v._version
    v.set_()
    # What torch.autograd._unsafe_preserve_version_counter's exit does, without its context's cost (every
    # offloaded tensor makes one): the counter, which v shares with t, back where the set_() moved it from.
    torch._C._autograd._unsafe_set_version_counter((v,), (version,))
    return v


def _revived(entry: "_Entry"):
    """The entry's storage, still alive on the device through a holder remat cannot see (a tensor autograd saved
    outside every Offload, or one another Offload left on the device), as a tensor that shares the saved
    tensor's version counter; None when it is not alive, was written since the save, or no longer holds the
    entry's bytes where they were (a storage resized in place)."""
    if entry.counter is None or entry.counter._version != entry.version or entry.storage.expired():
        return None
    storage = torch.UntypedStorage._new_with_weak_ptr(entry.storage.cdata)
    if storage.data_ptr() != entry.ptr or storage.nbytes() < entry.offset + entry.nbytes:
        return None
    r = entry.counter.detach().view(torch.uint8)
    with torch.autograd._unsafe_preserve_version_counter(r):
        r.set_(storage, 0, (storage.nbytes(),), (1,))
    return r


# The alignment a copy brought back keeps of its saved tensor's address (bytes), by device: a kernel that chooses
# or computes by alignment then runs on it as on the tensor saved. On CUDA, PyTorch hands cuBLASLt each operand's
# alignment, the largest power of two up to 256 that divides its address, and cuBLASLt picks its algorithm by
# it; on the CPU, MKL's arithmetic outside its reproducible mode may depend on 64-byte alignment.
# (C++'s alignment_of in src/runtime/offload/offload.cpp.)
ALIGNMENT = 64
CUDA_ALIGNMENT = 256


def _alignment(t: torch.Tensor) -> int:
    """The alignment a copy of t brought back keeps of t's address (bytes): by its device."""
    return CUDA_ALIGNMENT if t.is_cuda else ALIGNMENT


def _aligned_as(address: int, nbytes: int, device: torch.device, align: int) -> torch.Tensor:
    """nbytes of new device memory (uint8) that start at `address`'s alignment modulo `align` (_alignment()): a
    tensor saved at an offset into its storage comes back aligned as it was saved. Where that takes more than
    nbytes, the slack is the returned view's storage's bytes beyond nbytes: at most the offset's residue (the
    allocator's blocks are aligned), which the storage saved held before the tensor; a whole alignment where a
    block is not. (Made on 2026-12-04 for GPT-OSS's rare non-bitwise steps on the CPU, which turned out to be
    PyTorch's own race in summing its experts' bias gradients: docs/BENCHMARKS.md, "Transformers architectures,
    swept".)"""
    want = address % align
    if want == 0:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf = torch.empty(nbytes + want, dtype=torch.uint8, device=device)
    if buf.data_ptr() % align:  # a block not aligned itself: room for any start
        buf = None
        buf = torch.empty(nbytes + align, dtype=torch.uint8, device=device)
    start = (want - buf.data_ptr()) % align
    return buf[start:start + nbytes]


def _bytes_of(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The bytes [offset, offset + nbytes) of t's storage, as a uint8 tensor over that storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), offset, (nbytes,), (1,))


class Offload:
    """The saved-tensor hooks of offload(); its counts: offloaded (tensors sent to the host: byte ranges, one
    for the views of one storage that cover the same bytes; not those of a storage another saved tensor keeps on
    the device), offloaded_bytes, kept_on_device (tensors the pool's bound left on the device), brought_back (copies to the
    device), prefetched (of them, started before their tensor was asked for), found_on_device (tensors still
    alive on the device when needed back, another holder having kept them, and not written since: handed out
    as they are, not copied), alignment_bytes (device bytes allocated beyond copies brought back so that each
    starts at its saved tensor's alignment: a tensor saved at an offset into its storage; 0 for whole tensors)."""

    def __init__(self, pool: HostPool | None = None, min_bytes: int = 1 << 20, lookahead: int = 2,
                 engine: CopyEngine | None = None, window: int | None = None):
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"remat.offload: min_bytes must be a number of bytes >= 0, got {min_bytes!r}")
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"remat.offload: lookahead must be a count >= 0, got {lookahead!r}")
        if window is not None and (not isinstance(window, int) or window < 0):
            raise ValueError(f"remat.offload: window must be a number of bytes >= 0 or None, got {window!r}")
        # Streaming (a plan's Fa3@stream): at most `window` bytes of copies to the host in flight (the oldest
        # waited for past it; 0: each waited for at once), and in the backward pass tensors brought back ahead
        # of their use up to `window` bytes (in place of `lookahead`); prefetch() brings back that much.
        self.window = window
        self.pool = pool if pool is not None else HostPool()
        self.min_bytes = min_bytes
        self.lookahead = lookahead
        self.engine = engine
        self._engines: dict[torch.device, CopyEngine] = {}
        # Storages keep_on_device() names (parameters, buffers): never sent. `_never_sent_shared`, a set of them
        # the caller made once for many Offloads (a model's parameters' storages: LayerOffloads'), read in place
        # (merged into each layer's own set, it was copied a layer a step).
        self._never_sent: set[int] = set()
        self._never_sent_shared: set[int] | frozenset[int] = frozenset()
        self._by_storage: dict[tuple, weakref.ref] = {}  # (pointer, byte offset, bytes, version) -> entry
        self._at: dict[int, list[weakref.ref]] = {}  # storage pointer -> its entries
        # Storage pointer -> a saved tensor this Offload left on the device (weakly: autograd holds it): that
        # storage stays on the device whatever else saves it, so nothing of it is offloaded.
        self._left_on_device: dict[int, weakref.ref] = {}
        self._order: list[weakref.ref] = []  # entries in the order they were saved
        self._in_flight: list[_Entry] = []  # entries whose copy to the host may not have completed
        self._index: dict[int, int] = {}
        self.offloaded = self.offloaded_bytes = self.kept_on_device = self.brought_back = self.prefetched = 0
        self.found_on_device = 0
        self.alignment_bytes = 0
        self._hooks = None

    def keep_on_device(self, tensors=(), storages: set[int] = frozenset()) -> "Offload":
        """Storages never offloaded: those of `tensors` (a model's parameters and buffers: offload() passes
        them), and `storages`, data pointers as storage_ptrs() gives them (a set made once for many Offloads, read
        in place rather than copied: left unchanged while the Offload is in use)."""
        self._never_sent |= storage_ptrs(tensors)
        if storages:
            if self._never_sent_shared:
                self._never_sent |= storages
            else:
                self._never_sent_shared = storages
        return self

    def _engine(self, device: torch.device) -> CopyEngine:
        if self.engine is not None:
            return self.engine
        engine = self._engines.get(device)
        if engine is None:
            engine = self._engines[device] = CopyEngine(device)
        return engine

    # -- packing: the forward pass ---------------------------------------------------------------------------
    def _save_as_itself(self, t) -> Kept:
        """t is saved as itself (what autograd holds: a Kept): its storage stays on the device, and an entry of
        that storage already offloaded is found there when needed back (its host block returned once its copy has
        landed)."""
        kept = t.detach()
        saved = Kept(t, kept)
        ptr = _plain_ptr(t, self._never_sent, self._never_sent_shared)
        if ptr == 0:
            return saved
        self._left_on_device[ptr] = weakref.ref(kept)
        for ref in self._at.get(ptr, ()):
            entry = ref()
            if entry is not None and entry.held_by is None and entry.storage_alive():
                # Not offloaded after all: its bytes stay on the device, found there when needed back (held by the
                # entry: the saved tensor that keeps them may be dropped first).
                entry.held_by = kept
                self.offloaded -= 1
                self.offloaded_bytes -= entry.nbytes
                if entry.to_host_done is None:
                    self._to_host_landed(entry)  # its block back to the pool now (else once its copy lands)
        return saved

    def _left_at(self, ptr: int):
        ref = self._left_on_device.get(ptr)
        return ref() if ref is not None else None

    def pack(self, t: torch.Tensor):
        # Parameters (alive anyway), subclasses, sparse and meta tensors, small ones and views with gaps stay, and
        # so does any tensor of a storage that another saved tensor keeps on the device (copying it frees nothing).
        ptr = _offloadable_ptr(t, self.min_bytes, self._never_sent, self._never_sent_shared)
        if not ptr:
            return self._save_as_itself(t)
        if self._left_at(ptr) is not None:
            return self._save_as_itself(t)
        offset = t.storage_offset() * t.element_size()
        nbytes, version = t.nbytes, t._version
        key = (ptr, offset, nbytes, version)
        known = self._by_storage.get(key)
        entry = known() if known is not None else None
        if entry is not None and not entry.storage_alive():
            # Another storage at a freed one's address (the allocator reuses it): not the same bytes.
            entry = None
        if entry is not None and entry.handles <= 0:
            # Saved before by an operator whose graph is gone (dropped in the forward, its host block back in the
            # pool), the entry still alive while its copy was in flight: its bytes are nowhere now. Before (found
            # 2026-12-04) it was taken again, and the unpack found neither a host copy nor a device tensor (an
            # AttributeError with copies landing late: a DeepSeek-V3 layer streamed).
            entry = None
        shift = 0
        if entry is None:
            entry, shift = self._covering(t, ptr, offset)
        if entry is None:
            block = self.pool.take(nbytes)
            if block is None:
                self.kept_on_device += 1
                return self._save_as_itself(t)
            entry = _Entry()
            device = t.device
            entry.block, entry.nbytes, entry.offset, entry.ptr, entry.device = block, nbytes, offset, ptr, device
            entry.host = block[:nbytes]
            entry.align = _alignment(t)
            entry.storage = StorageWeakRef(t.untyped_storage())
            # Its byte range, in storage order (a view: a later in-place write shows in its version).
            entry.source = t.detach().as_strided((t.numel(),), (1,)).view(torch.uint8)
            entry.version = version
            entry.counter = _version_holder(t)
            engine = self._engine(device)
            entry.to_host_done = engine.copy(entry.host, entry.source)
            if entry.to_host_done is None and getattr(engine, "hold", False):  # (an engine of the caller's may lack it)
                entry.to_host_done = _HELD
            if entry.to_host_done is None:
                entry.source = None  # copied already: the device tensor is autograd's no more
            else:
                self._in_flight.append(entry)
                if self.window is not None:
                    self._bound_in_flight()
            ref = weakref.ref(entry)
            self._by_storage[key] = ref
            self._at.setdefault(ptr, []).append(ref)
            self._index[id(entry)] = len(self._order)
            self._order.append(ref)
            self.offloaded += 1
            self.offloaded_bytes += nbytes
        entry.originals.append(weakref.ref(t))
        self._settle()
        return _Handle(entry, self, t, shift, version)

    def _covering(self, t: torch.Tensor, ptr: int, offset: int):
        """(an entry of t's storage whose bytes, saved at t's version, hold all of t's, t's first element's
        distance from that entry's start in elements), or (None, 0). A tensor saved within bytes saved before it
        (a view of part of a tensor saved whole: chunks of an input that an in-place activation saved) shares
        their entry, so that they come back once, as the plain run holds them once. Before (found 2026-12-04 by
        python/tests/test_random.py), each came back apart, and where both were unpacked before either was
        dropped (retain_graph), the part was on the device twice, above the plain run's peak. A part saved
        before the whole still has an entry of its own (a limit)."""
        size = t.element_size()
        for ref in self._at.get(ptr, ()):
            e = ref()
            if (e is None or e.handles <= 0 or e.version != t._version or not e.storage_alive() or e.block is None
                    or not e.offset <= offset <= e.offset + e.nbytes - t.nbytes
                    or (offset - e.offset) % size or e.nbytes % size):
                continue
            return e, (offset - e.offset) // size
        return None, 0

    def _settle(self) -> None:
        """Releases the device tensors whose copies to the host have completed (queried, not waited on), oldest
        first, up to the first still in flight: an engine's copies complete in the order they were queued, so
        the ones after it are not asked (every pack calls this, and asking each entry made a layer's packs
        quadratic in its saved tensors). The others stay until a later call finds them done, or until unpacked
        or dropped (which wait)."""
        flight = self._in_flight
        landed = 0
        for entry in flight:
            if entry.source is not None:  # else landed already (unpacked, dropped)
                if entry.to_host_done is None or not entry.to_host_done.query():
                    break
                self._to_host_landed(entry)
            landed += 1
        if landed:
            del flight[:landed]

    def _bound_in_flight(self) -> None:
        """Streaming: waits for the oldest copies to the host until at most `window` bytes are in flight."""
        flying = [e for e in self._in_flight if e.source is not None]
        total = sum(e.nbytes for e in flying)
        for entry in flying:
            if total <= self.window:
                break
            self._to_host_landed(entry)
            total -= entry.nbytes
        self._in_flight = [e for e in flying if e.source is not None]

    # -- unpacking: the backward pass -------------------------------------------------------------------------
    def _to_host_landed(self, entry: _Entry) -> None:
        if entry.to_host_done is not None:
            done, entry.to_host_done = entry.to_host_done, None
            done.wait()
            if not getattr(done, "at_once", False):
                self._check_unmodified(entry)
        entry.source = None
        if entry.held_by is not None and entry.block is not None and entry.device_copy is None:
            # The storage stays on the device (autograd keeps it there through another saved tensor): the host
            # copy is not needed; its block goes back to the pool.
            self.pool.give(entry.block)
            entry.block = entry.host = None

    @staticmethod
    def _to_device_landed(entry: _Entry) -> None:
        if entry.to_device_done is not None:
            entry.to_device_done.wait()
            entry.to_device_done = None
        entry.host_view = None

    @staticmethod
    def _check_unmodified(entry: _Entry) -> None:
        """A tensor written in place while its copy to the host was in flight may have been copied half old,
        half new: an error, as autograd raises for a saved tensor modified in place (a copy made at once, on
        the CPU, holds the values saved, and the gradient is the one autograd would have computed)."""
        if entry.source is not None and entry.source._version != entry.version:
            raise RuntimeError(
                f"remat.offload: a tensor saved for backward ({entry.nbytes} bytes) was modified by an in-place "
                "operation while its copy to the host was in flight; its gradient would read values half old, "
                "half new. Clone it before the in-place operation, or leave that operation outside offload()")

    def _found(self, entry: _Entry):
        """A tensor through which the entry's storage is still on the device, not written since its save."""
        candidates = [r() for r in entry.originals] + [entry.held_by, self._left_at(entry.ptr)]
        for c in candidates:
            if (c is not None and c.device == entry.device and c._version == entry.version
                    and c.untyped_storage().data_ptr() == entry.ptr):
                return c
        return _revived(entry)

    def _start_to_device(self, entry: _Entry, may_alias: bool = True, saved_as: SavedAs | None = None) -> None:
        """Starts bringing the entry's bytes back (or finds them on the device). `saved_as`: the tensor being
        unpacked, named in the error raised when its bytes were kept on the device and written there since."""
        if entry.device_copy is not None:
            return
        self._to_host_landed(entry)  # remat's own hold on the bytes ends: whatever holds them now is another's
        if entry.storage_alive() and may_alias:
            # Still alive on the device (another holder kept it there: the layer before, whose output it is, a
            # saved tensor autograd keeps as itself, or one autograd saved outside every Offload) and not written
            # since: those bytes themselves; a copy back would be a second one.
            found = self._found(entry)
            if found is not None:
                entry.device_copy = _bytes_of(found, entry.offset, entry.nbytes)
                entry.alias_of = found.detach()  # shares its version counter: a later write shows
                entry.aliased = True
                self.found_on_device += 1
                return
        self._to_host_landed(entry)
        if entry.block is None:
            # Kept on the device (its host block returned: another saved tensor holds the storage) and written
            # there since: the values saved are gone.
            if saved_as is None:
                return  # a prefetch: the unpack raises
            if entry.held_by is None:  # not reached: a saved tensor's bytes kept nowhere
                raise RuntimeError(f"remat.offload: a tensor saved for backward ({entry.nbytes} bytes) is neither "
                                   "on the host nor on the device; this is remat's error, please report it")
            raise modified_error(entry.held_by, saved_as, version_of(entry.held_by), "remat.offload")
        host = entry.host
        engine = self._engine(entry.device)
        address = entry.ptr + entry.offset
        if getattr(engine, "allocates_apart", False):
            with engine.allocation_stream():
                out = _aligned_as(address, entry.nbytes, entry.device, entry.align)
        else:
            out = _aligned_as(address, entry.nbytes, entry.device, entry.align)
        if address % entry.align:
            self.alignment_bytes += out.untyped_storage().nbytes() - entry.nbytes
        entry.to_device_done = engine.copy(out, host)
        entry.host_view = host  # the copy's source, held until it has landed
        entry.device_copy = out
        self.brought_back += 1

    def unpack(self, h):
        if isinstance(h, Kept):
            return h.check(h.tensor, "remat.offload")
        if not isinstance(h, _Handle):
            return h
        entry = h.entry
        started = entry.device_copy is not None
        if started and not entry.unpacked and not entry.aliased:
            self.prefetched += 1  # its copy began before it was asked for
        entry.unpacked = True
        if entry.aliased and entry.alias_of._version != entry.version:
            # Written in place since it was found alive: the values saved come from the host after all.
            entry.device_copy, entry.alias_of, entry.aliased = None, None, False
            self.found_on_device -= 1
            self._start_to_device(entry, may_alias=False, saved_as=h)
        else:
            self._start_to_device(entry, saved_as=h)
        # The tensors saved before this one are the backward pass's next: start bringing them back.
        i = self._index.get(id(entry))
        if i is not None and self.window is not None:
            self._ahead(i)
        elif i is not None:
            for ref in self._order[max(0, i - self.lookahead):i]:
                other = ref()
                if other is not None and other.device_copy is None and other.away():  # (not started yet)
                    self._start_to_device(other)
        values = entry.device_copy.view(h.dtype)
        out = values.as_strided(h.shape, h.stride, values.storage_offset() + h.shift)
        self._to_device_landed(entry)
        # Held until autograd drops the saved tensor (every node that saved these bytes has run, or the graph is
        # freed): bytes saved by two operators, unpacked by both, come back once, as plain autograd holds them.
        return out

    def _ahead(self, i: int, window: int | None = None, found: set[int] | None = None) -> int:
        """Streaming: starts bringing back the tensors saved before the i-th (the backward pass's next), the
        nearest first, while those brought back and not yet asked for stay within `window` bytes (this
        Offload's by default), those saved after it among them: a backward pass may use its saved tensors out
        of the order they were saved in (an MoE layer's experts), and a tensor brought back ahead stays until
        it is asked for. Before (found 2026-12-05), only those saved before it counted, and a streamed GPT-OSS
        layer held up to 2.8 windows brought back ahead, 76,800 bytes above its prediction. With `found`
        (storage addresses), starts nothing and returns the bytes it would copy back: the storages in it taken
        as found on the device (no copy, nothing of the window), as those without a host block are; a saved
        storage is one of them only while it is alive (a later tensor may take the address of one let go of:
        found 2026-12-07, BERT's streamed layers' figure 64 KiB apart from one run to the next)."""
        window = self.window if window is None else window
        ahead = copied = 0
        if found is None:
            for ref in self._order[i:]:
                other = ref()
                if other is not None and other.device_copy is not None and not other.unpacked and not other.aliased:
                    ahead += other.nbytes
        for ref in reversed(self._order[:i]):
            other = ref()
            if other is None or other.unpacked or other.aliased:
                continue
            if other.device_copy is not None:  # on its way already
                ahead += other.nbytes
                continue
            if not other.away():
                continue
            if found is not None and (other.block is None or (other.ptr in found and other.storage_alive())):
                continue
            if ahead + other.nbytes > window:
                break
            if found is None:
                self._start_to_device(other)
            if not other.aliased:
                ahead += other.nbytes
                copied += other.nbytes
        return copied

    def ahead_bytes(self, window: int, maybe_found=()) -> int:
        """The bytes prefetch() would copy back now, streamed with `window` (bytes), starting nothing: the last
        tensors saved, newest first, while they fit in it; the most of it whichever storages of `maybe_found`
        (tensors: a layer's input and output, which may still be on the device when it runs, and are then
        found there, not copied) are found. A plan charges it ahead of a streamed layer's backward and in flight
        past its forward (the chain's OffloadCost.ahead_bytes). Raises ValueError for a window below 0."""
        if not isinstance(window, int) or window < 0:
            raise ValueError(f"remat.offload: ahead_bytes' window must be a number of bytes >= 0, got {window!r}")
        ptrs = sorted(storage_ptrs(maybe_found))
        return max(self._ahead(len(self._order), window, {p for k, p in enumerate(ptrs) if pick >> k & 1})
                   for pick in range(1 << len(ptrs)))

    def _drop(self, entry: _Entry) -> None:
        entry.handles -= 1
        if entry.handles > 0:
            return
        self._to_device_landed(entry)
        self._to_host_landed(entry)
        if entry.block is not None:
            self.pool.give(entry.block)
            entry.block = entry.host = None
        entry.device_copy = entry.alias_of = entry.held_by = None

    # -- what a planned step calls ------------------------------------------------------------------------------
    def finish_copies(self) -> None:
        """Waits for the copies to the host in flight and releases their device tensors (a planned step calls it
        when the next layer's forward has run: the plan's memory model holds them until then)."""
        for entry in self._in_flight:
            self._to_host_landed(entry)
        self._in_flight = []

    def prefetch(self) -> None:
        """Starts bringing back every tensor this Offload holds on the host (a planned step calls it when the
        backward pass reaches the next layer, so that the copies overlap that layer's backward); streaming, only
        the last saved (the backward pass's first) up to `window` bytes."""
        if self.window is not None:
            self._ahead(len(self._order))
            return
        for ref in self._order:
            entry = ref()
            if entry is not None and entry.away():
                self._start_to_device(entry)

    def bring_back(self, handles) -> None:
        """Starts bringing back the bytes of `handles` (what pack() returned) that are on the host, in their
        order; each is waited for where it is unpacked. remat's selective checkpointing calls it as a region's
        recompute begins, for the outputs its policy sent to the host."""
        for h in handles:
            if isinstance(h, _Handle) and h.entry.away():
                self._start_to_device(h.entry)

    # -- the context ----------------------------------------------------------------------------------------
    def __enter__(self):
        if self._hooks is not None:
            raise RuntimeError("remat.offload: this Offload is open already; an Offload is one context at a time "
                               "(make another for a context inside it)")
        # An Offload entered again (a step after a step): what the earlier passes saved and autograd has
        # dropped is forgotten, so that its bookkeeping does not grow with the steps.
        alive = [(r, r()) for r in self._order]
        self._order = [r for r, e in alive if e is not None]
        self._index = {id(e): i for i, e in enumerate(e for _, e in alive if e is not None)}
        del alive
        self._by_storage = {k: r for k, r in self._by_storage.items() if r() is not None}
        self._at = {p: live for p, rs in self._at.items() if (live := [r for r in rs if r() is not None])}
        self._left_on_device = {p: r for p, r in self._left_on_device.items() if r() is not None}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._hooks is None:
            raise RuntimeError("remat.offload: __exit__ of an Offload that is not open")
        top = top_hooks()
        if top is not None and top[0] != self.pack:
            # torch pops the innermost hooks, whoever's they are: this Offload's would stay on, another's go.
            raise RuntimeError(
                "remat.offload: an Offload's context ends while saved-tensor hooks opened after it (another "
                "Offload, torch.autograd.graph.saved_tensors_hooks, save_on_cpu) are still open; end those first "
                "(contexts end in the reverse order of their start)")
        hooks, self._hooks = self._hooks, None
        return hooks.__exit__(*exc)


def offload(model: torch.nn.Module | None = None, *, pool: HostPool | None = None, min_bytes: int = 1 << 20,
            lookahead: int = 2, engine: CopyEngine | None = None, window: int | None = None) -> Offload:
    """A context in which what autograd saves goes to host memory (see the module's documentation): tensors of
    at least min_bytes (bytes), never `model`'s parameters and buffers; `lookahead` tensors brought back ahead
    in the backward pass; with `window` (bytes), streamed instead: at most that much in flight to the host, and
    tensors brought back ahead of their use up to that much (Offload's window). Returns the Offload (its counts;
    the pool's host bytes). Raises ValueError for a negative min_bytes, lookahead or window."""
    o = Offload(pool=pool, min_bytes=min_bytes, lookahead=lookahead, engine=engine, window=window)
    if model is not None:
        o.keep_on_device(list(model.parameters()) + list(model.buffers()))
    return o
