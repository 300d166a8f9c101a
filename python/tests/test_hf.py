"""remat.hf.enable on Transformers models built from a config (nothing downloaded): BertModel (seed 001's model),
GPT-2 and a Llama-architecture model. Every step, the profiling one included, gives the plain run's loss,
gradients and next random draw, bitwise; the measured step peak stays within the budget and near the
prediction; eval and no_grad run plainly; an infeasible budget names the least feasible one; a Trainer
trains with it."""
import gc
import json
import warnings
from functools import partial

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
import remat.hf  # noqa: E402
from remat.offload import CopyEngine  # noqa: E402
from conftest import give_plan, per_layer_ops  # noqa: E402

# The measured peak above the prediction, at most (a share of the prediction): the profile's transients are
# measured once per layer and the rest of the step at its first run.
TOLERANCE = 0.05
# transformers 4.x (scripts/hf-versions runs these tests on 4.53.3): a few exact figures differ there, each
# stated where it is asserted (docs/testing.md).
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5


def bert():
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=256, max_position_embeddings=128)
    return transformers.BertModel(cfg), dict(batch=4, seq=64, vocab=1000, loss="hidden")


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=4, n_head=4, n_positions=128)
    return transformers.GPT2LMHeadModel(cfg), dict(batch=4, seq=64, vocab=1000, loss="lm")


def llama(hidden=64):
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, attention_dropout=0.1)
    return transformers.LlamaForCausalLM(cfg), dict(batch=4, seq=64, vocab=1000, loss="lm")


MODELS = {"bert": bert, "gpt2": gpt2, "llama": llama}


def make(name):
    torch.manual_seed(0)
    model, spec = MODELS[name]()
    model.train()
    return model, spec


def batch(spec, step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
    if spec["loss"] == "lm":
        return dict(input_ids=ids, labels=ids)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def step(model, spec, k, meter, make_batch=None, amp=False, backward_inside=False):
    """Training step k as Trainer runs it: gradients set to none, forward, loss, backward. make_batch(spec, k):
    the batch (batch() by default). amp: the forward and the loss under CPU bf16 autocast, the backward after
    the region (as Trainer and PyTorch's autocast guide run it), or inside it with backward_inside."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1000 + k)
    b = (make_batch or batch)(spec, k)
    base = meter.active()
    meter.reset_peak()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(**b)
        loss = out.loss if spec["loss"] == "lm" else out.last_hidden_state.square().mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    peak = meter.peak() - base
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, peak, torch.rand(4)


def hf_checkpointing(model):
    """Hugging Face's own per-layer checkpointing, non-reentrant (5.x's default; 4.x defaulted to reentrant),
    through activation_checkpointing_enable where the installed transformers has it (5.24 deprecates
    gradient_checkpointing_enable)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def same(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    for i, (g, h) in enumerate(zip(a[1], b[1])):
        assert (g is None) == (h is None), i
        if g is not None:
            assert torch.equal(g, h), f"gradient {i}: max difference {float((g - h).abs().max())}"
    assert torch.equal(a[3], b[3])


def planned_beside_plain(make, spec, meter):
    """Two plain steps of a model `make()` builds, and another of its models under remat.hf.enable (no budget to
    speak of) whose profiling step has been checked bitwise against the first: (the plain steps, model, plan)."""
    plain = make()
    want = [step(plain, spec, k, meter) for k in range(2)]
    model = make()
    lp = remat.hf.enable(model, budget=1 << 40)
    same(want[0], step(model, spec, 0, meter))
    return want, model, lp


@pytest.fixture(scope="module")
def plain_runs(meter):
    runs = {}
    for name in MODELS:
        model, spec = make(name)
        runs[name] = [step(model, spec, k, meter) for k in range(3)]
    return runs


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("where", [0.0, 0.15, 0.6])
def test_enable_plans_in_place_and_every_step_is_the_plain_run(name, where, meter, plain_runs):
    plain = plain_runs[name]
    plain_peak = plain[1][2]
    # A first, unplanned look at the floor: the least feasible budget for this model and batch.
    probe, spec = make(name)
    with pytest.raises(remat.InfeasibleBudget) as e:
        remat.hf.enable(probe, budget=1024)
        step(probe, spec, 0, meter)
    floor = e.value.min_bytes
    assert "below the least feasible one" in str(e.value) and str(floor) in str(e.value)
    with pytest.raises(remat.InfeasibleBudget, match="below the least feasible one"):  # and again, not silently
        step(probe, spec, 1, meter)
    assert floor < plain_peak
    budget = int(floor + where * (plain_peak - floor))

    model, spec = make(name)
    lp = remat.hf.enable(model, budget=budget)
    assert not lp.is_planned()
    runs = [step(model, spec, k, meter) for k in range(3)]
    for k in range(3):
        same(plain[k], runs[k])
    assert lp.is_planned() and lp.profiling_steps == 1
    assert len(lp.choices) == 4
    predicted = lp.predicted_peak_bytes
    assert predicted <= budget
    for k in (1, 2):
        assert runs[k][2] <= budget + TOLERANCE * predicted, (lp.choices, runs[k][2], predicted, budget)
        assert runs[k][2] <= predicted * (1 + TOLERANCE), (lp.choices, runs[k][2], predicted)
    assert lp.last_peak_bytes == runs[2][2]
    # The profiling step itself stays near the floor, far from the plain step.
    assert runs[0][2] < plain_peak
    if where < 0.5:
        assert "checkpoint" in lp.choices or "matmuls" in lp.choices


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_eval_no_grad_and_disable_run_plainly(name, meter):
    model, spec = make(name)
    lp = remat.hf.enable(model, budget="64MiB")
    model.eval()
    b = batch(spec, 0)
    with torch.no_grad():
        out = model(**b)
    ref, _ = make(name)
    ref.eval()
    with torch.no_grad():
        expected = ref(**b)
    key = "loss" if spec["loss"] == "lm" else "last_hidden_state"
    assert torch.equal(getattr(out, key), getattr(expected, key))
    assert not lp.is_planned() and lp.profiling_steps == 0
    model.train()
    with torch.no_grad():
        model(**b)
    assert lp.profiling_steps == 0
    remat.hf.disable(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_example_batch_plans_at_enable_and_leaves_the_model_as_it_was(meter, plain_runs):
    model, spec = make("gpt2")
    rng = torch.get_rng_state()
    lp = remat.hf.enable(model, budget=int(plain_runs["gpt2"][1][2] * 0.6), example=batch(spec, 0))
    assert lp.is_planned()
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    runs = [step(model, spec, k, meter) for k in range(2)]
    for k in range(2):
        same(plain_runs["gpt2"][k], runs[k])


def test_an_example_batch_planned_for_a_loop_that_keeps_less_is_profiled_again_at_its_first_step(meter):
    # The example's step holds the model's outputs through its backward pass (out = model(**batch);
    # out.loss.backward()); a loop that keeps only the loss, as Trainer's does, lets go of the logits first.
    # Before (found 2026-12-07) its steps stayed planned from the example's, a logits tensor below their
    # prediction (7.2% here, 11.7% on bench/architectures.py's Llama); now its first planned step says so and the
    # next one profiles.
    model, spec = make("llama")
    lp = remat.hf.enable(model, budget=1 << 40, example=batch(spec, 0))

    def keeps_loss(k):
        model.zero_grad(set_to_none=True)
        b = batch(spec, k)
        base = meter.active()
        meter.reset_peak()
        loss = model(**b).loss  # (the outputs let go of here)
        loss.backward()
        return meter.peak() - base

    example_prediction = lp.predicted_peak_bytes
    with pytest.warns(RuntimeWarning, match="below the prediction made from the example batch's step"):
        peak = keeps_loss(0)
    logits = spec["batch"] * spec["seq"] * spec["vocab"] * 4
    assert example_prediction - peak >= logits, (peak, example_prediction)
    keeps_loss(1)  # profiled as this loop runs
    peak = keeps_loss(2)
    assert abs(peak - lp.predicted_peak_bytes) <= 64, (peak, lp.predicted_peak_bytes)


def test_an_example_batch_leaves_existing_gradients_as_they_were():
    # A model after a step of its own, gradients alive: profiling the example adds nothing to them.
    model, spec = make("gpt2")
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, float(i))
    grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
    lp = remat.hf.enable(model, budget=1 << 40, example=batch(spec, 0))
    assert lp.is_planned()
    assert all(p.grad is g and torch.equal(g, before) for p, (g, before) in zip(model.parameters(), grads))
    remat.hf.disable(model)


def test_profile_gives_the_layers_chain_and_leaves_planning_off(meter):
    model, spec = make("bert")
    chain, context = remat.hf.profile(model, batch(spec, 0), loss=lambda out: out.last_hidden_state.mean())
    assert len(chain) == 4 and chain.policies == ["matmuls"]
    hidden = 4 * 64 * 64 * 4  # batch x seq x width, float32
    assert chain.input_bytes == hidden and all(s.output_bytes == hidden for s in chain.stages)
    assert all(s.output_bytes < s.policies[0].saved_bytes < s.saved_bytes for s in chain.stages)
    assert len(context.stage_grads_bytes) == 4 and context.before_saved_bytes > 0
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="gave no loss"):
        remat.hf.profile(model, batch(spec, 0))


def test_a_shorter_sequence_runs_the_longer_ones_plan_or_is_profiled_again(meter):
    # borrow_plans (the default): the shorter sequence runs the longer one's plan, within its prediction, with
    # no profiling step; without it, the shorter sequence's first step profiles. Either way every step the plain
    # run's, and the first shape keeps its plan.
    short = None
    for borrow in (True, False):
        model, spec = make("gpt2")
        lp = remat.hf.enable(model, budget="64MiB", borrow_plans=borrow)
        step(model, spec, 0, meter)
        step(model, spec, 1, meter)
        assert lp.is_planned()
        predicted = lp.predicted_peak_bytes
        short = dict(spec, seq=32)
        ref, _ = make("gpt2")
        expected = step(ref, short, 2, meter)
        got = step(model, short, 2, meter)
        same(expected, got)
        if borrow:
            assert lp.plan_borrowed and lp.profiling_steps == 0 and lp.predicted_peak_bytes == predicted
            assert 0 < got[2] <= predicted, (got[2], predicted)
        else:
            assert lp.profiling_steps == 1 and lp.is_planned()  # that shape's own profiling step
        step(model, spec, 3, meter)  # back to the first shape: its plan, no profiling
        assert lp.profiling_steps == 1 and not lp.plan_borrowed
        assert (lp.profiled_shapes, lp.borrowed_shapes) == ((1, 1) if borrow else (2, 0))


def test_set_budget_plans_again_without_profiling(meter, plain_runs, monkeypatch):
    model, spec = make("gpt2")
    plain_peak = plain_runs["gpt2"][1][2]
    lp = remat.hf.enable(model, budget=2 * plain_peak)
    step(model, spec, 0, meter)
    # Twice the plain step's peak: each layer as it measured fastest (for these tiny layers keeping and
    # checkpointing can measure alike, so which one is not asserted), within the budget.
    assert lp.predicted_peak_bytes <= 2 * plain_peak
    floor = lp.min_budget_bytes
    assert 0 < floor <= remat.min_step_budget(lp.chain, lp.context, "per-layer")
    lp.set_budget(floor)
    assert lp.choices != ["keep"] * 4 and lp.predicted_peak_bytes <= floor
    got = step(model, spec, 1, meter)
    same(plain_runs["gpt2"][1], got)
    assert lp.profiling_steps == 1
    assert got[2] <= floor * (1 + TOLERANCE)
    with pytest.raises(remat.InfeasibleBudget):
        lp.set_budget(floor - 1)
    with pytest.raises(remat.InfeasibleBudget):
        step(model, spec, 2, meter)
    # A budget planned before is not planned again while the figures the plan depends on are the same; a
    # figure changed plans it again (changed first here, as the steps above may have timed the rest again).
    calls = []
    plan_step = remat.layer_plan._core.plan_step
    monkeypatch.setattr(remat.layer_plan._core, "plan_step", lambda *a, **k: calls.append(a[2]) or plan_step(*a, **k))
    lp.context.rest_peak_bytes += 1
    lp.set_budget(floor)
    at_floor = str(lp.plan)
    lp.set_budget(2 * plain_peak)
    assert calls == [floor, 2 * plain_peak]
    lp.set_budget(floor)
    lp.set_budget(2 * plain_peak)
    lp.set_budget(floor)
    assert calls == [floor, 2 * plain_peak] and str(lp.plan) == at_floor and lp.predicted_peak_bytes <= floor
    lp.context.rest_peak_bytes += 1
    lp.set_budget(floor)
    assert calls == [floor, 2 * plain_peak, floor]


