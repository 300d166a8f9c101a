"""A planned step's measured peak against its prediction (issue 45): LayerPlan.prediction_error, the warning
beyond remat.PREDICTION_TOLERANCE, and replan_on_overshoot, which plans again below the budget by what a step
held above its prediction, once per input shape. The profile is made wrong on purpose (its stages' saved bytes
scaled) so that the model misses by a known share."""
import contextlib
import copy
import json
import warnings

import pytest
import torch

import remat
from conftest import assert_same_run, backward_ops, give_plan, mlp, per_layer_ops, train_step


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


def test_a_step_below_its_prediction_does_not_silence_a_later_one_above(meter):
    # Each direction is said once per input shape: a step that held less than predicted (a later micro-batch,
    # its gradients there already) silenced a later step of the same shape that held more (found 2026-12-07).
    m, x, lp, _ = _planned_wrongly(meter, 1.6, torch.randn(256, 64))
    lp.set_budget(1 << 40)
    _, said = _step_warned(m, x, meter, 2)
    assert len(said) == 1 and "below the plan's prediction" in said[0], said
    _scaled(lp._last.chain, 0.6 / 1.6)  # the profile now below what the steps hold
    plain_peak = remat.step_peak_bytes(lp.chain, lp.context, remat.no_checkpoint(lp.chain))
    lp.set_budget(int(0.9 * plain_peak))
    _, said = _step_warned(m, x, meter, 3)
    assert len(said) == 1 and "above the plan's prediction" in said[0], said
    _, said = _step_warned(m, x, meter, 4)
    assert said == []  # once per direction


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


def _accumulated(m, batches, meter, lp=None):
    """One optimizer step's micro-batches, accumulated from gradients set to None. Returns the gradients and, per
    micro-batch, (prediction, measured peak) of the plan that ran it (under lp)."""
    m.zero_grad(set_to_none=True)
    readings = []
    for x in batches:
        m(x).square().mean().backward()
        if lp is not None:
            readings.append((lp.predicted_peak_bytes, lp.last_peak_bytes))
            if lp.is_planned():  # the timeline and the context are the plan's state's
                assert lp.timeline()["peak_bytes"] == lp.predicted_peak_bytes
                assert remat.step_peak_bytes(lp.chain, lp.context, lp.plan) == lp.predicted_peak_bytes
    return [p.grad.clone() for p in m.parameters()], readings


def test_each_micro_batch_runs_the_plan_for_the_gradients_it_begins_with(meter):
    # Gradient accumulation: the first micro-batch begins with the gradients None and its backward pass makes
    # them, the others add to them. The 16-row shape is profiled at a second micro-batch (gradients present) and
    # later runs first: the plan made at its profiling step charged no gradients, and such a step held 92% more
    # than it predicted (found 2026-12-02). Each state gets its own plan now, made from the one profile.
    plain = mlp(depth=4)
    m = mlp(depth=4)
    lp = remat.enable(m, list(m), budget=1 << 30, borrow_plans=False)
    xa, xb = torch.randn(32, 64), torch.randn(16, 64)
    first_or_not = {}  # the 16-row shape's prediction, run first (its gradients None) and second (present)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no prediction missed beyond the tolerance on the unsafe side
        warnings.filterwarnings("ignore", message=".*below the plan's prediction")
        for s in range(4):
            order = [xa, xb] if s % 2 == 0 else [xb, xa]
            torch.manual_seed(s)
            want, _ = _accumulated(plain, order, meter)
            torch.manual_seed(s)
            got, readings = _accumulated(m, order, meter, lp)
            for g, h in zip(got, want):
                assert torch.equal(g, h)
            if s > 0:  # every shape planned in both states
                for predicted, peak in readings:
                    assert peak <= predicted * (1 + remat.PREDICTION_TOLERANCE), (s, readings)
                first_or_not[order[0] is xb] = readings[0 if order[0] is xb else 1][0]
    # The first micro-batch's plan charges the gradients its backward makes, the second's does not.
    assert first_or_not[True] > first_or_not[False], first_or_not
    assert lp.profiled_shapes == 2


@pytest.mark.parametrize("profiled_at", ["first", "later"])
def test_the_gradients_outside_the_layers_follow_the_micro_batch(meter, profiled_at):
    # A masked LM small enough that the step peaks in its embeddings' backward, after the layers', where every
    # gradient made in the step is held: the layers', the head's and the embeddings' own (the decoder's weight
    # is the word embedding's, summed there). Before (found 2026-12-07), the peak measured there was charged as
    # measured in every gradient state: profiled at a first micro-batch, a later one's step held 50.8% below
    # its prediction (its gradients there already); profiled at a later one, a first one's held 27% above.
    # Now the layers' and the head's gradients move it exactly, and the embeddings' own raise it (an upper
    # bound: that part may peak before it makes them) and do not lower it.
    transformers = pytest.importorskip("transformers")
    import remat.hf
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=100)
    model = transformers.BertForMaskedLM(cfg)
    lp = remat.hf.enable(model, budget="600MiB")
    ids = torch.randint(0, 100, (2, 16))
    if profiled_at == "later":
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    errors = {True: [], False: []}  # by whether the step began with the gradients None
    predicted = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (below the prediction: a first micro-batch's, profiled at a later one)
        for s in range(5):
            first = (s % 2 == 1) == (profiled_at == "later")
            if first:
                model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            if s > 0:
                errors[first].append(lp.prediction_error)
                predicted[first] = lp.predicted_peak_bytes
    for first, errs in errors.items():
        assert errs and all(e <= remat.PREDICTION_TOLERANCE for e in errs), (profiled_at, first, errs)
    if profiled_at == "first":
        # A later micro-batch's prediction without the gradients there (12,800 bytes below here, the same as a
        # first micro-batch's, which is not this test's).
        assert all(e >= -0.04 for e in errors[False]), errors
    # Each state's plan predicted for its own: the one that makes the gradients above the other.
    assert predicted[True] > predicted[False], predicted


def test_a_budget_that_fits_a_micro_batch_with_gradients_but_not_one_without_says_so(meter):
    m = mlp(depth=4)
    lp = remat.enable(m, list(m), budget=450_000)
    x = torch.randn(16, 64)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)  # as after zero_grad(set_to_none=False): the backward adds to them
    m(x).square().mean().backward()  # the profiling step
    m(x).square().mean().backward()
    plan, predicted = str(lp.plan), lp.predicted_peak_bytes
    assert lp.last_peak_bytes <= 450_000
    m.zero_grad(set_to_none=True)
    with pytest.raises(remat.InfeasibleBudget, match="of the layers' parameter gradients None, which its backward "
                                                    "pass makes") as caught:
        m(x)
    assert caught.value.budget_bytes == 450_000 and caught.value.min_bytes > 450_000
    # The plan for steps that begin with gradients stays in force, and such a step runs it.
    assert str(lp.plan) == plan and lp.predicted_peak_bytes == predicted
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    m(x).square().mean().backward()
    assert str(lp.plan) == plan and 0 < lp.last_peak_bytes <= 450_000



