"""Selective checkpointing with three outcomes per operator call (remat/selective.py): kept on the device, sent
to the host, recomputed. The CPU is the device; the host pool is memory remat's CPU meter does not count."""
import json

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import remat
from remat.offload import CopyEngine, HostPool, Offload
from remat.selective import _HostWord

from conftest import groups_to_the_host_pay

LN = torch.ops.aten.native_layer_norm.default


def block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64), nn.LayerNorm(64))


def policy_with(host_word):
    def policy(ctx, op, *args, **kwargs):
        if op in remat.MATMUL_OPS:
            return host_word
        if op is LN:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in remat.MATMUL_OPS or op is LN else CheckpointPolicy.PREFER_RECOMPUTE


def step(model, x, call=None, then=None):
    """One forward and backward (dropout on, its seed fixed): the gradients, and the device bytes held between
    the forward and the backward (after then(), when given: the bytes held before it, too)."""
    meter = remat.cpu_meter()
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    torch.manual_seed(1)
    base = meter.count()
    y = model(x) if call is None else call(model, x)
    held = meter.count() - base
    if then is not None:
        then()
        held = (held, meter.count() - base)
    y.sin().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()], held


@pytest.mark.parametrize("word", [remat.MUST_CPU_OFFLOAD, remat.PREFER_CPU_OFFLOAD, _HostWord.MUST_CPU_OFFLOAD],
                         ids=["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD", "remat's own word"])
def test_each_call_kept_sent_to_the_host_or_recomputed_gives_the_plain_gradients(word):
    model, x = block(), torch.randn(32, 64)
    plain, _ = step(model, x)
    # The same policy keeping the products on the device: the bytes the host answers free.
    _, kept_held = step(model, x, lambda m, t: remat.checkpoint(m, t, policy=keep_matmuls))
    pool = HostPool()
    # A delayed copy engine: a copy lands only when waited for (or two later copies on), so that a tensor read
    # before its copy landed, either way, gives a wrong gradient.
    o = Offload(pool=pool, min_bytes=0, engine=CopyEngine(torch.device("cpu"), delay=2))
    o.keep_on_device(list(model.parameters()))
    got, (before, held) = step(model, x, lambda m, t: remat.checkpoint(m, t, policy=policy_with(word), offload=o),
                               o.finish_copies)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    products = 32 * 256 * 4 + 32 * 64 * 4  # the two linears' outputs (addmm)
    assert o.offloaded == 2 and o.offloaded_bytes == products == pool.peak_bytes
    # Each landed before it was read, each came back once, started as the recompute began; none is left.
    assert o.brought_back == 2 and o.prefetched == 2 and pool.in_use_bytes == 0
    # On the device between the forward and the backward: while their copies are in flight, what keeping them
    # held (a device tensor is never freed while its copy reads it); once landed, that less their bytes.
    assert before == kept_held and held == kept_held - products, (before, held, kept_held)


def test_a_host_answer_needs_an_offload_and_an_answer_must_be_one_of_the_words():
    model, x = block(), torch.randn(8, 64, requires_grad=True)
    with pytest.raises(ValueError, match=r"answered 'host'.*aten\.addmm.*no remat\.offload\.Offload"):
        remat.checkpoint(model, x, policy=policy_with(remat.MUST_CPU_OFFLOAD))
    with pytest.raises(TypeError, match=r"answered 'save' for aten\.addmm"):
        remat.checkpoint(model, x, policy=lambda ctx, op, *a, **k: "save" if op in remat.MATMUL_OPS else False)
    assert all(p.grad is None for p in model.parameters())