def free_copies_budget(lp, forwards, checkpoint_ms=None):
    """The budget of the per-layer plan whose forward operations are `forwards` ("Fa0@host", ...), on lp's chain
    made to plan from the budget alone, not from this machine's timings: keeping costs nothing (checkpointing
    `checkpoint_ms` a layer where given), copies are free and hidden as a GPU's side stream hides them (the CPU
    makes them at once). Checked below keeping every layer on the device."""
    chain = lp.chain
    for st in chain.stages:
        st.fwd_ms = st.bwd_ms = 0.0
        if checkpoint_ms is not None:
            st.checkpoint_fwd_ms = st.checkpoint_bwd_ms = checkpoint_ms
    chain.to_host_gb_per_s = chain.to_device_gb_per_s = 1e6
    chain.copies_at_once = False
    n = len(chain.stages)
    plan = remat.Plan.from_json(json.dumps(
        {"num_stages": n, "ops": [*forwards, "L", *(f"B{i}" for i in reversed(range(n)))]}))
    budget = remat.step_peak_bytes(chain, lp.context, plan)
    assert budget < remat.step_peak_bytes(chain, lp.context, remat.no_checkpoint(chain))
    return budget


def test_offload_lets_the_planner_keep_layers_offloaded(meter, plain_runs):
    # offload=True: "the planner may offload" (Hugging Face's offload=True always moves every layer's input).
    # On this small Llama the least budget is the LM head's, which offloading cannot lower; offloading lets
    # layers be kept (their saved tensors on the host) at budgets where keeping them on the device does not fit.
    model, spec = make("llama")
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
    same(plain_runs["llama"][0], step(model, spec, 0, meter))
    chain = lp.chain
    assert chain.can_offload() and all(st.offload is not None and st.offload.bytes > 0 for st in chain.stages)
    # The CPU's copies are made at once as the hooks run: the planner charges every one in full.
    assert chain.copies_at_once and '"copies_at_once": true' in chain.to_json()
    lp.set_budget(free_copies_budget(lp, ["Fa0@host", "Fa1@host", "Fa2@host", "Fa3"]))
    # Kept, offloaded whole or streamed (the same copies; streaming holds less in the layers' backward).
    assert all(c.startswith("keep") for c in lp.choices) and any(c.endswith(("@host", "@stream")) for c in lp.choices)
    for k in (1, 2):
        got = step(model, spec, k, meter)
        same(plain_runs["llama"][k], got)
        assert got[2] <= lp.predicted_peak_bytes * (1 + TOLERANCE), (lp.choices, got[2], lp.predicted_peak_bytes)
    assert lp.host_pool.peak_bytes >= lp.predicted_host_bytes > 0
    stats = lp.offload_stats
    assert stats["brought_back"] + stats["found_on_device"] == stats["offloaded"] > 0
    # Keeping only the matmuls costs nothing, keeping everything or checkpointing costs time: at the budget of
    # the layers' matmuls kept on the host, the planner keeps them there (remat's selective checkpointing
    # sends its kept tensors through the layer's Offload), bitwise.
    for st in chain.stages:
        st.fwd_ms = st.bwd_ms = 1.0
        st.checkpoint_fwd_ms = st.checkpoint_bwd_ms = 1e3
        st.policies[0].fwd_ms = st.policies[0].bwd_ms = 0.0
        assert st.policies[0].offload is not None and st.policies[0].offload.bytes > 0
    on_host = remat.Plan.from_json('{"num_stages": 4, "ops": ["Fk0[matmuls]@host", "Fk1[matmuls]@host", '
                                   '"Fk2[matmuls]@host", "Fk3[matmuls]", "L", "B3", "B2", "B1", "B0"]}')
    budget = remat.step_peak_bytes(chain, lp.context, on_host)
    lp.set_budget(budget)
    assert sum(c == "matmuls@host" for c in lp.choices) >= 2, lp.choices
    lp.host_pool.peak_bytes = 0
    for k in (1, 2):
        got = step(model, spec, k, meter)
        same(plain_runs["llama"][k], got)
        assert got[2] <= lp.predicted_peak_bytes * (1 + TOLERANCE), (lp.choices, got[2], lp.predicted_peak_bytes)
    assert lp.host_pool.peak_bytes >= lp.predicted_host_bytes > 0


def test_streamed_decoder_layers_give_the_plain_run_below_whole_layer_offloading(meter, plain_runs):
    # keep@stream on a Transformers decoder layer (its attention's transposed query and output go as they are):
    # each layer's saved tensors come back one by one ahead of their use, so that streaming every layer fits a
    # budget below what offloading every layer whole needs; the steps are the plain run's, within the
    # predicted peak.
    model, spec = make("llama")
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
    same(plain_runs["llama"][0], step(model, spec, 0, meter))
    chain = lp.chain
    assert all(st.offload.can_stream() for st in chain.stages)
    for st in chain.stages:  # the plan from the budget alone: keeping costs nothing, copies are free (and
        st.fwd_ms = st.bwd_ms = 0.0  # hidden, as a GPU's side stream hides them)
    chain.to_host_gb_per_s = chain.to_device_gb_per_s = 1e6
    chain.copies_at_once = False

    def every(suffix):
        return remat.Plan.from_json('{"num_stages": 4, "ops": [%s, "L", "B3", "B2", "B1", "B0"]}'
                                    % ", ".join(f'"Fa{i}{suffix}"' for i in range(4)))

    streamed = remat.step_peak_bytes(chain, lp.context, every("@stream"))
    assert streamed < remat.step_peak_bytes(chain, lp.context, every("@host"))
    lp.set_budget(streamed)
    assert sum(c in ("keep@stream", "keep@stream0") for c in lp.choices) >= 2, lp.choices
    for k in (1, 2):
        got = step(model, spec, k, meter)
        same(plain_runs["llama"][k], got)
        assert got[2] <= lp.predicted_peak_bytes, (lp.choices, got[2], lp.predicted_peak_bytes)
        # The windows are charged in full (the CPU's copies to the host land at once): 8% above, measured.
        assert lp.predicted_peak_bytes - got[2] < 0.15 * got[2], (got[2], lp.predicted_peak_bytes)
    assert lp.host_pool.peak_bytes == lp.predicted_host_bytes > 0


def test_saved_groups_planned_on_a_llama_give_the_plain_run(meter, plain_runs):
    # groups=True on a Transformers decoder layer (attention, MLP, norms): its saved groups are measured, and
    # a plan that sends or keeps them (recomputing a layer is made costly, so that one does) gives the plain
    # run's steps within the predicted peak and host bytes.
    model, spec = make("llama")
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10, groups=True)
    same(plain_runs["llama"][0], step(model, spec, 0, meter))
    chain = lp.chain
    assert all(0 < len(st.groups) <= remat._core.MAX_GROUPS for st in chain.stages), [len(st.groups) for st in chain.stages]
    for st in chain.stages:
        # The group runtime's own times, measured (its dispatch mode's cost beside the calls'), are what a group
        # assignment is charged: its forward, and its backward plus the groups it recomputes.
        assert st.groups_fwd_ms > 0 and st.groups_bwd_ms > 0, (st.groups_fwd_ms, st.groups_bwd_ms)
        g = len(st.groups)
        assert remat._core.group_cost(st, "k" * g).fwd_ms == st.groups_fwd_ms
        assert remat._core.group_cost(st, "r" + "k" * (g - 1)).bwd_ms == st.groups_bwd_ms + st.groups[0].recompute_ms
        st.groups_fwd_ms, st.groups_bwd_ms = st.checkpoint_fwd_ms, st.bwd_ms
        st.checkpoint_bwd_ms = st.bwd_ms + 100.0
        for g in st.groups:
            g.recompute_ms = 100.0 / len(st.groups)
        st.fwd_ms = st.checkpoint_fwd_ms + 5.0  # keeping a layer whole costs more than sending its groups
        st.policies[0].fwd_ms = st.policies[0].bwd_ms = 1e3
    chain.to_host_gb_per_s = chain.to_device_gb_per_s = 1e6
    chain.copies_at_once = False  # hidden, as a GPU's side stream hides them
    lp.set_budget(lp.min_budget_bytes + (8 << 20))
    assert any(c.startswith("{") for c in lp.choices), lp.choices
    lp.host_pool.peak_bytes = 0
    for k in (1, 2):
        got = step(model, spec, k, meter)
        same(plain_runs["llama"][k], got)
        assert got[2] <= lp.predicted_peak_bytes * (1 + TOLERANCE), (lp.choices, got[2], lp.predicted_peak_bytes)
    assert lp.host_pool.peak_bytes == lp.predicted_host_bytes, (lp.choices, lp.host_pool.peak_bytes)
    # Every layer under one assignment, each outcome alone and mixed, with copies landing only when waited for
    # (as a GPU's may): each step holds its prediction, within 0.5%. A group assignment's backward is Fa's
    # over the same tensors, charged Fa's gradients at its peak, and its output, which is no group, is gone
    # by then as Fa's is (before 2026-12-01 all its gradients and its output were charged: 4.5% above with
    # every group recomputed, 2.6% with every group sent).
    lp.offloads.engines[torch.device("cpu")] = CopyEngine(torch.device("cpu"), delay=100)
    n = len(chain.stages)
    for how in ("r", "k", "h", "rkh"):
        ops = [f"Fk{i}{{{(how * 10)[:len(chain.stages[i].groups)]}}}" for i in range(n)]
        ops += ["L"] + [f"B{i}" for i in reversed(range(n))]
        _, predicted = give_plan(lp, ops)
        got = step(model, spec, 1, meter)
        same(plain_runs["llama"][1], got)
        assert 0.995 * predicted <= got[2] <= predicted, (how, got[2], predicted)


def _grouped(make, meter):
    """make()'s model (a fresh one each call), its plain steps 0 and 1, and the same model under
    remat.hf.enable(offload=True, groups=True, offload_min_bytes=1 KiB), its profiling step checked against the
    plain one: (model, spec, plain steps, LayerPlan)."""
    model, spec = make()
    plain = [step(model, spec, k, meter) for k in range(2)]
    model, spec = make()
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, groups=True, offload_min_bytes=1 << 10)
    same(plain[0], step(model, spec, 0, meter))
    return model, spec, plain, lp


def _held_to_the_byte(model, spec, plain, lp, predicted, meter, what=""):
    """Step 1 with copies made at once and with copies delayed: each the plain run's, each holding exactly
    `predicted`. Returns the last step's peak."""
    for engine in (CopyEngine(torch.device("cpu"), hold=True), CopyEngine(torch.device("cpu"), delay=100)):
        lp.offloads.engines[torch.device("cpu")] = engine
        got = step(model, spec, 1, meter)
        same(plain[1], got)
        assert got[2] == predicted, (what, got[2], predicted)
    return got[2]