class _Residual(torch.nn.Module):
    """Residual feed-forward layers, each adding its own residual (as Transformers' layers do): under autocast a
    layer takes and returns float32, so only the step's key tells an autocast step from a float32 one."""

    class Layer(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.f = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                         torch.nn.Linear(4 * width, width))

        def forward(self, x):
            return x + self.f(x)

    def __init__(self, width=64, depth=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(self.Layer(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_an_autocast_step_is_planned_apart_from_a_float32_one(meter):
    # The autocast state is part of a step's key: a step under CPU autocast saves the matmuls' bfloat16 results,
    # and the plan profiled so, run in float32, held 19% above its prediction (found 2026-12-02).
    plain, m = _Residual(), _Residual()
    x = torch.randn(256, 64)
    lp = remat.enable(m, list(m.layers), budget=1_500_000, policies=())
    for autocast in (True, False):
        for s in range(3):
            runs = []
            for model in (plain, m):
                torch.manual_seed(s)
                model.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = model(x)
                out.float().square().mean().backward()
                runs.append([p.grad.clone() for p in model.parameters()])
            for g, h in zip(*runs):
                assert torch.equal(g, h)
            if s > 0:
                assert lp.prediction_error <= remat.PREDICTION_TOLERANCE, (autocast, s, str(lp.plan))
                assert "Fc" in str(lp.plan), str(lp.plan)  # the budget makes it recompute
    assert lp.profiled_shapes == 2


class _SumsOutside(torch.nn.Module):
    """Feed-forward layers whose residual sum is the model's (`x = x + layer(x)`): each layer's output is let go
    of between two layers, where nothing else holds it. With a sigmoid last, a layer's graph saves its output.
    autocast: its forward under CPU bf16 autocast; aside: it takes a detached copy of each layer's input (another
    object on its storage) once the layer returned, held to the forward's end."""

    def __init__(self, sigmoid, width=64, depth=4, expand=4, last=None, autocast=False, aside=False):
        super().__init__()
        torch.manual_seed(0)
        self.autocast, self.aside = autocast, aside
        expands = [expand] * depth if isinstance(expand, int) else expand  # per layer: its hidden width's factor
        last = last or (torch.nn.Sigmoid if sigmoid else None)  # a module class ending each layer, or none
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, e * width), torch.nn.GELU(), torch.nn.Linear(e * width, width),
                                *([last()] if last else []))
            for e in expands)

    def forward(self, x):
        aside = []
        with torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext():
            for layer in self.layers:
                y = layer(x)
                if self.aside:
                    aside.append(x.detach())
                x = x + y
                del y  # (let go of here, as by `x = x + layer(x)`)
        return x


def _sums_kept(meter, make, policy, tolerance):
    """Three steps of _SumsOutside models made by `make` against the plain run's, every layer kept (under
    `policy` where given), the last two within `tolerance` of their predictions; the LayerPlan."""
    plain, m = make(), make()
    x = torch.randn(256, 64)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(policy,) if policy else (),
                      replan_on_overshoot=False)
    for s in range(3):
        runs = [train_step(model, x, meter, seed=s, set_to_none=True) for model in (plain, m)]
        assert_same_run(*runs)
        if s == 0:  # the profiling step: times that make the way under test the fastest, and Fc the slowest
            for st in lp._last.chain.stages:
                st.fwd_ms, st.bwd_ms, st.checkpoint_fwd_ms, st.checkpoint_bwd_ms = 1.0, 2.0, 1.0, 4.0
                for c in st.policies:
                    c.fwd_ms, c.bwd_ms = 0.5, 1.5
            lp.set_budget(1 << 40)
            assert str(lp.plan) == ("Fk0[matmuls] Fk1[matmuls] Fk2[matmuls] Fk3[matmuls] L B3 B2 B1 B0" if policy
                                    else "Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0"), lp.plan
        else:
            assert abs(lp.prediction_error) <= tolerance, (lp.plan, lp.prediction_error)
    assert list(lp.context.between_frees_output) == [False, True, True, True]
    return lp


@pytest.mark.parametrize("sigmoid,policy", [(True, None), (False, "matmuls")])
def test_an_output_let_go_of_between_layers_is_charged_where_the_layers_way_holds_it(meter, sigmoid, policy):
    # The model's code makes the next layer's input from a layer's output and lets go of it (read in the
    # profiling step, every layer checkpointed: StepContext.between_frees_output). A way that holds the output
    # (kept, where its graph saves it; kept under the matmuls policy, which keeps the last matmul's result)
    # keeps it beside the next input. Before (found 2026-12-02), such steps held an output per such layer above
    # their predictions: here 7.0% with every sigmoid layer kept, 9.6% with every layer kept under the policy.
    _sums_kept(meter, lambda: _SumsOutside(sigmoid), policy, remat.PREDICTION_TOLERANCE)


@pytest.mark.parametrize("last,policy,held", [(torch.nn.GELU, None, True), (torch.nn.Sigmoid, "matmuls", True),
                                              (None, None, False), (None, "matmuls", False)])
def test_a_residual_sum_outside_the_layers_holds_the_outputs_gradient_through_its_backward(meter, last, policy,
                                                                                            held):
    # `x = x + layer(x)` hands a layer's output gradient to the residual path too, which holds it through the
    # layer's backward, where the profile let go of it once used: Stage.bwd_grad_held_bytes, what that adds (a
    # layer ending in a GELU or a sigmoid peaks after that use: the gradient's bytes; one ending in a Linear
    # while using it: none), charged to the layer's backward whatever its way. The output's own credits are as
    # without the sum (kept, a GELU's graph saves its input, not its output; under the matmuls policy, which
    # keeps no sigmoid output, PolicyCost.saves_output false: gone by its backward). Before (found 2026-12-03),
    # every GELU layer kept peaked 2.2% above its prediction, and the sigmoid layers under the policy, once
    # their output was read as not held, 3.0%. Under the policy a Linear last makes its bias's gradient at a
    # moment the held gradient makes the peak, where Fa adds nothing: the policy's own figure
    # (PolicyCost.bwd_grad_held_bytes); before (found 2026-12-05), the last such layer held 256 bytes above.
    lp = _sums_kept(meter, lambda: _SumsOutside(False, last=last), policy, 1e-3)
    assert lp.last_peak_bytes <= lp.predicted_peak_bytes, (lp.last_peak_bytes, lp.predicted_peak_bytes)
    chain = lp._last.chain
    # (the first layer's input, the model's own, takes no gradient: the sum over it hands it nothing)
    assert [st.bwd_grad_held_bytes for st in chain.stages] == [0] + [st.output_bytes if held else 0
                                                                     for st in chain.stages[1:]]
    if policy and last is not None:
        assert [st.policies[0].saves_output for st in chain.stages] == [False] * 4
    if policy and last is None:  # one bias's gradient (64 floats)
        assert [st.policies[0].bwd_grad_held_bytes for st in chain.stages] == [0, 256, 256, 256]
    assert lp.context.rest_frees_output and lp.context.rest_takes_last_input  # the sum over the last layer


@pytest.mark.parametrize("last,ways", [(torch.nn.Sigmoid, "Fc0 Fa1@host Fa2 Fa3"),
                                       (torch.nn.Sigmoid, "Fa0 Fa1@host Fc2 Fa3@host"),
                                       (None, "Fc0 Fa1 Fa2@stream0 Fa3"),
                                       (None, "Fc0 Fa1@stream Fa2 Fa3@stream0")])
def test_offloaded_and_streamed_layers_under_a_residual_sum_outside_them_hold_their_predictions(meter, last, ways):
    # `x = x + layer(x)` lets go of each layer's output. A layer kept on the host whose graph saves its output (a
    # sigmoid last) sends the output too: its copy's source stays on the device until the copies are waited for
    # (after the next layer's forward), and the copy comes back at the next layer's backward, beside the sum's
    # result: charged as a kept layer's output held past the sum. A streamed layer's backward, not measured with
    # the gradient the residual path holds through it, is charged that gradient whole. Before (found 2026-12-06
    # by random plans of these layers), such steps peaked one output above their predictions (2.7-4.3%), on the
    # CPU's copies made at once and carried out late alike. Each step the plain run's bitwise.
    plain, m = (_SumsOutside(False, last=last) for _ in range(2))
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    lp = remat.enable(m, list(m.layers), budget=1 << 40, offload=True, offload_min_bytes=16 << 10,
                      replan_on_overshoot=False)
    assert_same_run(train_step(plain, x, meter, seed=0, set_to_none=True),
                    train_step(m, x, meter, seed=0, set_to_none=True))  # the profiling step
    fw = ways.split()
    windows = [0 if w.endswith("@stream0") else st.offload.window_bytes for w, st in zip(fw, lp.chain.stages)]
    ops = [w.replace("@stream0", "@stream") for w in fw]
    _, predicted = give_plan(lp, ops + backward_ops(ops), stream_windows=windows)
    for s in (1, 2):
        assert_same_run(train_step(plain, x, None, seed=s, set_to_none=True),
                        train_step(m, x, meter, seed=s, set_to_none=True))
        assert predicted * 0.999 <= lp.last_peak_bytes <= predicted, (ways, lp.last_peak_bytes, predicted)
    assert list(lp.context.residual_grad_shared) == [True] * 4  # one dtype: the sum hands on its own gradient


