"""remat.offload on the CPU (the device and the host one memory; the host pool reserved ahead so that remat's
meter counts the device's tensors): every step bitwise the plain run's, the bytes that left the device exact,
copies delayed by a fake engine read only once landed, checkpointed layers' inputs offloaded, the pool's
bound, a second backward pass."""
import contextlib
import copy
import gc
import json
import random
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat import _core
from remat.offload import CopyEngine, HostPool, offload
from conftest import forwards_plan, give_plan, matmul_seeing_alignment, per_layer_ops

WIDTH, BATCH = 256, 64  # a hidden state: 64 KiB


def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers)


def run(model, x, ctx=None, ckpt=False, backward_twice=False):
    """One step: (loss, gradients, bytes alive after the forward above the base, the next random draw)."""
    meter = remat.cpu_meter()
    model.zero_grad(set_to_none=False)
    torch.manual_seed(7)
    base = meter.count()
    if ctx is None:
        out = forward(model, x, ckpt)
    else:
        with ctx:
            out = forward(model, x, ckpt)
    held = meter.count() - base
    loss = out.square().mean()
    loss.backward(retain_graph=backward_twice)
    grads = [p.grad.clone() for p in model.parameters()]
    if backward_twice:
        model.zero_grad(set_to_none=False)
        loss.backward()
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    return loss.detach(), grads, held, torch.rand(3)


def forward(model, x, ckpt):
    if not ckpt:
        return model(x)
    h = x
    for i in range(0, len(model), 3):
        h = checkpoint(model[i:i + 3], h, use_reentrant=False)
    return h


def same(a, b):
    assert torch.equal(a[0], b[0])
    for g, h in zip(a[1], b[1]):
        assert torch.equal(g, h), float((g - h).abs().max())
    assert torch.equal(a[3], b[3])


def grads_ready(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


@pytest.fixture()
def x():
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))


def test_saved_tensors_leave_the_device_and_every_step_is_the_plain_run(x):
    model = mlp()
    grads_ready(model)
    plain = run(model, x)
    pool = HostPool()
    pool.reserve(64 << 20, BATCH * WIDTH * 4)
    o = offload(model, pool=pool, min_bytes=BATCH * WIDTH * 4)
    got = run(model, x, o)
    same(plain, got)
    # Each linear's input (the first is the batch, alive anyway: offloaded too, the device copy is the
    # caller's), each GELU's input, each dropout's mask (bool, 16 KiB: below the threshold, kept) are saved.
    assert o.offloaded > 0 and o.offloaded_bytes > 0
    freed = o.offloaded_bytes - x.nbytes  # the batch stays alive on the device: its copy frees nothing
    assert got[2] == plain[2] - freed, (plain[2], got[2], o.offloaded_bytes)
    assert pool.in_use_bytes == 0 and pool.peak_bytes == o.offloaded_bytes
    # A second step reuses the blocks: nothing allocated on the host.
    reserved = pool.reserved_bytes
    same(run(model, x), run(model, x, offload(model, pool=pool, min_bytes=BATCH * WIDTH * 4)))
    assert pool.reserved_bytes == reserved


def test_delayed_copies_are_read_only_once_landed(x):
    # The fake engine carries a copy out only when waited on or three copies later, and holds its source weakly:
    # reading a host block or a device copy before it landed would give wrong gradients; releasing a source
    # before its copy would raise.
    model = mlp()
    grads_ready(model)
    plain = run(model, x)
    for delay in (1, 3, 100):
        o = offload(model, min_bytes=1 << 12, lookahead=2, engine=CopyEngine(torch.device("cpu"), delay=delay))
        same(plain, run(model, x, o))
        # The batch (the first linear's input), alive in the caller, is handed out as it is, not copied back.
        assert o.found_on_device == 1 and o.brought_back + 1 == o.offloaded and o.prefetched > 0


def test_a_window_bounds_what_is_in_flight_each_way(x):
    # Streaming (Offload's window): with copies that land late (carried out only when waited on), at most the
    # window's bytes of copies to the host are in flight after any save, and in the backward pass at most the
    # window's bytes are brought back ahead of their use; the gradients are the plain run's. A transposed view
    # (dense, not contiguous) is sent too, and comes back as the same view.
    model = mlp()
    grads_ready(model)
    plain = run(model, x)
    hidden = BATCH * WIDTH * 4
    for window in (0, hidden, 2 * hidden):
        o = offload(model, min_bytes=1 << 12, window=window, engine=CopyEngine(torch.device("cpu"), delay=100))
        flying, ahead = [], []
        pack, unpack = o.pack, o.unpack

        def counted_pack(t):
            h = pack(t)
            flying.append(sum(e.nbytes for e in o._in_flight if e.source is not None))
            return h

        def counted_unpack(h):
            out = unpack(h)
            ahead.append(sum(r().nbytes for r in o._order
                             if r() is not None and r().device_copy is not None and not r().unpacked
                             and not r().aliased))
            return out

        o.pack, o.unpack = counted_pack, counted_unpack
        same(plain, run(model, x, o))
        assert max(flying) <= window and max(ahead) <= window, (window, flying, ahead)
        assert o.offloaded > 4 and o.brought_back + o.found_on_device == o.offloaded
        if window:
            assert max(ahead) == window and o.prefetched > 0
    t = torch.randn(WIDTH, BATCH, requires_grad=True)
    o = offload(min_bytes=0, window=0)
    with o:
        y = (t.t() * 2).exp()  # exp saves its output; t.t() is dense, not contiguous
    y.sum().backward()
    assert o.offloaded >= 1 and torch.equal(t.grad, (t.t() * 2).exp().t() * 2)
    with pytest.raises(ValueError, match="window must be a number of bytes >= 0 or None"):
        offload(window=-1)


def test_a_window_bounds_what_is_brought_back_ahead_where_the_backward_uses_a_tensor_saved_earlier():
    # A tensor saved by two operators comes back once, as the entry of its first save; the backward pass asks
    # for it at the later operator's backward, before the tensors saved between the two (here `s`, saved by
    # tanh and again by the last product, whose backward runs first). What prefetch() brought back ahead of
    # those stays until they are asked for, and counts against the window as what comes back after them does.
    # Before (found 2026-12-05 on GPT-OSS, whose experts' grouped products share their offsets), only the
    # tensors saved before the one asked for counted: here twice the window came back ahead at once.
    w = BATCH * WIDTH * 4
    x = torch.randn(BATCH, WIDTH, requires_grad=True)

    def f(x):
        s = x.exp().exp().tanh()  # saved: both exps' outputs, then tanh's (s)
        h = s.exp().exp()  # then these two
        return h * s.detach()  # s saved again: the same bytes

    want = torch.autograd.grad(f(x).sum(), x)[0]
    o = offload(min_bytes=1 << 12, window=2 * w, engine=CopyEngine(torch.device("cpu"), delay=100))
    ahead, unpack = [], o.unpack

    def counted_unpack(h):
        out = unpack(h)
        ahead.append(sum(r().nbytes for r in o._order if r() is not None and r().device_copy is not None
                         and not r().unpacked and not r().aliased))
        return out

    o.unpack = counted_unpack
    with o:
        loss = f(x).sum()
    o.finish_copies()
    assert o.offloaded == 5  # s's second save is its first's entry
    o.prefetch()
    got = torch.autograd.grad(loss, x)[0]
    assert torch.equal(got, want)
    assert ahead and max(ahead) <= 2 * w, ahead
    assert o.prefetched > 0 and o.brought_back == 5


def test_ahead_bytes_is_what_prefetch_brings_back():
    # What prefetch() brings back ahead of a streamed layer's backward: the last tensors saved, newest first,
    # while they fit in the window, stopping at the first that does not (the plan charges it: the chain's
    # OffloadCost.ahead_bytes). The layer saves x (w), gelu's input (2w), lin2's input (2w) and tanh's output
    # (w, the layer's output), in that order; the window is 2w.
    meter = remat.cpu_meter()
    w = BATCH * WIDTH * 4
    lin1, lin2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
    for found in (False, True):
        x = torch.randn(BATCH, WIDTH, requires_grad=True)
        o = offload(min_bytes=1 << 12, window=2 * w).keep_on_device([*lin1.parameters(), *lin2.parameters()])
        with o:
            out = torch.tanh(lin2(torch.nn.functional.gelu(lin1(x))))
        o.finish_copies()
        assert o.offloaded == 4
        # The output, found on the device when the backward comes (the next layer holds it), takes nothing of
        # the window: lin2's input comes back in its stead.
        assert o.ahead_bytes(2 * w) == w and o.ahead_bytes(2 * w, maybe_found=(out,)) == 2 * w
        assert o.ahead_bytes(0) == 0 and o.ahead_bytes(6 * w) == 6 * w
        loss = out.sum()
        if not found:
            del out  # its storage gone: only its copy on the host is left
        before = meter.count()
        o.prefetch()
        assert meter.count() - before == (2 * w if found else w)
        assert (o.brought_back, o.found_on_device) == ((1, 1) if found else (1, 0))
        loss.backward()
        assert torch.equal(x.grad, torch.autograd.grad(torch.tanh(lin2(torch.nn.functional.gelu(lin1(x)))).sum(),
                                                       x)[0])
    with pytest.raises(ValueError, match="ahead_bytes' window must be a number of bytes >= 0"):
        o.ahead_bytes(-1)


