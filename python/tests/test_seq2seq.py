"""remat.hf.enable on encoder-decoder Transformers models built from a config (nothing downloaded): T5 and mT5,
whose blocks return tuples (the hidden state, then the position bias the first block makes from a trained
embedding and hands to every later block), BART and Whisper. Each has two layer lists (the encoder's, the
decoder's), planned together for one budget; the decoder's layers attend to the encoder's output, whose
gradient flows back into the encoder. Every step, the profiling one included, gives the plain run's loss,
gradients and next random draw, bitwise; the measured step peak stays within the budget and near the
prediction; eval and no_grad run plainly."""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
import remat.hf  # noqa: E402

from test_hf import TOLERANCE, TRANSFORMERS_4, hf_checkpointing, same  # noqa: E402
from test_hf import step as hf_step  # noqa: E402

LAYERS = 3  # per layer list


def t5(cls="T5ForConditionalGeneration", config="T5Config"):
    cfg = getattr(transformers, config)(vocab_size=1000, d_model=64, d_kv=16, d_ff=256, num_layers=LAYERS,
                                        num_decoder_layers=LAYERS, num_heads=4, decoder_start_token_id=0,
                                        pad_token_id=0)
    return getattr(transformers, cls)(cfg)


def mt5():
    return t5("MT5ForConditionalGeneration", "MT5Config")


def bart():
    cfg = transformers.BartConfig(vocab_size=1000, d_model=64, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                                  decoder_ffn_dim=256, max_position_embeddings=128)
    return transformers.BartForConditionalGeneration(cfg)


def whisper():
    cfg = transformers.WhisperConfig(vocab_size=1000, d_model=64, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                                     decoder_ffn_dim=256, num_mel_bins=16, max_source_positions=32,
                                     max_target_positions=64, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                     decoder_start_token_id=0)
    return transformers.WhisperForConditionalGeneration(cfg)


MODELS = {"t5": t5, "mt5": mt5, "bart": bart, "whisper": whisper}