@pytest.mark.parametrize("last", [torch.nn.GELU, torch.nn.Sigmoid])
def test_a_residual_sum_in_another_dtype_hands_its_layers_a_gradient_of_their_own(meter, last):
    # Under CPU bf16 autocast `x = x + layer(x)` adds a bf16 output into the fp32 residual: its backward hands
    # the output a bf16 cast of the path's gradient, which the layer's backward lets go of once used
    # (StepContext.residual_grad_shared false): no gradient held through that backward is charged. Before
    # (found 2026-12-03), layers ending in a GELU or a sigmoid were 1.65% below their prediction here, every
    # layer kept (1.9-2.8% on every plan of bench/residual_sums.py keeping the last layer).
    lp = _sums_kept(meter, lambda: _SumsOutside(False, last=last, autocast=True), None, 1e-3)
    assert list(lp.context.residual_grad_shared) == [False] * 4
    assert all(st.bwd_grad_held_bytes for st in lp.chain.stages[1:])  # measured, not charged


@pytest.mark.parametrize("input_grad", [False, True])
def test_a_residual_sums_larger_gradient_that_nothing_before_the_layers_takes_is_charged_once(meter, input_grad):
    # Under CPU bf16 autocast the first sum (`x = x + layer(x)` on the model's own input) hands its fp32
    # gradient to the first layer's output as a bf16 cast and, where the input takes no gradient, lets go of it.
    # The reading of what ran between counted back the whole fp32 gradient as the model's, which holds it at the
    # bytes of the layer's output (the chain's a_1; the rest is in what ran between's peak): the first layer's
    # backward was charged that rest again. Before (found 2026-12-02, located 2026-12-03), every layer
    # checkpointed was 2.47% above what the step held without the input's gradient, exact with it; now both
    # exact (and every plan of bench/residual_sums.py, which was down to 2.47% below).
    m = _SumsOutside(False, autocast=True)
    x = torch.randn(256, 64, requires_grad=input_grad)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, _checkpointed)
    assert str(lp.plan) == "Fc0 Fc1 Fc2 Fc3 L Fa3 B3 Fa2 B2 Fa1 B1 Fa0 B0"
    assert abs(lp.prediction_error) <= 1e-3, (lp.last_peak_bytes, lp.predicted_peak_bytes)
    # The first boundary's gradient, freed there where the input takes none: the model lets go of a_1 of it.
    assert lp.context.between_held_bytes[1] == (-32768 if input_grad else -65536)


@pytest.mark.parametrize("aside,sigmoid", [(False, False), (True, False), (False, True)])
def test_a_residual_sums_result_its_kept_layer_does_not_save_is_let_go_of_once_its_forward_is_done(meter, aside,
                                                                                                   sigmoid):
    # Under CPU bf16 autocast a kept layer saves the bf16 cast of its fp32 input, not the input, which the next
    # sum (`x = x + layer(x)`) replaces: each layer's input, the sum's result (a_i, and what the sum left held
    # beyond it), goes once the layer's forward is done (StepContext.inputs_held_in_forward), the last layer's
    # once the rest's forward is (StepContext.last_input_let_go_in_rest: the sum over that layer makes its
    # result first). Read from the input's object and its storage's owners (the profiling step's aliases only):
    # a copy kept aside, another object on the same storage, holds it. Layers ending in a sigmoid, whose graph
    # saves its output, hold that output beside the sum's result, which goes alone. Before (found 2026-12-03),
    # every layer kept was 9.6% below its prediction (the sigmoids', 10.5%).
    # (Copies held to the forward's end: the inputs charged through each layer's backward, safe.)
    lp = _sums_kept(meter, lambda: _SumsOutside(sigmoid, autocast=True, aside=aside), None, 0.15 if aside else 1e-3)
    assert list(lp.context.inputs_held_in_forward) == [True, aside, aside, True]
    assert lp.context.last_input_let_go_in_rest is not aside
    assert [st.saves_input for st in lp.chain.stages] == [False] * 4  # the bf16 casts


class _PostNorm(torch.nn.Module):
    """A feed-forward layer with its own residual sum and a LayerNorm last (BERT's shape)."""

    def __init__(self, width=64, bias=True):
        super().__init__()
        self.up, self.down, self.norm = (torch.nn.Linear(width, 4 * width, bias=bias),
                                         torch.nn.Linear(4 * width, width, bias=bias), torch.nn.LayerNorm(width))

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class _CastHead(torch.nn.Module):
    """_PostNorm layers whose output a Linear head takes: under autocast the head saves a bf16 cast of it and
    lets go of the fp32 output, as BERT's head does. Its Linears have no biases: written when a kept layer left
    its biases' casts in autocast's cache (Stage.autocast_cache_bytes); since 2026-12-03 no layer leaves any."""

    def __init__(self, width=64, depth=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_PostNorm(width, bias=False) for _ in range(depth))
        self.head = torch.nn.Linear(width, width)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).float().square().mean()


def test_a_rest_that_lets_go_of_the_output_without_taking_the_last_input_holds_no_gradient_for_it(meter):
    # The rest of the step lets go of the layers' output in its forward (StepContext.rest_frees_output: a head
    # that saves a bf16 cast of it under autocast) but takes nothing else of the last layer's: its backward hands
    # that layer a gradient nothing else holds (StepContext.rest_takes_last_input false, read from the rest's
    # graph), and the last layer's output is gone by its backward whole. Charged the gradient a sum over the last
    # layer holds (the reading's default), every plan was above what the step held.
    m = _CastHead()
    x = torch.randn(256, 64, requires_grad=True)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    for s in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x)
        loss.backward()
        del loss
        m.zero_grad(set_to_none=True)
        x.grad = None
        if s == 0:  # every layer kept
            for st in lp._last.chain.stages:
                st.fwd_ms, st.bwd_ms, st.checkpoint_fwd_ms, st.checkpoint_bwd_ms = 1.0, 2.0, 1.0, 4.0
            lp.set_budget(1 << 40)
            assert str(lp.plan) == "Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0", lp.plan
        else:
            assert abs(lp.prediction_error) <= 1e-3, (lp.plan, lp.prediction_error)
    ctx = lp.context
    assert ctx.rest_frees_output and not ctx.rest_takes_last_input
    assert [st.autocast_cache_bytes for st in lp._last.chain.stages] == [0] * 4
    assert lp._last.chain.stages[-1].bwd_grad_held_bytes == lp._last.chain.stages[-1].output_bytes
    taken = remat.StepContext.__new__(remat.StepContext)
    taken.__setstate__(ctx.__getstate__()[:24])  # the reading's default: taken
    # The last layer's backward is charged more so. (Not the step's peak where the rest's is higher: on some
    # CPUs the head's backward peaks above it, and the whole step's figures were equal there.)

    def last_backward(c):
        points = json.loads(remat._core.step_timeline_json(lp.chain, c, lp.plan, 0))["points"]
        return next(p["peak_bytes"] for p in points if p["op"] == "B3")

    assert last_backward(taken) > last_backward(ctx)
    assert remat.step_peak_bytes(lp.chain, taken, lp.plan) >= lp.predicted_peak_bytes