def test_a_group_assignments_recompute_is_charged_the_output_it_makes_anew(meter):
    # A group assignment's backward first recomputes what it did not keep, as a checkpointed layer's does, and
    # makes the layer's output again with it. Where the step let go of the first output (a BERT layer does not
    # save its own, so it goes once the next layer's backward is done), the one made anew is held as that
    # recompute ends. Charged before only where something else held the first (found 2026-12-05 by random
    # plans on RoBERTa, bench/architectures.py --random): a layer with every group recomputed after a layer on
    # the host held 39,104 bytes above its prediction (its recompute, charged a hidden state less than it held,
    # was the step's peak). Now it holds its prediction to the byte, with copies made at once and late, as the
    # same layer checkpointed whole does.
    def masked_lm():
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=128)
        return transformers.BertForMaskedLM(cfg).train(), dict(batch=4, seq=64, vocab=1000, loss="lm")

    model, spec, plain, lp = _grouped(masked_lm, meter)
    recomputed = "{" + "r" * len(lp.chain.stages[2].groups) + "}"
    predictions = []
    for way in (f"Fk2{recomputed}", "Fc2"):
        ops = ["Fa0", "Fa1@host", way, "Fc3"]
        ops += ["L", "Fa3", "B3"] + (["Fa2"] if way == "Fc2" else []) + ["B2", "B1", "B0"]
        _, predicted = give_plan(lp, ops)
        predictions.append(predicted)
        _held_to_the_byte(model, spec, plain, lp, predicted, meter, way)
    assert predictions[0] == predictions[1], predictions


def test_a_group_assignments_recompute_is_charged_the_groups_it_has_not_reached_part_way(meter):
    # A group assignment's recompute holds every group kept or sent from the recompute's start until it reaches
    # their call. A Qwen3 layer's forward peaks early (its rotary embedding), before its attention kernel,
    # output projection and MLP projections: kept, those wait beside that peak. The profile measures the plain
    # forward's peak before each call (SavedGroup.fwd_peak_before_bytes), and the model charges each such
    # point. Before (found 2026-12-05 by bench/architectures.py --random), only the recompute's two ends were:
    # this plan held 70,080 bytes above its prediction.
    def qwen3():
        torch.manual_seed(0)
        cfg = transformers.Qwen3Config(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                       use_cache=False)
        return transformers.Qwen3ForCausalLM(cfg).train(), dict(batch=4, seq=64, vocab=1000, loss="lm")

    model, spec, plain, lp = _grouped(qwen3, meter)
    groups = lp.chain.stages[3].groups
    peaks = [g.fwd_peak_before_bytes for g in groups]
    assert all(p >= 0 for p in peaks) and peaks == sorted(peaks), peaks
    ops = ["Fa0", "Fa1", "Fa2", "Fk3{" + "r" * (len(groups) - 4) + "kkkk}", "L", "B3", "B2", "B1", "B0"]
    plan, predicted = give_plan(lp, ops)
    held = _held_to_the_byte(model, spec, plain, lp, predicted, meter)
    # Without the figure, the model charges that recompute below what it held.
    unmeasured = remat.Chain.from_json(lp.chain.to_json())
    for g in unmeasured.stages[3].groups:
        g.fwd_peak_before_bytes = -1
    assert remat.step_peak_bytes(unmeasured, lp.context, plan) < held


@pytest.mark.parametrize("experts", ["eager", None])
def test_mixture_of_experts_layers_routed_differently_each_step_give_the_plain_run(experts, meter):
    # A Mixtral (router jitter noise: a random draw in each layer's forward) whose experts run as transformers'
    # eager loop, one call per expert hit, so that what a layer calls and saves follows each step's routing, or
    # as transformers' default (grouped_mm where it can dispatch: every expert in one call). Each way of running
    # a layer (planned at the least budget, its groups recomputed, kept and sent, streamed, its matmuls on the
    # host) gives the plain run's steps: the recompute replays the step's own draw and routing, whatever the
    # profiling step's were; each peak within TOLERANCE of its prediction.
    hit = []

    def make_moe():
        torch.manual_seed(0)
        cfg = transformers.MixtralConfig(vocab_size=1000, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=16,
                                         num_experts_per_tok=2, router_jitter_noise=0.1, max_position_embeddings=128,
                                         experts_implementation=experts)
        model = transformers.MixtralForCausalLM(cfg).train()
        for layer in model.model.layers:  # the experts hit by each call of a layer's forward, the recompute's too
            moe = getattr(layer, "mlp", None) or layer.block_sparse_moe  # (transformers 4.x's name)
            moe.gate.register_forward_hook(lambda _, args, out: hit.append(int(torch.bincount(
                (out[2] if isinstance(out, tuple) else out.topk(2).indices).flatten(), minlength=16).gt(0).sum())))
        return model

    spec = dict(batch=2, seq=16, vocab=1000, loss="lm")
    plain = make_moe()
    want = [step(plain, spec, k, meter) for k in range(3)]
    model = make_moe()
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=1 << 10, groups=True)
    hit.clear()
    same(want[0], step(model, spec, 0, meter))
    profiled = list(hit)
    n = len(lp.chain.stages)
    assert all(len(st.groups) > 0 for st in lp.chain.stages)
    ways = [None,  # the planner's own, at the least budget
            [f"Fk{i}{{{('rkh' * 10)[:len(lp.chain.stages[i].groups)]}}}" for i in range(n)],
            [f"Fa{i}@stream" for i in range(n)], [f"Fk{i}[matmuls]@host" for i in range(n)]]
    for way in ways:
        if way is None:
            lp.set_budget(lp.min_budget_bytes)
            predicted = lp.predicted_peak_bytes
        else:
            predicted = give_plan(lp, way + ["L"] + [f"B{i}" for i in reversed(range(n))])[1]
        for k in (1, 2):
            hit.clear()
            got = step(model, spec, k, meter)
            same(want[k], got)
            assert got[2] <= predicted * (1 + TOLERANCE), (str(lp.plan), got[2], predicted)
            if experts == "eager":  # each layer's routing differs from the profiling step's
                assert hit[:n] != profiled[:n], (hit, profiled)


@pytest.mark.parametrize("frozen_embeddings", [False, True])
def test_a_mask_made_before_the_layers_is_charged_once_and_only_while_a_layer_holds_it(frozen_embeddings, meter):
    # Gemma-2 makes its sliding-window and full-attention masks before its layers; the first layer takes the
    # sliding one, the second the full one. Both are in what the part before the layers holds from the chain's
    # start (StepContext.before_saved_bytes); the full one was charged again as what the layers take beside their
    # input (side_bytes): found 2026-12-04, 64 KiB here, 1 GiB on a real Gemma-2 (sequence 8,192, batch 8, bf16).
    # Read now from the tensors alive when the first layer is called: charged once. Nothing but the layers holds
    # them past the model's forward (StepContext.taken_bytes): a layer that takes one holds it until its backward
    # is done where it is checkpointed (its checkpoint holds its arguments); kept, its graph (an additive mask's)
    # does not save it; so are the position ids. Before (2026-12-06) they were charged to the step's end
    # whatever the plan: every layer kept, 131,488 bytes (1%) high here. (Every plan holds 96 bytes above its
    # prediction: on the CPU only, the three Python numbers each layer's graph saves outside the saved-tensor
    # hooks, docs/python.md, Limits.) With the embeddings frozen (the layers' input takes no gradient, as under
    # LoRA), the first layer's backward is the step's last: what is let go of by the step's end was let go of
    # once it was done (before, not read there, and the sliding mask was charged to the step's end).
    def gemma2():
        torch.manual_seed(0)
        cfg = transformers.Gemma2Config(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                        max_position_embeddings=256, sliding_window=16, attn_implementation="eager")
        model = transformers.Gemma2ForCausalLM(cfg).train()
        model.get_input_embeddings().requires_grad_(not frozen_embeddings)
        return model

    spec = dict(batch=4, seq=64, vocab=1000, loss="lm")
    want, model, lp = planned_beside_plain(gemma2, spec, meter)
    mask = 4 * 64 * 64 * 4  # batch, 1, sequence, sequence; fp32
    ctx = lp.context
    assert ctx.side_bytes == 0 and ctx.before_saved_bytes >= 2 * mask, (ctx.side_bytes, ctx.before_saved_bytes)
    # Each taken by every other layer (sliding, full, sliding, full), saved by none; and the rotary embedding's
    # cosines and sines (1, sequence, head size; fp32), taken and saved by every layer (held until the first
    # layer's backward whatever its way: in the part before the layers' backward no more), one entry; and the
    # position ids (1, sequence; int64), taken by every layer, saved by none.
    rotary = 64 * 16 * 4
    assert sorted(zip(ctx.taken_bytes, ctx.taken_by, ctx.taken_saved_by)) == [
        (64 * 8, [True] * 4, [False] * 4), (2 * rotary, [True] * 4, [True] * 4),
        (mask, [False, True, False, True], [False] * 4), (mask, [True, False, True, False], [False] * 4)], \
        (ctx.taken_bytes, ctx.taken_by, ctx.taken_saved_by)
    n = len(lp.chain.stages)

    def per_layer(ways):
        return ([f"F{w}{i}" for i, w in enumerate(ways)] + ["L"] +
                [x for i in reversed(range(n)) for x in ((f"Fa{i}",) if ways[i] == "c" else ()) + (f"B{i}",)])

    # Every layer kept (both let go of as the model's forward returns), every layer checkpointed (each held until
    # the backward of the first layer that takes it), and the first two kept, the last two checkpointed (each held
    # until the backward of a later layer).
    for ways in ("aaaa", "cccc", "aacc"):
        _, predicted = give_plan(lp, per_layer(ways))
        got = step(model, spec, 1, meter)
        same(want[1], got)
        assert predicted <= got[2] <= predicted + 128, (ways, got[2], predicted)


@pytest.mark.parametrize("attentions", [False, True])
def test_what_a_layer_hands_on_beside_its_output_is_charged_only_where_something_holds_it(attentions, meter):
    # GPT-J's blocks return their attention weights beside their output (BLOOM's too; GPT-J's no more from
    # transformers 5.24, where every figure below holds with nothing handed on); the model's code drops them
    # unless the caller asks for attentions (output_attentions=True: collected, held to the step's end). Dropped,
    # they are charged nothing (side_bytes 0): before (found 2026-12-04) each was charged with a gradient from the
    # chain's start through the last layer's backward, 2 MiB here, and every plan was 17-31% below its
    # prediction. The rest's readings are taken above what the last two layers handed on and the rest lets go of
    # (the model's variable holds each until the next call returns), which the model charges nowhere: with every
    # layer checkpointed (the profiling step) the prediction is exact, every layer kept at most 1% high (the
    # weights kept layers save are theirs). Collected, each is charged its storage.
    def gptj():
        torch.manual_seed(0)
        cfg = transformers.GPTJConfig(vocab_size=1000, n_embd=64, n_layer=4, n_head=4, rotary_dim=8, n_positions=128)
        return transformers.GPTJForCausalLM(cfg).train()

    spec = dict(batch=4, seq=64, vocab=1000, loss="lm")

    def make_batch(spec, k):
        return dict(batch(spec, k), output_attentions=True) if attentions else batch(spec, k)

    plain = gptj()
    handed = []  # whether a block hands on anything beside its output
    hook = plain.transformer.h[0].register_forward_hook(
        lambda _, args, out: handed.append(isinstance(out, tuple) and any(torch.is_tensor(t) for t in out[1:])))
    want = [step(plain, spec, k, meter, make_batch=make_batch) for k in range(3)]
    hook.remove()
    collected = attentions and handed[0]
    model = gptj()
    lp = remat.hf.enable(model, budget=1 << 40)
    same(want[0], step(model, spec, 0, meter, make_batch=make_batch))
    chain, ctx = lp.chain, lp.context
    weights = 4 * 4 * 64 * 64 * 4  # one layer's attention weights: batch, heads, sequence, sequence; fp32
    assert ctx.side_bytes == (4 * weights if collected else 0), ctx.side_bytes
    every = remat.step_peak_bytes(chain, ctx, remat.checkpoint_all(chain))
    assert every * 0.999 <= ctx.checkpoint_all_peak_bytes <= every * 1.001, (ctx.checkpoint_all_peak_bytes, every)
    n = len(chain.stages)
    _, predicted = give_plan(lp, [f"Fa{i}" for i in range(n)] + ["L"] + [f"B{i}" for i in reversed(range(n))])
    for k in (1, 2):
        got = step(model, spec, k, meter, make_batch=make_batch)
        same(want[k], got)
    if not collected:
        # (Up to 128 bytes above: on the CPU only, the Python numbers the blocks' graphs save outside the
        # saved-tensor hooks, docs/python.md, Limits; hidden until 2026-12-06 by the attention mask and the
        # position ids, 66,048 bytes charged to the step's end where the model lets go of them as its forward
        # returns: StepContext.taken_bytes.)
        assert got[2] - 128 <= predicted <= got[2] * 1.01, (got[2], predicted)
    else:  # a kept layer's weights are its saved tensors too: charged twice (a limit, on the safe side)
        assert got[2] <= predicted <= got[2] + 4 * weights + weights // 2, (got[2], predicted)