def test_a_second_backward_through_the_region_is_refused_and_a_write_to_a_kept_output_is_autograds_error():
    model, x = block(), torch.randn(8, 64, requires_grad=True)
    o = Offload(min_bytes=0).keep_on_device(list(model.parameters()))
    y = remat.checkpoint(model, x, policy=policy_with(remat.MUST_CPU_OFFLOAD), offload=o)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recomputed a second time"):
        y.sum().backward()

    def writes(t):
        h = torch.sigmoid(t)
        out = h * 2
        h.mul_(3)  # writes what the policy kept (sigmoid's output), after its use
        return out

    policy = lambda ctx, op, *a, **k: op is torch.ops.aten.sigmoid.default  # noqa: E731
    y = remat.checkpoint(writes, x, policy=policy)
    with pytest.raises(RuntimeError, match="is at version 1; expected version 0"):
        y.sum().backward()
    # Sent to the host instead, its copy carried out late (behind the write, as a GPU's side stream may): the
    # Offload's error for a write while a copy is in flight, as outside selective checkpointing (a copy made at
    # once holds the values saved, as torch's save_on_cpu). Before (2026-12-06) no error, and sigmoid's backward
    # read the written values: the Offload's version holder, made below the dispatch mode, missed the write.
    host = lambda ctx, op, *a, **k: (remat.MUST_CPU_OFFLOAD if op is torch.ops.aten.sigmoid.default  # noqa: E731
                                     else CheckpointPolicy.PREFER_RECOMPUTE)
    y = remat.checkpoint(writes, x, policy=host,
                         offload=Offload(min_bytes=0, engine=CopyEngine(torch.device("cpu"), delay=100)))
    with pytest.raises(RuntimeError, match="modified by an in-place operation while its copy to the host"):
        y.sum().backward()


@pytest.mark.parametrize("dims", [4, 2])
def test_a_kept_output_written_in_place_that_autograd_did_not_save_is_recomputed(dims):
    # torch.matmul on more than two dimensions returns bmm's output through aten::_unsafe_view, which does not
    # share its version counter; transformers 4.53's T5 attention then adds its position bias to it in place.
    # Autograd saves neither, so the plain run is valid; the matmuls policy kept bmm's output, the recompute was
    # handed the biased values and biased them again: gradients 7e-3 from the plain run's, silently. On two
    # dimensions (mm's own output, its version moved by the write) it was autograd's error, on a valid program.
    # Now the forward sees the write and the recompute makes the call again. Every way bitwise the plain run.
    torch.manual_seed(0)
    shape = (2, 3, 8, 16) if dims == 4 else (8, 16)
    q, k = (torch.randn(*shape, requires_grad=True) for _ in range(2))
    bias = torch.randn(3, 8, 8) if dims == 4 else torch.randn(8, 8)

    def attention(q, k):
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores += bias
        return scores.softmax(-1).matmul(k)

    def grads(y):
        y.sin().sum().backward()
        got = [q.grad.clone(), k.grad.clone()]
        q.grad = k.grad = None
        return got

    plain = grads(attention(q, k))
    for policy in (keep_matmuls, policy_with(remat.MUST_CPU_OFFLOAD)):
        got = grads(remat.checkpoint(attention, q, k, policy=policy,
                                     offload=Offload(min_bytes=1 << 30)))  # all left on the device
        assert all(torch.equal(a, b) for a, b in zip(plain, got))
    # Sent to the host, its copy made at once or carried out late (as a GPU's side stream may, behind the write):
    # also made again. Before (found 2026-12-06 on Gemma-3n's AltUp, `predictions += hidden_states`), the late
    # copy took the written values and the gradients differed from the plain run's, silently; on two dimensions
    # the Offload's own check for a write while a copy is in flight did not see it either (its version holder,
    # made below the dispatch mode, had a counter of its own).
    for delay in (0, 100):
        engine = CopyEngine(torch.device("cpu"), delay=delay)
        got = grads(remat.checkpoint(attention, q, k, policy=policy_with(remat.MUST_CPU_OFFLOAD),
                                     offload=Offload(min_bytes=0, engine=engine)))
        assert all(torch.equal(a, b) for a, b in zip(plain, got)), delay
        with Offload(min_bytes=0, engine=engine):  # kept inside an Offload's context: sent with it (Fk[...]@host)
            y = remat.checkpoint(attention, q, k, policy=keep_matmuls)
        assert all(torch.equal(a, b) for a, b in zip(plain, grads(y))), delay