def test_a_policy_that_keeps_no_output_of_its_layer_leaves_it_gone_by_its_backward(meter):
    # Layers whose last call the matmuls policy does not keep (a LayerNorm after their own residual sum, as a
    # BERT layer's) hold no output under it (PolicyCost.saves_output false, measured); one ending in a Linear
    # holds it (the kept product). Before (found 2026-12-03), every policy was charged its output through its
    # backward: a small BERT under the policy, every layer kept, 1.4% below its prediction.
    class Model(torch.nn.Module):
        def __init__(self, last_linear):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(_PostNorm(), torch.nn.Linear(64, 64)) if last_linear else _PostNorm()
                for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    x = torch.randn(256, 64)
    for last_linear in (False, True):
        m = Model(last_linear)
        lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=("matmuls",), replan_on_overshoot=False)

        def times(i, st):
            st.fwd_ms, st.bwd_ms, st.checkpoint_fwd_ms, st.checkpoint_bwd_ms = 1.0, 2.0, 1.0, 4.0
            for c in st.policies:
                c.fwd_ms, c.bwd_ms = 0.5, 1.5

        _train_with_times(m, x, lp, times)
        assert str(lp.plan) == "Fk0[matmuls] Fk1[matmuls] Fk2[matmuls] Fk3[matmuls] L B3 B2 B1 B0", lp.plan
        assert [st.policies[0].saves_output for st in lp._last.chain.stages] == [last_linear] * 4
        assert abs(lp.prediction_error) <= 1e-3, (last_linear, lp.plan, lp.prediction_error)


def _train_with_times(m, x, lp, times, autocast=False, steps=3):
    """Steps of m on x (the first profiles), the stages' times set after the first by times(i, stage)."""
    for s in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(x)
        out.float().square().mean().backward()
        del out  # (held into the next step, it would be in that step's base and freed during it)
        m.zero_grad(set_to_none=True)
        if s == 0:
            for i, st in enumerate(lp._last.chain.stages):
                times(i, st)
            lp.set_budget(1 << 40)


def _kept(i, st):  # times that make every layer kept the fastest
    st.fwd_ms, st.bwd_ms, st.checkpoint_fwd_ms, st.checkpoint_bwd_ms = 1.0, 2.0, 1.0, 4.0


def _checkpointed(i, st):  # times that make every layer checkpointed the fastest
    st.fwd_ms, st.bwd_ms, st.checkpoint_fwd_ms, st.checkpoint_bwd_ms = 1.0, 20.0, 1.0, 4.0


class _LogSoftmaxHead(torch.nn.Module):
    """Residual feed-forward layers (Linears with biases) and a head whose log-softmax, inside the caller's
    autocast region, is the step's peak."""

    def __init__(self, width=64, depth=4, classes=1024):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_ResidualBlock(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return torch.log_softmax(self.head(x), -1).mean()


def test_kept_layers_leave_nothing_in_autocasts_cache(meter):
    # Under autocast a kept layer run with autocast's cache on would leave there the casts its graph does not
    # save (its Linears' biases; the first layer's weight too, its input being the model's own, which takes no
    # gradient), held until the caller's autocast region ends: here past the head's log-softmax, the step's peak.
    # Found 2026-12-03: this step held 35,328 bytes (0.58%) above its prediction, one bf16 weight and four
    # layers' biases; the profiler then measured them (Stage.autocast_cache_bytes) and the model charged them.
    # Since, remat runs every layer with the cache off in training, kept too: nothing is left there, nothing is
    # measured, and the prediction holds without that charge.
    m = _LogSoftmaxHead()
    x = torch.randn(512, 64)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, _kept, autocast=True)
    assert str(lp.plan) == "Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0"
    assert [st.autocast_cache_bytes for st in lp.chain.stages] == [0] * 4
    assert -0.001 <= lp.prediction_error <= 0, lp.prediction_error


def test_layers_run_with_autocasts_cache_off_in_training_only(meter):
    # Kept or checkpointed, a layer in a training step runs with autocast's cache off; a forward without grad
    # (generation, evaluation) keeps the caller's cache, whose casts its next calls reuse.
    m = _LogSoftmaxHead()
    x = torch.randn(64, 64)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    seen = []
    m.layers[1].up.register_forward_pre_hook(lambda mod, args: seen.append(torch.is_autocast_cache_enabled()))
    _train_with_times(m, x, lp, _kept, autocast=True, steps=2)
    assert str(lp.plan) == "Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0"
    assert seen and not any(seen), seen
    seen.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)
    assert seen == [True]
    assert torch.is_autocast_cache_enabled()


def test_the_profilers_casts_are_not_held_through_the_callers_autocast_region(meter):
    # The profiling step profiles the layers from inputs that are leaves requiring grad, whose casts autocast's
    # cache would keep until the caller's autocast region ends: four bf16 copies of the last layer's input held
    # at the layers' return, freed before the backward pass, read as what the rest of the step lets go of.
    # Before (found 2026-12-02), the rest's held gradient was read as 0 and a residual MLP summed outside its
    # layers held 3.7% above its prediction under CPU bf16 autocast; the profiler runs with the cache off now.
    m = _SumsOutside(sigmoid=False, depth=2)
    x = torch.randn(1024, 64)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, _kept, autocast=True)
    assert str(lp.plan) == "Fa0 Fa1 L B1 B0"
    assert lp.prediction_error <= remat.PREDICTION_TOLERANCE, lp.prediction_error
    assert lp.context.rest_grads_bytes >= x.nbytes  # the gradient the sum keeps for the residual path


def test_an_input_made_larger_between_layers_has_its_whole_gradient_charged(meter):
    # Under autocast the layers return bf16 and the residual sum outside them makes the next layer's input in
    # fp32: that input's gradient is twice the bytes of the output the chain counts at the boundary. The profiler
    # took the whole gradient off the layer's backward peak, and the model charged back the output's bytes; what
    # ran between was read likewise. Before (found 2026-12-02), every layer checkpointed held 4.5% above its
    # prediction here (a layer's backward, its recompute's peak); now the rest of the gradient is left in both.
    m = _SumsOutside(sigmoid=False, depth=2, expand=1)
    x = torch.randn(1024, 64)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, _checkpointed, autocast=True)
    assert str(lp.plan) == "Fc0 Fc1 L Fa1 B1 Fa0 B0"
    assert lp.last_peak_bytes <= lp.predicted_peak_bytes, (lp.last_peak_bytes, lp.predicted_peak_bytes)
    assert abs(lp.prediction_error) <= remat.PREDICTION_TOLERANCE, lp.prediction_error
    # What ran between (the sum's backward, the cast of the gradient to bf16) held the whole fp32 gradient.
    assert lp.context.between_backward_peak_bytes[1] >= x.nbytes


def test_an_input_made_between_layers_from_the_last_output_is_let_go_of_once_in_the_backward(meter):
    # What runs between two layers made the next layer's input from the last layer's output and let go of it
    # (a residual sum outside the layers): the model holds that output for part of the input, and lets go of it
    # itself at the later layer's backward, where the reading of what runs between let go of the whole input as
    # well. Before (found 2026-12-02) that output was let go of twice, and the backward passes after it held that
    # much more than predicted: 6.9% above here in fp32, every layer checkpointed, the middle one the widest.
    m = _SumsOutside(sigmoid=False, depth=3, expand=(1, 4, 1))
    x = torch.randn(1024, 64)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, _checkpointed)
    assert str(lp.plan) == "Fc0 Fc1 Fc2 L Fa2 B2 Fa1 B1 Fa0 B0"
    assert lp.last_peak_bytes <= lp.predicted_peak_bytes, (lp.last_peak_bytes, lp.predicted_peak_bytes)
    assert abs(lp.prediction_error) <= remat.PREDICTION_TOLERANCE, lp.prediction_error


def test_the_layers_output_let_go_of_by_the_rest_is_charged_where_the_last_layers_way_holds_it(meter):
    # The model's code sums its residual over the last layer too and lets go of that layer's output before it
    # returns (StepContext.rest_frees_output). A last layer kept under the matmuls policy keeps its output (its
    # last matmul's result) beside what the rest of the step makes. Before (found 2026-12-02) the rest's peak,
    # read with that output let go of, was charged so: 5.4% above the prediction here.
    m = _SumsOutside(sigmoid=False, depth=3, expand=(1, 4, 1))
    x = torch.randn(512, 64)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=("matmuls",), replan_on_overshoot=False)

    def last_under_the_policy(i, st):  # the first layer checkpointed, the second kept, the last under the policy
        st.fwd_ms, st.bwd_ms, st.checkpoint_fwd_ms, st.checkpoint_bwd_ms = 1.0, 2.0 if i == 1 else 20.0, 1.0, 4.0
        for c in st.policies:
            c.fwd_ms, c.bwd_ms = (0.5, 1.5) if i == 2 else (10.0, 30.0)

    _train_with_times(m, x, lp, last_under_the_policy)
    assert str(lp.plan) == "Fc0 Fa1 Fk2[matmuls] L B2 B1 Fa0 B0"
    assert lp.context.rest_frees_output
    assert lp.last_peak_bytes <= lp.predicted_peak_bytes, (lp.last_peak_bytes, lp.predicted_peak_bytes)
    assert abs(lp.prediction_error) <= remat.PREDICTION_TOLERANCE, lp.prediction_error