@pytest.mark.skipif(not hasattr(transformers, "xLSTMConfig"), reason="this transformers has no xLSTM")
def test_a_state_a_layer_hands_on_in_a_tuple_is_read_as_the_rest_lets_go_of_it(meter):
    # xLSTM's blocks return (output, (C, n, m)): their recurrent state, in a tuple, slices of tensors their graph
    # saves. The model's code holds the last block's until its forward returns, in the rest of the step, whose
    # readings are taken above what the last layer handed on and the rest lets go of. Before (found 2026-12-06 by
    # bench/architectures.py), a tuple handed on was not looked into: the rest's readings, taken with every layer
    # checkpointed (the state's storages the layer's own, let go of in the rest), took that letting go as the
    # rest's own, and both plans here were 35,264 bytes above their predictions (0.22% every layer kept, 0.63%
    # every layer checkpointed; 192 bytes now).
    def xlstm():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(transformers.xLSTMConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_heads=4, use_cache=False)).train()

    spec = dict(batch=4, seq=64, vocab=1000, loss="lm")
    want, model, lp = planned_beside_plain(xlstm, spec, meter)
    n = len(lp.chain.stages)
    for way in ("keep", "checkpoint"):
        _, predicted = give_plan(lp, per_layer_ops([way] * n))
        got = step(model, spec, 1, meter)
        same(want[1], got)
        # (48 bytes a layer above here, not located: likely the Python numbers a block's graph saves outside the
        # saved-tensor hooks, on the CPU only; docs/python.md, Limits.)
        assert predicted <= got[2] <= predicted + 48 * n, (way, got[2], predicted)


def test_a_layer_inside_a_layer_runs_as_part_of_it(meter):
    # Zamba2's hybrid layers each hold a Mamba layer, both GradientCheckpointingLayers, the inner one called
    # inside the outer one's call. remat plans the outermost only, and runs the inner one as part of it (as its
    # plan runs it: kept, recomputed, sent). Before (found 2026-12-06 by bench/architectures.py) both were planned,
    # and the profiling step failed with an IndexError. Bitwise with every layer kept and every layer recomputed.
    def zamba2():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(transformers.Zamba2Config(
            vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=128, layers_block_type=["mamba", "hybrid"] * 2, mamba_d_state=8, mamba_expand=2,
            n_mamba_heads=2, mamba_headdim=64, attention_head_dim=16, kv_channels=16, adapter_rank=8,
            use_cache=False)).train()

    spec = dict(batch=2, seq=16, vocab=1000, loss="lm")
    want, model, lp = planned_beside_plain(zamba2, spec, meter)
    assert [type(m).__name__ for m in lp.layers] == ["Zamba2MambaDecoderLayer", "Zamba2HybridLayer"] * 2
    for way in ("keep", "checkpoint"):
        give_plan(lp, per_layer_ops([way] * 4))
        same(want[1], step(model, spec, 1, meter))


def test_bad_budgets_and_models_are_refused():
    model, _ = make("bert")
    with pytest.raises(ValueError, match="positive"):
        remat.hf.enable(model, budget=0)
    with pytest.raises(ValueError, match="not a size"):
        remat.hf.enable(model, budget="lots")
    with pytest.raises(TypeError, match="bytes"):
        remat.hf.enable(model, budget=1.5)
    with pytest.raises(TypeError, match="no GradientCheckpointingLayer"):
        remat.hf.enable(torch.nn.Linear(2, 2), budget=1 << 20)
    # Arguments of the wrong kind are refused by name at enable, the model left as it was. Before (found
    # 2026-12-07): a plan string, an AttributeError; policies="matmuls", "the plan keeps with policy 'm'"; an
    # exclude text the planners cannot read, a ValueError at the end of the first step's backward pass; repeats
    # 2.5, a TypeError inside the profiling step; max_host_bytes=-3, "the budget must be a positive number".
    for kwargs, error, words in [
            (dict(plan="Fc0 Fc1 Fc2 Fc3"), TypeError, "plan must be a remat.Plan .* got str 'Fc0 Fc1"),
            (dict(budget=1 << 20, policies="matmuls"), TypeError, "policies must be a sequence .* 'matmuls'"),
            (dict(budget=1 << 20, exclude="Fk"), TypeError, "exclude must be a sequence .* str 'Fk'"),
            (dict(budget=1 << 20, exclude=["Fk", "Fc"]), ValueError, "remat.hf.enable: cannot exclude 'Fc'"),
            (dict(budget=1 << 20, exclude=["Fk", 3]), TypeError, "exclude must be a sequence .* int 3 among them"),
            (dict(budget=1 << 20, repeats=2.5), TypeError, "repeats must be an int >= 1, got float 2.5"),
            (dict(budget=1 << 20, offload=True, max_host_bytes=-3), ValueError,
             "max_host_bytes must be a positive number of bytes, got -3")]:
        with pytest.raises(error, match=words):
            remat.hf.enable(model, **kwargs)
        assert not _remat_left(model), (kwargs, _remat_left(model))
    lp = remat.hf.enable(model, budget=1 << 20, exclude=(e for e in ("Fk[tags]", "Fk[matmuls]")))
    assert lp.exclude == ["Fk[tags]", "Fk[matmuls]"]  # a generator read once


def test_remat_enable_refuses_a_cache_in_training_by_name_and_trains_with_it_off(meter):
    # remat.enable (not remat.hf.enable, which turns the cache off) on a Llama whose config keeps its KV cache on:
    # each run of a layer appends to the cache, and the profiler runs each layer again. Refused at the first
    # layer's call, naming it; before (found 2026-12-07), "Trying to backward through the graph a second time"
    # from inside the profiling step. With the cache off the same model trains as the plain run.
    plain, spec = make("llama")
    model, _ = make("llama")
    assert model.config.use_cache
    lp = remat.enable(model, list(model.model.layers), budget=1 << 40)
    with pytest.raises(ValueError, match=r"layer 0 \(LlamaDecoderLayer\) was called in training with a cache "
                                         r"\(past_key_values=DynamicCache\)"):
        step(model, spec, 0, meter)
    assert all(p.grad is None for p in model.parameters())
    for m in (plain, model):
        m.config.use_cache = False
    for k in range(2):
        same(step(plain, spec, k, meter), step(model, spec, k, meter))
    assert lp.is_planned()


def test_trainer_trains_with_it(tmp_path, meter):
    from torch.utils.data import Dataset

    class Data(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 1000, (32,), generator=g)
            return dict(input_ids=ids, labels=ids)

    def train(plan):
        model, _ = make("gpt2")
        lp = remat.hf.enable(model, budget="64MiB") if plan else None
        args = transformers.TrainingArguments(output_dir=str(tmp_path / ("p" if plan else "n")), max_steps=3,
                                              per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
                                              report_to=[], save_strategy="no", use_cpu=True, seed=7,
                                              dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
        trainer.train()
        return model, lp, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    plain_model, _, plain_losses = train(False)
    model, lp, losses = train(True)
    assert lp.is_planned()
    assert losses == plain_losses
    for p, q in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(p, q)



def _compiled_gpt2(how):
    # GPT-2 without dropout: torch.compile draws dropout masks by its own generator, and a graph with
    # checkpointing draws them differently from one without (Hugging Face's own checkpointing too). Dynamo's
    # caches emptied: the tests' many models, shapes and choices would pass its recompile limit (8 per function),
    # past which it runs a function eagerly.
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=4, n_head=4, n_positions=128, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    layers = model.transformer.h
    for i in range(len(layers)):
        if how == "layer.compile()":
            layers[i].compile()
        elif how == "torch.compile(layer)":
            layers[i] = torch.compile(layers[i])
    return model, dict(batch=4, seq=64, vocab=1000, loss="lm")


def _refused_where_the_whole_call_is_wrapped(how, meter):
    """True where the installed transformers checkpoints a layer's whole call (before 5.23: remat.hf.
    wraps_whole_call), after checking that remat refuses layers compiled on their own there, at enable() and,
    for layer.compile() after it, at the step, with a TypeError naming what would work, the model untouched."""
    if not remat.hf.wraps_whole_call():
        return False
    model, spec = _compiled_gpt2(how)
    with pytest.raises(TypeError, match=r"compiled on its own.*transformers 5\.23 or later"):
        remat.hf.enable(model, budget=1 << 40)
    assert getattr(model, "_remat_layer_plan", None) is None
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if how == "layer.compile()":
        model, spec = _compiled_gpt2(None)
        remat.hf.enable(model, budget=1 << 40)
        model.transformer.h[1].compile()
        with pytest.raises(TypeError, match="compiled on its own"):
            step(model, spec, 0, meter)
    return True


def test_layers_compiled_on_their_own_are_refused_where_transformers_wraps_the_whole_call(monkeypatch):
    # Before 5.23 Hugging Face's hook runs around a compiled layer's graph, not inside it: remat cannot run a
    # plan inside the graph nor profile it as it runs (predictions 12.8% high, a policy not bitwise, and on
    # PyTorch 2.11 torch's CheckpointError, measured with 4.53.3 and 5.17.0), and says so. CI's transformers
    # wraps the forward; the answer of the check is replaced to test the refusal here (the compiled tests
    # below check it on the old versions themselves, through scripts/hf-versions).
    monkeypatch.setattr(remat.hf, "wraps_whole_call", lambda: True)
    model, _ = _compiled_gpt2("torch.compile(layer)")
    with pytest.raises(TypeError, match=r"layer GPT2Block is compiled on its own, and transformers .* 5\.23 or later"):
        remat.hf.enable(model, budget=1 << 40)
    assert getattr(model, "_remat_layer_plan", None) is None
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    model, _ = _compiled_gpt2(None)  # uncompiled layers are planned as before
    assert remat.hf.enable(model, budget=1 << 40) is model._remat_layer_plan




@pytest.mark.parametrize("how", ["layer.compile()", "torch.compile(layer)"])
def test_compiled_layers_run_the_plan_inside_their_graphs(how, meter):
    # Layers compiled one by one run remat's plan inside their compiled graphs (dynamo traces the checkpointing
    # the plan asks for, as selective checkpointing's context for a policy): every step after the profiling one
    # is bitwise the plain compiled run's; the profiling step runs the layers eagerly (equal to rounding); a new
    # plan recompiles the layers' graphs (the choice is guarded), and its memory shows the choice was run.
    if _refused_where_the_whole_call_is_wrapped(how, meter):
        return
    plain_model, spec = _compiled_gpt2(how)
    plain = [step(plain_model, spec, k, meter) for k in range(4)]
    model, _ = _compiled_gpt2(how)
    lp = remat.hf.enable(model, budget="1GiB", policies=())  # keep or checkpoint
    first = step(model, spec, 0, meter)
    assert lp.is_planned() and lp.profiling_steps == 1
    for g, h in zip(first[1], plain[0][1]):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)
    # Keeping a layer made free in the profile: the planner keeps as many layers as the budget fits, whatever
    # the timings of a loaded machine say (a checkpointed plan measured fastest under CI's load once).
    for st in lp.chain.stages:
        st.fwd_ms = st.bwd_ms = 0.0
    lp.set_budget(1 << 40)  # every layer kept now: its predicted peak
    lo, hi = lp.min_budget_bytes, lp.predicted_peak_bytes
    budget = (lo + hi) // 2
    lp.set_budget(budget)
    assert "keep" in lp.choices and "checkpoint" in lp.choices, (lp.choices, lo, hi)
    mixed = [step(model, spec, k, meter) for k in (1, 2)]
    for got, want in zip(mixed, plain[1:3]):
        same(got, want)
        assert got[2] <= budget * (1 + TOLERANCE), (got[2], budget)
    # A new plan, every layer kept: the layers' graphs recompile (the choice is guarded), more memory held.
    lp.set_budget(hi)
    assert lp.choices == ["keep"] * 4
    again = step(model, spec, 3, meter)
    same(again, plain[3])
    assert again[2] > mixed[1][2], (again[2], mixed[1][2])
    # A second call before the backward pass runs inside the first's step, checkpointed in its compiled graph
    # (before, through remat's eager dispatch: equal to rounding, not bitwise).
    want = two_calls(plain_model, 4, "one", meter, first=64, second=64)
    with pytest.warns(UserWarning, match="earlier training call"):
        same(two_calls(model, 4, "one", meter, first=64, second=64), want)
    lp.remove()