def test_ahead_bytes_finds_a_saved_storage_only_while_it_is_alive():
    # ahead_bytes takes the tensors it is handed as found on the device by their storages' addresses; a storage
    # saved and let go of since may have its address taken by a later tensor, which is not it. Before (found
    # 2026-12-07), such a saved tensor read as found: BERT's streamed layers' figure was 64 KiB apart from one run
    # to the next, as the allocator placed the layer's output, and a plan streaming the last layer 1.05% high.
    # The address is taken here by construction: two storages over one NumPy array's bytes.
    w = BATCH * WIDTH * 4
    lin = nn.Linear(WIDTH, 2 * WIDTH)
    arr = torch.randn(BATCH, WIDTH).numpy()
    s = torch.from_numpy(arr)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    o = offload(min_bytes=1 << 12, window=2 * w).keep_on_device([*lin.parameters()])
    with o:
        # Saved, in order: x (w), gelu's input (2w), s (w, by the product: the slice's gradient needs it).
        out = torch.nn.functional.gelu(lin(x))[:, :WIDTH] * s
    o.finish_copies()
    assert o.offloaded == 3
    # Newest first within 2w: s, then gelu's input does not fit; with s found, gelu's input alone.
    assert (o.ahead_bytes(2 * w), o.ahead_bytes(2 * w, maybe_found=(s,))) == (w, 2 * w)
    del s  # its storage gone (its bytes, the array's, stay), its copy on the host
    again = torch.from_numpy(arr)  # another storage at its address
    assert again.untyped_storage().data_ptr() == arr.ctypes.data
    assert o.ahead_bytes(2 * w, maybe_found=(again,)) == w
    out.sum().backward()


def test_checkpointed_layers_inputs_are_offloaded(x):
    # Under torch.utils.checkpoint the layers save nothing but their inputs, which the checkpoint saves
    # outside its own hooks: those go to the host.
    model = mlp()
    grads_ready(model)
    plain = run(model, x, ckpt=True)
    pool = HostPool()
    pool.reserve(4 * BATCH * WIDTH * 4, BATCH * WIDTH * 4)  # allocated here, not in the step the meter reads
    o = offload(model, pool=pool, min_bytes=BATCH * WIDTH * 4)
    got = run(model, x, o, ckpt=True)
    same(plain, got)
    assert o.offloaded == 4  # the four layers' inputs, the batch included
    assert got[2] == plain[2] - 3 * BATCH * WIDTH * 4


def test_a_saved_tensor_still_on_the_device_comes_back_as_itself(x):
    # Another holder (the layer before, whose output it is; here the caller) keeps it on the device: a copy back
    # would be a second one there. Written in place after it was saved, the saved values come from the host.
    w = torch.randn(BATCH, WIDTH, requires_grad=True)
    seen = []

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            seen.append(a.data_ptr())
            return g * b, g * a

    o = offload(min_bytes=1024)
    with o:
        y = Mul.apply(x, w)
    y.sum().backward()
    # Both saved tensors went to the host (w: no model was given to keep its tensors on the device), both came
    # back as themselves.
    assert seen == [x.data_ptr()] and o.offloaded == 2 and o.found_on_device == 2 and o.brought_back == 0
    assert torch.equal(w.grad, x)
    w.grad = None
    h = x.clone()
    with o:
        y = Mul.apply(h, w)
    o.prefetch()  # h is found alive here...
    h.add_(1)  # ...and written before the backward pass reads it
    y.sum().backward()
    assert torch.equal(w.grad, x) and o.brought_back == 1 and o.found_on_device == 2 + 1  # counts add up


def test_the_pool_bound_keeps_the_rest_on_the_device_and_a_second_backward_works(x):
    model = mlp()
    grads_ready(model)
    plain = run(model, x, backward_twice=True)
    pool = HostPool(max_bytes=3 * BATCH * WIDTH * 4)
    o = offload(model, pool=pool, min_bytes=BATCH * WIDTH * 4)
    same(plain, run(model, x, o, backward_twice=True))
    assert o.offloaded == 3 and o.kept_on_device > 0
    assert pool.reserved_bytes <= 3 * BATCH * WIDTH * 4 and pool.in_use_bytes == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="min_bytes"):
        offload(min_bytes=-1)
    with pytest.raises(ValueError, match="lookahead"):
        offload(lookahead=-2)
    with pytest.raises(ValueError, match="max_bytes"):
        HostPool(max_bytes=-5)


def test_an_in_place_write_during_a_copy_is_an_error_not_a_wrong_gradient():
    # Plain autograd refuses a saved tensor modified in place. Copied at once (the CPU), the host holds the
    # values saved and the gradient is the one autograd would compute; with the copy in flight (the fake
    # engine's late copies, CUDA's side stream), the write may land first: an error naming the tensor.
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)

    def step(o):
        h = x @ w
        with o:
            y = h.sin()
        h.mul_(2)  # what sin saved
        y.sum().backward()

    x.grad = w.grad = None
    step(offload(min_bytes=0))
    assert torch.equal(x.grad, (torch.cos(x.detach() @ w.detach())) @ w.detach().t())
    # Made at once with its source held until waited for (the planned layers' engine): the values saved too.
    x.grad = w.grad = None
    step(offload(min_bytes=0, engine=CopyEngine(torch.device("cpu"), hold=True)))
    assert torch.equal(x.grad, (torch.cos(x.detach() @ w.detach())) @ w.detach().t())
    late = offload(min_bytes=0, engine=CopyEngine(torch.device("cpu"), delay=100))
    with pytest.raises(RuntimeError, match=r"modified by an in-place operation while its copy to the host"):
        step(late)



def test_a_held_copy_keeps_its_source_on_the_device_until_waited_for():
    # CopyEngine(hold=True), the planned layers' engine on the CPU: each copy made at once, its source on the
    # device until finish_copies(), as a GPU holds it while the copy is in flight (the plan's model charges so);
    # then the bytes that leave are those of the engine that lets go at once. Every step the plain run's.
    meter = remat.cpu_meter()
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)

    def step(o, finish):
        x.grad = w.grad = None
        base = meter.count()
        with o:
            y = (x @ w).sin().cos()
        if finish:
            o.finish_copies()
        alive = meter.count() - base
        y.sum().backward()
        return alive, x.grad.clone(), w.grad.clone()

    plain = step(contextlib.nullcontext(), False)
    cpu = torch.device("cpu")
    kept = step(offload(min_bytes=0, engine=CopyEngine(cpu, hold=True)), False)
    waited = step(offload(min_bytes=0, engine=CopyEngine(cpu, hold=True)), True)
    at_once = step(offload(min_bytes=0), False)
    assert all(torch.equal(a, b) for got in (kept, waited, at_once) for a, b in zip(plain[1:], got[1:]))
    assert kept[0] == plain[0] > waited[0] == at_once[0], (plain[0], kept[0], waited[0], at_once[0])
    assert not CopyEngine(cpu, delay=2, hold=True).hold  # a delayed engine holds its own way
    # The experimental host_wait=False (CUDA's waits left to the stream) changes nothing on the CPU: the same
    # bytes, the same gradients; the class default is the engines' made without it; a non-bool is refused.
    nowait = step(offload(min_bytes=0, engine=CopyEngine(cpu, hold=True, host_wait=False)), False)
    assert nowait[0] == kept[0] and all(torch.equal(a, b) for a, b in zip(plain[1:], nowait[1:]))
    assert CopyEngine(cpu).host_wait and not CopyEngine(cpu, host_wait=False).host_wait
    with pytest.raises(ValueError, match="CopyEngine: host_wait must be True, False or None, got 'no'"):
        CopyEngine(cpu, host_wait="no")


@pytest.mark.parametrize("delay", [0, 100])
def test_a_tensor_saved_again_after_its_first_savers_graph_is_gone_comes_back(delay):
    # A tensor saved by an operator whose graph the forward then drops (an output nobody keeps), and saved again by
    # a later one: the first save's host block went back to the pool with its graph. With the copy still in flight
    # the first entry was alive (the copies in flight hold it) and was taken for the second save: its unpack found
    # its bytes neither on the host nor on the device (an AttributeError with late copies, found 2026-12-04 on a
    # streamed DeepSeek-V3 layer). The gradient is the plain run's, at once and with late copies.
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)

    def step(o):
        x.grad = w.grad = None
        with o:
            h = x @ w
            dropped = h.sin()  # saves h; its graph goes with it
            del dropped
            y = h.cos()  # saves h again: the same bytes, the same version
            del h
        y.sum().backward()
        return x.grad.clone(), w.grad.clone()

    want = step(contextlib.nullcontext())
    o = offload(min_bytes=0, engine=CopyEngine(torch.device("cpu"), delay=delay))
    got = step(o)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # x and w (the matmul's), h twice (an entry each); back: the second h (x and w found where they are)
    assert (o.offloaded, o.brought_back) == (4, 1), (o.offloaded, o.brought_back)


@pytest.mark.parametrize("keep_base", [True, False])
def test_a_dense_view_at_an_offset_comes_back_with_its_values_and_its_alignment(keep_base):
    # A saved tensor that starts one element into its storage (4 bytes: no multiple of 64), found on the device
    # where its storage is alive or brought back from the host where it is not: its values, and a copy back
    # starts at its address's alignment modulo 64 bytes on the CPU (256 on CUDA), as the tensor saved did, so that
    # kernels that compute or choose by alignment (MKL's GEMM outside its reproducible mode; cuBLASLt's choice of
    # algorithm) run on it as on the tensor saved. (Added for GPT-OSS's rare non-bitwise steps on the CPU, found
    # later that day to be PyTorch's own race in summing its experts' bias gradients: docs/BENCHMARKS.md.)
    seen = []
    Saves = matmul_seeing_alignment(seen, 64)

    torch.manual_seed(0)
    values = torch.randn(64 * 64 + 1)
    w = torch.randn(64, 64, requires_grad=True)

    def step(o):
        w.grad = None
        base = values.clone()
        with o:
            loss = Saves.apply(base[1:].view(64, 64), w).sum()
        if not keep_base:
            del base
        loss.backward()
        return w.grad.clone()

    want = step(contextlib.nullcontext())
    seen.clear()
    o = offload(min_bytes=1024)
    assert torch.equal(step(o), want)
    # w too went, and is found where it is (the caller holds it)
    assert (o.offloaded, o.found_on_device, o.brought_back) == ((2, 2, 0) if keep_base else (2, 1, 1))
    assert seen[0] == seen[1] == 4, seen
    # The copy back's block is the offset's residue larger (the CPU allocator's blocks are 64-byte aligned).
    assert o.alignment_bytes == (0 if keep_base else 4), o.alignment_bytes


