"""A budget that names the device ("auto", "90%"), on the CPU with a pretended device: the budget in bytes is the
planner library's rule over what the device had when the profiling step began, the plan is the one that budget
in bytes gets, the steps are the plain run's, and on a device with no capacity of its own it is a clear error."""
import copy

import pytest
import torch

import remat
from remat.fit import pretend_device

from conftest import assert_same_run, mlp, preallocate, train_step

MARGIN = 256 << 20  # remat._core.device_margin of a device under 12.8 GiB


def x_of():
    torch.manual_seed(123)
    return torch.randn(32, 64)


@pytest.fixture(scope="module")
def least():
    """The least budget a plan of the model exists for (bytes), from a profiling step under a budget in bytes."""
    model = mlp()
    preallocate(model)
    lp = remat.enable(model, list(model), budget=1 << 40)
    train_step(model, x_of())
    return lp.min_budget_bytes


def test_auto_plans_for_what_the_device_has_free_as_that_budget_in_bytes_would(least):
    assert remat._core.device_margin(4 << 30) == MARGIN
    budget = least + (64 << 10)
    base = mlp()
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    for m in (plain, model):
        preallocate(m)  # (a copy has no gradients)
    plain = train_step(plain, x_of())
    lp = remat.enable(model, list(model), budget="auto")
    with pretend_device(free_bytes=budget + MARGIN, total_bytes=4 << 30):
        train_step(model, x_of())  # the profiling step
        assert lp.budget_bytes == budget and lp.is_planned()
        # The plan the budget in bytes gets from the same measurements; a tight one: not every layer kept.
        by_bytes = remat.plan_step(lp.chain, lp.context, budget, "per-layer")
        assert lp.choices == remat.choices_of(by_bytes.plan) and lp.choices != ["keep"] * 6
        assert_same_run(plain, train_step(model, x_of()))
    # Another share of the same reading, planned without profiling again: half of it is less than the margin,
    # which leaves no budget at all.
    with pytest.raises(remat.InfeasibleBudget, match=r"budget='50%': 50% of the device's") as e:
        lp.set_budget("50%")
    assert e.value.budget_bytes == lp.budget_bytes == 0 and e.value.min_bytes >= least
    assert lp.profiling_steps == 1


def test_a_device_with_too_little_free_names_the_budget_its_readings_made(least):
    model = mlp()
    preallocate(model)
    remat.enable(model, list(model), budget="90%")
    free = int((least - 1 + MARGIN) / 0.9) - 4096  # with the 4096 held, just below the least
    with pretend_device(free_bytes=free, cached_bytes=4096, total_bytes=4 << 30):
        with pytest.raises(remat.InfeasibleBudget) as e:
            train_step(model, x_of())
    text = str(e.value)
    assert "budget='90%': 90% of the device's" in text and "cached by its allocator" in text, text
    assert e.value.budget_bytes == int(0.9 * (free + 4096)) - MARGIN < e.value.min_bytes


def test_on_the_cpu_a_device_budget_is_a_clear_error_and_changes_nothing():
    model = mlp()
    preallocate(model)
    before = [p.detach().clone() for p in model.parameters()]
    lp = remat.enable(model, list(model), budget="auto")
    with pytest.raises(ValueError, match=r"budget='auto' fits the step to a CUDA device's free memory, but this step "
                                         r"runs on cpu.*pass the budget in bytes instead"):
        train_step(model, x_of())
    assert not lp.is_planned() and lp.budget_bytes == -1
    assert all(not p.grad.any() for p in model.parameters())  # preallocated zeros, untouched
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for bad, words in (("150%", "not a percentage in \\(0%, 100%\\]"), ("0%", "not a percentage"),
                       ("lots", "is not a size")):
        with pytest.raises(ValueError, match=words):
            remat.enable(mlp(), list(mlp()), budget=bad)