def test_a_kept_output_written_in_place_at_a_let_go_saved_tensors_address_is_recomputed():
    # A checkpointed forward lets go of what autograd saves; a later output may take its address. remat told the
    # storages autograd saved by address alone, so such an output, kept or sent and then written in place (Llama
    # 4's shared expert, `out.add_(...)`, found 2026-12-06 by bench/architectures.py --random), read as saved:
    # kept, its written values were handed back (autograd's error, on a valid program); sent, its copy in flight
    # was refused; each as the allocator placed it, so not every run. Now the saved storages are held by weak
    # reference. Here the address is taken by construction, not by the allocator's chance: autograd saves a
    # second storage object over the product's bytes (from_numpy), which the forward lets go of before the
    # write. Every way gives the plain run's gradient (before: three of the four raised).
    torch.manual_seed(0)
    x, w = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64)
    addresses = []

    def layer(x):
        out = x * w  # autograd saves w of it, not its output
        v = torch.from_numpy(out.detach().numpy())  # another storage object at the product's address
        addresses.append((v.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()))
        s = (x * v).sum(0)  # mul saves v: autograd's save at that address
        del v  # its storage object gone; the product's bytes stay
        out.add_(s)
        return out.sin()

    plain = torch.autograd.grad(layer(x).sum(), x)[0]
    for answer in (CheckpointPolicy.MUST_SAVE, remat.MUST_CPU_OFFLOAD):
        policy = lambda ctx, op, *a, answer=answer, **k: (  # noqa: E731
            answer if ctx.call == "aten::mul#0" else CheckpointPolicy.PREFER_RECOMPUTE)
        for delay in (0, 100):
            addresses.clear()
            y = remat.checkpoint(layer, x, policy=policy,
                                 offload=Offload(min_bytes=0, engine=CopyEngine(torch.device("cpu"), delay=delay)))
            assert addresses[0][0] == addresses[0][1]  # the saved storage was at the product's address
            assert torch.equal(torch.autograd.grad(y.sum(), x)[0], plain), (answer, delay)