def test_an_offload_entered_every_step_forgets_what_autograd_dropped(x):
    # One Offload reused across steps keeps no bookkeeping of the steps before (it would grow with them).
    model = mlp()
    grads_ready(model)
    plain = run(model, x)
    o = offload(model, min_bytes=BATCH * WIDTH * 4)
    same(plain, run(model, x, o))
    one_step = len(o._order)  # the entries of one step
    for _ in range(3):
        same(plain, run(model, x, o))
        assert len(o._order) == one_step and len(o._index) == one_step and len(o._by_storage) <= one_step


# ---------------------------------------------------------------------------------------------------------------
# Offloading as a planned choice: remat.enable(..., offload=True).

class Block(nn.Module):
    """A transformer-like block's shape: its input saved by its first linear, its output a residual sum that no
    operator saves."""

    def __init__(self, w):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(w, 4 * w), nn.Linear(4 * w, w), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.b(torch.nn.functional.gelu(self.a(x))))


class Stack(nn.Module):
    def __init__(self, w=128, n=5):
        super().__init__()
        self.inp = nn.Linear(w, w)
        self.layers = nn.ModuleList(Block(w) for _ in range(n))
        self.head = nn.Linear(w, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).square().mean()


def stack_step(model, x):
    """One step: (loss, gradients, the step's peak above the bytes alive when it began)."""
    meter = remat.cpu_meter()
    model.zero_grad(set_to_none=False)
    torch.manual_seed(3)
    base = meter.count()
    with meter.window() as window:
        loss = model(x)
        loss.backward()
        peak = window.peak() - base
    return loss.detach(), [p.grad.clone() for p in model.parameters()], peak


def planned_stack(**kwargs):
    torch.manual_seed(0)
    model = Stack()
    grads_ready(model)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))  # a hidden state: 128 KiB
    plain = stack_step(model, x)
    lp = remat.enable(model, list(model.layers), budget=1 << 40, offload=True, offload_min_bytes=64 << 10,
                      **kwargs)
    same_step(plain, stack_step(model, x))  # the profiling step
    return model, x, plain, lp


def drop_stream_figures(chain):
    """Sets aside a chain's stream figures (in place; returns it): its stages can then be offloaded whole only."""
    for st in chain.stages:
        o = st.offload
        if o is not None:
            o.stream_fwd_bytes = o.stream_bwd_bytes = -1
            o.window_bytes = 0
            st.offload = o
    return chain


def same_step(a, b):
    assert torch.equal(a[0], b[0])
    for g, h in zip(a[1], b[1]):
        assert torch.equal(g, h), float((g - h).abs().max())


def test_planned_offloading_fits_budgets_no_plan_without_it_fits():
    model, x, plain, lp = planned_stack()
    chain, ctx = lp.chain, lp.context
    assert chain.can_offload() and chain.to_host_gb_per_s > 0 and chain.to_device_gb_per_s > 0
    # Each block saves its input (the first linear's) and, beyond its output, its 512 KiB and 128 KiB hidden
    # states; a checkpointed block's input goes to the host.
    for st in chain.stages:
        assert st.offload.input and not st.offload.output
        assert st.offload.bytes == st.saved_bytes - st.output_bytes
        assert st.checkpoint_offload.input and st.checkpoint_offload.bytes == 0
    without = _core.min_step_budget(chain, ctx, "per-layer")  # the least budget without offloading
    # Whole layers offloaded (@host) here: streaming (tested below) would win at these budgets.
    drop_stream_figures(chain)
    least = lp.min_budget_bytes
    assert least < without
    for budget in (least, (least + without) // 2):
        lp.set_budget(budget)
        assert any(c.endswith("@host") for c in lp.choices), lp.choices
        pool = lp.host_pool
        pool.peak_bytes = 0
        got = stack_step(model, x)
        same_step(plain, got)  # bitwise, dropout included
        assert got[2] <= lp.predicted_peak_bytes <= budget, (got[2], lp.predicted_peak_bytes, budget)
        assert lp.predicted_peak_bytes - got[2] < 0.1 * got[2]
        # The host bytes the plan predicts are the pool's (blocks of these sizes are not rounded).
        assert pool.peak_bytes == lp.predicted_host_bytes > 0 and pool.in_use_bytes == 0
        stats = lp.offload_stats
        assert stats["offloaded_bytes"] == pool.peak_bytes and stats["kept_on_device"] == 0
        # Every tensor sent to the host comes back once; those of a layer followed by another start coming back
        # when the backward pass reaches that one, before they are asked for (prefetched).
        assert stats["brought_back"] == stats["offloaded"] > 0
        assert not lp.choices[-1].endswith("@host") and stats["prefetched"] == stats["offloaded"]
    # A plan given as it is (the same choices, offloaded ones included) runs the same.
    plan = lp.plan
    lp.remove()
    given = remat.enable(model, list(model.layers), plan=plan)
    assert given.choices == remat.choices_of(plan) and "@host" in str(plan)
    same_step(plain, stack_step(model, x))
    given.remove()


def test_what_a_policy_keeps_goes_to_the_host_with_its_input():
    # Fk[matmuls]@host: what selective checkpointing keeps (each block's two linears' outputs, 512 + 128 KiB)
    # goes to the layer's Offload with the checkpoint's input; the profile measures it, and a plan that offloads
    # it runs bitwise within its predicted step peak, with the host bytes simulate() predicts. remat's own
    # selective checkpointing (remat/selective.py) sends them, on any torch (torch.utils.checkpoint is given no
    # respect_saved_tensors_hooks, which PyTorch 2.11 lacks): without it the kept tensors would stay on the
    # device, above the prediction, and the host bytes would be the inputs' only.
    model, x, plain, lp = planned_stack()
    chain, ctx = lp.chain, lp.context
    hidden = 256 * 128 * 4
    for st in chain.stages:
        (pc,) = st.policies
        assert pc.policy == "matmuls" and pc.offload.input and not pc.offload.output
        assert pc.offload.bytes == 5 * hidden
    lp.remove()
    text = ("Fk0[matmuls]@host Fk1[matmuls]@host Fc2@host Fk3[matmuls]@host Fa4 L "
            "B4 B3 Fa2 B2 B1 B0").split()
    plan = remat.Plan.from_json('{"num_stages": 5, "ops": %s}' % str(text).replace("'", '"'))
    sim = remat.simulate(chain, plan)
    predicted = remat.step_peak_bytes(chain, ctx, plan)
    given = remat.enable(model, list(model.layers), plan=plan, offload_min_bytes=64 << 10)
    assert given.choices == ["matmuls@host", "matmuls@host", "checkpoint@host", "matmuls@host", "keep"]
    got = stack_step(model, x)
    same_step(plain, got)
    stats = given.offload_stats
    # Three blocks' kept outputs and inputs, and the checkpointed block's input.
    assert stats["offloaded_bytes"] == 3 * (5 * hidden + hidden) + hidden == sim.host_peak_bytes
    assert given.host_pool.peak_bytes == sim.host_peak_bytes and given.host_pool.in_use_bytes == 0
    assert stats["brought_back"] == stats["offloaded"] and stats["prefetched"] == stats["offloaded"]
    assert got[2] <= predicted and predicted - got[2] < 0.12 * got[2], (got[2], predicted)
    given.remove()


class ViewsBlock(nn.Module):
    """Saves that share storages, as attention blocks' do: its input by two linears, each through a 2-D view of
    its own (same bytes); h contiguous by gelu and as every other column by sin (a view with gaps: h stays on
    the device, as a padded key saved by a fused kernel does; a transposed view, dense, would go)."""

    def __init__(self, w):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(w, w), nn.Linear(w, w), nn.Linear(w, w)

    def forward(self, x):
        h = self.q(x) * self.k(x)
        return x + self.o(torch.nn.functional.gelu(h) + h[..., ::2].sin().repeat(1, 1, 2))


def test_bytes_saved_through_several_views_go_once_and_a_storage_kept_on_the_device_goes_not():
    # Before: the input went to the host once per view (and came back once per view), and h was copied though
    # it stays on the device; the plan then predicted fewer host bytes, and a lower peak, than the step had.
    torch.manual_seed(0)
    w = 64
    blocks = nn.Sequential(*[ViewsBlock(w) for _ in range(3)])
    grads_ready(blocks)
    x = torch.randn(4, 64, w, generator=torch.Generator().manual_seed(2))  # a hidden state: 64 KiB

    def step(ctx=None):
        blocks.zero_grad(set_to_none=False)
        inp = x.clone().requires_grad_()
        if ctx is None:
            loss = blocks(inp).square().mean()
        else:
            with ctx:
                loss = blocks(inp).square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in blocks.parameters()] + [inp.grad]

    plain = step()
    o = offload(blocks, min_bytes=x.nbytes)
    got = step(o)
    assert torch.equal(got[0], plain[0]) and all(torch.equal(a, b) for a, b in zip(got[1], plain[1]))
    # Per block: the input once, q(x) and k(x) (saved by the product), the sum the last linear saves; not h
    # (found on the device instead); and the last block's output, which the loss's square saves. The first
    # block's input, which the caller holds, is found on the device at the backward pass, not copied back.
    assert o.offloaded == 3 * 4 + 1 and o.offloaded_bytes == o.offloaded * x.nbytes == o.pool.peak_bytes
    assert o.brought_back == o.offloaded - 1 and o.found_on_device == 3 + 1 and o.pool.in_use_bytes == 0

    # Planned: the profile counts what the hooks send, so the pool's peak is the predicted host bytes and the
    # step stays within its predicted peak.
    model = Stack(w=w, n=4)
    model.layers = nn.ModuleList(ViewsBlock(w) for _ in range(4))
    grads_ready(model)
    xs = torch.randn(4, 64, w, generator=torch.Generator().manual_seed(3))
    plain = stack_step(model, xs)
    lp = remat.enable(model, list(model.layers), budget=1 << 40, offload=True, offload_min_bytes=xs.nbytes)
    same_step(plain, stack_step(model, xs))  # the profiling step
    for st in lp.chain.stages:
        assert st.offload.input and st.offload.bytes == 3 * xs.nbytes
    drop_stream_figures(lp.chain)  # whole layers sent (@host): what the host pool holds at once is their bytes
    lp.set_budget(lp.min_budget_bytes)
    assert any(c.endswith("@host") for c in lp.choices), lp.choices
    lp.host_pool.peak_bytes = 0
    got = stack_step(model, xs)
    same_step(plain, got)
    assert lp.host_pool.peak_bytes == lp.predicted_host_bytes > 0
    assert got[2] <= lp.predicted_peak_bytes, (got[2], lp.predicted_peak_bytes)
    lp.remove()