@pytest.mark.parametrize("how", ["layer.compile()", "torch.compile(layer)"])
def test_compiled_layers_are_profiled_as_they_run(how, meter):
    # Issue 45: a compiled layer is profiled through its compiled graph under each choice (profiled eagerly, the
    # prediction overstated the compiled step by 15-21%, and the plan checkpointed more than the budget needed).
    # The planned steps run inside the layers' graphs and are measured from the model's outputs:
    # last_peak_bytes is the step's peak and the prediction holds within 2% (measured: exactly).
    if _refused_where_the_whole_call_is_wrapped(how, meter):
        return
    plain_model, spec = _compiled_gpt2(how)
    plain = [step(plain_model, spec, k, meter) for k in range(3)]
    model, _ = _compiled_gpt2(how)
    budget = int(0.8 * plain[2][2])  # profiled eagerly: 12.5% overstated here
    lp = remat.hf.enable(model, budget=budget)
    step(model, spec, 0, meter)
    assert lp.is_planned() and lp.profiling_steps == 1
    assert len(model.transformer.h) == 4 and set(lp.compiled_layers) == {0, 1, 2, 3}
    got = [step(model, spec, k, meter) for k in (1, 2)]
    for a, b in zip(got, plain[1:]):
        same(a, b)
    measured, predicted = got[1][2], lp.predicted_peak_bytes
    assert lp.last_peak_bytes == measured, (lp.last_peak_bytes, measured)
    assert abs(measured / predicted - 1) <= remat.PREDICTION_TOLERANCE, (measured, predicted, lp.choices)
    assert lp.prediction_error is not None and abs(lp.prediction_error) <= remat.PREDICTION_TOLERANCE
    assert measured <= budget
    lp.remove()


def test_compiled_layers_run_a_given_plan_with_a_policy(meter):
    # A given plan with every choice, the matmuls policy included (selective checkpointing's context, traced
    # by dynamo as a constant), from the first step: bitwise the plain compiled run, in less memory.
    if _refused_where_the_whole_call_is_wrapped("layer.compile()", meter):
        return
    plain_model, spec = _compiled_gpt2("layer.compile()")
    plain = [step(plain_model, spec, k, meter) for k in range(2)]
    model, _ = _compiled_gpt2("layer.compile()")
    from conftest import per_layer_plan
    remat.hf.enable(model, plan=per_layer_plan(["checkpoint", "matmuls", "keep", "matmuls"]))
    got = [step(model, spec, k, meter) for k in range(2)]
    for a, b in zip(got, plain):
        same(a, b)
    keep_model, _ = _compiled_gpt2("layer.compile()")
    remat.hf.enable(keep_model, plan=per_layer_plan(["keep"] * 4))
    kept = step(keep_model, spec, 1, meter)
    same(kept, plain[1])
    assert got[1][2] < kept[2]


def test_compiled_layers_are_offloaded_around_their_graphs(meter):
    # offload=True on layers compiled one by one: the profile measures what each compiled graph saves (the
    # saved-tensor hooks see the compiled function's saves), and the planner may send it to the host, the
    # layer's Offload opened around its compiled call (remat.dispatch.around_compiled), its base choice run
    # inside the graph. Every planned step is bitwise the plain compiled run, within the predicted peak, the
    # tensors sent and brought back; before, a compiled layer had no offload figures and was never offloaded.
    # (torch.compile(layer)'s wrappers: test_apply.py's test of every offloaded choice.)
    how = "layer.compile()"
    if _refused_where_the_whole_call_is_wrapped(how, meter):
        return
    plain_model, spec = _compiled_gpt2(how)
    plain = [step(plain_model, spec, k, meter) for k in range(3)]
    model, _ = _compiled_gpt2(how)
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10, policies=())
    step(model, spec, 0, meter)
    assert set(lp.compiled_layers) == {0, 1, 2, 3}
    chain = lp.chain
    # Its copies start once its graph's forward has run (the graph saves its tensors at its end): the planner
    # hides them behind the next layer's forward alone.
    assert all(st.offload is not None and st.offload.bytes > 0 and not st.offload.can_stream() and
               st.offload.after_forward and st.checkpoint_offload.after_forward for st in chain.stages)
    # Checkpointing costs much here: the layers below the budget of two of them kept on the host are kept.
    lp.set_budget(free_copies_budget(lp, ["Fa0@host", "Fa1@host", "Fa2", "Fa3"], checkpoint_ms=1e3))
    assert lp.choices.count("keep@host") >= 1 and "checkpoint" not in lp.choices, lp.choices
    for k in (1, 2):
        got = step(model, spec, k, meter)
        same(got, plain[k])
        assert got[2] <= lp.predicted_peak_bytes * (1 + remat.PREDICTION_TOLERANCE), \
            (lp.choices, got[2], lp.predicted_peak_bytes)
        stats = lp.offload_stats
        assert stats["brought_back"] + stats["found_on_device"] == stats["offloaded"] > 0, stats
    assert lp.host_pool.peak_bytes >= lp.predicted_host_bytes > 0
    lp.remove()


# The prediction tests' Llama (hidden 128) and batch.
_PREDICTION_SPEC = dict(batch=4, seq=64, vocab=1000, loss="lm")


def _prediction_llama():
    torch.manual_seed(0)
    m, _ = llama(hidden=128)
    m.train()
    return m


@pytest.mark.parametrize("amp", ["fp32", "bf16"])
def test_predictions_hold_within_two_percent_in_fp32_and_cpu_bf16_autocast(amp, meter):
    # Issue 45: a Llama planned between Hugging Face's per-layer peak and the plain peak came in 2.6-6.9% below
    # its predictions, which charged each layer's backward with all its parameters' gradients at its peak;
    # gradients made by the step (zero_grad(set_to_none=True), as a Trainer does) arrive as the backward goes,
    # and its peak comes before the last of them (Stage::bwd_grads_tmp_bytes, measured). Under autocast a
    # checkpointed layer runs with autocast's weight cache off (its recompute too), so that it does not hold its
    # weights' bf16 copies until the autocast region ends. Every step is the plain run's, bitwise.
    make_llama, spec = _prediction_llama, _PREDICTION_SPEC

    def run(model, k):
        return step(model, spec, k, meter, amp=amp == "bf16")

    plain_model = make_llama()
    plain = [run(plain_model, k) for k in range(3)]
    hf_model = make_llama()
    hf_checkpointing(hf_model)
    hf_peak = run(hf_model, 1)[2]
    del plain_model, hf_model
    gc.collect()
    model = make_llama()
    lp = remat.hf.enable(model, budget=plain[1][2])
    same(plain[0], run(model, 0))
    assert lp.prediction_error is None
    # The floor is at most the peak of the one switch remat replaces.
    assert lp.min_budget_bytes <= hf_peak, (lp.min_budget_bytes, hf_peak)
    # Each layer's backward peaks before its last gradient is made: measured above the peak with the gradients
    # already there, below that plus all of them.
    for st, grads in zip(lp.chain.stages, lp.context.stage_grads_bytes):
        assert st.bwd_tmp_bytes <= st.bwd_grads_tmp_bytes < st.bwd_tmp_bytes + grads, (st.bwd_tmp_bytes, grads)
    for where in (0.2, 0.6):
        budget = int(hf_peak + where * (plain[1][2] - hf_peak))
        lp.set_budget(budget)
        assert "checkpoint" in lp.choices or "matmuls" in lp.choices, lp.choices
        runs = [run(model, k) for k in (1, 2)]
        for k in (1, 2):
            same(plain[k], runs[k - 1])
        predicted, measured = lp.predicted_peak_bytes, runs[1][2]
        assert measured <= budget, (lp.choices, measured, budget)
        assert abs(measured - predicted) <= 0.02 * predicted, (lp.choices, measured, predicted)
        assert lp.last_peak_bytes == measured and lp.prediction_error == pytest.approx(measured / predicted - 1)


def test_a_backward_inside_the_autocast_region_holds_no_kept_layers_casts(meter):
    # Autocast's cache keeps the casts of weights until the caller's autocast region ends. remat runs every layer
    # with the cache off in training, kept or not, so where the caller runs its backward inside the region a kept
    # layer's bf16 weights go with its graph. Before (found 2026-12-03), a kept layer left them in the cache:
    # checkpointing the first three layers and keeping the last held 491,520 bytes (6.0%) above the prediction,
    # the last layer's weights through the other layers' backward passes.

    make_llama, spec = _prediction_llama, _PREDICTION_SPEC

    def run(model, k):
        return step(model, spec, k, meter, amp=True, backward_inside=True)

    plain_model = make_llama()
    plain = [run(plain_model, k) for k in range(3)]
    del plain_model
    model = make_llama()
    lp = remat.hf.enable(model, budget=1 << 40, replan_on_overshoot=False)
    same(plain[0], run(model, 0))
    assert [st.autocast_cache_bytes for st in lp.chain.stages] == [0] * 4
    for ways in (["checkpoint"] * 3 + ["keep"], ["keep"] * 4):
        _, predicted = give_plan(lp, per_layer_ops(ways))
        runs = [run(model, k) for k in (1, 2)]
        for k in (1, 2):
            same(plain[k], runs[k - 1])
        assert abs(lp.prediction_error) <= 0.001, (ways, runs[1][2], predicted)


# ---------------------------------------------------------------------------------------------------------------
# What users do with an enabled model: copy it, save it, disable it, let Hugging Face enable its own.

