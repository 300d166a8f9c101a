"""The planner library as Python sees it: the same chains, plans and JSON as the C++ library and the remat
command, in both directions."""
import json
import pickle
import subprocess
import threading
import time

import pytest

import remat

from conftest import cli


def chain_of(n=8, unit=1 << 20):
    c = remat.uniform_chain(n, 2.0, 4.0, unit, 6 * unit)
    c.stages[3].saved_bytes = 11 * unit  # one heavier stage
    return c


def test_chain_json_round_trip_and_fields():
    c = chain_of()
    d = remat.Chain.from_json(c.to_json())
    assert d.to_json() == c.to_json()
    assert len(d) == 8 and d.input_bytes == 1 << 20
    assert d.stages[3].saved_bytes == 11 << 20
    assert json.loads(c.to_json())["stages"][0]["saved_bytes"] == 6 << 20


def test_a_list_of_stages_or_groups_set_anew_leaves_the_elements_python_holds_readable():
    # Elements of a chain's lists are references (writes go through); setting the list anew used to free the
    # elements they point into (a MemoryError or a crash at the next read, 2026-12-05).
    c = chain_of()
    stage = c.stages[3]
    stage.groups = [remat.SavedGroup("aten::mm#0", 10, 1.0), remat.SavedGroup("aten::mm#1", 20, 2.0, 5, 3)]
    held = list(stage.groups)
    held[1].recompute_ms = 2.5  # through the reference
    assert stage.groups[1].recompute_ms == 2.5
    stage.groups = [held[1]]
    assert (held[0].name, held[0].bytes) == ("aten::mm#0", 10)  # what it held
    assert [(g.name, g.bytes, g.unsaved_bytes, g.stays_bytes) for g in stage.groups] == [("aten::mm#1", 20, 5, 3)]
    assert repr(stage.groups[0]) == ("SavedGroup('aten::mm#1', bytes=20, recompute_ms=2.500000, unsaved_bytes=5, "
                                     "stays_bytes=3)")
    stages = list(c.stages)
    c.stages = stages[:2]
    assert stages[3].saved_bytes == 11 << 20 and stages[3].groups[0].name == "aten::mm#1"
    assert len(c.stages) == 2
    plan = remat.optimal(chain_of(), 1 << 40)
    ops = list(plan.ops)
    plan.ops = ops[:1]
    assert (ops[-1].stage, ops[-2].stage, len(plan.ops)) == (0, 1, 1)  # B0 and B1, read after the list went
    # A step plan's plan, set anew to a longer one (its ops moved to a larger buffer).
    step = remat.plan_step(remat.uniform_chain(2, 2.0, 4.0, 1 << 20, 6 << 20), remat.StepContext(), 1 << 40, "per-layer")
    ops = list(step.plan.ops)
    step.plan = remat.plan_step(chain_of(), remat.StepContext(), 1 << 40, "per-layer").plan
    assert [o.stage for o in ops] == [0, 1, -1, 1, 0] and len(step.plan.ops) == 17


def test_a_groups_forward_peak_before_its_call_goes_through_json_pickle_and_validation():
    # SavedGroup.fwd_peak_before_bytes (2026-12-05): -1 (not measured) by default, in old pickles and in chains
    # that do not name it; written and read where measured; below -1 refused naming it.
    g = remat.SavedGroup("aten::mm#0", 10, 1.0, 0, 0, 123)
    assert g.fwd_peak_before_bytes == 123 and repr(g).endswith(", fwd_peak_before_bytes=123)")
    assert remat.SavedGroup("aten::mm#0", 10, 1.0).fwd_peak_before_bytes == -1
    assert pickle.loads(pickle.dumps(g)).fwd_peak_before_bytes == 123
    old = remat.SavedGroup.__new__(remat.SavedGroup)
    old.__setstate__(("aten::mm#0", 10, 1.0, 0, 0))  # a state pickled before the figure
    assert (old.name, old.fwd_peak_before_bytes) == ("aten::mm#0", -1)
    c = chain_of()
    c.stages[3].groups = [g, remat.SavedGroup("aten::mm#1", 20, 1.0)]
    back = remat.Chain.from_json(c.to_json())
    assert [x.fwd_peak_before_bytes for x in back.stages[3].groups] == [123, -1]
    assert "fwd_peak_before_bytes" not in json.dumps(json.loads(c.to_json())["stages"][3]["groups"][1])
    assert remat._core.group_recompute_peak_bytes(back.stages[3], "kk") == 123 + 30
    assert remat._core.group_recompute_peak_bytes(back.stages[3], "rr") == 123
    c.stages[3].groups[0].fwd_peak_before_bytes = -2
    with pytest.raises(ValueError, match="fwd_peak_before_bytes -2"):
        c.validate()