def test_a_host_bound_holds_and_late_copies_are_waited_for():
    model, x, plain, lp = planned_stack(max_host_bytes=200 << 10)
    chain, ctx = lp.chain, lp.context
    # The least budget's plan checkpoints four blocks, each holding the CPU generator's state its checkpoint saved
    # (StepContext.checkpoint_state_bytes, read in the profiling step) to its backward: without it charged the
    # step held 20,224 bytes more than predicted. And the blocks' output, which the head saved and let go of, is
    # let go of once (output_held_in_backward): the prediction was 4.2% high with it held through the last
    # block's backward.
    assert ctx.checkpoint_state_bytes == torch.get_rng_state().nbytes > 0
    assert not ctx.output_held_in_backward
    lp.set_budget(_core.min_step_budget(chain, ctx, "per-layer", offload=True, max_host_bytes=200 << 10))
    assert 0 < lp.predicted_host_bytes <= 200 << 10 and sum(c.endswith("@host") for c in lp.choices) == 1
    # Copies completed late (the fake engine carries one out only when waited on or two copies later, holding its
    # source weakly): each layer's copies are waited for before the next but one runs, brought back ahead, and
    # read only once landed.
    lp.offloads.engines[x.device] = CopyEngine(x.device, delay=2)
    lp.host_pool.peak_bytes = 0
    got = stack_step(model, x)
    same_step(plain, got)
    assert got[2] <= lp.predicted_peak_bytes and lp.host_pool.peak_bytes <= 200 << 10
    assert lp.predicted_peak_bytes - got[2] < 0.01 * got[2]


class TanhBefore(nn.Module):
    """Stack's part before the blocks ending in a tanh, which saves its output: the blocks' input."""

    def __init__(self, w):
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x):
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("before", ["linear", "tanh", "none"])
def test_the_profiling_step_reads_whether_anything_but_the_layers_holds_their_input(before):
    # Read once the first layer's backward is done (its checkpoint has dropped its input by then): a Linear
    # before the layers saves its own input, not theirs; a tanh saves its output, their input; with no part
    # before them, their input is the caller's tensor, read at the step's end.
    torch.manual_seed(0)
    model = Stack(WIDTH, 2)
    if before == "tanh":
        model.inp = TanhBefore(WIDTH)
    elif before == "none":
        model.inp = nn.Identity()
    grads_ready(model)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=before == "none")
    lp = remat.enable(model, list(model.layers), budget=1 << 40)
    stack_step(model, x)
    assert lp.context.input_held_in_backward == (before != "linear")
    # The caller's tensor was alive when the step's base was read: in the base, not charged above it again.
    assert lp.context.input_in_base == (before == "none")
    lp.remove()


class DeepBlock(nn.Module):
    """Four linear layers with GELU between, and a residual sum: it saves eight hidden states, and its backward
    needs a few at a time."""

    def __init__(self, w):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(w if k == 0 else 2 * w, w if k == 3 else 2 * w) for k in range(4))

    def forward(self, x):
        h = x
        for k, lin in enumerate(self.lins):
            h = lin(h)
            if k < 3:
                h = torch.nn.functional.gelu(h)
        return x + h


def test_streamed_layers_go_below_whole_layer_offloading_bitwise():
    # "keep@stream" (a plan's Fa3@stream): what a block saves goes to the host as its forward makes it and comes
    # back tensor by tensor, each just ahead of its use, so that a block's backward holds its working set and a
    # window, not all it saved; "keep@stream0" with no window (each copy waited for as it is made, each tensor
    # brought back when asked for): its working set only. The profile measures both peaks; at the least budget
    # the planner streams with no window, below what the least budget is without streaming; with the room for
    # the windows it streams with them (faster: the copies hidden); every step is the plain run's, within the
    # predicted peak, with the predicted host bytes, also when copies land late.
    torch.manual_seed(0)
    model = Stack()
    model.layers = nn.ModuleList(DeepBlock(128) for _ in range(5))
    grads_ready(model)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))
    plain = stack_step(model, x)
    lp = remat.enable(model, list(model.layers), budget=1 << 40, offload=True, offload_min_bytes=64 << 10)
    same_step(plain, stack_step(model, x))  # the profiling step
    chain, ctx = lp.chain, lp.context
    for st in chain.stages:
        o = st.offload
        assert o.can_stream() and o.window_bytes == 256 * 256 * 4  # the largest tensor a block sends
        # Its backward holds a few of the eight hidden states it saves at a time (and its gradients' transients).
        assert 0 < o.stream_bwd_bytes < st.saved_bytes, (o.stream_bwd_bytes, st.saved_bytes)
    # Had that backward made the block's gradients (as after zero_grad): its peak comes before the last of them
    # (the model charges only those made by then).
    grads = sum(p.nbytes for p in model.layers[0].parameters())
    for st in chain.stages:
        o = st.offload
        assert o.stream_bwd_bytes <= o.stream_bwd_grads_bytes < o.stream_bwd_bytes + grads, \
            (o.stream_bwd_grads_bytes, grads)
    unstreamed = drop_stream_figures(remat.Chain.from_json(chain.to_json()))
    without = _core.min_step_budget(unstreamed, ctx, "per-layer", offload=True)
    least = lp.min_budget_bytes
    assert least < without
    windowed = list(chain.stages[0].offload.window_bytes for _ in chain.stages)
    every = remat.Plan.from_json('{"num_stages": 5, "ops": [%s, "L", "B4", "B3", "B2", "B1", "B0"], '
                                 '"stream_windows": %s}' % (", ".join(f'"Fa{i}@stream"' for i in range(5)), windowed))
    with_windows = remat.step_peak_bytes(chain, ctx, every)
    assert least < with_windows < without, (least, with_windows, without)
    # Planned as for a GPU, whose copies run on a side stream and hide behind the computation: on the CPU they
    # are made at once (the chain says so, and no window makes a step faster there).
    assert chain.copies_at_once
    chain.copies_at_once = False
    for budget, way in ((least, "keep@stream0"), (with_windows, "keep@stream")):
        lp.set_budget(budget)
        assert sum(c == way for c in lp.choices) >= 3, lp.choices
        assert "@stream" in str(lp.plan)
        # The plan's text says which: Fa3@stream0 where the window is 0.
        assert str(lp.plan).count("@stream0") == lp.choices.count("keep@stream0")
        windows = list(lp.plan.stream_windows)
        assert all(w == (0 if c == "keep@stream0" else windowed[0]) for w, c in zip(windows, lp.choices) if w >= 0)
        for delay in (0, 2):
            # Copies carried out only when waited on or two copies later, their sources held weakly.
            lp.offloads.engines[x.device] = CopyEngine(x.device, delay=delay, hold=True)
            lp.host_pool.peak_bytes = 0
            got = stack_step(model, x)
            same_step(plain, got)
            assert got[2] <= lp.predicted_peak_bytes <= budget, (lp.choices, got[2], lp.predicted_peak_bytes)
            # Within 0.5% (to the byte when measured; one hidden state above, 8-11%, before the chain's output
            # was read as freed by the rest's backward). The chain's input is not among what is held: the first
            # streamed block takes it to the host (below).
            assert lp.predicted_peak_bytes - got[2] <= 0.005 * got[2], (got[2], lp.predicted_peak_bytes)
            assert lp.host_pool.peak_bytes == lp.predicted_host_bytes > 0
    # Nothing but the blocks holds their input in the backward pass (the Linear before them saves its own
    # input): the streamed first block takes it to the host, and the step is predicted without it from the loss.
    assert not ctx.input_held_in_backward and lp.choices[0].startswith("keep@stream")
    held = copy.deepcopy(ctx)
    held.input_held_in_backward = True
    assert remat.step_peak_bytes(chain, held, lp.plan) - lp.predicted_peak_bytes == chain.input_bytes
    # A plan given as it is cannot stream: its stream figures are the profiled chain's.
    plan = lp.plan
    lp.remove()
    with pytest.raises(ValueError, match="streams a layer"):
        remat.enable(model, list(model.layers), plan=plan)


