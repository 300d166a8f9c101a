"""remat.max_batch: the largest batch that trains within a budget, predicted from profiles at two sizes and
confirmed by a step, is the one a search that trains every size finds; the model is left as it was."""
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


def trains(model, n, budget):
    """Whether a batch of n trains within `budget` under remat.enable: its profiling step plans, and the planned
    step's measured peak is within it."""
    lp = remat.enable(model, list(model), budget=budget)
    try:
        for _ in range(2):
            loss_of(model(make_batch(n))).backward()
        return 0 <= lp.last_peak_bytes <= budget
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


def test_the_largest_batch_is_the_one_training_each_size_finds(budget):
    model = model_of()
    before = [p.detach().clone() for p in model.parameters()]
    state = torch.get_rng_state()
    found = remat.max_batch(model, make_batch, budget, layers=list(model), loss=loss_of)
    # The model is as it was: parameters, zeroed gradients, forward, the generator.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(not p.grad.any() for p in model.parameters())
    assert all("forward" not in m.__dict__ for m in model)
    assert torch.equal(torch.get_rng_state(), state)
    # The search that trains each size, from 1 up until one does not train.
    n = 1
    while trains(model, n + 1, budget):
        n += 1
    assert found.batch == n == 20, (found, n)
    assert found.confirmed and found.tried == [n] and found.steps == 2 + 2
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
