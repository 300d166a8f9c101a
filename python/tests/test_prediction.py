"""A planned step's measured peak against its prediction (issue 45): LayerPlan.prediction_error, the warning
beyond remat.PREDICTION_TOLERANCE, and replan_on_overshoot, which plans again below the budget by what a step
held above its prediction, once per input shape. The profile is made wrong on purpose (its stages' saved bytes
scaled) so that the model misses by a known share."""
import warnings

import pytest
import torch

import remat
from conftest import assert_same_run, mlp, train_step


def _scaled(chain, share):
    """The chain with each stage's saved bytes (beyond its output) scaled by `share`, and times that make keeping
    a layer faster than checkpointing it (measured ones vary from run to run)."""
    stages = list(chain.stages)
    for st in stages:
        st.saved_bytes = st.output_bytes + int((st.saved_bytes - st.output_bytes) * share)
        st.policies = []
        st.fwd_ms = st.fwd_nosave_ms = st.checkpoint_fwd_ms = 1.0
        st.bwd_ms, st.checkpoint_bwd_ms = 2.0, 3.0
    chain.stages = stages
    return chain


def _planned_wrongly(meter, share, x, **kw):
    m = mlp(depth=6)
    lp = remat.enable(m, list(m), budget=1 << 40, **kw)
    train_step(m, x, meter, set_to_none=True)  # the profiling step
    _scaled(lp._last.chain, share)
    # The plain step's peak as the wrong profile predicts it
    return m, x, lp, remat.step_peak_bytes(lp.chain, lp.context, remat.no_checkpoint(lp.chain))


def _step_warned(m, x, meter, seed):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train_step(m, x, meter, seed=seed, set_to_none=True)
    return run, [str(w.message) for w in caught if "prediction" in str(w.message)]


def test_a_step_above_its_prediction_is_planned_again_below_the_budget_once(meter):
    plain_model = mlp(depth=6)
    x = torch.randn(256, 64)
    plain = [train_step(plain_model, x, meter, seed=s, set_to_none=True) for s in (1, 2, 3, 4)]
    m, x, lp, plain_peak = _planned_wrongly(meter, 0.6, x, replan_on_overshoot=True)
    budget = int(0.9 * plain_peak)
    lp.set_budget(budget)
    first_plan, predicted = str(lp.plan), lp.predicted_peak_bytes
    assert "keep" in lp.choices and "checkpoint" in lp.choices, lp.choices
    run, said = _step_warned(m, x, meter, 2)
    assert_same_run(run, plain[1])
    overshoot = lp.last_peak_bytes - predicted
    assert lp.prediction_error == pytest.approx(overshoot / predicted) and lp.prediction_error > 0.02
    assert len(said) == 1 and "above the plan's prediction" in said[0] and "planned again" in said[0], said
    # The next plan is made below the budget by the overshoot, and the step that runs it stays within the budget.
    assert str(lp.plan) != first_plan and lp.predicted_peak_bytes <= budget - overshoot
    run, said = _step_warned(m, x, meter, 3)
    assert_same_run(run, plain[2])
    assert lp.last_peak_bytes <= budget, (lp.last_peak_bytes, budget)
    # Once per input shape: the new plan's own miss is reported, not planned again.
    second_plan = str(lp.plan)
    run, said = _step_warned(m, x, meter, 4)
    assert_same_run(run, plain[3])
    assert str(lp.plan) == second_plan and said == []


def test_a_miss_is_reported_and_the_plan_kept_without_the_option(meter):
    for share, words in ((0.6, "replan_on_overshoot=True plans again"), (1.6, "below the plan's prediction")):
        m, x, lp, plain_peak = _planned_wrongly(meter, share, torch.randn(256, 64))
        lp.set_budget(int(0.9 * plain_peak) if share < 1 else int(1.2 * plain_peak))
        plan = str(lp.plan)
        _, said = _step_warned(m, x, meter, 2)
        assert len(said) == 1 and words in said[0], said
        assert (lp.prediction_error > 0.02) if share < 1 else (lp.prediction_error < -0.02)
        assert str(lp.plan) == plan
        _, said = _step_warned(m, x, meter, 3)
        assert said == []  # once per input shape
    with pytest.raises(ValueError, match="replan_on_overshoot must be True or False"):
        remat.enable(mlp(depth=2), list(mlp(depth=2)), budget=1 << 30, replan_on_overshoot="yes")
    with pytest.raises(ValueError, match="ranks that agree must run one plan"):
        remat.enable(mlp(depth=2), list(mlp(depth=2)), budget=1 << 30, replan_on_overshoot=True, agree=True)


def test_check_prediction_is_the_planner_librarys_rule():
    c = remat.check_prediction(1000, 1050, 2000)
    assert c.error == pytest.approx(0.05) and c.beyond and c.replan_budget_bytes == 1950
    c = remat.check_prediction(1000, 1010, 2000)
    assert not c.beyond and c.replan_budget_bytes == -1
    c = remat.check_prediction(1000, 900, 2000)
    assert c.beyond and c.replan_budget_bytes == -1
    assert remat.check_prediction(1000, 5000, 2000).replan_budget_bytes == 0
    for bad in ((0, 1, 1), (1, -1, 1), (1, 1, 0)):
        with pytest.raises(ValueError, match="remat::check_prediction"):
            remat.check_prediction(*bad)
    with pytest.raises(ValueError, match="tolerance"):
        remat.check_prediction(1, 1, 1, tolerance=float("nan"))