class TailBlock(nn.Module):
    """A DeepBlock and a LayerNorm: the last tensor it sends, the norm's input (a hidden state), is half the
    largest (the window); the one sent before it is the largest."""

    def __init__(self, w):
        super().__init__()
        self.deep, self.norm = DeepBlock(w), nn.LayerNorm(w)

    def forward(self, x):
        return self.norm(self.deep(x))


def test_a_streamed_layer_holds_ahead_of_its_backward_what_its_prefetch_brings_back():
    # Streamed with the chain's window, a block brings back ahead of its backward (while the block after it runs
    # its backward) the last tensors it sent that fit in the window, newest first: here the norm's input, half
    # the window (the profile's ahead_bytes). The plan charges that, not the window: each streamed block's
    # backward is predicted a hidden state lower than the window would have it, and the step is its prediction
    # to the byte (it was a hidden state above that before the profile handed each block its output's gradient
    # as a step does, freed once the norm's backward has used it).
    torch.manual_seed(0)
    model = Stack(w=64, n=4)
    model.layers = nn.ModuleList(TailBlock(64) for _ in range(4))
    grads_ready(model)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    hidden = 256 * 64 * 4
    plain = stack_step(model, x)
    lp = remat.enable(model, list(model.layers), budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
    same_step(plain, stack_step(model, x))
    chain, ctx = lp.chain, lp.context
    for st in chain.stages:
        assert (st.offload.window_bytes, st.offload.ahead_bytes) == (2 * hidden, hidden)
    windows = [2 * hidden] * 4
    every = remat.Plan.from_json('{"num_stages": 4, "ops": [%s, "L", "B3", "B2", "B1", "B0"], "stream_windows": %s}'
                                 % (", ".join(f'"Fa{i}@stream"' for i in range(4)), windows))
    unmeasured = remat.Chain.from_json(chain.to_json())
    for st in unmeasured.stages:
        o = st.offload
        o.ahead_bytes = -1
        st.offload = o
    predicted = remat.step_peak_bytes(chain, ctx, every)
    assert remat.step_peak_bytes(unmeasured, ctx, every) - predicted == hidden
    chain.copies_at_once = False  # planned as for a GPU's side stream: the window is then the faster
    lp.set_budget(predicted)
    assert str(lp.plan) == str(every), lp.plan
    got = stack_step(model, x)
    same_step(plain, got)
    assert got[2] == predicted, (got[2], predicted)


def test_offloading_options_are_checked():
    model = Stack(n=2)
    with pytest.raises(ValueError, match="offload must be True or False"):
        remat.enable(model, list(model.layers), budget="1GiB", offload="yes")
    with pytest.raises(ValueError, match="max_host_bytes .* needs offload=True"):
        remat.enable(model, list(model.layers), budget="1GiB", max_host_bytes="1MiB")
    with pytest.raises(ValueError, match="offload_min_bytes"):
        remat.enable(model, list(model.layers), budget="1GiB", offload=True, offload_min_bytes=-1)
    assert "forward" not in model.layers[0].__dict__  # nothing left wrapped


def test_the_plan_executor_refuses_an_offloaded_plan():
    plan = remat.Plan.from_json('{"num_stages": 2, "ops": ["Fa0@host", "Fa1", "L", "B1", "B0"]}')
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="Fa0@host offloads, which the plan executor does not run"):
        remat.run_plan(remat.stages_of(model), plan, torch.randn(2, 4, requires_grad=True))
    # Nor a streamed stage (it would run unstreamed, above its plan's figures), nor a group assignment.
    for op, why in (("Fa1@stream", "offloads"), ("Fk1{k}", "is a group assignment")):
        plan = remat.Plan.from_json('{"num_stages": 2, "ops": ["Fa0", "%s", "L", "B1", "B0"]}' % op)
        with pytest.raises(ValueError, match=re.escape(f"{op} {why}")):
            remat.run_plan(remat.stages_of(model), plan, torch.randn(2, 4, requires_grad=True))


def test_cpu_autocast_and_autograd_grad_give_the_plain_runs_gradients(x):
    # bf16 autocast (the saved tensors are the low-precision ones), and torch.autograd.grad instead of backward.
    model = mlp()
    params = list(model.parameters())

    def grads(ctx):
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if ctx is None:
                out = model(x)
            else:
                with ctx:
                    out = model(x)
        loss = out.float().square().mean()
        return [loss.detach()] + list(torch.autograd.grad(loss, params))

    plain = grads(None)
    o = offload(model, min_bytes=BATCH * WIDTH * 2)
    got = grads(o)
    assert o.offloaded > 0
    for a, b in zip(plain, got):
        assert torch.equal(a, b)


def test_garbage_collected_during_the_profiling_step_does_not_lower_its_readings():
    # Garbage in a reference cycle (8 MiB) collected inside the profiling step, as Python's collector may run at
    # any allocation (here a hook on the first layer runs it): the step collects it before reading its base, so
    # the profile and the least budget are those of a step without it (collected after the base, its free lowers
    # the count every reading is taken against: the step peak read 128 KiB for 2.6 MiB). Not offloading's own:
    # found while checking the offloading benchmark, where a dropped model collected mid-step lowered a least
    # budget from 35.7 to 15.8 MB.
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))

    def readings(garbage):
        torch.manual_seed(0)
        model = Stack()
        grads_ready(model)
        lp = remat.enable(model, list(model.layers), budget=1 << 40)
        gc.collect()
        gc.disable()
        hook = None
        try:
            if garbage:
                cycle = {"t": torch.empty(8 << 20, dtype=torch.uint8)}
                cycle["self"] = cycle
                del cycle
                hook = model.layers[0].register_forward_pre_hook(lambda m, a: (gc.collect(), None)[1])
            stack_step(model, x)
        finally:
            gc.enable()
            if hook is not None:
                hook.remove()
        return lp.context.checkpoint_all_peak_bytes, lp.min_budget_bytes

    clean = readings(False)
    assert clean[0] > 1 << 20
    assert readings(True) == clean


# ---------------------------------------------------------------------------------------------------------------
# What users do: in-place writes, conjugate views, graphs kept or dropped, contexts ended out of order.

MODIFIED = "one of the variables needed for gradient computation has been modified by an inplace operation"


def test_an_in_place_write_to_a_saved_tensor_left_on_the_device_is_autograds_error():
    # Behind saved-tensor hooks autograd checks no version: each way a saved tensor stays on the device (below
    # min_bytes, over the pool's bound, a view with gaps, a storage another saved tensor keeps there) gave the
    # gradient of the values written, where plain PyTorch raises.
    x = torch.randn(64, 256, requires_grad=True)

    def written():  # sigmoid saves its output, written after
        y = x.sigmoid()
        y.mul_(2)
        return y.sum()

    def written_kept_by_a_view():  # h saved whole by gelu and through a view with gaps by sin
        h = x * 2
        loss = torch.nn.functional.gelu(h).sum() + h[:, ::2].sin().sum()
        h.mul_(2)
        return loss

    cases = [(written, dict(min_bytes=1 << 30)), (written, dict(min_bytes=0, pool=HostPool(max_bytes=0))),
             (written_kept_by_a_view, dict(min_bytes=1024))]
    for f, options in cases:
        with pytest.raises(RuntimeError, match=MODIFIED):
            f().backward()
        with offload(**options):
            loss = f()
        with pytest.raises(RuntimeError, match=MODIFIED + r".* is at version 1; expected version 0.*remat\.offload"):
            loss.backward()
    with offload(min_bytes=1 << 30):
        loss = written()
    with pytest.raises(RuntimeError, match=r"\[torch\.FloatTensor \[64, 256\]\], which is output 0 of Sigmoid"):
        loss.backward()


def test_a_storage_kept_on_the_device_by_a_view_freed_first_stays_for_its_other_save():
    # h saved whole by gelu (offloaded) and through a view with gaps by sin, which keeps h on the device: sin's
    # backward runs first and frees its view; gelu's still finds h.
    x = torch.randn(4, 64, 64, requires_grad=True)

    def step(ctx):
        x.grad = None
        with ctx:
            h = x * 2
            loss = torch.nn.functional.gelu(h).sum() + h[..., ::2].sin().sum()
        loss.backward()
        return x.grad.clone()

    import contextlib
    o = offload(min_bytes=1024)
    assert torch.equal(step(contextlib.nullcontext()), step(o))
    assert o.offloaded == 0


def test_bytes_autograd_saved_outside_every_offload_are_found_on_the_device_not_brought_back():
    # An in-place ReLU before the context saves its output (ReluBackward holds those bytes); the linear layer
    # inside saves the same tensor as its input. Its bytes never leave the device, so the Offload must find them
    # there (through the saved tensor's version counter, which it holds without the bytes) rather than bring a
    # second copy back beside them (the property test's long run: above the plain peak by those bytes). Written
    # in place after the save, the plain run's error.
    meter = remat.cpu_meter()
    torch.manual_seed(0)
    lin = nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)

    def step(o, write=False):
        x.grad = None
        lin.zero_grad(set_to_none=True)
        gc.collect()
        base = meter.count()
        with meter.window() as w:
            h = (x * 2).relu_()
            if o is None:
                y = lin(h)
            else:
                with o:
                    y = lin(h)
            if write:
                h.mul_(2)
            del h
            try:
                y.square().mean().backward()
            except RuntimeError as e:
                return str(e), None
            peak = w.peak() - base
        return peak, [x.grad.clone()] + [p.grad.clone() for p in lin.parameters()]

    plain_peak, plain = step(None)
    o = offload(min_bytes=0, engine=CopyEngine(torch.device("cpu"), delay=1))
    peak, got = step(o)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert o.offloaded >= 1 and o.found_on_device >= 1 and o.brought_back == 0, (o.found_on_device, o.brought_back)
    assert peak <= plain_peak, (peak, plain_peak)
    plain_error, _ = step(None, write=True)
    error, _ = step(offload(min_bytes=0), write=True)
    assert "modified by an inplace operation" in plain_error and "modified by an inplace operation" in error