def test_a_groups_forward_peak_after_it_is_let_go_of_goes_through_json_pickle_and_validation():
    # SavedGroup.fwd_peak_after_bytes (2026-12-06), as fwd_peak_before_bytes: -1 by default, in old pickles and
    # in chains that do not name it; written and read where measured; below -1 refused naming it.
    g = remat.SavedGroup("aten::mm#0", 10, 1.0, 0, 0, 123, 456)
    assert g.fwd_peak_after_bytes == 456 and repr(g).endswith(", fwd_peak_after_bytes=456)")
    assert remat.SavedGroup("aten::mm#0", 10, 1.0).fwd_peak_after_bytes == -1
    assert pickle.loads(pickle.dumps(g)).fwd_peak_after_bytes == 456
    old = remat.SavedGroup.__new__(remat.SavedGroup)
    old.__setstate__(("aten::mm#0", 10, 1.0, 0, 0, 123))  # a state pickled before the figure
    assert (old.fwd_peak_before_bytes, old.fwd_peak_after_bytes) == (123, -1)
    c = chain_of()
    c.stages[3].groups = [g, remat.SavedGroup("aten::mm#1", 20, 1.0)]
    back = remat.Chain.from_json(c.to_json())
    assert [x.fwd_peak_after_bytes for x in back.stages[3].groups] == [456, -1]
    assert "fwd_peak_after_bytes" not in json.dumps(json.loads(c.to_json())["stages"][3]["groups"][1])
    # A group assignment's forward: -1 where a group it keeps is unmeasured, else the largest of the forward's
    # whole peak (without saving) and each group's figure plus those let go of by then.
    assert remat._core.group_forward_peak_bytes(back.stages[3], "kr") == \
        max(back.stages[3].output_bytes + (back.stages[3].fwd_nosave_tmp_bytes or back.stages[3].fwd_tmp_bytes),
            456 + 10)
    assert remat._core.group_forward_peak_bytes(back.stages[3], "kk") == -1
    c.stages[3].groups[0].fwd_peak_after_bytes = -2
    with pytest.raises(ValueError, match="fwd_peak_after_bytes -2"):
        c.validate()


def test_optimal_plan_string_is_the_cpp_one_and_fits():
    c = chain_of()
    budget = 20 << 20
    p = remat.optimal(c, budget)
    assert str(p) == p.to_string()
    assert str(p).split()[-1] == "B0" and " L " in str(p)
    assert p.predicted.peak_bytes <= budget
    assert remat.simulate(c, p).peak_bytes == p.predicted.peak_bytes
    q = remat.Plan.from_json(p.to_json())
    assert str(q) == str(p)


def test_infeasible_budget_names_the_least():
    c = chain_of()
    least = remat.min_feasible_budget(c)
    with pytest.raises(remat.InfeasibleBudget) as e:
        remat.optimal(c, least - 1)
    assert e.value.min_bytes == least and e.value.budget_bytes == least - 1
    assert "minimum for this chain" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(remat.InfeasibleBudget) as e:
        remat.per_layer(c, remat.per_layer_min_budget(c) - 1)
    assert e.value.min_bytes == remat.per_layer_min_budget(c)


@pytest.mark.parametrize("call", ["optimal", "plan_step"])
def test_planning_lets_the_other_python_threads_run(call):
    """The planners run without the GIL (planning a long chain with offloading and groups takes seconds): a
    Python thread ticks all through the call, and the call's errors still reach the caller."""
    c = remat.uniform_chain(120, 1.0, 2.0, 1000, 3000)
    ctx = remat.StepContext()
    least = remat.min_step_budget(c, ctx, "optimal")
    plan = {"optimal": lambda b: remat.optimal(c, b), "plan_step": lambda b: remat.plan_step(c, ctx, b, "optimal")}
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.02)
        begin = time.perf_counter()
        plan[call](2 * least)
        end = time.perf_counter()
    finally:
        stop.set()
        ticker.join()
    inside = [t for t in ticks if begin < t < end]
    # Holding the GIL, the call would let the ticker in only at its edges (the interpreter's switch interval).
    assert len(inside) >= 10 and inside[-1] - inside[0] > 0.5 * (end - begin), (len(inside), end - begin)
    with pytest.raises(remat.InfeasibleBudget):
        plan[call](remat.min_feasible_budget(c) - 1)


