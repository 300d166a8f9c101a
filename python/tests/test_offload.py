"""remat.offload on the CPU (the device and the host one memory; the host pool reserved ahead so that remat's
meter counts the device's tensors): every step bitwise the plain run's, the bytes that left the device exact,
copies delayed by a fake engine read only once landed, checkpointed layers' inputs offloaded, the pool's
bound, a second backward pass."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat.offload import CopyEngine, HostPool, offload

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
        assert o.brought_back >= o.offloaded and o.prefetched > 0


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
    late = offload(min_bytes=0, engine=CopyEngine(torch.device("cpu"), delay=100))
    with pytest.raises(RuntimeError, match=r"modified by an in-place operation while its copy to the host"):
        step(late)


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