def test_conjugate_and_negative_views_are_saved_with_their_bits():
    x = torch.randn(64, 64, dtype=torch.complex64, requires_grad=True)

    def step(ctx):
        x.grad = None
        with ctx:
            y = x * x.conj()  # saves x.conj(), a conjugate view
            z = x.conj().imag * x.real  # saves a negative view
        (y.real.sum() + z.sum()).backward()
        return x.grad.clone()

    import contextlib
    assert torch.equal(step(contextlib.nullcontext()), step(offload(min_bytes=0)))


def test_what_stays_on_the_device_is_freed_with_its_graph_without_the_cycle_collector():
    # A pack hook that returns its argument makes a cycle (saved tensor -> tensor -> grad_fn -> saved tensor):
    # a graph kept by retain_graph, or a forward pass without a backward, held its tensors until Python's cycle
    # collector ran. A plain run frees them at once.
    meter = remat.cpu_meter()
    x = torch.randn(64, 256, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        for backward in (False, True):
            for options in (dict(min_bytes=1 << 30), dict(min_bytes=0)):
                base = meter.count()
                with offload(**options):
                    y = x.sigmoid().exp()  # both outputs saved by their own nodes
                    loss = y.sum()
                if backward:
                    loss.backward(retain_graph=True)
                    x.grad = None
                del y, loss
                assert meter.count() == base, (backward, options)
    finally:
        gc.enable()


def test_contexts_end_in_the_reverse_order_of_their_start():
    a, b = offload(min_bytes=0), offload(min_bytes=0)
    a.__enter__()
    b.__enter__()
    # torch would pop b's hooks and leave a's on: refused, nothing changed.
    with pytest.raises(RuntimeError, match="end those first"):
        a.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="open already"):
        b.__enter__()
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="not open"):
        a.__exit__(None, None, None)
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None  # no hooks left


def test_a_tensor_another_offload_keeps_on_the_device_comes_back_as_itself():
    # Sent to the host by one Offload, kept on the device by another (which holds it detached, the tensor itself
    # gone): found there through that one's tensor while it holds it (retain_graph keeps it through the backward
    # pass), not copied back beside it (found by the property test: a second copy above the plain run's peak).
    x = torch.randn(64, 256, requires_grad=True)
    a, b = offload(min_bytes=0), offload(min_bytes=1 << 30)
    with a:
        y = (x * 2).relu_()  # relu_ saves its output: to the host
    with b:
        z = y.sin()  # saves y: left on the device
    del y
    z.sum().backward(retain_graph=True)
    assert a.offloaded == 1 and a.found_on_device == 1 and a.brought_back == 0
    assert torch.equal(x.grad, 2 * (x.detach() * 2).relu().cos() * (x.detach() > 0))


def test_the_gpu_tables_bound_sends_what_the_link_carries_and_recomputes_the_cheapest_rest():
    # bench/offload_cuda.py's bound (issue 42's GPU table), by hand: 1 GB/s = 1e6 bytes a millisecond, 20 ms of
    # forward: 2e7 bytes leave; the rest is recomputed cheapest first, a group's bytes or a whole layer's.
    from offload_cuda import physics_bound
    chain = dict(to_host_gb_per_s=1.0, to_device_gb_per_s=2.0, stages=[
        dict(fwd_ms=10, bwd_ms=20, saved_bytes=5e7, groups=[dict(name="a", bytes=2e7, recompute_ms=1),
                                                            dict(name="b", bytes=2e7, recompute_ms=8)]),
        dict(fwd_ms=10, bwd_ms=20, saved_bytes=4e7)])
    assert physics_bound(chain, 1e8, 1e8, 100) == 1.0                # nothing to leave
    assert physics_bound(chain, 1e8, 8e7, 100) == 1.0                # 2e7 leave: all of it
    # 5e7 over: 2e7 leave, 2e7 of group a (1 ms), 1e7 of what the first layer's groups leave of its 5e7, at the
    # layer's cost (10 ms for 5e7: 2 ms), cheaper than the second layer's (10 ms for 4e7).
    assert physics_bound(chain, 1e8, 5e7, 100) == pytest.approx(1.03)
    # 9e7 over: 7e7 recomputed, group b (8 ms for 2e7) left for last: 1 + 2 + 10 ms.
    assert physics_bound(chain, 1e8, 1e7, 100) == pytest.approx(1.13)
    assert physics_bound(chain, 1e9, 0, 100) is None                  # more than the layers save
    # Over every call profiled (LayerPlan.saved_calls), not only the listed groups: the second layer's 4e7 saved
    # bytes are two calls, one of them cheap (1e7 for 0.1 ms), which the layer's average cost hid.
    calls = [chain["stages"][0]["groups"], [dict(name="c", bytes=1e7, recompute_ms=0.1),
                                            dict(name="d", bytes=3e7, recompute_ms=9.9)]]
    # 5e7 over: 2e7 leave, call c's 1e7 (0.1 ms), 2e7 of group a (1 ms).
    assert physics_bound(chain, 1e8, 5e7, 100, calls) == pytest.approx(1.011)


class MeanSquare(nn.Module):
    def forward(self, h):
        return h.square().mean()