def test_bad_json_and_bad_strategy_are_value_errors():
    with pytest.raises(ValueError, match="remat::chain_from_json"):
        remat.Chain.from_json("{")
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        remat.make_plan(chain_of(), "fastest")
    with pytest.raises(ValueError, match="parse_size"):
        remat.parse_size("lots")


def test_strategy_words_match_the_cpp_grammar():
    c = chain_of()
    assert str(remat.make_plan(c, "uniform:4")) == str(remat.uniform(c, 4))
    assert str(remat.make_plan(c, "per-layer:30MiB")) == str(remat.per_layer(c, 30 << 20))
    assert "per-layer" in remat.STRATEGY_WORDS


def test_per_layer_plans_are_per_layer():
    c = chain_of()
    c.policies = ["matmuls"]
    for s in c.stages:
        pc = remat.PolicyCost()
        pc.policy, pc.saved_bytes, pc.fwd_ms, pc.bwd_ms = "matmuls", s.saved_bytes // 2, s.fwd_ms, s.bwd_ms + 1.0
        s.policies = [pc]
    lo, hi = remat.per_layer_min_budget(c), remat.no_checkpoint(c).predicted.peak_bytes
    seen = set()
    for k in range(8):
        p = remat.per_layer(c, lo + (hi - lo) * k // 7)
        choices = remat.choices_of(p)
        assert len(choices) == 8
        seen.update(choices)
    assert seen == {"keep", "checkpoint", "matmuls"}
    with pytest.raises(ValueError, match="not a per-layer plan"):
        remat.choices_of(remat.uniform(c, 2))


def test_cli_reads_python_chains_and_python_reads_cli_plans(tmp_path):
    remat_cli = cli()
    c = chain_of()
    path = tmp_path / "chain.json"
    path.write_text(c.to_json())
    out = subprocess.run([remat_cli, "plan", "--chain", str(path), "--budget", "20MiB", "--json"],
                         capture_output=True, text=True, check=True).stdout
    from_cli = remat.Plan.from_json(out)
    assert str(from_cli) == str(remat.optimal(c, 20 << 20))
    assert json.loads(out)["predicted_peak_bytes"] == remat.optimal(c, 20 << 20).predicted.peak_bytes
    assert json.loads(remat.summarize_plan_json(c, from_cli))["stages_recomputed"] == \
        json.loads(out)["stages_recomputed"]
    per_layer = subprocess.run([remat_cli, "plan", "--chain", str(path), "--budget", "30MiB", "--planner",
                                "per-layer", "--json"], capture_output=True, text=True, check=True).stdout
    assert str(remat.Plan.from_json(per_layer)) == str(remat.per_layer(c, 30 << 20))


def test_step_planning_fits_the_whole_step():
    c = chain_of()
    ctx = remat.StepContext()
    ctx.before_saved_bytes = 3 << 20
    ctx.rest_peak_bytes = 5 << 20
    ctx.stage_grads_bytes = [1 << 20] * 8
    least = remat.min_step_budget(c, ctx, "per-layer")
    p = remat.plan_step(c, ctx, least + (4 << 20), "per-layer")
    assert p.step_peak_bytes <= least + (4 << 20)
    assert p.step_peak_bytes == remat.step_peak_bytes(c, ctx, p.plan)
    with pytest.raises(remat.InfeasibleBudget, match="below the least feasible one"):
        remat.plan_step(c, ctx, least - 1, "per-layer")
    # A per-layer plan's time as the planner charges it (remat.step_time_ms): the plan it chose, and one given,
    # whose checkpointed stage is charged its per-call figures where simulate() charges its whole recompute.
    ctx.rest_ms = 1.5
    p = remat.plan_step(c, ctx, least + (4 << 20), "per-layer")
    assert remat.step_time_ms(c, ctx, p.plan) == pytest.approx(p.step_time_ms, rel=1e-12)
    c.stages[2].checkpoint_fwd_ms, c.stages[2].checkpoint_bwd_ms = 0.25, c.stages[2].fwd_ms + c.stages[2].bwd_ms
    given = remat.checkpoint_stages(len(c.stages), [2])
    sim = remat.simulate(c, given).time_ms
    assert remat.step_time_ms(c, ctx, given) == pytest.approx(sim - c.stages[2].fwd_ms + 0.25 + 1.5, rel=1e-12)
    with pytest.raises(ValueError, match="is not a per-layer plan"):
        remat.step_time_ms(c, ctx, remat.revolve(c, 2))  # stages run forward more than once


def test_step_readings_turn_into_the_same_context_as_in_cpp():
    """The numbers of tests/step_test.cpp's ReadingsTurnIntoTheContext, through the binding: the one piece
    of code (remat/step.h) that remat::Planned and the package's in-place planning both call."""
    r = remat._core.StepReadings()
    r.base, r.input_in_base, r.at_chain, r.peak_before_chain, r.input_bytes = 1000, False, 1700, 1900, 300
    r.at_return, r.rest_peak, r.at_output_grad, r.output_grad_bytes, r.rest_ms = 2500, 3100, 2800, 200, 12.5
    r.peak_after_chain_backward, r.step_peak, r.stage_grads_bytes = 2300, 3400, [40, 50]
    r.side_bytes = 64
    c = remat._core.step_context(r)
    assert (c.input_in_base, c.before_saved_bytes, c.before_peak_bytes, c.before_backward_peak_bytes) == \
        (False, 400, 900, 1300)
    assert (c.rest_peak_bytes, c.rest_ms, c.rest_grads_bytes, list(c.stage_grads_bytes)) == (600, 12.5, 100, [40, 50])
    assert c.checkpoint_all_peak_bytes == 2400 and c.side_bytes == 64 and c.input_held_in_backward
    r.input_held_in_backward = False
    c = remat._core.step_context(r)
    assert not c.input_held_in_backward
    assert not pickle.loads(pickle.dumps(c)).input_held_in_backward  # pickled with its fields
    # What runs between two stages: as read (its backward may free more than it makes), pickled with the rest, and
    # a state pickled before these figures existed still loads.
    r.between_forward_held_bytes, r.between_backward_peak_bytes, r.between_held_bytes = [0, 30], [0, 500], [0, -20]
    r.side_grads_bytes = [0, 16]  # of side_bytes, the gradient arriving at the second stage's backward
    c = remat._core.step_context(r)
    back = pickle.loads(pickle.dumps(c))
    assert (list(back.between_forward_held_bytes), list(back.between_backward_peak_bytes),
            list(back.between_held_bytes), list(back.side_grads_bytes)) == ([0, 30], [0, 500], [0, -20], [0, 16])
    old = remat._core.StepContext.__new__(remat._core.StepContext)
    old.__setstate__(c.__getstate__()[:11])
    assert old.rest_peak_bytes == 600 and list(old.between_held_bytes) == []
    # The chain's output, let go of by the rest's backward: counted back into what the rest leaves held (the
    # model lets go of it once), read as not held, and pickled; a state of 16 fields loads as held.
    r.output_freed_bytes, r.checkpoint_state_bytes, r.outputs_held_to_end = 24, 5056, [False, True]
    c = remat._core.step_context(r)
    assert c.rest_grads_bytes == 124 and not c.output_held_in_backward and c.checkpoint_state_bytes == 5056
    back = pickle.loads(pickle.dumps(c))
    assert not back.output_held_in_backward and back.checkpoint_state_bytes == 5056
    assert list(back.outputs_held_to_end) == [False, True]
    old = remat._core.StepContext.__new__(remat._core.StepContext)
    old.__setstate__(c.__getstate__()[:16])
    assert old.output_held_in_backward and old.checkpoint_state_bytes == 0 and list(old.side_grads_bytes) == [0, 16]
    assert list(old.outputs_held_to_end) == []
    # What the stages take beside their input, let go of once a stage's backward is done: carried, pickled; a
    # state of 19 fields loads with none let go of.
    r.side_freed_bytes = [0, 32]
    c = remat._core.step_context(r)
    back = pickle.loads(pickle.dumps(c))
    assert list(back.side_freed_bytes) == [0, 32] and list(back.outputs_held_to_end) == [False, True]
    old = remat._core.StepContext.__new__(remat._core.StepContext)
    old.__setstate__(c.__getstate__()[:19])
    assert list(old.side_freed_bytes) == [] and list(old.outputs_held_to_end) == [False, True]
    # Each later field: carried, pickled; a state of the fields before it loads with its default, and the
    # field before it as set. An output let go of by what runs between (a residual sum in the model's code);
    # the chain's output let go of by the rest's forward; inputs nothing held past their stage's forward; the
    # layers' output gradient held past the last layer's backward; whether the rest takes the last stage's
    # input; whether the last stage's input was let go of in the rest's forward; whether the residual path
    # hands each output its own gradient.
    later = [("between_frees_output", [False, True], []), ("rest_frees_output", True, False),
             ("inputs_held_in_forward", [True, False], []), ("output_grad_held_in_backward", [False, True], []),
             ("rest_takes_last_input", False, True), ("last_input_let_go_in_rest", True, False),
             ("residual_grad_shared", [False, True], [])]
    value = lambda x: list(x) if not isinstance(x, bool) else x  # noqa: E731
    before = ("side_freed_bytes", [0, 32])
    for fields, (field, set_to, default) in enumerate(later, start=20):
        setattr(r, field, set_to)
        c = remat._core.step_context(r)
        assert value(getattr(pickle.loads(pickle.dumps(c)), field)) == set_to, field
        old = remat._core.StepContext.__new__(remat._core.StepContext)
        old.__setstate__(c.__getstate__()[:fields])
        assert value(getattr(old, field)) == default and value(getattr(old, before[0])) == before[1], field
        before = (field, set_to)
    # The masks only the stages hold (set on the context, not read by step_context()): pickled; a state of 27
    # fields loads with none.
    c.taken_bytes, c.taken_by, c.taken_saved_by = [100], [[True, False]], [[False, False]]
    back = pickle.loads(pickle.dumps(c))
    assert (list(back.taken_bytes), back.taken_by, back.taken_saved_by) == ([100], [[True, False]], [[False, False]])
    old = remat._core.StepContext.__new__(remat._core.StepContext)
    old.__setstate__(c.__getstate__()[:27])
    assert list(old.taken_bytes) == [] and list(old.residual_grad_shared) == [False, True]
    # What of the side gradients arrives after its backward's peak: read, pickled; a state of 30 fields loads with
    # none (all at the peak) and the masks as set.
    r.side_grads_late_bytes = [0, 16]
    c = remat._core.step_context(r)
    c.taken_bytes, c.taken_by, c.taken_saved_by = [100], [[True, False]], [[False, False]]
    assert list(pickle.loads(pickle.dumps(c)).side_grads_late_bytes) == [0, 16]
    old = remat._core.StepContext.__new__(remat._core.StepContext)
    old.__setstate__(c.__getstate__()[:30])
    assert list(old.side_grads_late_bytes) == [] and list(old.taken_bytes) == [100]
    r.between_held_bytes = [0]
    with pytest.raises(ValueError, match="between_held_bytes"):
        remat._core.step_context(r)


def test_the_offload_schedule_is_the_planners_and_the_layers_carry_it_out_per_layer():
    # One schedule for both runtimes: remat::offload_schedule, per operation; the planned layers read it per
    # layer (after layer i's forward; when the backward pass reaches layer i's output).
    from remat.layer_offload import layer_points as _layer_points

    plan = remat.Plan.from_json(json.dumps({"num_stages": 3, "ops": [
        "Fa0@host", "Fa1", "Fc2@host", "L", "Fa2", "B2", "B1", "B0"]}))
    before, after = remat._core.offload_schedule(plan)
    assert after[1] == [("wait_to_host", 0)] and after[2] == []
    assert before[4] == [("wait_to_host", 2), ("start_back", 2)]  # still in flight at the loss
    assert before[6] == [("start_back", 0)]
    after_forward, at_backward = _layer_points(plan)
    assert after_forward == [[], [("wait_to_host", 0)], []]
    assert at_backward == [[], [("start_back", 0)], [("wait_to_host", 2), ("start_back", 2)]]
    with pytest.raises(ValueError):
        remat._core.offload_schedule(remat.Plan())