class _ResidualKeepingInputs(_Residual):
    """_Residual whose forward holds every layer's input in a list until it returns, after a last operation."""

    def forward(self, x):
        inputs = []
        for layer in self.layers:
            inputs.append(x)
            x = layer(x)
        return x * 1.0


class _ResidualSavingAnInput(_Residual):
    """_Residual whose forward saves the second layer's input in an operation of its own (sin saves its input):
    the autograd graph alone holds that input past the layer's forward, through the backward pass. What the sin
    makes is held aside to the forward's end: made between two layers whose second takes the first's output as
    handed on (read since 2026-12-02 as what runs between leaves held; before, not read: 2.4% above the
    prediction in fp32 on the plan keeping every layer)."""

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 1:
                aside = x.sin()
            x = layer(x)
        return x + aside.mean()


@pytest.mark.parametrize("ways", ["kept", "alternating"])
def test_an_input_its_layer_does_not_save_is_let_go_of_once_its_forward_is_done(meter, ways):
    # Under autocast a layer whose first operation is a Linear saves the bf16 cast of its fp32 input, not the
    # input (Stage.saves_input false); where nothing else holds the input past the layer's forward
    # (StepContext.inputs_held_in_forward, read in the profiling step) it goes then. Before (found 2026-12-02),
    # it was charged to the layer's backward: 2.7-10.9% above the step's measured peak on plans keeping layers.
    # A model that holds the inputs through its forward is read so, and charged as before.
    x = torch.randn(512, 64)

    def times(i, st):  # every layer kept, or the even ones checkpointed (the odd ones' inputs plain outputs)
        (_checkpointed if ways == "alternating" and i % 2 == 0 else _kept)(i, st)

    plan = "Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0" if ways == "kept" else "Fc0 Fa1 Fc2 Fa3 L B3 Fa2 B2 B1 Fa0 B0"
    for model, autocast in ((_Residual, True), (_Residual, False), (_ResidualKeepingInputs, True),
                            (_ResidualSavingAnInput, True), (_ResidualSavingAnInput, False)):
        m = model()
        lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
        _train_with_times(m, x, lp, times, autocast=autocast)
        assert str(lp.plan) == plan
        assert [s.saves_input for s in lp.chain.stages] == [not autocast] * 4
        held = model is _ResidualKeepingInputs
        # (An object the autograd graph holds stays alive: read held.)
        saved = model is _ResidualSavingAnInput
        assert list(lp.context.inputs_held_in_forward) == [True, held or saved, held, held]
        if held or saved:  # charged to the layers' backward passes: at or above what the step holds
            assert lp.last_peak_bytes <= lp.predicted_peak_bytes, (lp.last_peak_bytes, lp.predicted_peak_bytes)
        else:
            assert abs(lp.prediction_error) <= 0.001, (autocast, lp.prediction_error)
        lp.remove()


class _ResidualSkippingToTheEnd(_Residual):
    """_Residual whose output adds the second layer's input (a skip to the head)."""

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 1:
                skip = x
            x = layer(x)
        return x + skip


def test_the_output_gradient_a_skip_to_the_head_holds_is_charged_until_it_is_let_go_of(meter):
    # The sum's backward hands the layers' output and the skipped input one gradient tensor, which that input's
    # gradient buffer holds until the second layer's backward is done (StepContext.output_grad_held_in_backward,
    # read as each layer's input gradient is ready). Before (found 2026-12-02), it was let go of at the last
    # layer's backward: 2.9% above the prediction in fp32, 3.75% under CPU bf16 autocast.
    x = torch.randn(512, 64)

    def last_kept(i, st):
        (_kept if i == 3 else _checkpointed)(i, st)

    for autocast in (False, True):
        m = _ResidualSkippingToTheEnd()
        lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
        _train_with_times(m, x, lp, last_kept, autocast=autocast)
        assert str(lp.plan) == "Fc0 Fc1 Fc2 Fa3 L B3 Fa2 B2 Fa1 B1 Fa0 B0"
        held = list(lp.context.output_grad_held_in_backward)
        assert held == [False, False, True, True], held  # let go of within the second layer's backward
        assert abs(lp.prediction_error) <= 0.001, (autocast, lp.prediction_error)
        lp.remove()
    # Without the skip nothing holds it.
    m = _Residual()
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, last_kept)
    assert list(lp.context.output_grad_held_in_backward) == [False] * 4


class _ResidualSummedBesideAWeight(_Residual):
    """_Residual whose forward sums its output beside a weight of its own: the sum's backward hands the layers'
    output the loss's one-element gradient, broadcast (an expanded view of a few bytes), and the weight's
    gradient, made in the rest's backward, is held from there to the step's end."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(512, 64))

    def forward(self, x):
        return super().forward(x).sum() + self.w.square().sum()


def test_an_expanded_output_gradient_is_left_in_what_the_rest_holds(meter):
    # The whole gradient's bytes were taken off what the rest leaves held whatever its storage held: the weight's
    # gradient read as not held, and (found 2026-12-03) every layer kept held 2.5% above the prediction here; the
    # broadcast gradient, alive to the backward's end, read as a whole one held past each layer's backward.
    x = torch.randn(512, 64)
    m = _ResidualSummedBesideAWeight()
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, _kept)
    assert str(lp.plan) == "Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0"
    assert abs(lp.prediction_error) <= 0.001, lp.prediction_error
    assert lp.context.rest_grads_bytes >= m.w.nbytes
    assert list(lp.context.output_grad_held_in_backward) == []


class _ReluStack(torch.nn.Module):
    """Linear-ReLU layers, each ending in a ReLU, which saves its result (the layer's output) for its backward."""

    def __init__(self, width=64, depth=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, width),
                                torch.nn.ReLU()) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("ways", ["kept", "alternating"])
def test_an_output_its_graph_lets_go_of_early_in_the_backward_is_charged_so(meter, ways):
    # A layer ending in a ReLU holds its output, which its graph alone holds, only until the ReLU's backward has
    # run (Stage.bwd_output_freed_bytes, measured by running its backward again so), kept or after its recompute.
    # Before (found 2026-12-03), every plan here was predicted 2.4-3.9% above what it held.
    x = torch.randn(512, 64)

    def times(i, st):  # every layer kept, or the even ones checkpointed
        (_checkpointed if ways == "alternating" and i % 2 == 0 else _kept)(i, st)

    m = _ReluStack()
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, times)
    assert str(lp.plan) == ("Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0" if ways == "kept" else
                            "Fc0 Fa1 Fc2 Fa3 L B3 Fa2 B2 B1 Fa0 B0")
    assert all(s.saves_output and 0 < s.bwd_output_freed_bytes <= s.output_bytes for s in lp.chain.stages)
    assert abs(lp.prediction_error) <= 0.001, lp.prediction_error