class _EarlyPeak(nn.Module):
    """A block whose forward peaks at a wide product it only sums (48 times its input), before the calls that
    save: the product is alive at that peak, and autograd does not save it."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        wide = x.repeat(1, 48).sum(-1, keepdim=True)
        return self.fc2(torch.nn.functional.gelu(self.fc1(x + wide))) + x


def test_a_group_assignments_forward_holds_a_kept_transient_once(meter):
    # A group assignment's forward holds what it keeps only past where a forward without saving lets go of it:
    # the profile measures that forward's peak after each group is let go of (SavedGroup.fwd_peak_after_bytes),
    # and the model charges it. The wide product kept was charged beside the forward's whole peak, which holds
    # it already: 2.6 MB (70%) above what the step held. Now to the byte, with copies at once and late.
    from conftest import give_plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), _EarlyPeak(), nn.Linear(64, 64))
    x = torch.randn(256, 64, requires_grad=True)

    def step():
        model.zero_grad(set_to_none=True)
        base = meter.active()
        meter.reset_peak()
        model(x).sum().backward()
        return meter.peak() - base, [p.grad.clone() for p in model.parameters()]

    want = step()[1]
    lp = remat.enable(model, list(model), budget=1 << 40, groups=True)
    step()  # the profiling step
    groups = lp.chain.stages[1].groups
    assert groups[0].name == "aten::repeat#0" and 0 < groups[0].fwd_peak_after_bytes < groups[0].bytes
    for assignment in ("k" + "r" * (len(groups) - 1), "kk" + "r" * (len(groups) - 2)):
        plan, predicted = give_plan(lp, ["Fc0", "Fk1{" + assignment + "}", "Fc2", "L", "Fa2", "B2", "B1", "Fa0",
                                         "B0"])
        for engine in (CopyEngine(torch.device("cpu"), hold=True), CopyEngine(torch.device("cpu"), delay=100)):
            lp.offloads.engines[torch.device("cpu")] = engine
            held, grads = step()
            assert all(torch.equal(a, b) for a, b in zip(want, grads))
            assert held == predicted, (assignment, held, predicted)
        unmeasured = remat.Chain.from_json(lp.chain.to_json())
        for g in unmeasured.stages[1].groups:
            g.fwd_peak_after_bytes = -1
        assert remat.step_peak_bytes(unmeasured, lp.context, plan) - held > 30 * x.nbytes  # hidden states


def test_a_policy_that_answers_host_is_not_profiled_for_a_plan_yet():
    # The chain has no figures for what a policy sends to the host itself: profiling one is refused by name
    # (not profiled as if it kept or recomputed those calls).
    model, x = block(), torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"policy 'half' answered .*CPU_OFFLOAD for aten\.addmm"):
        remat.profile(remat.stages_of(model), x, policies={"half": policy_with(remat.MUST_CPU_OFFLOAD)},
                      offload_min_bytes=0)


def test_measuring_groups_leaves_nothing_of_the_forward_alive(meter):
    # The groups' measurement runs forwards with no backward: its saved-tensor hooks must not hand a saved output
    # back as itself (ReLU saves its own output: a reference cycle through autograd's C++ that Python's
    # collector cannot free, holding the forward's graph). It did: on a Llama (its attention saves its output)
    # every profiling step with groups kept the graphs alive, and each plan's least budget rose by 88 MiB.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(2)])
    x = torch.randn(64, 64)
    before = meter.count()
    chain = remat.profile(remat.stages_of(model), x, groups=True, warmup=0, repeats=2)
    # (The first product too since 2026-12-04: ReLU does not save its input, and keeping it spares its recompute.)
    assert [[g.name for g in st.groups] for st in chain.stages] == [["aten::addmm#0", "aten::relu#0"]] * 2
    assert meter.count() == before


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + x


class _Calls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, op):
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **kwargs or {})


def test_a_call_whose_output_autograd_does_not_save_is_a_group_and_kept_is_not_made_again():
    # Since 2026-12-04 a saved group is any call with outputs of its own: fc1's product, which ReLU reads and
    # does not save (it saves its own output), is one, all of its bytes unsaved; kept, the recompute before the
    # backward does not make it again (one product fewer there), and the gradients are the plain run's. fc2's
    # product comes after autograd's last save (fc2 saves its input before it runs): a recompute that stops
    # early never makes it, so it is no group.
    from remat.selective import GroupPolicy

    model, x = _Residual(), torch.randn(32, 64)
    chain = remat.profile(remat.stages_of(nn.Sequential(model)), x, groups=True, warmup=0, repeats=1)
    groups = chain.stages[0].groups
    assert [g.name for g in groups] == ["aten::addmm#0", "aten::relu#0"]
    assert [g.bytes for g in groups] == [32 * 256 * 4] * 2
    assert [g.unsaved_bytes for g in groups] == [32 * 256 * 4, 0]
    assert chain.stages[0].saved_bytes - chain.stages[0].output_bytes < sum(g.bytes for g in groups)
    assert remat.group_unsaved_bytes(chain.stages[0], "kr") == 32 * 256 * 4
    assert remat.group_unsaved_bytes(chain.stages[0], "rk") == 0
    plain, _ = step(model, x)
    names = [g.name for g in groups]
    for assignment, products in (("rr", 1), ("kr", 0), ("rk", 1), ("kk", 0)):
        policy = GroupPolicy(names, assignment)
        calls = _Calls(torch.ops.aten.addmm.default)
        for p in model.parameters():
            p.grad = None
        t = x.detach().requires_grad_(True)
        y = remat.checkpoint(model, t, policy=policy)
        with calls:
            y.sin().sum().backward()
        assert calls.count == products, (assignment, calls.count)
        got = [t.grad] + [p.grad for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(plain, got)), assignment


class _TwoDropouts(_Residual):
    # aten::native_dropout called as CUDA's dropout calls it (on the CPU, F.dropout draws with bernoulli_ instead).
    def forward(self, x):
        h = torch.ops.aten.native_dropout(self.fc1(x), 0.5, True)[0]
        return torch.ops.aten.native_dropout(self.fc2(torch.relu(h)), 0.5, True)[0]


@pytest.mark.skipif(remat.selective._CACHEABLE_EFFECT is None, reason="this torch's selective checkpointing "
                    "has no ordered effects it caches (before 2.15)")
def test_an_ordered_effect_runs_once_as_torchs_selective_checkpointing_runs_it(capfd):
    # aten::_print is an ordered effect torch's selective checkpointing caches whatever the policy answers; it
    # returns nothing, which remat's cache once took for "recompute", and the recompute printed again.
    def f(x):
        torch.ops.aten._print("remat-effect")
        return (x.sin() * 2).sum()

    recompute = lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE  # noqa: E731
    x = torch.randn(4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False, context_fn=lambda: (
        torch.utils.checkpoint.create_selective_checkpoint_contexts(recompute))).backward()
    torchs = capfd.readouterr().out.count("remat-effect")
    remat.checkpoint(f, x, policy=recompute).backward()
    assert capfd.readouterr().out.count("remat-effect") == torchs == 1


@pytest.mark.parametrize("word", [CheckpointPolicy.MUST_SAVE, remat.MUST_CPU_OFFLOAD], ids=["kept", "sent"])
def test_a_random_call_kept_moves_the_generator_on_for_the_random_calls_recomputed_after_it(word):
    # The first dropout kept (or sent), the second recomputed: the recompute, which starts from the forward's
    # generator state and does not run the first, must draw the second's mask where the forward did. Before
    # (found on an H200, where BERT's attention kernel and its dropouts are single random calls), it drew it
    # from the state before the first: gradients 5e-3 from the plain run's, the loss equal.
    model, x = _TwoDropouts(), torch.randn(32, 64)
    plain, _ = step(model, x)
    drop = torch.ops.aten.native_dropout.default

    def policy(ctx, op, *args, **kwargs):
        first = getattr(ctx, "call", None) == "aten::native_dropout#0"
        return word if op is drop and first else CheckpointPolicy.PREFER_RECOMPUTE

    o = Offload(min_bytes=0).keep_on_device(list(model.parameters()))
    got, _ = step(model, x, lambda m, t: remat.checkpoint(m, t, policy=policy, offload=o))
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


def test_inside_an_offloads_context_what_is_kept_goes_with_it_but_must_save():
    # True (or PREFER_SAVE) keeps, and the enclosing Offload takes it to the host with the checkpoint's input
    # (as it takes what autograd saves around it: the plan's Fk[name]@host); MUST_SAVE stays on the device;
    # a host answer goes through the enclosing Offload when none is given.
    model, x = block(), torch.randn(32, 64)
    plain, _ = step(model, x)

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.addmm.default:
            return args[1].shape[-1] == 64 or remat.MUST_CPU_OFFLOAD  # True for the first, host the second
        return CheckpointPolicy.MUST_SAVE if op is LN else CheckpointPolicy.PREFER_RECOMPUTE

    o = Offload(min_bytes=0).keep_on_device(list(model.parameters()))

    def call(m, t):
        with o:
            return remat.checkpoint(m, t, policy=policy)

    got, _ = step(model, x, call)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    # The input and both products; not layer norm's outputs (32 x 64 floats, and its mean and rstd).
    assert o.offloaded == 3 and o.offloaded_bytes == 32 * 64 * 4 + 32 * 256 * 4 + 32 * 64 * 4
    # The input is found alive on the device (the caller holds it), the products come back.
    assert o.kept_on_device == 0 and o.brought_back == 2 and o.found_on_device == 1


def runs_as_planned(lp, model, x, plain, budget: int, sending: int, within: float):
    """Plans lp at `budget` (at least `sending` layers sending groups to the host), then runs two steps of
    test_offload's stack_step: each the plain run's bitwise, at most the predicted peak and less than `within`
    of it below, with the host bytes simulate() predicts."""
    from test_offload import same_step, stack_step

    lp.set_budget(budget)
    assert sum(c.startswith("{") and "h" in c for c in lp.choices) >= sending, lp.choices
    sim = remat.simulate(lp.chain, lp.plan)
    pool = lp.host_pool
    for _ in range(2):
        pool.peak_bytes = 0
        got = stack_step(model, x)
        same_step(plain, got)
        assert got[2] <= lp.predicted_peak_bytes <= budget, (lp.choices, got[2], lp.predicted_peak_bytes)
        assert lp.predicted_peak_bytes - got[2] < within * got[2]
        assert pool.peak_bytes == sim.host_peak_bytes == lp.predicted_host_bytes, (lp.choices, pool.peak_bytes)


def test_the_planner_chooses_each_groups_outcome_and_the_step_runs_as_predicted():
    # remat.enable(groups=True): the profiling step measures each block's saved groups (its calls with outputs of
    # their own), the planner may run a block as a group assignment ("{khr}"), and the step gives the
    # plain run's gradients bitwise within the predicted peak, with the host bytes simulate() predicts.
    from test_offload import planned_stack

    model, x, plain, lp = planned_stack(groups=True)
    chain, ctx = lp.chain, lp.context
    hidden = 256 * 128 * 4
    for st in chain.stages:
        names = [g.name for g in st.groups]
        # The first product (GELU saves it), GELU's output (the second product saves it) and the second product
        # (dropout reads it and saves only its mask: kept, the recompute does not make it again); not dropout's
        # mask (a factory's output, empty_like, that bernoulli_ fills in place), nor the block's output.
        assert names == ["aten::addmm#0", "aten::gelu#0", "aten::addmm#1"], names
        assert [g.bytes for g in st.groups] == [4 * hidden, 4 * hidden, hidden]
        assert [g.unsaved_bytes for g in st.groups] == [0, 0, hidden]
        assert all(g.recompute_ms >= 0 for g in st.groups)
        # What the planner charges a stage under an assignment (remat.group_cost, as simulate() does).
        c = remat.group_cost(st, "hkr")
        assert c.offload.bytes == 4 * hidden and c.saved_bytes == st.output_bytes + 8 * hidden
    # Recomputing a block costs much (100 ms, half of it each group's call), keeping it whole (its forward
    # saving everything: 5 ms) or under the matmuls policy more: at the budget of every block but the last sending its groups to the host, the
    # planner sends them (the CPU's own timings would decide by noise). Every step is the plain run's,
    # within the predicted peak, with the host bytes simulate() predicts.
    groups_to_the_host_pay(chain)
    sent = remat.Plan.from_json('{"num_stages": 5, "ops": ["Fk0{hhh}", "Fk1{hhh}", "Fk2{hhh}", "Fk3{hhh}", '
                                '"Fk4{kkk}", "L", "B4", "B3", "B2", "B1", "B0"]}')
    assert remat.simulate(chain, sent).host_peak_bytes == 4 * 9 * hidden
    budget = remat.step_peak_bytes(chain, ctx, sent)
    runs_as_planned(lp, model, x, plain, budget, sending=3, within=0.1)
    # The same chain without groups: that budget costs more time.
    without = remat.per_layer(chain, remat.simulate(chain, lp.plan).peak_bytes, offload=True, groups=False)
    assert without.predicted.time_ms > remat.per_layer(chain, remat.simulate(chain, lp.plan).peak_bytes,
                                                       offload=True).predicted.time_ms
    lp.remove()


class _Attention(nn.Module):
    """A self-attention block on the CPU's attention kernel, whose outputs are the attention's (32 KiB here)
    and its log-sum-exp (2 KiB)."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(1, 2).reshape(b, s, w))