def test_a_copy_of_a_planned_model_carries_its_plan_and_trains_as_the_plain_run(meter, tmp_path):
    # copy.deepcopy (an EMA copy, TRL's reference model) and torch.save raised on the planner's objects and
    # remat's local functions. The copy is a working model with its own LayerPlan: the plan carried, nothing
    # profiled again, every step the plain run's; the original plans on, apart.
    import copy
    plain_model, spec = make("gpt2")
    plain = [step(plain_model, spec, k, meter) for k in range(3)]
    model, spec = make("gpt2")
    lp = remat.hf.enable(model, budget="1GiB")
    same(step(model, spec, 0, meter), plain[0])  # the profiling step
    lp.set_budget(lp.min_budget_bytes)
    assert "keep" not in lp.choices, lp.choices
    twin = copy.deepcopy(model)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    for m in (twin, loaded):
        clp = m._remat_layer_plan
        assert clp is not lp and clp.model is m and clp.is_planned() and clp.choices == lp.choices
        assert all(a is b for a, b in zip(clp.layers, m.transformer.h))
        same(step(m, spec, 1, meter), plain[1])
        assert clp.profiling_steps == 1 and 0 < clp.last_peak_bytes <= lp.predicted_peak_bytes * (1 + TOLERANCE)
    # A model saved before a shape had a field (here the plans it keeps, LayerPlan._planned), or before the
    # LayerPlan had the options added since it first pickled: loaded, each field has its default, the step is
    # the plain run's and the plan can change.
    # (and before step keys named the frozen parameters and the autocast state: two parts, not four; and before
    # they named the parameters' dtypes and shapes: the frozen indices alone as the third part)
    for old_key in (lambda key: key[:2], lambda key: (key[0], key[1], key[2][0], key[3])):
        old = copy.deepcopy(model)
        olp = old._remat_layer_plan
        for shape in olp._shapes.values():
            del shape.planned_chain, shape.planned_at
        olp._shapes = {old_key(key): shape for key, shape in olp._shapes.items()}
        for key, shape in olp._shapes.items():
            shape.key = key
        for name in ("replan_on_oom", "replan_on_overshoot", "groups", "compiled_layers", "fit", "_budget_text",
                     "_param_form", "_forms", "_form_id"):
            delattr(olp, name)
        torch.save(old, path)
        loaded_model = torch.load(path, weights_only=False)
        loaded = loaded_model._remat_layer_plan
        assert not loaded.groups and loaded.compiled_layers == set() and loaded.fit is None
        same(step(loaded_model, spec, 1, meter), plain[1])
        # carried, not profiled again
        assert list(loaded._shapes) == [loaded._last.key] and loaded._last.key[2] == ((), 0), loaded._last.key
    loaded.set_budget(1 << 40)
    assert loaded.is_planned() and loaded.predicted_peak_bytes <= 1 << 40
    assert all(s.planned_chain is s.chain and len(s.planned_at) == 1 for s in loaded._shapes.values())
    twin.gradient_checkpointing_disable()
    assert "_remat_layer_plan" not in twin.__dict__ and lp.is_planned()
    same(step(model, spec, 2, meter), plain[2])
    same(step(twin, spec, 2, meter), plain[2])


def _frozen(model, k):
    """Fine-tuning's freezing: the embeddings and the first k layers of a Llama require no grad."""
    model.model.embed_tokens.requires_grad_(False)
    for layer in model.model.layers[:k]:
        layer.requires_grad_(False)
    return model


def lora_llama():
    """The test Llama as a LoRA model of peft's (r 8 on the attention's query and value, dropout 0.1), in training
    mode, and its batch's spec (bench/frozen_layers.py's too)."""
    import peft
    model, spec = make("llama")
    torch.manual_seed(5)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    return peft.get_peft_model(model, config).train(), spec


def _fastest_then_least(model, spec, lp, meter, plain_fastest, plain_least, below, above_bytes=0):
    """A step under the budget in force (above every plan: the fastest plan, which the measured times choose),
    then one at the least budget, each the plain run's (steps 1 and 2 of `step`, as plain_fastest and
    plain_least are), each at most `above_bytes` above its prediction, the first also within `below` (a share)
    under it."""
    for k, plain, low in ((1, plain_fastest, 1 - below), (2, plain_least, 0)):
        if k == 2:
            lp.set_budget(lp.min_budget_bytes)
        got = step(model, spec, k, meter)
        same(plain, got)
        assert low * lp.predicted_peak_bytes <= got[2] <= lp.predicted_peak_bytes + above_bytes, \
            (lp.choices, got[2], lp.predicted_peak_bytes)


def test_frozen_layers_are_planned_as_they_run_and_unfreezing_plans_again(meter):
    # A layer frozen on an input that needs no gradient (the lower layers under fine-tuning) makes no graph and
    # saves nothing. The profiler took every layer's input after the first as needing a gradient, so it measured
    # such layers saving what a trainable one saves: a keep-all plan was predicted 36% above its step and,
    # planned with offloading and groups at the least budget, a step held 1.4% more than predicted (found
    # 2026-12-01). Now they are profiled as they run, and freezing or unfreezing parameters is a new step key:
    # profiled and planned again.
    plain_model, spec = make("llama")
    _frozen(plain_model, 3)
    plain = [step(plain_model, spec, k, meter) for k in range(3)]
    plain_model.requires_grad_(True)
    plain += [step(plain_model, spec, k, meter) for k in (3, 4)]
    model, spec = make("llama")
    _frozen(model, 3)
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10, groups=True)
    same(plain[0], step(model, spec, 0, meter))
    stages = lp.chain.stages
    for st in stages[:3]:  # the frozen layers: their output alone, no backward, no groups
        assert st.saved_bytes == st.output_bytes and st.bwd_ms == 0 and not st.groups, st.name
    assert stages[3].saved_bytes > 10 * stages[3].output_bytes
    # Safe side by what the model holds of the frozen layers' inputs until their (empty) backward (about 197 KiB:
    # 2.8% with every layer kept; before, 36.5%).
    _fastest_then_least(model, spec, lp, meter, plain[1], plain[2], below=0.06)
    lp.set_budget(1 << 40)
    model.requires_grad_(True)
    same(plain[3], step(model, spec, 3, meter))  # a new key: profiled
    assert lp.profiling_steps == 1 and lp.chain.stages[0].saved_bytes > 10 * lp.chain.stages[0].output_bytes
    got = step(model, spec, 4, meter)
    same(plain[4], got)
    assert got[2] <= lp.predicted_peak_bytes * (1 + TOLERANCE), (lp.choices, got[2], lp.predicted_peak_bytes)


def test_a_model_whose_parameters_change_is_profiled_and_planned_again(meter):
    # The model's parameters are part of the step's key: a vocabulary grown (new embedding and head objects) or
    # the model cast to bfloat16 (the same objects; inputs that are token ids do not show it) is a new key,
    # profiled and planned. Before (found 2026-12-07), the plan and the parameters read at enable were kept:
    # after the resize the steps held above their prediction (its gradient state read off the replaced
    # parameters), and after the cast every step ran every layer checkpointed, measured by nothing.
    def change(model, k):
        if k == 2:
            torch.manual_seed(7)
            model.resize_token_embeddings(2000, mean_resizing=False)
        elif k == 4:
            model.to(torch.bfloat16)

    def grown(spec, k):  # the grown vocabulary's tokens in the batches after the resize
        return batch(dict(spec, vocab=2000 if k >= 2 else spec["vocab"]), k)

    plain_model, spec = make("llama")
    plain = []
    for k in range(6):
        change(plain_model, k)
        plain.append(step(plain_model, spec, k, meter, grown))
    model, spec = make("llama")
    lp = remat.hf.enable(model, budget=1 << 40)
    for k in range(6):
        change(model, k)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no layer off its plan's shapes, no step off its prediction
            got = step(model, spec, k, meter, grown)
        same(plain[k], got)
        assert lp.profiled_shapes == 1 + k // 2 and lp.profiling_steps == 1, k
        if k % 2:
            assert lp.is_planned() and got[2] <= lp.predicted_peak_bytes * 1.02, (k, got[2], lp.predicted_peak_bytes)
    assert lp._params[-1] is model.lm_head.weight and lp._params[-1].dtype == torch.bfloat16