class _FrozenBelow(torch.nn.Module):
    """Residual feed-forward layers on a frozen embedding's output, the first `frozen` layers frozen too: the
    layers' input, and each frozen layer's output, take no gradient. The model's forward holds the embedding's
    output in a variable until it returns, as Hugging Face's models hold `inputs_embeds`."""

    def __init__(self, frozen, width=64, depth=4):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(100, width).requires_grad_(False)
        self.layers = torch.nn.ModuleList(_ResidualBlock(width) for _ in range(depth))
        for layer in list(self.layers)[:frozen]:
            layer.requires_grad_(False)
        self.head = torch.nn.Linear(width, 100)

    def forward(self, ids):
        e = self.emb(ids)
        h = e
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class _ResidualBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("frozen,ways", [(1, "acaa"), (0, "cccc"), (3, "aaaa")])
def test_inputs_that_take_no_gradient_are_charged_as_they_are_held(meter, frozen, ways):
    # Three readings of inputs without a gradient (found 2026-12-03), each case failing without its own:
    # - the embedding's output, which the model's forward holds until it returns, is freed by the time the rest
    #   hands the layers their gradient (StepReadings.input_freed_in_rest): the rest's readings let go of it, and
    #   the model did again from the loss on. With the first layer frozen, kept, the second checkpointed, the step
    #   held 3.7% above its prediction (three frozen layers kept, with the next reading: 5.9% above);
    # - a layer whose input takes no gradient makes none, and the model charges one at its backward: its profiled
    #   peaks are less those bytes (every layer checkpointed on the frozen embedding: 4.5% below);
    # - a frozen layer's output, which no gradient hook reads, is read at the backward pass's end
    #   (StepContext.outputs_held_in_backward): three frozen layers kept, each output was held through the
    #   backward in the model (10.1% below).
    ids = torch.randint(0, 100, (8, 64))

    def times(i, st):
        (_checkpointed if ways[i] == "c" else _kept)(i, st)

    m = _FrozenBelow(frozen)
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, ids, lp, times)
    assert [str(lp.plan).split()[i][:2] for i in range(4)] == ["F" + w for w in ways]
    assert abs(lp.prediction_error) <= 0.001, lp.prediction_error
    assert lp.context.input_held_in_backward == (frozen > 0)
    assert list(lp.context.outputs_held_in_backward)[1:frozen + 1] == [False] * frozen


@pytest.mark.parametrize("offload", [False, True])
def test_a_layer_without_a_backward_is_kept_whatever_its_times_say(meter, offload):
    # A layer frozen on an input that needs no gradient makes no graph (Stage.has_backward false), so every way
    # runs it as kept: the planner keeps it, with times under which checkpointing looks the faster. Before
    # (found 2026-12-03), such layers were checkpointed (or offloaded) by the times alone, and charged an input
    # held to a backward they do not have: every layer checkpointed, 11.5% below the prediction.
    ids = torch.randint(0, 100, (8, 64))
    m = _FrozenBelow(3)
    kw = dict(offload=True, groups=True, offload_min_bytes=4096) if offload else {}
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False, **kw)
    _train_with_times(m, ids, lp, _checkpointed)
    assert [s.has_backward for s in lp.chain.stages] == [False, False, False, True]
    assert lp.choices[:3] == ["keep"] * 3, lp.choices
    if not offload:
        assert lp.choices[3] == "checkpoint"
        assert abs(lp.prediction_error) <= 0.001, lp.prediction_error
    lp.set_budget(lp.min_budget_bytes)  # and at the least budget
    assert lp.choices[:3] == ["keep"] * 3, lp.choices
    out = m(ids)
    out.float().square().mean().backward()
    del out
    assert -0.001 <= lp.prediction_error <= 0, lp.prediction_error


def test_a_post_norm_bert_under_autocast_lets_go_of_each_layers_input_once_its_forward_is_done(meter):
    # A BERT layer's first operations are Linears, which under bf16 autocast save the bf16 cast of its fp32 input;
    # its last LayerNorm saves the sum it normalizes, not the input. Nothing else holds a layer's input (the
    # encoder's loop lets go of it), nor the embeddings' output once the model's forward is done
    # (StepContext.inputs_held_in_forward, entry 0): a plan keeping every layer holds none of them in the backward
    # pass, the first layer's input from the loss on. Before (found 2026-12-02) the plan was predicted 4.3% high.
    transformers = pytest.importorskip("transformers")
    import remat.hf  # noqa: F401
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=512, max_position_embeddings=128, attn_implementation="eager")
    m = transformers.BertForMaskedLM(cfg).train()
    ids = torch.randint(0, 1000, (4, 64))
    lp = remat.hf.enable(m, budget=1 << 40, policies=(), replan_on_overshoot=False)
    for s in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        del out
        m.zero_grad(set_to_none=True)
        if s == 0:
            for i, st in enumerate(lp.chain.stages):
                _kept(i, st)
            lp.set_budget(1 << 40)
    assert str(lp.plan) == "Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0"
    assert [s.saves_input for s in lp.chain.stages] == [False] * 4
    assert list(lp.context.inputs_held_in_forward) == [False] * 4
    assert not lp.context.input_held_in_backward
    assert abs(lp.prediction_error) <= 0.001, lp.prediction_error


class _Combined(torch.nn.Module):
    """A residual layer ending as a mixture of experts does, in a sum over each token's k outputs of a Linear:
    that sum's backward and the reshape's before it read nothing saved and hand the Linear a copy of the
    gradient k times the output's (an expanded gradient reshaped); the residual path holds the gradient the
    layer is handed. Before the Linear, a transient 16 times the output that the layer does not save (a
    detached repeat, summed)."""

    def __init__(self, width=64, k=2):
        super().__init__()
        self.k = k
        self.lin = torch.nn.Linear(width, k * width)

    def forward(self, x):
        t = x.detach().repeat(1, 16).sum(-1, keepdim=True)
        z = self.lin(x + t)
        return x + z.view(*x.shape[:-1], self.k, x.shape[-1]).sum(-2)


def test_the_gradients_a_checkpointed_layers_backward_makes_before_its_recompute_are_charged(meter):
    # torch.utils.checkpoint recomputes a layer once its backward first asks for a tensor the layer did not keep:
    # the backward of its last operations, which reads nothing saved, has run by then, and what it made is held
    # through the recompute (Stage.grads_before_recompute_bytes: here the copied gradient, twice the output's
    # bytes, measured with the gradient the layer is handed held through, as its residual path holds it; the
    # recompute's transient beside it is the step's peak). Found 2026-12-04: a 4-layer GPT-OSS with its
    # last layer checkpointed held 131,072 bytes (its experts' combined gradient) above its recompute's charge.
    torch.manual_seed(0)
    m = torch.nn.Sequential(*(_Combined() for _ in range(4)))
    x = torch.randn(256, 64)
    lp = remat.enable(m, list(m), budget=1 << 40, policies=(), replan_on_overshoot=False)
    _train_with_times(m, x, lp, _checkpointed)
    assert str(lp.plan) == "Fc0 Fc1 Fc2 Fc3 L Fa3 B3 Fa2 B2 Fa1 B1 Fa0 B0"
    assert abs(lp.prediction_error) <= 1e-3, (lp.last_peak_bytes, lp.predicted_peak_bytes)
    chain = lp.chain
    assert [st.grads_before_recompute_bytes for st in chain.stages] == [2 * st.output_bytes for st in chain.stages]
    # Without the figure the step is charged less than it held; kept, the layers' backward holds the copy as it
    # is measured (bwd_tmp_bytes), and nothing changes.
    for st in chain.stages:
        st.grads_before_recompute_bytes = 0
    assert remat.step_peak_bytes(chain, lp.context, lp.plan) < lp.last_peak_bytes