class _AttentionStack(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(_Attention() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_call_with_outputs_too_small_to_send_is_a_group_whose_small_outputs_stay():
    # Profiled for offloading, a call with an output below offload_min_bytes (an attention kernel's log-sum-exp
    # beside its output) is a group whose stays_bytes are that output's: sent, the rest leaves, it stays on the
    # device. Before 2026-12-05 such a call was no group (the Llama's attention on the H200 was always
    # recomputed). The step sending it is the plain run's bitwise, with the host bytes simulate() predicts
    # (without the log-sum-exp) and within the predicted peak.
    from test_offload import same_step, stack_step

    torch.manual_seed(0)
    model = _AttentionStack()
    x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(2))
    plain = stack_step(model, x)
    lp = remat.enable(model, list(model.layers), budget=1 << 40, offload=True, offload_min_bytes=8 << 10,
                      groups=True)
    same_step(plain, stack_step(model, x))  # the profiling step
    chain, ctx = lp.chain, lp.context
    out, lse = 2 * 64 * 64 * 4, 2 * 4 * 64 * 4
    for st in chain.stages:
        attention = [g for g in st.groups if g.name.startswith("aten::_scaled_dot_product")]
        assert len(attention) == 1, [g.name for g in st.groups]
        assert (attention[0].bytes, attention[0].stays_bytes) == (out + lse, lse)
        assert all(g.stays_bytes == 0 for g in st.groups if g is not attention[0])
        which = "".join("h" if g.name == attention[0].name else "r" for g in st.groups)
        assert remat.group_cost(st, which).offload.bytes == out
    groups_to_the_host_pay(chain)
    n = len(chain.stages)
    sends = "".join("h" for _ in chain.stages[0].groups)
    ops = [f"Fk{i}{{{sends}}}" for i in range(n - 1)] + [f"Fa{n - 1}", "L"] + [f"B{i}" for i in reversed(range(n))]
    sent = remat.Plan.from_json(json.dumps({"num_stages": n, "ops": ops}))
    budget = remat.step_peak_bytes(chain, ctx, sent)
    runs_as_planned(lp, model, x, plain, budget, sending=2, within=0.01)  # exact to the byte on 2.15
    lp.remove()