def test_a_layer_in_eval_mode_runs_as_it_is_and_it_is_said(meter):
    # A layer put in eval mode in a training model (its dropout off) is called by Hugging Face without its
    # checkpointing function, so remat does not see it: no plan is made (a plan is of every layer), the steps are
    # the plain run's, and a warning says why. Before (found 2026-12-07), the profile had a stage too few: a
    # ValueError from the planner library at the end of every step's backward pass.
    plain_model, spec = make("llama")
    model, _ = make("llama")
    for m in (plain_model, model):
        m.model.layers[1].eval()
    lp = remat.hf.enable(model, budget=1 << 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(2):
            same(step(plain_model, spec, k, meter), step(model, spec, k, meter))
    said = [str(w.message) for w in caught if "eval mode" in str(w.message)]
    assert len(said) == 1 and "layer 1 (LlamaDecoderLayer) is in eval mode" in said[0], said
    assert not lp.is_planned() and lp._last.skipped_profiles == 2
    model.train()
    same(step(plain_model.train(), spec, 2, meter), step(model, spec, 2, meter))  # profiles now
    assert lp.is_planned()


def llava():
    """A Llava (a CLIP vision tower of 2 layers, a Llama of 3) under Llava's default vision_feature_layer=-2: the
    projector takes the hidden states before the last vision layer, whose output the loss never reads."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
    text = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=299,
                                   vision_feature_layer=-2)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(cfg).train()


def llava_batch(spec, k):
    """Batch k of 2 sequences of 40 tokens; an image each (16 image tokens) where spec["images"]."""
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(0, 290, (2, 40), generator=g)
    b = {}
    if spec["images"]:
        ids[:, 2:18] = 299
        b["pixel_values"] = torch.randn((2, 3, 32, 32), generator=g)
    return dict(b, input_ids=ids, labels=ids.clone())


def test_a_vision_language_model_is_planned_for_its_image_batches_and_for_its_text_only_ones(meter):
    # Llava's layers are its vision tower's and its language model's. With images every layer runs and the steps
    # are planned; the last vision layer's output is read by nothing (vision_feature_layer=-2), so its backward
    # never runs, and what runs between the two stacks (the projector, the embeddings merged) ends at the first
    # vision layer's output gradient. Before (found 2026-12-07) that window was never read: a plan checkpointing
    # every layer held 3.8% above its prediction. A batch without images calls no vision layer: its first step
    # profiles nothing (said), the second profiles the layers it calls (Shape.stages), and the steps after run
    # their plan, within their prediction. Before (2026-12-07), every text-only step ran every layer checkpointed.
    # The last vision layer's graph is gone before the backward pass: it is offered no way that sends to the host
    # (its copies would save nothing). Before (2026-12-07), at 0.7 of the way from the least budget to keeping
    # everything, the plan sent what its matmuls save, its input among them, which the projector's graph holds:
    # 4,352 bytes above the prediction.
    images, text = dict(images=True, loss="lm"), dict(images=False, loss="lm")
    order = [images, images, images, text, text, text, images]
    plain = llava()
    want = [step(plain, spec, k, meter, llava_batch) for k, spec in enumerate(order)]
    model = llava()
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=1024)
    assert [type(m).__name__ for m in lp.layers] == ["CLIPEncoderLayer"] * 2 + ["LlamaDecoderLayer"] * 3
    same(want[0], step(model, images, 0, meter, llava_batch))
    dead = lp.chain.stages[1]
    assert dead.offload is None and dead.checkpoint_offload is None and not dead.groups
    least, top = lp.min_budget_bytes, lp.predicted_peak_bytes  # the image batches', above the text-only ones'
    lp.set_budget(int(least + 0.7 * (top - least)))
    got = step(model, images, 1, meter, llava_batch)
    same(want[1], got)
    assert "@" not in lp.choices[1] and got[2] <= lp.predicted_peak_bytes, (lp.choices, got[2], lp.predicted_peak_bytes)
    lp.set_budget(least)
    assert lp.choices[0] == "keep@stream0" and lp.choices[1] == "checkpoint", lp.choices
    got = step(model, images, 2, meter, llava_batch)
    same(want[2], got)
    # Within 64 bytes either way: the wrapped numbers a graph saves outside the saved-tensor hooks (docs/python.md,
    # "Limits"), 16 bytes on the CPU with every layer checkpointed.
    assert abs(got[2] - lp.predicted_peak_bytes) <= 64, (got[2], lp.predicted_peak_bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same(want[3], step(model, text, 3, meter, llava_batch))
        same(want[4], step(model, text, 4, meter, llava_batch))
    said = [str(w.message) for w in caught if "did not call layer 0 (CLIPEncoderLayer)" in str(w.message)]
    assert len(said) == 1 and "text-only" in said[0], [str(w.message) for w in caught]
    assert lp.profiled_shapes == 2 and lp.stages == [2, 3, 4] and len(lp.choices) == 3, (lp.stages, lp.choices)
    assert any("@stream" in c for c in lp.choices), lp.choices  # the offloading's schedule is of the stages
    got = step(model, text, 5, meter, llava_batch)
    same(want[5], got)
    # At or below its prediction, within 0.2% (0 to 64 bytes in two-thread runs; 576 bytes below once in ctest's
    # one-thread run, whose timings may choose another plan at this budget).
    assert 0 <= lp.predicted_peak_bytes - got[2] <= 0.002 * got[2] and lp.last_peak_bytes == got[2], \
        (lp.plan, got[2], lp.predicted_peak_bytes)
    same(want[6], step(model, images, 6, meter, llava_batch))
    assert lp.stages == [0, 1, 2, 3, 4]


def test_a_vision_language_model_with_its_vision_tower_frozen_is_planned_within_its_predictions(meter):
    # The usual fine-tuning of a Llava: the vision tower frozen, the projector and the language model trained. No
    # gradient comes to the vision layers' outputs, so what runs between them and the text layers (the projector,
    # the embeddings), trained, has its backward window read at the end of the backward pass. Before (found
    # 2026-12-07) it was never read: the plans held 1.8% to 2.7% above their predictions here (up to 10.8% on
    # bench/vision_text_only.py's models so frozen).
    images = dict(images=True, loss="lm")

    def frozen():
        m = llava()
        m.model.vision_tower.requires_grad_(False)
        return m

    plain = frozen()
    want = [step(plain, images, k, meter, llava_batch) for k in range(3)]
    model = frozen()
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=1024)
    same(want[0], step(model, images, 0, meter, llava_batch))
    assert lp.context.between_backward_peak_bytes[2] > 0  # read, at the first text layer's boundary
    for k, budget in ((1, lp.min_budget_bytes), (2, 1 << 40)):
        lp.set_budget(budget)
        got = step(model, images, k, meter, llava_batch)
        same(want[k], got)
        # At or below the prediction, within 3% (the least budget's 16,448 to 20,480 bytes of 800,000 high, 2.1% to
        # 2.6% from one run to another: the issue's lead 83, not traced).
        assert 0 <= lp.predicted_peak_bytes - got[2] <= 0.03 * got[2], (k, lp.plan, got[2], lp.predicted_peak_bytes)


def test_layers_that_are_all_frozen_run_as_they_are_and_it_is_said(meter):
    # Every layer frozen (only the LM head trained): no layer's output needs a gradient, so there is nothing to
    # plan. The step used to profile, never reach the layers' backward, and leave no plan and no word.
    plain_model, spec = make("llama")
    plain_model.model.requires_grad_(False)
    plain = [step(plain_model, spec, k, meter) for k in range(3)]
    model, spec = make("llama")
    model.model.requires_grad_(False)
    lp = remat.hf.enable(model, budget=1 << 40)
    with pytest.warns(UserWarning, match="no layer's output needs a gradient"):
        same(plain[0], step(model, spec, 0, meter))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        same(plain[1], step(model, spec, 1, meter))
    assert not lp.is_planned() and lp.profiling_steps == 0
    model.model.layers[3].requires_grad_(True)  # one layer trained: planned
    step(model, spec, 2, meter)
    assert lp.is_planned() and len(lp.choices) == 4


def test_a_peft_model_is_planned_through_its_base_model(meter):
    # LoRA (peft.get_peft_model) freezes the base model's weights and puts trainable adapters in its layers. The
    # PeftModel around it has no checkpointing hook of its own class (its attributes reach the base model's), and
    # remat.hf.enable raised AttributeError on it (found 2026-12-01). Now the base model is planned, its frozen
    # embeddings and adapted layers profiled as they run: each step the plain run's, within 1 KiB above its
    # prediction.
    pytest.importorskip("peft")
    plain_model, spec = lora_llama()
    plain = [step(plain_model, spec, k, meter) for k in range(3)]
    model, spec = lora_llama()
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10, groups=True)
    assert lp.model is model.get_base_model()
    same(plain[0], step(model, spec, 0, meter))
    # Up to 64 bytes above the prediction, at 4 to 6 MiB: each adapter's `* scaling` (a Python float) saves an
    # 8-byte wrapped number that autograd keeps without the saved-tensor hooks, so a checkpointed layer holds 16
    # bytes (two adapters) the model does not charge, on a CPU device only (docs/python.md).
    _fastest_then_least(model, spec, lp, meter, plain[1], plain[2], below=0.02, above_bytes=16 * 4)
    remat.hf.disable(model)
    assert not _remat_left(model)


def paired_llama(hidden=64, layers=4):
    """A Llama with a vocabulary of 128 (its LM head small beside the layers), random weights, in training mode:
    the model two_calls calls (bench/calls_before_backward.py's too), and bench/many_shapes.py's."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).train()


def two_calls(model, k, order, meter, batch=4, first=128, second=64):
    """Step k with two training calls of a causal LM (paired_llama, or any whose vocabulary holds 128 tokens)
    before their backward passes (a contrastive or paired loss), on batches of `batch` sequences of lengths
    `first` and `second`. order "one": one backward pass for both; "second first" or "first first": a backward
    pass for each, in that order. (loss, gradients, peak above the first call's base, next draw)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1000 + k)
    g = torch.Generator().manual_seed(100 + k)
    a, b = torch.randint(0, 128, (batch, first), generator=g), torch.randint(0, 128, (batch, second), generator=g)
    base = meter.active()
    meter.reset_peak()
    one = model(input_ids=a, labels=a).loss
    two = model(input_ids=b, labels=b).loss
    if order == "one":
        (one + 0.5 * two).backward()
    elif order == "second first":
        (0.5 * two).backward()
        one.backward()
    else:
        one.backward()
        (0.5 * two).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return one.detach() + 0.5 * two.detach(), grads, meter.peak() - base, torch.rand(4)


def test_calls_before_one_backward_pass_run_inside_the_first_calls_step_and_hold_its_budget(meter):
    # Two forwards before the backward pass. Each call was planned on its own, for the budget above what was alive
    # when it began, so the first call's step, which holds the second's, went over the budget unsaid. The second
    # call now runs inside the first's step, checkpointed; that step ends once the second call's backward pass
    # has, and the first call's plan is made for the step with it in: every step within its prediction and the
    # budget, the plain run's bitwise, whatever the order of backward passes; said once.
    plain_model = paired_llama()
    steps = [(0, "one"), (1.0, "one"), (2.5, "one"), (2.5, "second first")]
    plain = [two_calls(plain_model, k, order, meter) for k, (_, order) in enumerate(steps)]
    model = paired_llama()
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, groups=True)
    with pytest.warns(UserWarning, match="called for training while the graph of an earlier training call"):
        same(plain[0], two_calls(model, 0, "one", meter))  # the profiling step
    # Memory figures only, whatever plans a machine's timings choose: the model's peak for the profiling step's
    # own schedule (every layer checkpointed) is the one that step measured. The second call's backward pass
    # runs before the first call's layers' (its nodes are later): the layers' gradients it makes (waiting in
    # the engine's buffers for the first call's) were charged again to the layers' backward, 6.7% high.
    every_layer = remat.step_peak_bytes(lp.chain, lp.context, remat.checkpoint_all(lp.chain))
    assert abs(every_layer - lp.context.checkpoint_all_peak_bytes) <= lp.context.checkpoint_all_peak_bytes // 100, \
        (every_layer, lp.context.checkpoint_all_peak_bytes)
    least = lp.min_budget_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, and every step within 2% of its prediction
        for k, (where, order) in enumerate(steps[1:], start=1):
            lp.set_budget(int(where * least))
            got = two_calls(model, k, order, meter)
            same(plain[k], got)
            assert 0.98 * lp.predicted_peak_bytes <= got[2] <= lp.predicted_peak_bytes <= lp.budget_bytes, \
                (where, order, lp.choices, got[2], lp.predicted_peak_bytes)
    # A call after an earlier one's backward pass ended, that call's graph still alive (its loss kept), is not
    # inside it: the second call's shapes, never planned inside the first's steps, are profiled and planned; then
    # the first call's shapes run planned and measured.
    g = torch.Generator().manual_seed(7)
    short, whole = torch.randint(0, 128, (4, 64), generator=g), torch.randint(0, 128, (4, 128), generator=g)
    first_shape = lp._last
    kept = model(input_ids=short, labels=short).loss
    kept.backward()
    assert len(lp._shapes) == 2 and all(s.choices is not None for s in lp._shapes.values())
    assert lp._last is not first_shape
    first_shape.last_peak = -1
    # (Its plan was made for the step with the second call in it: alone, the step holds less, and it is said.)
    with pytest.warns(RuntimeWarning, match="below the plan's prediction"):
        model(input_ids=whole, labels=whole).loss.backward()
    assert lp._last is first_shape and 0 < first_shape.last_peak <= 0.95 * lp.predicted_peak_bytes
    del kept
    # A backward pass for each call, the first call's first (so the second's runs after the first call's step
    # would have ended): on a 6-layer, 128-wide Llama at its least budget (every layer streamed to the host,
    # below per-layer checkpointing's peak), the step held 18.9% above the budget before the first call's step
    # waited for the second's backward pass.
    plain_model = paired_llama(128, 6)
    plain = [two_calls(plain_model, k, "first first", meter, 8, 256, 256) for k in range(2)]
    model = paired_llama(128, 6)
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, groups=True)
    with pytest.warns(UserWarning, match="called for training while the graph of an earlier training call"):
        same(plain[0], two_calls(model, 0, "first first", meter, 8, 256, 256))
    lp.set_budget(lp.min_budget_bytes)
    got = two_calls(model, 1, "first first", meter, 8, 256, 256)
    same(plain[1], got)
    assert 0.98 * lp.predicted_peak_bytes <= got[2] <= lp.predicted_peak_bytes <= lp.budget_bytes, \
        (lp.choices, got[2], lp.predicted_peak_bytes)


def _remat_left(model):
    """What of remat is on the model: attributes named for it, the stand-in for its checkpointing hook, forward
    pre-hooks, and the checkpointing functions its layers hold."""
    left = [name for m in model.modules() for name in m.__dict__ if "remat" in name]
    left += [name for name in model.__dict__ if name == "_set_gradient_checkpointing"]
    left += [f"pre-hook {h!r}" for m in model.modules() for h in m._forward_pre_hooks.values()]
    left += [f"layer function {type(m._gradient_checkpointing_func).__module__}"
             for m in model.modules() if "remat" in type(getattr(m, "_gradient_checkpointing_func", None)).__module__]
    return left


def _checkpointing(model):
    """Whether Hugging Face's checkpointing flag is on in a layer (is_gradient_checkpointing, deprecated in 5.x)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_disabling_takes_all_of_remat_off_and_a_call_that_replaces_it_says_so(meter, tmp_path):
    import warnings
    plain_model, spec = make("bert")
    plain = [step(plain_model, spec, k, meter) for k in range(2)]
    # remat.hf.disable and Hugging Face's own call leave the same model: nothing of remat (remat's forward
    # pre-hook stayed after gradient_checkpointing_disable()).
    for off in ("remat.hf.disable", "gradient_checkpointing_disable"):
        model, spec = make("bert")
        remat.hf.enable(model, budget="1GiB")
        assert _remat_left(model)
        same(step(model, spec, 0, meter), plain[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # 5.x deprecates gradient_checkpointing_disable
            remat.hf.disable(model) if off == "remat.hf.disable" else model.gradient_checkpointing_disable()
        assert _remat_left(model) == [], off
        assert not _checkpointing(model)
        same(step(model, spec, 1, meter), plain[1])
    # Hugging Face's own checkpointing enabled over remat's: remat stops planning and says so, naming the call.
    model, spec = make("bert")
    lp = remat.hf.enable(model, budget="1GiB")
    with pytest.warns(UserWarning, match=r"model\.\w+_checkpointing_enable\(\) replaced remat's checkpointing"):
        hf_checkpointing(model)
    assert _remat_left(model) == [] and _checkpointing(model)
    same(step(model, spec, 0, meter), plain[0])
    assert lp.profiling_steps == 0
    # ... through a Trainer asked for gradient checkpointing.
    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return dict(input_ids=torch.arange(8) + i, labels=torch.arange(8) + i)

    lm = transformers.BertForMaskedLM(model.config)
    remat.hf.enable(lm, budget="1GiB")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                          report_to=[], save_strategy="no", use_cpu=True,
                                          gradient_checkpointing=True, dataloader_num_workers=0)
    with pytest.warns(UserWarning, match=r"Trainer \(TrainingArguments\(gradient_checkpointing=True\)\)"):
        transformers.Trainer(model=lm, args=args, train_dataset=Data()).train()
    assert _remat_left(lm) == []


def test_a_layers_output_that_nothing_holds_is_charged_as_freed_after_the_next_layers_backward(meter, plain_runs):
    # BERT's layers end in a LayerNorm, which saves its input, not its output: once the next layer's backward is
    # done nothing holds a layer's output, and the profiling step reads so (StepContext.outputs_held_in_backward).
    # At the least budget with offloading the prediction is then the measured peak (it held one hidden state
    # through each layer's backward before: 3.4% above).
    model, spec = make("bert")
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
    step(model, spec, 0, meter)
    assert list(lp.context.outputs_held_in_backward)[1:] == [False] * 3
    lp.set_budget(lp.min_budget_bytes)
    runs = [step(model, spec, k, meter) for k in (1, 2)]
    for k, run in zip((1, 2), runs):
        same(plain_runs["bert"][k], run)
    peak = max(run[2] for run in runs)
    assert lp.predicted_peak_bytes * 0.995 <= peak <= lp.predicted_peak_bytes, (peak, lp.predicted_peak_bytes)
    # No layer's output is held to the step's end (StepContext.outputs_held_to_end) but the last: the caller's
    # last_hidden_state holds the layers' output to the end.
    assert list(lp.context.outputs_held_to_end) == [False] * 3 + [True] and lp.context.output_held_in_backward
    # A model that returns every layer's output holds them all, to the step's end: read so, and charged so. At the
    # least budget with offloading (every layer streamed), the prediction is then the measured peak (it was 6.6%
    # below it: the model let go of each hidden state at a layer's backward).
    held, spec = make("bert")

    def hidden(s, k):
        return dict(batch(s, k), output_hidden_states=True)

    lp = remat.hf.enable(held, budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
    step(held, spec, 0, meter, make_batch=hidden)
    assert list(lp.context.outputs_held_in_backward)[1:] == [True] * 3
    assert list(lp.context.outputs_held_to_end) == [True] * 4
    lp.set_budget(lp.min_budget_bytes)
    peak = max(step(held, spec, k, meter, make_batch=hidden)[2] for k in (1, 2))
    assert lp.predicted_peak_bytes * 0.995 <= peak <= lp.predicted_peak_bytes, (peak, lp.predicted_peak_bytes)


@pytest.mark.parametrize("hidden_states", [False, True])
def test_streamed_and_kept_layers_are_predicted_where_the_caller_holds_their_outputs(hidden_states, meter,
                                                                                     plain_runs):
    # Plans from the least budget to the plain step's peak, with offloading, the caller holding the layers'
    # output (last_hidden_state) or every layer's (output_hidden_states=True) to the step's end. Each planned
    # step is its prediction within 0.5% both ways. Before (issue 42's sixth note), with three layers streamed
    # and the last kept, 6.9% below it, and on the way to the fix 4.8% above: a streamed layer was
    # charged its whole window ahead of its backward (not what its prefetch brings back: ahead_bytes), the
    # profile held each layer's output gradient through its backward (a step frees it once used), the last
    # layer's output was read as not held to the end, and a streamed layer's input that the caller holds was
    # charged as gone from the device.
    model, spec = make("bert")

    def make_batch(s, k):
        return dict(batch(s, k), output_hidden_states=hidden_states)

    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
    step(model, spec, 0, meter, make_batch=make_batch)
    # Planned as for a GPU, whose side stream hides the copies (the CPU makes them at once, and no window makes a
    # step faster there): streaming with a window is then among the plans.
    lp.chain.copies_at_once = False
    plain, least, seen = plain_runs["bert"][1][2], lp.min_budget_bytes, set()
    for where in (0.0, 0.3, 1.0):
        lp.set_budget(int(least + where * (plain - least)))
        peak = max(step(model, spec, k, meter, make_batch=make_batch)[2] for k in (1, 2))
        assert abs(peak - lp.predicted_peak_bytes) <= 0.005 * lp.predicted_peak_bytes, (str(lp.plan), peak,
                                                                                         lp.predicted_peak_bytes)
        seen.add(str(lp.plan))
    # Among them (which, beyond the least budget's, depends on the measured times) a layer streamed with its
    # window before another layer's backward: its tail charged as what its prefetch brings back.
    assert any("@stream " in p for p in seen), seen


def test_the_profiler_runs_a_layer_handed_as_its_whole_call_without_its_module_hooks():
    # transformers 4.53 to 5.22 hand remat a layer's whole module call (partial(nn.Module.__call__ bound to the
    # layer)); the profiler runs each layer many times, and the layer's module hooks ran at each run: with
    # 5.17.0, output_hidden_states' capturing hooks made the profiling step return 25 hidden states, not 5, and
    # its plan's prediction came out 24-61% high (test above, through scripts/hf-versions 5.17.0). The profiler
    # runs the forward instead, with the call's keywords, as 5.23 hands it.
    from remat.measure_step import without_module_hooks

    class Scaled(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    layer, ran = Scaled(), []
    layer.register_forward_hook(lambda m, i, o: ran.append(o))
    whole = partial(super(Scaled, layer).__call__, scale=3.0)  # as GradientCheckpointingLayer.__call__ hands it
    assert whole.func.__func__ is nn.Module.__call__
    x = torch.ones(2)
    assert torch.equal(whole(x), 3 * x) and len(ran) == 1
    profiled = without_module_hooks(whole, layer)
    assert torch.equal(profiled(x), 3 * x) and len(ran) == 1
    forward = partial(Scaled.forward, layer, scale=2.0)  # as 5.23 hands it: unchanged
    assert without_module_hooks(forward, layer) is forward
    other = partial(super(Scaled, Scaled()).__call__, scale=3.0)  # another module's call: unchanged
    assert without_module_hooks(other, layer) is other


def test_a_checkpointed_layers_backward_is_charged_without_an_output_its_graph_does_not_save(meter, plain_runs):
    # A checkpointed layer's recompute stops early, at the last tensor its backward needs: a BERT layer's output
    # (its final LayerNorm saves its input, not its output) is never made again, and the profile reads so
    # (Stage.saves_output). The model of every layer checkpointed charged that output in the layer's backward:
    # 2.1% above the profiling step's measured peak; now within 0.1% of it.
    model, spec = make("bert")
    lp = remat.hf.enable(model, budget=1 << 40)
    step(model, spec, 0, meter)
    chain, ctx = lp.chain, lp.context
    assert [st.saves_output for st in chain.stages] == [False] * 4
    every = remat.checkpoint_all(chain)
    predicted, measured = remat.step_peak_bytes(chain, ctx, every), ctx.checkpoint_all_peak_bytes
    assert measured <= predicted <= measured * 1.001, (predicted, measured)
    saved = remat.Chain.from_json(chain.to_json())
    for st in saved.stages:
        st.saves_output = True
    assert remat.step_peak_bytes(saved, ctx, every) == predicted + chain.stages[0].output_bytes
    # Planned at that peak, the step is the plain run's and holds what was predicted.
    lp.set_budget(predicted)
    runs = [step(model, spec, k, meter) for k in (1, 2)]
    for k, run in zip((1, 2), runs):
        same(plain_runs["bert"][k], run)
    peak = max(run[2] for run in runs)
    assert lp.predicted_peak_bytes * 0.995 <= peak <= lp.predicted_peak_bytes, (peak, lp.predicted_peak_bytes)


def test_a_first_layer_that_does_not_send_its_input_is_charged_it_streamed_or_not(meter, plain_runs):
    # With offload=True at the default least size (1 MiB), this Llama's layers send nothing, their input (a 64
    # KiB hidden state) included: streaming the first layer leaves the chain's input on the device, and the
    # step is charged it as when the layer is kept. Before (fixed 2026-12-01), a first layer streamed was
    # charged as taking the input to the host whatever it sent: 64 KiB less, and the planner, finding that
    # plan as fast, chose it at an unlimited budget, its prediction 0.46% below the measured step.
    model, spec = make("llama")
    lp = remat.hf.enable(model, budget=1 << 40, offload=True)
    same(plain_runs["llama"][0], step(model, spec, 0, meter))
    chain, ctx = lp.chain, lp.context
    assert not ctx.input_held_in_backward and all(not st.offload.input for st in chain.stages)

    def peak(first):
        return remat.step_peak_bytes(chain, ctx, remat.Plan.from_json(
            '{"num_stages": 4, "ops": ["%s", "Fa1", "Fa2", "Fa3", "L", "B3", "B2", "B1", "B0"]}' % first))

    assert peak("Fa0@stream0") == peak("Fa0@host") == peak("Fa0")
    got = max(step(model, spec, k, meter)[2] for k in (1, 2))
    # transformers 4.x makes a causal mask before the layers (64 x 64 in fp32), which the model's forward lets go
    # of when it returns: read as held by the part before the layers (before_saved_bytes) and charged to the
    # step's end, where the peak is (16 KiB high, 0.12%; not read, a limit of 4.x only).
    slack = 64 * 64 * 4 if TRANSFORMERS_4 else 0
    assert got <= lp.predicted_peak_bytes <= got * 1.001 + slack, (lp.choices, got, lp.predicted_peak_bytes)


def test_what_the_rest_lets_go_of_from_before_the_layers_is_read_as_let_go_of(meter):
    # GPT-2's forward holds its token and position embeddings (locals) until it returns, past the layers: the
    # part before the layers holds them at the first layer's call (before_saved_bytes), and the rest of the step,
    # from that return on, does not. Where the rest keeps less than that (a small vocabulary, the caller keeping
    # only the loss), what it leaves held once it hands the layers their gradient is less than it found
    # (StepContext.rest_grads_bytes, signed since 2026-12-03): read as 0 before, every plan's step was 0.5-1.1%
    # below its prediction from the rest's backward on; now within 0.1%.
    def gpt2():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=128, n_layer=4, n_head=4, n_positions=128)
        return transformers.GPT2LMHeadModel(cfg).train()

    plain, model = gpt2(), gpt2()
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    lp = remat.hf.enable(model, budget=1 << 40)

    def train(m):
        torch.manual_seed(2)
        meter.reset_peak()
        base = meter.active()
        m(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return meter.peak() - base, grads

    train(model)  # profiled; then times that make every layer kept the fastest
    for st in lp._last.chain.stages:
        st.fwd_ms, st.bwd_ms, st.checkpoint_fwd_ms, st.checkpoint_bwd_ms = 1.0, 2.0, 1.0, 4.0
        for c in st.policies:
            c.fwd_ms, c.bwd_ms = 50.0, 50.0
    lp.set_budget(1 << 40)
    chain, ctx = lp.chain, lp.context
    assert -ctx.before_saved_bytes <= ctx.rest_grads_bytes < 0, (ctx.rest_grads_bytes, ctx.before_saved_bytes)
    every = remat.checkpoint_all(chain)
    predicted, measured = remat.step_peak_bytes(chain, ctx, every), ctx.checkpoint_all_peak_bytes
    assert abs(predicted / measured - 1) <= 1e-3, (predicted, measured)  # (0.5-1.1% high before)
    # Every layer kept: the plain run's gradients, and what was predicted.
    want = train(plain)[1]
    for _ in range(2):
        peak, grads = train(model)
        assert all(torch.equal(a, b) for a, b in zip(want, grads))
    assert str(lp.plan).startswith("Fa0 Fa1 Fa2 Fa3 L"), lp.plan
    assert abs(peak / lp.predicted_peak_bytes - 1) <= 1e-3, (peak, lp.predicted_peak_bytes)