def test_a_plan_of_ones_own_runs_and_is_predicted_and_checked_as_remats(meter):
    """choose_plan (C++'s PlannedOptions::choose_plan): the plan a function makes from the shape's profile, the
    step's context and the budget runs as the plain step, predicted by step_peak_bytes and measured against it;
    a plan that is not for the profiled layers, or is predicted above the budget, is refused by name."""
    x = torch.randn(64, 64)
    plain_model = mlp(depth=4)
    plain = [train_step(plain_model, x, meter, seed=s, set_to_none=True) for s in (1, 2, 3)]

    def plan_of(ops, n=4):
        return remat.Plan.from_json(json.dumps({"num_stages": n, "ops": ops}))

    ops = ["Fc0", "Fa1", "Fa2", "Fc3", "L", "Fa3", "B3", "B2", "B1", "Fa0", "B0"]
    calls = []

    def choose(chain, context, budget):
        calls.append((len(chain.stages), budget))
        return plan_of(ops)

    m = mlp(depth=4)
    lp = remat.enable(m, list(m), budget=1 << 40, choose_plan=choose)
    for s, want in zip((1, 2, 3), plain):
        assert_same_run(train_step(m, x, meter, seed=s, set_to_none=True), want)
    assert calls and all(c == (4, 1 << 40) for c in calls), calls
    assert lp.choices == ["checkpoint", "keep", "keep", "checkpoint"]
    assert lp.predicted_peak_bytes == remat.step_peak_bytes(lp.chain, lp.context, lp.plan)
    assert lp.plan.predicted.peak_bytes == remat.simulate(lp.chain, lp.plan).peak_bytes
    assert 0 < lp.last_peak_bytes <= lp.predicted_peak_bytes, (lp.last_peak_bytes, lp.predicted_peak_bytes)
    # Above the budget, refused by name with both figures; so is a plan of another size or shape.
    predicted = lp.predicted_peak_bytes
    with pytest.raises(remat.InfeasibleBudget, match=f"choose_plan's plan .* above the budget of .*{predicted - 1} b"):
        lp.set_budget(predicted - 1)
    with pytest.raises(remat.InfeasibleBudget, match="above the budget"):  # the shape has no plan at that budget
        train_step(m, x, meter, set_to_none=True)
    lp.set_budget(predicted)
    assert_same_run(train_step(m, x, meter, seed=1, set_to_none=True), plain[0])
    for bad, words in ((plan_of(["Fa0", "Fa1", "L", "B1", "B0"], 2), "for 2 stages but the profile has 4"),
                       (plan_of(["Fa0", "Fn1", "Fa2", "Fa3", "L", "B3", "B2", "Fa1", "B1", "B0"]),
                        "not a per-layer plan")):
        m2 = mlp(depth=4)
        remat.enable(m2, list(m2), budget=1 << 40, choose_plan=lambda chain, context, budget: bad)
        with pytest.raises(ValueError, match=f"choose_plan's plan .* is not one for the profiled layers: .*{words}"):
            for s in (1, 2):  # the profiling step, then the one that plans
                train_step(m2, x, meter, seed=s, set_to_none=True)
    m3 = mlp(depth=4)
    remat.enable(m3, list(m3), budget=1 << 40, choose_plan=lambda chain, context, budget: " ".join(ops))
    with pytest.raises(TypeError, match="choose_plan returned a str, not a remat.Plan"):
        for s in (1, 2):
            train_step(m3, x, meter, seed=s, set_to_none=True)
    with pytest.raises(TypeError, match="choose_plan must be a callable"):
        remat.enable(mlp(depth=2), list(mlp(depth=2)), budget=1 << 30, choose_plan="per-layer")
    with pytest.raises(ValueError, match="give budget too"):
        remat.enable(mlp(depth=2), list(mlp(depth=2)), choose_plan=choose)
    # Set once profiled: planning at a budget the planner planned (and kept a plan for) takes the chosen plan;
    # None hands planning back, its kept plan again.
    m4 = mlp(depth=4)
    lp4 = remat.enable(m4, list(m4), budget=1 << 40)
    for s in (1, 2):
        train_step(m4, x, meter, seed=s, set_to_none=True)
    lp4.set_budget(1 << 40)  # the planner's plan, kept for these figures
    planners = str(lp4.plan)
    assert planners != str(plan_of(ops))
    lp4.choose_plan = choose
    lp4.set_budget(1 << 40)
    assert str(lp4.plan) == str(plan_of(ops))
    assert_same_run(train_step(m4, x, meter, seed=3, set_to_none=True), plain[2])
    lp4.choose_plan = None
    lp4.set_budget(1 << 40)
    assert str(lp4.plan) == planners


class _SideLayer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x, side):
        return torch.tanh(self.lin(x) * side)


class _SideMadeFromInput(torch.nn.Module):
    """Layers that each take a side input made from their input before them, with an embedding whose gradient is
    larger than the layers' activations (Gemma 4's per-layer inputs)."""

    def __init__(self, rows=256, width=64, depth=3, vocab=8192):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(width, width)
        self.proj = torch.nn.Linear(width, width)
        self.table = torch.nn.Embedding(vocab, width)
        self.register_buffer("ids", torch.arange(rows) * 7 % vocab)
        self.layers = torch.nn.ModuleList(_SideLayer(width) for _ in range(depth))

    def forward(self, x):
        x = self.inp(x)
        side = self.proj(x) + self.table(self.ids)
        for layer in self.layers:
            x = layer(x, side)
        return x


@pytest.mark.parametrize("ways", [["keep"] * 3, ["checkpoint"] * 3])
def test_a_backward_before_the_layers_that_runs_ahead_of_their_inputs_gradient_is_read_whole(meter, ways):
    # The side input is made from the layers' input, so its backward (the embedding's 2 MiB gradient, the step's
    # peak) runs once the first layer's is done and before that input has its whole gradient. Before (found
    # 2026-12-06 on Gemma 4 by bench/architectures.py), what runs after the layers' backward was read from that
    # gradient on, after the embedding's backward had let go of what it held at its peak: both plans here were
    # 179,968 bytes (7.8%) above their predictions.
    m = _SideMadeFromInput()
    x = torch.randn(256, 64)
    want = [train_step(m, x, meter, seed=s, set_to_none=True) for s in (1, 2)]
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    assert_same_run(want[0], train_step(m, x, meter, seed=1, set_to_none=True))  # the profiling step
    _, predicted = give_plan(lp, per_layer_ops(ways))
    got = train_step(m, x, meter, seed=2, set_to_none=True)
    assert_same_run(want[1], got)
    assert predicted <= got[2] <= predicted + 64, (got[2], predicted)


class _DeadBranchLayer(torch.nn.Module):
    """A layer that computes more than its output takes (RWKV's attention updates its state once more after its
    last output): an exp, which saves its result, on a branch the output does not reach."""

    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        h = self.lin(x)
        torch.exp(h)  # (its result let go of at once; its graph holds h's, and through it x)
        return torch.tanh(h)


@pytest.mark.parametrize("ways", [["keep"] * 4, ["checkpoint"] * 4])
def test_a_layers_call_its_output_does_not_take_leaves_nothing_alive_after_profiling(meter, ways):
    # The profile counts what a stage saves with saved-tensor hooks that handed each tensor back as itself: a
    # saved result then holds its own grad_fn, a cycle through autograd's C++ that only the backward of the call
    # that saved it breaks, and the backward never reaches a call the output does not take. Before (found
    # 2026-12-06 on RWKV), each such call's graph, the layer's input among what it holds, outlived the profile:
    # the profiling step read the layers' outputs as held to the step's end and charged each backward one high.
    # The saves are now counted only while their graph is alive (the hooks hand back a detached tensor, and a
    # let-go save's storage address may be a later allocation's).
    m = torch.nn.Sequential(*[_DeadBranchLayer(64) for _ in range(4)])
    x = torch.randn(128, 64, requires_grad=True)
    want = [train_step(m, x, meter, seed=s, set_to_none=True) for s in (1, 2)]
    lp = remat.enable(m, list(m), budget=1 << 40, policies=(), replan_on_overshoot=False)
    assert_same_run(want[0], train_step(m, x, meter, seed=1, set_to_none=True))  # the profiling step
    # (The last layer's output is the one train_step holds, as `out`, through the backward.)
    assert lp.context.outputs_held_to_end == [False, False, False, True], lp.context.outputs_held_to_end
    _, predicted = give_plan(lp, per_layer_ops(ways))
    got = train_step(m, x, meter, seed=2, set_to_none=True)
    assert_same_run(want[1], got)
    # Kept, exact (before, 131,072 bytes high: the calls' saves counted, which a step lets go of with their
    # results). Checkpointed, 5,056 bytes above (a CPU generator state's size, not located; without the call
    # the output does not take, exact; before, 46,336 bytes high).
    assert predicted <= got[2] <= predicted + (5056 if ways[0] == "checkpoint" else 0), (got[2], predicted)