def make(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    return model


def batch(name, k):
    g = torch.Generator().manual_seed(100 + k)
    labels = torch.randint(1, 1000, (4, 24), generator=g)
    if name == "whisper":  # 16 mel bins, 64 frames: 32 positions after the encoder's strided convolution
        return dict(input_features=torch.randn(4, 16, 64, generator=g), labels=labels)
    return dict(input_ids=torch.randint(1, 1000, (4, 32), generator=g), labels=labels)


def step(model, name, k, meter):
    """Training step k (test_hf's step on this file's batches; the loss is the model's)."""
    return hf_step(model, dict(name=name, loss="lm"), k, meter, make_batch=lambda spec, k: batch(spec["name"], k))


@pytest.mark.parametrize("name", list(MODELS))
def test_both_layer_lists_planned_for_one_budget_and_every_step_is_the_plain_run(name, meter):
    plain_model = make(name)
    plain = [step(plain_model, name, k, meter) for k in range(3)]
    plain_peak = plain[1][2]
    hf_model = make(name)
    hf_checkpointing(hf_model)
    hf_peak = step(hf_model, name, 0, meter)[2]
    del plain_model, hf_model

    # The floor, from a first model's profiling step.
    probe = make(name)
    lp_probe = remat.hf.enable(probe, budget=1024)
    with pytest.raises(remat.InfeasibleBudget) as e, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step(probe, name, 0, meter)
    floor = e.value.min_bytes
    # T5's decoder makes its cross-attention's zero position bias a leaf that requires a gradient under
    # checkpointing and hands it on: read as a side tensor, its gradient charged, not warned of as a leaf the
    # model does not charge (it was, for a moment on 2026-12-06).
    assert not [w for w in seen if "has no grad_fn" in str(w.message)], [str(w.message) for w in seen]
    assert floor < plain_peak
    # What the layers take and hand on beside their input and output is charged: T5's position biases (each
    # made by a first block) and every model's encoder output, which the decoder's layers attend to.
    assert lp_probe.context.side_bytes > 0
    # What runs between the encoder's last layer and the decoder's first (the encoder's final norm, the decoder's
    # embeddings) is read there and nowhere else: its backward pass's peak (a tied embedding's dense gradient and
    # the sum it is accumulated into), and what its forward left held.
    ctx = lp_probe.context
    assert ctx.between_backward_peak_bytes[LAYERS] > 0 and ctx.between_forward_held_bytes[LAYERS] >= 0
    for j in set(range(2 * LAYERS)) - {LAYERS}:
        assert ctx.between_backward_peak_bytes[j] == ctx.between_forward_held_bytes[j] == ctx.between_held_bytes[j] == 0
    # The encoder's output's gradient arrives at the last decoder layer's backward, and is charged from there.
    assert ctx.side_grads_bytes[2 * LAYERS - 1] > 0 and sum(ctx.side_grads_bytes) <= ctx.side_bytes
    # The caller's output holds the encoder's output (encoder_last_hidden_state) to the step's end. BART's is its
    # last encoder layer's output: charged as that layer's, held to the end (side_bytes charge only its gradient;
    # charging it there too, a decoder's embeddings' reading let it go, and the encoder's backward passes were
    # predicted one encoder output low). T5's and Whisper's end in a final norm, run between the layer lists.
    held = [False] * (2 * LAYERS)
    held[LAYERS - 1] = name == "bart"
    assert list(ctx.outputs_held_to_end) == held
    # What the layers take beside their input is let go of where it is (side_freed_bytes): T5's position biases
    # and their gradients, in the encoder's and the decoder's backward passes; BART's and Whisper's encoder
    # output and its gradient, never in a layer's backward (the caller holds the output; the gradient is the
    # last encoder layer's output's, or is used up by the encoder's final norm, which runs between). On
    # transformers 4.x their decoder layers also take the labels' positions (cache_position, 24 in int64), which
    # the first decoder layer's backward lets go of.
    freed = list(ctx.side_freed_bytes)
    if name in ("t5", "mt5"):
        assert 0 < sum(freed) <= ctx.side_bytes, freed
    else:
        assert sum(freed) == (24 * 8 if TRANSFORMERS_4 else 0), freed
    # The profiling step runs every layer checkpointed: its measured peak against the prediction for that plan,
    # within 0.1% both ways (BART was 1.19% above it, T5 1.09% below). On transformers 4.x, T5's and mT5's are
    # 24 KiB above (0.77%): the first decoder block's cross-attention position bias, a leaf made inside it to
    # require a gradient, which 4.x masks before handing it on, so that the graph alone holds it to the step's
    # end, and its gradient from that block's backward on (12 KiB each; a limit of 4.x only, docs/testing.md).
    chain = lp_probe.chain
    every = remat.step_peak_bytes(chain, ctx, remat.checkpoint_all(chain))
    above = 24 * 1024 + 64 if TRANSFORMERS_4 and name in ("t5", "mt5") else 0
    assert every * 0.999 <= ctx.checkpoint_all_peak_bytes <= every * 1.001 + above, (ctx.checkpoint_all_peak_bytes, every)
    del probe, lp_probe, ctx, chain

    # Just above the floor: the backward pass of Whisper's convolutions before the encoder's layers, where its
    # step peaks with every layer checkpointed, measured 2.14 to 2.23 MiB in three runs of one process.
    for where in (0.05, 0.5):
        budget = int(floor + where * (plain_peak - floor))
        model = make(name)
        lp = remat.hf.enable(model, budget=budget)
        runs = [step(model, name, k, meter) for k in range(3)]
        for k in range(3):
            same(plain[k], runs[k])
        assert lp.is_planned() and lp.profiling_steps == 1
        assert len(lp.choices) == 2 * LAYERS  # the encoder's and the decoder's layers in one plan
        predicted = lp.predicted_peak_bytes
        assert predicted <= budget
        for k in (1, 2):
            assert runs[k][2] <= budget + TOLERANCE * predicted, (where, lp.choices, runs[k][2], predicted, budget)
            assert runs[k][2] <= predicted * (1 + TOLERANCE), (where, lp.choices, runs[k][2], predicted)
        assert lp.last_peak_bytes == runs[2][2]
        if where < 0.5:
            assert "checkpoint" in lp.choices or "matmuls" in lp.choices
    # A user can ask for the memory of the one switch remat replaces (Whisper's floor was above it while a
    # reference cycle held selective checkpointing's cache of the profiled policy until Python collected it).
    assert floor <= hf_peak, (floor, hf_peak)


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_eval_and_no_grad_run_plainly(name, meter):
    model = make(name)
    lp = remat.hf.enable(model, budget="64MiB")
    ref = make(name)
    for m in (model, ref):
        m.eval()
    b = batch(name, 0)
    with torch.no_grad():
        assert torch.equal(model(**b).loss, ref(**b).loss)
    model.train()
    ref.train()
    with torch.no_grad():
        torch.manual_seed(5)
        a = model(**b).loss
        torch.manual_seed(5)
        assert torch.equal(a, ref(**b).loss)
    assert lp.profiling_steps == 0 and not lp.is_planned()


def test_a_step_with_longer_labels_is_planned_for_them(meter):
    # Whisper's decoder runs as long as its labels, which its first planned layer (the encoder's) does not show:
    # plans were kept under that layer's shapes, and a step with longer labels ran the short labels' plan (at
    # the plain step's peak, over the budget) without profiling. Steps are told apart by the shapes of all the
    # model's inputs now.
    def batch_of(length):
        def make_batch(spec, k):
            g = torch.Generator().manual_seed(100 + k)
            return dict(input_features=torch.randn(4, 16, 64, generator=g),
                        labels=torch.randint(1, 1000, (4, length), generator=g))
        return make_batch

    short, long = batch_of(8), batch_of(60)

    def run(model, k, make_batch):
        return hf_step(model, dict(name="whisper", loss="lm"), k, meter, make_batch=make_batch)

    plain_model = make("whisper")
    plain = [run(plain_model, k, short if k < 2 else long) for k in range(4)]
    hf_model = make("whisper")
    hf_checkpointing(hf_model)
    hf_peak = run(hf_model, 2, long)[2]
    budget = (hf_peak + plain[2][2]) // 2
    model = make("whisper")
    lp = remat.hf.enable(model, budget=budget)
    runs = []
    for k in range(4):
        runs.append(run(model, k, short if k < 2 else long))
        if k == 1:
            # The short labels' plan keeps every layer: its peak is the backward pass between the encoder and the
            # decoder (the decoder's embeddings' dense gradient), 7.6% above the prediction before that part was
            # read; now within the tolerance.
            assert abs(lp.prediction_error) <= TOLERANCE, (lp.choices, lp.prediction_error)
    for k in range(4):
        same(plain[k], runs[k])
    for k in (2, 3):
        assert runs[k][2] <= budget + TOLERANCE * budget, (k, runs[k][2], budget, plain[k][2])
    assert lp.profiling_steps == 1 and len(lp._shapes) == 2  # the long labels profiled in step 2
    assert lp.last_peak_bytes == runs[3][2]


def test_what_runs_between_may_leave_less_held_than_before_it(meter):
    # With labels of 8, BART's decoder embeddings make less than what its encoder's forward held in the model's
    # variables (the token embeddings, charged from the layers' start), which is freed as the encoder returns:
    # what runs between leaves less held than before it, read as negative. Floored at 0, the plain step was
    # predicted 1.7% above what it held. Now it is never below it, and above it by at most one encoder output's
    # gradient (the known miss: charged at the last decoder layer's backward peak, which comes before the layer's
    # cross-attention makes it). A relative bound failed on CI, whose totals were 0.5 MiB smaller than this
    # machine's for the same model (1.05% against 0.89%, the same 32 KiB).
    def short(spec, k):
        g = torch.Generator().manual_seed(100 + k)
        return dict(input_ids=torch.randint(1, 1000, (4, 32), generator=g),
                    labels=torch.randint(1, 1000, (4, 8), generator=g))

    model = make("bart")
    lp = remat.hf.enable(model, budget=1 << 40)
    runs = [hf_step(model, dict(name="bart", loss="lm"), k, meter, make_batch=short) for k in range(2)]
    assert lp.context.between_forward_held_bytes[LAYERS] < 0
    predicted = lp.predicted_peak_bytes
    encoder_output_grad = 4 * 32 * model.config.d_model * 4
    assert 0 <= predicted - runs[1][2] <= encoder_output_grad, (runs[1][2], predicted)


def test_a_shape_planned_for_the_layers_its_steps_called_is_profiled_again_where_one_calls_another(meter):
    # Two steps in a row that call the same layers (every encoder layer dropped: layerdrop 1) plan the shape for
    # those (Shape.stages), and the planned steps hold their prediction. A later step of that shape that calls
    # another layer runs the rest checkpointed, said, and the shape is profiled again for every layer it calls
    # from then on: a step that drops layers again runs that plan for the layers called (LayerDrop's rule).
    plain_model, model = make("bart"), make("bart")
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
    drops = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, p in enumerate(drops):
            for m in (plain_model, model):
                m.model.encoder.layerdrop = p
            got = step(model, "bart", k, meter)
            same(step(plain_model, "bart", k, meter), got)
            if k == 1:
                assert lp.stages == list(range(LAYERS, 2 * LAYERS)) and lp.profiling_steps == 1, lp.stages
                lp.set_budget(int(lp.min_budget_bytes * 1.3))  # (above every layer's least, 1.17 of it)
            if k in (2, 5):
                assert 0 <= lp.predicted_peak_bytes - got[2] <= 1024, (k, got[2], lp.predicted_peak_bytes)
            if k == 4:
                assert lp.stages == list(range(2 * LAYERS)), lp.stages
    said = [str(w.message) for w in caught if "which the steps that profiled this input shape did not call" in
            str(w.message)]
    assert len(said) == 1 and f"called layers {list(range(LAYERS, 2 * LAYERS))}" in said[0], said
    assert lp.stages == list(range(2 * LAYERS)) and lp._step.skipped == list(range(LAYERS))


def test_layers_skipped_at_random_run_as_the_plain_run_and_profile_once_all_run(meter, monkeypatch):
    # LayerDrop (BART's encoder_layerdrop, Wav2Vec2's layerdrop): in training, the model skips each layer at
    # random. A step that was to profile and skips one profiles nothing (its layers from there run
    # checkpointed) and the next tries again; a planned step runs its plan for the layers called, unmeasured.
    # Before (found 2026-12-07), the first layer skipped raised "layer 1 ran before layer 0", another skipped
    # made a profile of too few stages (a ValueError at the end of the backward pass, at every step after).
    models = [make("bart") for _ in range(2)]
    for m in models:
        m.model.encoder.layerdrop = 0.5
    plain_model, model = models
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=16 << 10)
    skips = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(10):
            if k == 4:  # planned: the least budget (streamed layers), and the decoder's last layer may drop too
                assert lp.is_planned() and lp.profiling_steps == 1
                lp.set_budget(lp.min_budget_bytes)
                for m in models:
                    m.model.decoder.layerdrop = 0.5
            want = step(plain_model, "bart", k, meter)
            got = step(model, "bart", k, meter)
            same(want, got)
            skips.append(list(lp._step.skipped))
            if k >= 4:  # what runs of the plan holds at most what all of it was predicted to
                assert got[2] <= lp.predicted_peak_bytes, (k, skips[-1], lp.choices, got[2], lp.predicted_peak_bytes)
    said = [str(w.message) for w in caught if "did not call layer" in str(w.message)]
    # Steps 0-2 were to profile and skipped layers (the first one in steps 0 and 2, the encoder's last ones in
    # step 1: seen at the decoder's first); step 3 ran all and profiled.
    assert skips[:4] == [[0, 1, 2], [1, 2], [0], []], skips
    assert lp._last.skipped_profiles == 3 and lp._last.profiling_steps == 1
    assert any(2 * LAYERS - 1 in s for s in skips[4:]), skips  # the last layer (LayerPlan._forward_ends)
    assert any("@stream" in c for c in lp.choices), lp.choices
    assert len(said) == 2 and "profiled nothing" in said[0] and "not measured" in said[1], said
    # An example's step (remat.hf.profile, enable(example=), remat.max_batch) runs again while it skips a layer
    # (before, profile() returned (None, None)), the model and its generators left as they were; where every try
    # skips one, a ValueError says what to do.
    model = make("bart")
    model.model.encoder.layerdrop = 0.5
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chain, _ = remat.hf.profile(model, batch("bart", 0))
    assert len(chain.stages) == 2 * LAYERS and torch.equal(torch.rand(4), torch.manual_seed(0) and torch.rand(4))
    assert all(p.grad is None for p in model.parameters())
    # Where the steps skip the same layers each time (every encoder layer at layerdrop 1), the second try profiles
    # the layers it calls (Shape.stages).
    model = make("bart")
    model.model.encoder.layerdrop = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chain, _ = remat.hf.profile(model, batch("bart", 0))
    assert len(chain.stages) == LAYERS and [s.name.split(":")[0] for s in chain.stages] == \
        [str(j) for j in range(LAYERS, 2 * LAYERS)], [s.name for s in chain.stages]
    model = make("bart")
    model.model.encoder.layerdrop = 1.0
    monkeypatch.setattr(remat.layer_plan, "WHOLE_STEP_TRIES", 1)  # (16 by default)
    with warnings.catch_warnings(), pytest.raises(
            ValueError, match="each of 1 training steps on the example batch skipped a layer .* set the model's "
                              "layerdrop"):
        warnings.simplefilter("ignore")
        remat.hf.profile(model, batch("bart", 0))