def relu_stack():
    """Four layers of Linear(128, 128) then ReLU and a mean-square loss, on a batch of 256 (a hidden state: 128
    KiB), planned in place with offloading (offload_min_bytes 64 KiB) and profiled: (model, layers, batch, the
    plain step, the LayerPlan)."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(4)]
    model = nn.Sequential(*layers, MeanSquare())
    grads_ready(model)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))
    plain = stack_step(model, x)
    lp = remat.enable(model, layers, budget=1 << 40, offload=True, offload_min_bytes=64 << 10)
    same_step(plain, stack_step(model, x))  # the profiling step
    return model, layers, x, plain, lp


def test_an_offloaded_layer_whose_graph_saves_its_output_is_charged_it_let_go_of_early_in_its_backward():
    # A ReLU saves its output; sent to the host and brought back, the copy is let go of once the ReLU's backward
    # has read it, before the Linear's weight gradient is made, as a kept layer's output is
    # (Stage.bwd_output_freed_bytes). Before (found 2026-12-03), only a kept layer not offloaded was charged so:
    # every layer Fa@host held 7.75% less than predicted, with copies made at once or delayed; and a mixed plan.
    # Copies made at once run on the planned layers' own engine, which holds each copy's source until the plan
    # waits for it, as a GPU does (CopyEngine's `hold`): before it (2026-12-06) they left the device sooner than
    # the model charges, and the mixed plan held less than its prediction made so.
    model, layers, x, plain, lp = relu_stack()
    assert all(st.saves_output for st in lp.chain.stages)
    assert all(st.bwd_output_freed_bytes > 0 for st in lp.chain.stages[1:])  # (the first makes no input gradient)
    for choices in (["keep@host"] * 4, ["keep", "keep@host", "checkpoint", "keep@host"]):
        _, predicted = give_plan(lp, per_layer_ops(choices))
        for delay in (0, 100):
            lp.offloads.engines.pop(x.device, None)  # the layers' own engine, made at the step
            if delay:
                lp.offloads.engines[x.device] = CopyEngine(x.device, delay=delay)
            got = stack_step(model, x)
            same_step(plain, got)
            assert lp.offloads.engines[x.device].hold == (not delay)
            assert predicted * 0.999 <= got[2] <= predicted, (choices, delay, got[2], predicted)
    lp.remove()


def test_a_policy_that_keeps_more_than_keeping_everything_is_charged_what_it_keeps():
    # Linear then ReLU: keeping everything saves the output alone (ReLU saves what it returns), while the
    # "matmuls" policy keeps the product too. Both profilers charged a policy at most what keeping everything
    # keeps: with Fk[matmuls] on every layer the step held 52% more than predicted, and remat.enable(offload=True)
    # raised at the profiling step (the policy's offload cost above that charge; found 2026-12-01). Now a
    # policy is charged what it keeps, offloaded or not, and each step is the plain run's, within its prediction.
    model, layers, x, plain, lp = relu_stack()
    chain, ctx = lp.chain, lp.context
    for st in chain.stages:
        (pol,) = st.policies
        # The output and the product (and, on the CPU, the generator state the region keeps).
        assert st.saved_bytes == st.output_bytes and pol.saved_bytes >= 2 * st.output_bytes
        assert pol.offload is not None and pol.offload.bytes >= st.output_bytes  # the product, sent
    got = stack_step(model, x)
    same_step(plain, got)
    assert got[2] <= lp.predicted_peak_bytes * 1.02, (lp.choices, got[2], lp.predicted_peak_bytes)
    lp.remove()
    # The policy on every layer, and offloaded on one: each step within its prediction (the first was 52% above
    # it), the host bytes as simulate() predicts.
    for text in ("Fk0[matmuls] Fk1[matmuls] Fk2[matmuls] Fk3[matmuls]", "Fa0 Fk1[matmuls]@host Fa2 Fa3"):
        ops = text.split() + "L B3 B2 B1 B0".split()
        plan = remat.Plan.from_json(json.dumps({"num_stages": 4, "ops": ops, "policies": ["matmuls"]}))
        predicted = remat.step_peak_bytes(chain, ctx, plan)
        given = remat.enable(model, layers, plan=plan, offload_min_bytes=64 << 10)
        got = stack_step(model, x)
        same_step(plain, got)
        assert predicted * 0.98 <= got[2] <= predicted, (text, got[2], predicted)
        if "@host" in text:
            assert given.offload_stats["offloaded_bytes"] == remat.simulate(chain, plan).host_peak_bytes > 0
        given.remove()
    # Adjacent layers that both send the tensor between them (the first's ReLU saves it, the second's Linear
    # too), the first bringing its copy back ahead while the second's backward runs with its own: charged twice
    # there since 2026-12-01 (the step was 10% above its prediction). A streamed plan runs only as planned in
    # place: the planner's answer is replaced by it.
    # Layers 2 and 3 streamed take their input to the host (the layer before sends it too) and bring it back
    # in their backward (OffloadCost.stream_bwd_input_bytes, a hidden state, since 2026-12-07); the output's copy
    # their ReLU brings back is let go of once it has run backward, before that input comes back, which the model
    # does not credit (it holds a streamed layer's output through its backward): a hidden state high, safe.
    lp = remat.enable(model, layers, budget=1 << 40, offload=True, offload_min_bytes=64 << 10)
    stack_step(model, x)  # the profiling step
    ops = "Fa0@host Fa1@host Fa2@stream Fa3@stream L B3 B2 B1 B0".split()
    _, predicted = give_plan(lp, ops, stream_windows=[0] * 4)
    assert lp.choices == ["keep@host", "keep@host", "keep@stream0", "keep@stream0"], lp.choices
    with pytest.warns(RuntimeWarning, match="below the plan's prediction"):
        got = stack_step(model, x)
    same_step(plain, got)
    assert predicted - got[2] == x.nbytes, (got[2], predicted)
    # The least budget's plan, within its prediction (the planner's again).
    lp.choose_plan = None
    lp.set_budget(lp.min_budget_bytes)
    got = stack_step(model, x)
    same_step(plain, got)
    assert got[2] <= lp.predicted_peak_bytes, (lp.choices, got[2], lp.predicted_peak_bytes)


# A step's peak phase by phase, measured and predicted (also bench/given_plan_predictions.py --stack --phases).
class Phases:
    """The peak of each phase of a step of `layers` (above the count when the first layer's forward begins),
    marked by hooks: each layer's forward ("F0"), what runs from the last layer's output to the last layer's
    backward ("loss": the rest's forward, the loss, its backward), each layer's backward ("B3", from its output's
    gradient to the next one's; the first layer's to the step's end)."""

    def __init__(self, layers, meter):
        self.meter, self.marks, self.window, self.start, self.last = meter, [], None, 0, len(layers) - 1
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self.mark(f"F{i}")))
            self.handles.append(layer.register_forward_hook(lambda m, a, out, i=i: self.forward_done(i, out)))

    def forward_done(self, i, out):
        self.mark("loss" if i == self.last else None)
        out.register_hook(lambda g, i=i: self.mark(f"B{i}"))

    def mark(self, name):
        """Closes the phase in progress (its peak) and begins `name` (None: no phase)."""
        if self.window is None:
            self.window, self.start = self.meter.window(), self.meter.count()
        elif self.marks and self.marks[-1][1] is None:
            self.marks[-1][1] = self.window.peak() - self.start
        self.marks.append([name, None])
        self.window.restart()

    def done(self) -> dict:
        self.mark(None)
        for h in self.handles:
            h.remove()
        self.window.close()
        return {name: peak for name, peak in self.marks if name is not None}


def predicted_phases(timeline: dict) -> dict:
    """The prediction's peak per phase of Phases, from the step's timeline (remat.LayerPlan.timeline's points):
    the rest's forward, the loss and the rest's backward are the phase "loss"; the backward of the part before
    the chain (nothing here) is the first layer's, and a recompute (a forward after the loss) is its stage's
    backward's."""
    out, after_loss = {}, False
    for p in timeline["points"]:
        after_loss = after_loss or p["op"] == "L"
        if p["op"] == "before":
            continue
        if p["op"] in ("after", "L", "B(after)"):
            name = "loss"
        elif p["op"] == "B(before)":
            name = "B0"
        else:  # a forward after the loss is a recompute, within its stage's backward phase
            name = f"{'B' if p['backward'] or after_loss else 'F'}{p['stage']}"
        out[name] = max(out.get(name, 0), p["peak_bytes"])
    return out


def test_a_streamed_layer_that_sends_only_its_input_and_output_is_charged_no_window_in_its_forward():
    # The Linear-ReLU stack's layers save their input (the Linear's) and output (the ReLU's) alone: nothing else
    # leaves the device (offload.bytes 0). Streamed with a window, their copies in flight are of tensors the
    # forward holds anyway, so a forward holds its measured peak (each copy waited for at once) and nothing
    # beside it. Charged the whole window before 2026-12-01, each streamed forward was predicted a hidden state
    # (128 KiB) above what it held. Measured phase by phase, copies carried out only when waited for: the first
    # two forwards hold their predictions to the byte (the later ones are charged the previous layer's input in
    # flight past its forward, where its output is: a safe miss), and no phase holds more than predicted.
    model, layers, x, plain, lp = relu_stack()
    chain = lp.chain
    for st in chain.stages:
        assert st.offload.bytes == 0 and st.offload.window_bytes == x.nbytes and st.offload.can_stream()
    ops = [f"Fa{i}@stream" for i in range(4)] + "L B3 B2 B1 B0".split()
    _, predicted = give_plan(lp, ops, stream_windows=[x.nbytes] * 4)
    assert lp.choices == ["keep@stream"] * 4, lp.choices
    lp.offloads.engines[x.device] = CopyEngine(x.device, delay=100)
    phases = Phases(layers, remat.cpu_meter())
    got = stack_step(model, x)
    same_step(plain, got)
    measured, expected = phases.done(), predicted_phases(lp.timeline())
    assert measured["F0"] == expected["F0"] and measured["F1"] == expected["F1"], (measured, expected)
    assert all(peak <= expected[name] for name, peak in measured.items()), (measured, expected)
    assert got[2] <= predicted


class ScaledSkip(nn.Module):
    """A Linear-GELU-Linear and a skip scaled by a parameter: its input saved by the first Linear and by the
    scale's product, whose backward, the first to run, brings it back while the MLP's backward has yet to run."""

    def __init__(self, w):
        super().__init__()
        self.a, self.b = nn.Linear(w, 4 * w), nn.Linear(4 * w, w)
        self.g = nn.Parameter(torch.ones(w))

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))) + x * self.g


def test_a_streamed_layers_input_that_left_the_device_is_charged_where_its_backward_brings_it_back():
    # Each layer saves its input, which nothing else holds: streamed, the input leaves the device with it and its
    # backward brings it back from the host early (the scaled skip's product runs backward first), beside the
    # MLP's backward. The profile's streamed run holds its input, found on the device there, so a second run
    # with it let go of measures what the copy adds (OffloadCost.stream_bwd_input_bytes: the whole hidden
    # state). Before (found 2026-12-07 on DeepSeek-V4), the model took the copy as among the measured peak:
    # every layer streamed with no window held a hidden state (131,072 bytes, 7.7%) above its prediction; now
    # exact, with copies made at once and delayed.
    torch.manual_seed(0)
    model = Stack(n=4)
    model.layers = nn.ModuleList(ScaledSkip(128) for _ in range(4))
    grads_ready(model)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))  # a hidden state: 128 KiB
    plain = stack_step(model, x)
    lp = remat.enable(model, list(model.layers), budget=1 << 40, offload=True, offload_min_bytes=64 << 10)
    same_step(plain, stack_step(model, x))  # the profiling step
    for st in lp.chain.stages:
        assert st.offload.input and st.offload.stream_bwd_input_bytes == x.nbytes, st.offload.stream_bwd_input_bytes
    # (Block's input comes back at its first Linear's backward, after its peak: it adds nothing there.)
    ops, windows = forwards_plan(lp.chain, [f"Fa{i}@stream0" for i in range(4)])
    _, predicted = give_plan(lp, ops, stream_windows=windows)
    unmeasured = remat.Chain.from_json(lp.chain.to_json())
    for st in unmeasured.stages:
        o = st.offload
        o.stream_bwd_input_bytes = 0  # as the model read it before
        st.offload = o
    assert predicted - remat.step_peak_bytes(unmeasured, lp.context, lp.plan) == x.nbytes
    for delay in (0, 100):
        lp.offloads.engines[x.device] = CopyEngine(x.device, delay=delay, hold=True)
        got = stack_step(model, x)
        same_step(plain, got)
        assert got[2] == predicted, (delay, got[2], predicted)