class _Concatenating(torch.nn.Module):
    """A residual MLP layer (width, hidden, width); with `cat`, it concatenates what the model hands every layer
    beside its input to its input (as Zamba2's hybrid layers do the embeddings) before its first Linear, or with
    `last`, to its hidden state before its second."""

    def __init__(self, width, hidden, cat, last=False):
        super().__init__()
        self.cat, self.last = cat, last
        self.up = torch.nn.Linear(2 * width if cat and not last else width, hidden)
        self.down = torch.nn.Linear(hidden + width if cat and last else hidden, width)

    def forward(self, x, e):
        if not self.cat:
            return self.down(torch.relu(self.up(x))) + x
        if self.last:
            return self.down(torch.cat([torch.relu(self.up(x)), e], -1)) + x
        return self.down(torch.relu(self.up(torch.cat([x, e], -1)))) + x


class _HandsEveryLayer(torch.nn.Module):
    """A Linear, then layers each handed a copy of its output beside their input, the second the widest; those
    of `cats` concatenate it to their input (or, `last`, to their hidden state)."""

    def __init__(self, cats, last=False, width=64):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(width, width)
        self.layers = torch.nn.ModuleList(_Concatenating(width, h * width, i in cats, last)
                                          for i, h in enumerate((1, 4, 1, 1)))

    def forward(self, x):
        x = self.inp(x)
        e = x.clone()
        for layer in self.layers:
            x = layer(x, e)
        return x


@pytest.mark.parametrize("cats, last", [((1, 3), False), ((1,), False), ((), False), ((1, 3), True)])
@pytest.mark.parametrize("ways", [["checkpoint"] * 4, ["keep"] * 4, ["keep", "checkpoint"] * 2])
def test_what_every_layer_is_handed_is_charged_as_its_gradient_arrives_and_as_it_is_held(meter, cats, last, ways):
    # Zamba2 hands each layer a copy of the embeddings beside its input; its hybrid layers concatenate it to
    # theirs, its Mamba layers do not use it. The concatenation's backward hands the copy a view of one gradient
    # for both, and autograd holds that gradient's storage whole from the last such layer's backward until the
    # next one's gradient is summed in; a layer that concatenates it first hands it that gradient last in its
    # backward, after the backward's peak. Before (found 2026-12-06 on Zamba2, 55,296 bytes above there), the
    # copy's own bytes were charged, from the peak of the backward of the last layer that took it, used or not,
    # and the copy itself to the step's end: concatenated by layers 1 and 3, the plans that checkpoint layer 1
    # were one input's gradient above their predictions here (layer 1's backward); by layer 1 alone, 9% high;
    # unused, one or two inputs high. Now each is exact. Concatenated last (to the hidden state), the gradient
    # arrives before the backward's peak: charged there (the concatenation's whole gradient, which the
    # backward's measured peak holds too: high, the safe side).
    m = _HandsEveryLayer(cats, last)
    x = torch.randn(1024, 64)
    want = [train_step(m, x, meter, seed=s, set_to_none=True) for s in (1, 2)]
    lp = remat.enable(m, list(m.layers), budget=1 << 40, policies=(), replan_on_overshoot=False)
    assert_same_run(want[0], train_step(m, x, meter, seed=1, set_to_none=True))  # the profiling step
    ctx = lp.context
    assert list(ctx.taken_bytes) == [x.nbytes], ctx.taken_bytes  # the copy, held by the layers that hold it
    _, predicted = give_plan(lp, per_layer_ops(ways))
    got = train_step(m, x, meter, seed=2, set_to_none=True)
    assert_same_run(want[1], got)
    if last:
        assert list(ctx.side_grads_late_bytes) == [0] * 4, ctx.side_grads_late_bytes
        assert got[2] <= predicted, (got[2], predicted)
        return
    grads = [0] * 4
    if cats:
        grads[max(cats)] = 2 * x.nbytes  # (the whole storage it arrives in)
    assert list(ctx.side_grads_bytes) == grads and ctx.side_bytes == sum(grads), (ctx.side_grads_bytes, ctx.side_bytes)
    assert list(ctx.side_grads_late_bytes) == grads, ctx.side_grads_late_bytes
    assert got[2] == predicted, (got[2], predicted)


class _Indexed(torch.nn.Module):
    """A layer whose scores only choose rows (DSA's indexer in GLM-MoE-DSA and DeepSeek-V3.2): `index`'s
    parameters are used by the forward and given no gradient (`graded` sums its scores into the output, times
    zero, which gives them one); and an expert (`expert`) no row reaches unless `reached`. Its weights are large
    beside its rows, so that the gradients decide the step's peak."""

    def __init__(self, width, rows):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.index = torch.nn.Linear(width, width)
        self.expert = torch.nn.Linear(width, width)
        self.rows, self.graded, self.reached = rows, False, False

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        scores = self.index(x).amax(-1)
        top = scores.topk(self.rows).indices
        h = h.index_add(0, top, torch.sigmoid(h[top]))
        if self.graded:
            h = h + scores[:, None] * 0
        if self.reached:
            h = h + self.expert(h)
        return h


@pytest.mark.parametrize("ways", [["keep"] * 4, ["checkpoint"] * 4])
def test_a_parameter_the_forward_uses_and_the_backward_gives_no_gradient_is_charged_none(meter, ways):
    # The profiling step watches each parameter the layers' forward hands to a call (ParamsUsed) for the
    # gradient its backward makes: one used and given none (the indexer's) is charged none, one the forward did
    # not use (an expert no row reached, which a later batch may reach) stays charged. Before (found 2026-12-06
    # on GLM-MoE-DSA), each was charged: its checkpointed plans 7.5% high.
    torch.manual_seed(0)
    m = torch.nn.Sequential(*(_Indexed(256, 8) for _ in range(4)))
    x = torch.randn(16, 256)
    want = [train_step(m, x, meter, seed=s, set_to_none=True) for s in (1, 2)]
    m[2].graded = True
    want.append(train_step(m, x, meter, seed=3, set_to_none=True))
    m[2].graded = False
    lp = remat.enable(m, list(m), budget=1 << 40, policies=(), replan_on_overshoot=False)
    assert_same_run(want[0], train_step(m, x, meter, seed=1, set_to_none=True))  # the profiling step
    lin = sum(p.nbytes for p in m[0].lin.parameters())
    assert lp.context.stage_grads_bytes == [2 * lin] * 4, lp.context.stage_grads_bytes  # lin's and the expert's
    plan, predicted = give_plan(lp, per_layer_ops(ways))
    got = train_step(m, x, meter, seed=2, set_to_none=True)
    assert_same_run(want[1], got)
    # Exact but for the expert's gradients, charged and not made (the prediction of a step that charges them
    # none); the peak is the first layer's backward, with every gradient made.
    unreached = remat.step_peak_bytes(lp.chain, remat._core.context_for_grads(lp.context, [lin] * 4), plan)
    assert unreached == got[2] <= predicted - 3 * lin, (got[2], unreached, predicted)
    # A step that gives the indexer a gradient is warned of, naming it, and steps from there on charge it.
    m[2].graded = True
    with pytest.warns(UserWarning, match=r"2\.index\.weight was given a gradient"):
        assert_same_run(want[2], train_step(m, x, meter, seed=3, set_to_none=True))
    m.zero_grad(set_to_none=True)
    assert lp._grads_state()[1] == (2 * lin, 2 * lin, 3 * lin, 2 * lin, frozenset(), frozenset())  # (none outside)
    # A copy watches its own parameters (a Parameter's copy has no hooks).
    c = copy.deepcopy(m)
    c[1].graded = True
    with pytest.warns(UserWarning, match=r"1\.index\.weight was given a gradient"):
        train_step(c, x, meter, seed=3, set_to_none=True)
    lp.remove()  # the watches go with the plan
    assert not any(p._post_accumulate_grad_hooks for p in m.parameters())
