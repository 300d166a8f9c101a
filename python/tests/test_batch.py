"""remat.max_batch: the largest batch that trains within a budget, predicted from profiles at two sizes and
confirmed by a step, is the one a search that profiles and plans every size finds, and it trains; the model is left
as it was."""
import pytest
import torch

import remat
from remat.fit import pretend_device

from conftest import block, preallocate

WIDTH = 64


def model_of():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[block(WIDTH, 1024) for _ in range(4)])
    preallocate(model)
    return model


def make_batch(n):
    return torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(n))


def loss_of(out):
    return out.float().square().mean()


def plans(model, n, budget):
    """Whether the profiling step of a batch of n finds a plan within `budget` under remat.enable (which depends
    on memory alone: the least feasible budget is the measured bytes')."""
    lp = remat.enable(model, list(model), budget=budget)
    try:
        loss_of(model(make_batch(n))).backward()
        return lp.is_planned()
    except remat.InfeasibleBudget:
        return False
    finally:
        lp.remove()


def least_at(n):
    model = model_of()
    lp = remat.enable(model, list(model), budget=1 << 40)
    loss_of(model(make_batch(n))).backward()
    return lp.min_budget_bytes


@pytest.fixture(scope="module")
def budget():
    """Halfway between the least feasible budgets of batches 20 and 21: no measurement near the edge decides."""
    return (least_at(20) + least_at(21)) // 2


def test_the_largest_batch_is_the_one_planning_each_size_finds_and_it_trains(budget):
    model = model_of()
    before = [p.detach().clone() for p in model.parameters()]
    state = torch.get_rng_state()
    found = remat.max_batch(model, make_batch, budget, layers=list(model), loss=loss_of)
    # The model is as it was: parameters, zeroed gradients, forward, the generator.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(not p.grad.any() for p in model.parameters())
    assert all("forward" not in m.__dict__ for m in model)
    assert torch.equal(torch.get_rng_state(), state)
    # The search that profiles and plans each size, from 1 up until one has no plan within the budget.
    n = 1
    while plans(model, n + 1, budget):
        n += 1
    assert n == 20 and found.tried[0] == n, (found, n)
    # The answer trains: a planned step at it ran within the budget. Where the step at n ran over its predicted
    # peak (the per-layer model's predictions are not exact, issue 45; a plan's choice follows measured times),
    # max_batch stepped down and confirmed a smaller batch: each try is smaller than the last.
    assert found.confirmed and found.batch == found.tried[-1] and found.steps == 2 + 2 * len(found.tried)
    assert all(a > b for a, b in zip(found.tried, found.tried[1:]))
    assert found.measured_peak_bytes <= budget == found.budget_bytes
    assert found.predicted_peak_bytes <= budget and found.choices is not None and len(found.choices) == 4
    assert found.plan.num_stages == 4 and found.ms_per_sample > 0


def test_predicted_alone_and_what_it_refuses(budget):
    model = model_of()
    found = remat.max_batch(model, make_batch, budget, layers=list(model), loss=loss_of, confirm=False)
    assert found.batch == 20 and not found.confirmed and found.steps == 2 and found.measured_peak_bytes == -1
    # A device budget: the budget in bytes made from the device's reading in the first profiling step.
    with pretend_device(free_bytes=budget + remat._core.device_margin(4 << 30), total_bytes=4 << 30):
        auto = remat.max_batch(model, make_batch, "auto", layers=list(model), loss=loss_of, confirm=False)
    assert auto.budget_bytes == budget and auto.batch == 20  # (its choices follow measured times: not compared)
    # Nothing fits a budget of one byte.
    none = remat.max_batch(model, make_batch, 1, layers=list(model), loss=loss_of)
    assert none.batch == 0 and none.plan is None and none.tried == []
    for kwargs, words in ((dict(sizes=(2, 2)), "two different batch sizes"), (dict(limit=0), "limit must be"),
                          (dict(budget="lots"), "is not a size")):
        args = dict(budget=budget, layers=list(model), loss=loss_of)
        args.update(kwargs)
        with pytest.raises(ValueError, match=words):
            remat.max_batch(model, make_batch, **args)
    with pytest.raises(ValueError, match=r"make_batch\(4\) gave the layers an input of the size make_batch\(2\)"):
        remat.max_batch(model, lambda n: make_batch(3), budget, layers=list(model), loss=loss_of)
    with pytest.raises(ValueError, match="give loss="):
        remat.max_batch(model, make_batch, budget, layers=list(model))
    lp = remat.enable(model, list(model), budget=budget)
    with pytest.raises(ValueError, match="remat already plans this model"):
        remat.max_batch(model, make_batch, budget, layers=list(model), loss=loss_of)
    lp.remove()


class Embedded(torch.nn.Module):
    """An embedding of 4000 rows before four blocks: its dense gradient (1,024,000 bytes, the same at every
    batch) is the profiling step's largest moment at batches 2 and 4; the blocks' from about batch 24 on."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(4000, WIDTH)
        self.layers = torch.nn.Sequential(*[block(WIDTH, 256) for _ in range(4)])

    def forward(self, ids):
        return self.layers(self.emb(ids))


def make_ids(n):
    return torch.randint(0, 4000, (n, 8), generator=torch.Generator().manual_seed(n))


def test_a_peak_measured_at_small_batches_is_not_carried_to_large_ones():
    def least_at(n):
        model = Embedded()
        preallocate(model)
        lp = remat.enable(model, list(model.layers), budget=1 << 40)
        loss_of(model(make_ids(n))).backward()
        lp.remove()
        return lp.min_budget_bytes, lp.context

    (a, ctx_a), (b, ctx_b) = least_at(2), least_at(4)
    # The premise: at batches 2 and 4 the embedding's gradient is the step's peak, nearly the same at both.
    for ctx in (ctx_a, ctx_b):
        assert ctx.checkpoint_all_peak_bytes == ctx.before_backward_peak_bytes >= 1_024_000
    assert b - a < 8192
    budget = (least_at(32)[0] + least_at(33)[0]) // 2
    model = Embedded()
    preallocate(model)
    found = remat.max_batch(model, make_ids, budget, layers=list(model.layers), loss=loss_of)
    # A line through the peaks at 2 and 4 put the first try near batch 220 (a profiling step at seven times
    # the batch that fits); the per-layer model alone predicts 30, where 32 fits (it charges a recompute as a
    # whole layer run: issue 45).
    assert 27 <= found.tried[0] <= 32 and found.confirmed, found