def test_a_recompute_after_an_offloaded_layer_holds_its_input_twice_as_its_backward_does():
    # Layer 2 offloaded sends its ReLU's output (layer 3's input); layer 3 checkpointed with its input on the
    # host sends it too. Layer 3's backward begins by bringing layer 2's copy back ahead, then recomputes from its
    # own: both copies are on the device through the recompute, as through the backward. Before (found
    # 2026-12-04), only the backward was charged the second copy; the recompute, which also holds the generator
    # state it saves while it replays the first (5,056 bytes), peaked that much above its prediction with copies
    # made at once (a GPU's copies back, which land during the recompute, are as early). Measured phase by
    # phase: layer 3's backward to the byte made at once, at most its prediction delayed.
    model, layers, x, plain, lp = relu_stack()
    ops = "Fa0 Fa1 Fa2@host Fc3@host L Fa3 B3 B2 B1 B0".split()
    _, predicted = give_plan(lp, ops)
    assert lp.choices == ["keep", "keep", "keep@host", "checkpoint@host"], lp.choices
    for delay in (0, 100):
        lp.offloads.engines[x.device] = CopyEngine(x.device, delay=delay)
        phases = Phases(layers, remat.cpu_meter())
        # Made at once, layer 2's copies leave before the loss: the step is 12% below its prediction, warned of.
        below = pytest.warns(RuntimeWarning, match="below the plan's prediction")
        with contextlib.nullcontext() if delay else below:
            got = stack_step(model, x)
        same_step(plain, got)
        measured, expected = phases.done(), predicted_phases(lp.timeline())
        assert all(peak <= expected[name] for name, peak in measured.items()), (delay, measured, expected)
        assert measured["B3"] == expected["B3"] or delay, (measured, expected)
        assert got[2] <= predicted


STACK_WAYS = ("Fa{i}", "Fa{i}@host", "Fa{i}@stream", "Fa{i}@stream0", "Fk{i}[matmuls]", "Fk{i}[matmuls]@host",
              "Fc{i}", "Fc{i}@host")


def test_random_plans_of_the_stacks_ways_hold_at_most_their_prediction():
    # The stack's four layers each run one of its eight ways, drawn at random, every plan with copies made at once
    # and delayed: every step the plain run's, none above its prediction. Over all 4,096 such plans, 120 runs were
    # above before 2026-12-04's charge of a recompute's second copy (up to 0.77%), none since; of these 100
    # draws, seeds 59, 73 and 92 went above then (5 runs of 200; test_random.py's REMAT_RANDOM_SEED and
    # REMAT_RANDOM_COUNT draw others).
    from test_random import _seeds
    model, layers, x, plain, lp = relu_stack()
    chain, above = lp.chain, []
    for seed in _seeds(1, 100):
        rng = random.Random(seed)
        fwd = [rng.choice(STACK_WAYS).format(i=i) for i in range(len(chain.stages))]
        ops, windows = forwards_plan(chain, fwd)
        _, predicted = give_plan(lp, ops, stream_windows=windows, policies=list(chain.policies))
        for delay in (0, 100):
            lp.offloads.engines[x.device] = CopyEngine(x.device, delay=delay)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # steps below their prediction, warned of
                got = stack_step(model, x)
            same_step(plain, got)
            if got[2] > predicted:
                above.append(f"seed {seed}, delay {delay}: {' '.join(fwd)} held {got[2]}, predicted {predicted}")
    assert not above, "\n".join(above)


def test_a_tensor_saved_within_bytes_saved_whole_before_it_comes_back_once():
    # An in-place ReLU saves its output whole; a Linear then saves the output's two halves of rows (dense views of
    # the same bytes, the second at an offset). They share the whole's entry: sent once, brought back once, and
    # with retain_graph (nothing dropped between the backward passes) the device holds them once, as the plain
    # run does. Before (found 2026-12-04 by test_random.py, seed 18889), the halves came back apart beside the
    # whole: 64 KiB more. The C++ twin: Offload.ATensorSavedWithinBytesSavedWholeBeforeItComesBackOnce.
    meter = remat.cpu_meter()
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(256, 64, requires_grad=True)

    def step(o):
        lin.zero_grad(set_to_none=True)
        x.grad = None
        base = meter.count()
        with o:
            top, bottom = (x * 2).relu_().chunk(2, 0)  # r (64 KiB) saved by relu_; halves of 32 KiB
            loss = (lin(top) * lin(bottom)).sum()
            del top, bottom
        meter.reset_peak()  # the backward passes' peak: where the copies come back
        loss.backward(retain_graph=True)
        loss.backward()
        return [x.grad.clone()] + [p.grad.clone() for p in lin.parameters()], meter.peak() - base

    want, plain_peak = step(contextlib.nullcontext())
    o = offload(lin, min_bytes=0)
    got, peak = step(o)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # r, and the product's factors (the outputs of lin, 32 KiB each); not the halves. Each back once.
    assert (o.offloaded, o.offloaded_bytes, o.brought_back) == (3, 128 << 10, 3), (o.offloaded, o.brought_back)
    assert peak <= plain_peak, (peak, plain_peak)


def test_the_gpu_tables_bench_runs_on_a_cpu_as_the_next_gpu_call_runs_it(tmp_path):
    # bench/offload_cuda.py end to end with the options scripts/gpu-session's next call gives it (groups, remat at
    # hf's peak and its least budget, profiled with the pipelined timing and compared with the synchronized one,
    # each remat row also on the experimental host_wait=False engines, and on a copy whose layers are compiled one
    # by one, here by aot_eager: no code generated, the same paths as inductor's through remat),
    # on a 2-layer Llama on the CPU: a Python error in its code paths would otherwise first show on a lent GPU.
    import os
    import subprocess
    import sys
    pytest.importorskip("transformers")
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "offload_cuda.py")
    out = tmp_path / "offload.json"
    args = ["--device", "cpu", "--model", "llama", "--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads",
            "1", "--intermediate", "64", "--seq", "16", "--batch", "1", "--rounds", "1", "--steps", "1", "--groups",
            "--timing", "pipelined", "--compare-timing", "--at", "hf,least", "--skip", "hf-offload,save_on_cpu",
            "--min-bytes", "1024", "--nowait-rows"]
    import remat.hf
    if not remat.hf.wraps_whole_call():  # layers compiled on their own: transformers 5.23 or later
        args += ["--compiled-layers", "aot_eager"]
    r = subprocess.run([sys.executable, bench, *args, "--json", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    d = json.loads(out.read_text())
    assert d["stage"] == "measured" and d["timing"] == "pipelined" and d["other_timing"]["timing"] == "synced"
    assert d["other_timing"]["chain"]["stages"] and set(d["rows"]) >= {"hf", "sac", "remat@at-hf", "remat@least"}
    # Each remat row's twin on the experimental host_wait=False engines (--nowait-rows), the same plan; offloading
    # (--min-bytes 1 KiB), so that the engines are swapped on a step that copies.
    assert {"remat@at-hf/nowait", "remat@least/nowait"} <= set(d["rows"])
    assert d["rows"]["remat@at-hf"]["host_peak"] > 0 and d["rows"]["remat@at-hf/nowait"]["host_peak"] > 0
    # Every call profiled as a candidate group, per layer, for the bound: each layer's chosen groups among them.
    assert len(d["saved_calls"]) == len(d["chain"]["stages"]) and all(d["saved_calls"])
    for layer, st in zip(d["saved_calls"], d["chain"]["stages"]):
        assert {g["name"] for g in st["groups"]} <= {c["name"] for c in layer} and len(layer) >= len(st["groups"])
    for row in ("at-hf", "least"):
        plan = d["plans"][row]
        assert plan["check"]["loss_equal"] and plan["predicted_ms"] > 0 and plan["predicted_ms_other"] > 0
        assert plan["replanned_other"]["choices"] and plan["replanned_other"]["predicted_ms"] > 0
    if "--compiled-layers" in args:
        # Each remat row on the compiled layers too, planned from their own profile at the same budget, its step
        # compared with the plain run's; below what compiled layers allow (no streaming, no group assignments:
        # the eager least budget, which streams both layers here), at their own least, marked so. Since
        # 2026-12-05 compiled layers may go to the host: their profile has offload figures.
        assert {"remat@at-hf/compiled", "remat@least/compiled"} <= set(d["rows"])
        assert d["compiled_layers"]["backend"] == "aot_eager" and d["compiled_layers"]["chain"]["stages"]
        for row in ("at-hf/compiled", "least/compiled"):
            plan = d["plans"][row]
            assert plan["compiled_layers"] and plan["choices"] and plan["predicted_ms"] > 0
            assert plan["check"]["grad_max_diff"] < 1e-2, plan["check"]
        assert all(st.get("offload") for st in d["compiled_layers"]["chain"]["stages"])
        fallen = d["plans"]["least/compiled"]
        assert fallen["least"] == fallen["budget"] > fallen["asked"] == d["plans"]["least"]["budget"], fallen


def test_a_planned_layer_never_sends_the_models_parameters_as_they_are_now_nor_another_layers_inputs():
    # A planned layer's Offload leaves on the device the storages of the model's parameters and buffers (read once a
    # step through the model's Walk, kept across steps) and of what the call takes beside its input. A parameter
    # swapped in between steps (as FSDP2 swaps its unsharded ones in) is read as it is now; what one layer's call
    # takes is not left on the device by the next layer's Offload.
    from remat.layer_offload import LayerOffloads
    from remat.saved import Kept
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    offloads = LayerOffloads(True, None, 0)
    x, mask = torch.randn(4, 16), torch.randn(4, 16)

    def packed(i, t, *taken):
        o = offloads.for_layer(i, "keep@host", lambda h, *a: h, (x, *taken), None, model)
        return isinstance(o.pack(t), Kept)

    for step in range(2):
        offloads.begin_step()
        weight = model[1].weight
        assert packed(0, weight.detach().t(), mask), step  # a view of a parameter's storage: left
        assert packed(0, mask.view(-1), mask), step  # what the call takes
        assert not packed(1, mask.view(-1)), step  # another layer's input: sent
        assert not packed(1, torch.randn(4, 16)), step
        model[1].weight = nn.Parameter(weight.detach().clone())  # a new storage from the next step on
