#!/usr/bin/env python3
"""remat.hf.enable across Transformers architectures: every step against the plain run's, bitwise, and each
planned step's peak against its prediction (docs/BENCHMARKS.md, "Transformers architectures, swept").

Each model is built from a small config of its own architecture (4 layers, width 64, 4 heads, 2 key-value heads
where it has them, intermediate 128, vocabulary 1000; nothing downloaded), trained on random tokens (batch 4,
sequence 64; a causal LM's loss on its own labels, a masked LM's on the tokens), on the CPU. The plain run is the
model called as a training loop calls it, with `use_cache=False` where the config has a cache (as Hugging Face's
own checkpointing sets it, and remat.hf.enable with it: Jamba's plain run with its cache on takes another path,
docs/python.md, "Limits"). remat.hf.enable(offload=True, groups=True, offload_min_bytes=1 KiB) profiles it in
the first step; then, for each copy engine (copies made at once, the CPU's; and carried out only when waited
for, `--delay`, as a GPU's may land late) and each budget (the least feasible, and a share of the way from it
to the plain step's predicted peak), two steps, each compared with the plain run's bitwise (loss, every
gradient, the next random draw) and its peak with the plan's prediction. Each row: the model, whether every
step was bitwise, the least budget against gradient_checkpointing_enable()'s measured peak, and per engine the
prediction errors' range (measured less predicted, over predicted: negative where the model overstates), and
whether remat warned in the profiling step (the JSON has the words).

    python bench/architectures.py                          # every architecture of MODELS below
    python bench/architectures.py --models more --deterministic   # the 52 of MORE (several are mixtures of experts)
    python bench/architectures.py --models further --deterministic   # the 57 of FURTHER (36 decoders, 21 encoders)
    python bench/architectures.py --models vision         # the 7 vision-language models of VISION (an image a batch)
    python bench/architectures.py --models gptj,mixtral --budgets 0,0.5 --json out/arch.json
    python bench/architectures.py --autocast bf16         # the forward and the loss under CPU bf16 autocast
    python bench/architectures.py --deterministic         # torch.use_deterministic_algorithms(True)
    python bench/architectures.py --random 8 --seed 0     # 8 random per-layer plans each, in place of budgets
    python bench/architectures.py --checkpointed --delay 0  # the plan that checkpoints every layer, each

With --random, each model runs random per-layer plans in place of the planner's (bench/given_plan_predictions.py's
draw: each layer kept, kept with what it saves on the host, streamed with its window or none, under the matmuls
policy on the device or the host, checkpointed with its input on the device or the host, or a random assignment
of its saved groups to keep, host and recompute), each step under both engines, checked bitwise and against the
plan's predicted peak as the budgets' steps are: the ways a budget's plans never choose on that model, run on
its real layers.

Without --deterministic, a model whose backward sums three or more gradients into one row of an indexed tensor
(GPT-OSS's experts' biases, gathered per token) is not always bitwise against even its own plain run on a CPU
with two threads or more: PyTorch sums them there by atomic adds from several threads, in whichever order they
land (docs/BENCHMARKS.md, "Transformers architectures, swept").

transformers 5.23 builds every architecture listed; an architecture the installed version lacks, or whose
config fails to build, is reported as such and the sweep goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402

import remat  # noqa: E402
import remat.hf  # noqa: E402
from remat.offload import CopyEngine  # noqa: E402

import test_hf  # noqa: E402  (python/tests: its comparison of two steps and Hugging Face's checkpointing)

COMMON = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=256)
# What an architecture's config needs beside COMMON to be small and valid.
EXTRA = {
    "phi3": dict(pad_token_id=0),
    "gemma3_text": dict(head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        n_group=1, topk_group=1),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "jamba": dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_expand=2,
                  use_mamba_kernels=False),
    "mamba": dict(state_size=8, expand=2),
    "bloom": dict(n_layer=4, n_head=4),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1),
    "gptj": dict(n_embd=64, n_layer=4, n_head=4, rotary_dim=8),
    "deberta-v2": dict(pad_token_id=0),
    "gpt_neo": dict(num_layers=4, num_heads=4, attention_types=[[["global", "local"], 2]], window_size=16),
    "glm4": dict(pad_token_id=0),
    "smollm3": dict(pad_token_id=0),
    "olmo_hybrid": dict(pad_token_id=0),
    "kimi_linear": dict(pad_token_id=0),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=4, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "mamba2": dict(num_heads=2, head_dim=64, n_groups=1, state_size=8, expand=2),
    "helium": dict(head_dim=16),
    "hunyuan_v1_dense": dict(head_dim=16),
    "ministral": dict(head_dim=16),
    "codegen": dict(n_embd=64, n_layer=4, n_head=4, rotary_dim=8),
    "deepseek_v2": dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
    "minicpm3": dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                     qk_nope_head_dim=8, v_head_dim=16),
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                  n_group=1, topk_group=1, head_dim=16, n_shared_experts=1),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"] * 2, mamba_d_state=8, mamba_expand=2, n_mamba_heads=2,
                   mamba_headdim=64, attention_head_dim=16, kv_channels=16, num_key_value_heads=4, adapter_rank=8),
    "gemma3n_text": dict(head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
                         num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=1000,
                         intermediate_size=[128] * 4, laurel_rank=8),
}
MASKED = {"roberta", "deberta-v2", "electra", "bert"}
MODELS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "olmo2", "cohere", "starcoder2",
          "granite", "gpt_neox", "falcon", "bloom", "opt", "gptj", "mixtral", "qwen3_moe", "gpt_oss",
          "deepseek_v3", "mamba", "jamba", "recurrent_gemma", "bert", "roberta", "deberta-v2", "electra"]
# Swept first on 2026-12-06 (docs/BENCHMARKS.md, "52 more architectures"): `--models more`, or `--models all` for both.
MORE = ["gpt2", "gpt_bigcode", "gpt_neo", "codegen", "phi", "gemma", "stablelm", "nemotron", "glm4", "olmo3", "smollm3",
        "exaone4", "cohere2", "ernie4_5", "helium", "hunyuan_v1_dense", "ministral", "seed_oss", "apertus", "arcee",
        "doge", "diffllama", "bitnet", "internlm3", "minicpm3", "vaultgemma", "granite_swa", "mpt", "biogpt", "xglm",
        "minimax", "llama4_text", "gemma4_text", "qwen3_5_text", "deepseek_v2", "granitemoe", "qwen2_moe", "olmoe",
        "phimoe", "dbrx", "glm4_moe", "qwen3_next", "kimi_linear", "mamba2", "falcon_mamba", "bamba", "falcon_h1",
        "nemotron_h", "lfm2", "olmo_hybrid", "xlstm", "rwkv"]

# Swept first later on 2026-12-06 (docs/BENCHMARKS.md, "57 further Transformers architectures"): `--models further`;
# each is built with pad_token_id=0 (several configs default to a pad id beyond the small vocabulary).
FURTHER_EXTRA = {
    "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, head_dim=16),
    "cohere2_moe": dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, head_dim=16),
    "cwm": dict(head_dim=16),
    "deepseek_v32": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         n_group=1, topk_group=1, first_k_dense_replace=1, head_dim=16, kv_lora_rank=16,
                         q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
    "deepseek_v4": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        head_dim=16, q_lora_rank=32, qk_rope_head_dim=8),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
                       n_group=1, topk_group=1, first_k_dense_replace=1),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2),
    "glm": dict(head_dim=16),
    "glm4_moe_lite": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                          n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                          qk_nope_head_dim=8, v_head_dim=16),
    "glm_moe_dsa": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        n_group=1, topk_group=1, first_k_dense_replace=1, head_dim=16, kv_lora_rank=16,
                        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
    "granitemoe_swa": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoehybrid": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, head_dim=16),
    "hy_v3": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, head_dim=16),
    "hy_v4": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1,
                  topk_group=1, head_dim=16, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=16),
    "jais2": dict(head_dim=16),
    "laguna": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "lfm3": dict(head_dim=16),
    "mellum": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "mimo_v2_flash": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
                          topk_group=1, head_dim=16, v_head_dim=16),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "ministral3": dict(head_dim=16),
    "qwen3_5_moe_text": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "solar_open": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                       n_group=1, topk_group=1, head_dim=16),
    "kolibri1": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "flint": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "nomic_bert": dict(head_dim=16),
    "eurobert": dict(head_dim=16, num_key_value_heads=4),
}
FURTHER = ["zamba2", "gemma3n_text", "dots1", "jetmoe", "afmoe", "cohere2_moe", "cwm", "deepseek_v32", "deepseek_v4",
           "ernie4_5_moe", "exaone_moe", "flex_olmo", "glm", "glm4_moe_lite", "glm_moe_dsa", "granitemoe_swa",
           "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "jais2", "laguna", "lfm3",
           "mellum", "mimo_v2_flash", "minimax_m2", "ministral3", "modernbert-decoder", "nanochat", "olmo", "persimmon",
           "qwen3_5_moe_text", "solar_open", "kolibri1", "flint", "distilbert", "modernbert", "megatron-bert",
           "roformer", "convbert", "esm", "xlm-roberta", "camembert", "data2vec-text", "ernie", "rembert",
           "roberta-prelayernorm", "nomic_bert", "eurobert", "yoso", "nystromformer", "mra", "fnet", "big_bird",
           "longformer", "deberta"]
FURTHER_MASKED = {"distilbert", "modernbert", "megatron-bert", "roformer", "convbert", "esm", "xlm-roberta",
                  "camembert", "data2vec-text", "ernie", "rembert", "roberta-prelayernorm", "nomic_bert", "eurobert",
                  "yoso", "nystromformer", "mra", "fnet", "big_bird", "longformer", "deberta"}

# Vision-language models (2026-12-07, the sixty-ninth session: `--models vision`): each a tiny vision tower (2 layers
# of width 32 on 32x32 images; Mllama's 16x16, one tile) and a text model of COMMON's size, trained on batches with an
# image each. Their GradientCheckpointingLayers, the vision tower's then the text model's (Mllama: its text layers,
# one of them cross-attention), are one chain; "llava-2" is Llava under its default vision_feature_layer=-2, whose
# last vision layer's output the loss never reads.
VISION = ["llava", "llava-2", "qwen2_vl", "gemma3", "paligemma", "idefics3", "mllama"]
IMAGE_TOKEN = 999  # the image placeholder in every vision model's text (996-998: their other special tokens)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                   patch_size=8)
TEXT = dict(COMMON, pad_token_id=0)


def build_vision(kind: str):
    """The vision-language model `kind` of VISION, from tiny configs (nothing downloaded), in training mode."""
    import transformers as t
    torch.manual_seed(0)
    if kind in ("llava", "llava-2"):
        cfg = t.LlavaConfig(vision_config=t.CLIPVisionConfig(**TINY_VISION, projection_dim=32),
                            text_config=t.LlamaConfig(**TEXT), image_token_id=IMAGE_TOKEN,
                            vision_feature_layer=-2 if kind == "llava-2" else -1)
        return t.LlavaForConditionalGeneration(cfg).train()
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2)
        text = dict(TEXT, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0))
        cfg = t.Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                              vision_start_token_id=997, vision_end_token_id=998, video_token_id=996)
        return t.Qwen2VLForConditionalGeneration(cfg).train()
    if kind == "gemma3":
        text = t.Gemma3TextConfig(**TEXT, **EXTRA["gemma3_text"])
        cfg = t.Gemma3Config(text_config=text, vision_config=t.SiglipVisionConfig(**TINY_VISION),
                             mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=997,
                             eoi_token_index=998)
        return t.Gemma3ForConditionalGeneration(cfg).train()
    if kind == "paligemma":
        cfg = t.PaliGemmaConfig(vision_config=t.SiglipVisionConfig(**TINY_VISION, projection_dim=64),
                                text_config=t.GemmaConfig(**TEXT, head_dim=16), image_token_index=IMAGE_TOKEN,
                                projection_dim=64)
        return t.PaliGemmaForConditionalGeneration(cfg).train()
    if kind == "idefics3":
        cfg = t.Idefics3Config(vision_config=TINY_VISION, text_config=dict(TEXT, model_type="llama"),
                               image_token_id=IMAGE_TOKEN, scale_factor=2)
        return t.Idefics3ForConditionalGeneration(cfg).train()
    if kind == "mllama":
        vision = dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                      intermediate_size=64, vision_output_dim=64, intermediate_layers_indices=[0], image_size=16,
                      patch_size=8, max_num_tiles=1, supported_aspect_ratios=[[1, 1]])
        text = dict(TEXT, cross_attention_layers=[1], bos_token_id=1, eos_token_id=2)
        cfg = t.MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
        return t.MllamaForConditionalGeneration(cfg).train()
    raise ValueError(f"architectures: no vision-language model {kind!r}")


def vision_batch(model, ids: torch.Tensor, g: torch.Generator) -> dict:
    """A batch of `ids` with an image each: the model's image placeholders written into the text and its pixel
    inputs (and the inputs the model asks for beside them)."""
    b, kind = ids.shape[0], model.config.model_type
    out = {}
    if kind == "qwen2_vl":  # a 4x4 grid of patches, merged 2x2: four image tokens after a vision-start token
        ids[:, 1], ids[:, 2:6], ids[:, 6] = 997, IMAGE_TOKEN, 998
        out.update(pixel_values=torch.randn((b * 16, 96), generator=g),
                   image_grid_thw=torch.tensor([[1, 4, 4]] * b), mm_token_type_ids=(ids == IMAGE_TOKEN).int())
    elif kind == "mllama":
        ids[:, 1] = IMAGE_TOKEN
        out.update(pixel_values=torch.randn((b, 1, 1, 3, 16, 16), generator=g),
                   aspect_ratio_ids=torch.ones((b, 1), dtype=torch.long),
                   aspect_ratio_mask=torch.ones((b, 1, 1), dtype=torch.long),
                   cross_attention_mask=torch.ones((b, ids.shape[1], 1, 1), dtype=torch.long))
    else:
        tokens = {"llava": 16, "paligemma": 16, "gemma3": 4, "idefics3": 4}[kind]
        start = 0 if kind == "paligemma" else 2  # (PaliGemma's image comes first)
        ids[:, start:start + tokens] = IMAGE_TOKEN
        shape = (b, 1, 3, 32, 32) if kind == "idefics3" else (b, 3, 32, 32)
        out["pixel_values"] = torch.randn(shape, generator=g)
        if kind in ("gemma3", "paligemma"):
            out["token_type_ids"] = (ids == IMAGE_TOKEN).long() if kind == "gemma3" else torch.zeros_like(ids)
    out["use_cache"] = False  # (the text config's; as for the text models)
    return out


def build(kind: str):
    import transformers
    if kind in VISION:
        return build_vision(kind)
    torch.manual_seed(0)
    further = dict(pad_token_id=0, **FURTHER_EXTRA.get(kind, {})) if kind in FURTHER else {}
    cfg = transformers.AutoConfig.for_model(kind, **{**COMMON, **EXTRA.get(kind, {}), **further})
    masked = kind in MASKED or kind in FURTHER_MASKED
    auto = transformers.AutoModelForMaskedLM if masked else transformers.AutoModelForCausalLM
    return auto.from_config(cfg).train()


def batch(model, k: int, size: tuple[int, int]) -> dict:
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(1, 1000, size, generator=g)
    b = dict(input_ids=ids, labels=ids)
    if hasattr(model.config, "vision_config"):
        ids.clamp_(max=IMAGE_TOKEN - 4)  # (below the special tokens)
        b.update(vision_batch(model, ids, g), labels=ids.clone())
    if getattr(model.config, "use_cache", None) is not None:
        b["use_cache"] = False
    return b


AUTOCAST = False  # --autocast bf16: the forward and the loss under CPU bf16 autocast, the backward after


def step(model, k: int, size, meter):
    """Training step k as a loop that keeps only the loss runs it (test_hf.step's, but the model's output let go
    of before the backward): (loss, gradients, peak above the step's base, the next random draw), as test_hf.same
    compares them."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1000 + k)
    b = batch(model, k, size)
    base = meter.active()
    meter.reset_peak()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST):
        loss = model(**b).loss
    loss.backward()
    peak = meter.peak() - base
    return (loss.detach(), [p.grad.clone() if p.grad is not None else None for p in model.parameters()], peak,
            torch.rand(4))


def same(a, b) -> bool:
    """Whether two steps are equal bitwise (test_hf.same: the loss, every gradient, the next random draw)."""
    try:
        test_hf.same(a, b)
    except AssertionError:
        return False
    return True


def checkpointed_plan(n: int) -> str:
    """The per-layer plan of n layers that checkpoints every one."""
    return " ".join([f"Fc{i}" for i in range(n)] + ["L"]
                    + [f"{op}{i}" for i in reversed(range(n)) for op in ("Fa", "B")])


def random_plans(lp, model, want, delays, size, meter, plans: int, seed: int, checkpointed: bool = False) -> list[dict]:
    """`plans` random per-layer plans (given_plan_predictions.draw, seeded by `seed` and the model's name) run
    in place of the planner's, after the plan that checkpoints every layer where `checkpointed`, each step under
    each engine: the runs' figures, as sweep() records them."""
    import random
    from conftest import give_plan
    from given_plan_predictions import draw
    rng = random.Random(f"{seed}:{model.config.model_type}")
    runs = []
    n = len(lp.chain.stages)
    for k in range(plans + checkpointed):
        text, windows = (checkpointed_plan(n), None) if checkpointed and k == 0 else draw(lp.chain, rng)
        _, predicted = give_plan(lp, text.split(), **({} if windows is None else dict(stream_windows=windows)),
                                 policies=list(lp.chain.policies))
        for delay in delays:
            lp.offloads.engines[torch.device("cpu")] = CopyEngine(torch.device("cpu"), delay=delay) if delay else \
                CopyEngine(torch.device("cpu"), hold=True)
            got = step(model, 1, size, meter)
            runs.append(dict(delay=delay, plan=text, bitwise=same(want[1], got), peak_bytes=got[2],
                             predicted_bytes=predicted, error=got[2] / predicted - 1))
    return runs


def sweep(kind: str, fractions, delays, size, meter, plans: int = 0, seed: int = 0,
          checkpointed: bool = False) -> dict:
    row = dict(model=kind)
    plain = build(kind)
    want = [step(plain, k, size, meter) for k in range(3)]
    hf = build(kind)
    try:
        test_hf.hf_checkpointing(hf)
        row["hf_peak_bytes"] = step(hf, 0, size, meter)[2]
    except ValueError as e:  # JetMoE's: "does not support activation checkpointing"; the rest of the row still runs
        row["hf_peak_bytes"], row["hf_refused"] = None, str(e)
    del plain, hf
    model = build(kind)
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, groups=True, offload_min_bytes=1 << 10)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        bitwise = same(want[0], step(model, 0, size, meter))
    row["warnings"] = [str(w.message) for w in seen if str(w.message).startswith("remat")]
    row["least_bytes"] = lp.min_budget_bytes
    top = remat.step_peak_bytes(lp.chain, lp.context, remat.no_checkpoint(lp.chain))
    if plans or checkpointed:
        runs = random_plans(lp, model, want, delays, size, meter, plans, seed, checkpointed)
        row.update(bitwise=bitwise and all(r["bitwise"] for r in runs), runs=runs)
        return row
    runs = []
    for delay in delays:
        lp.offloads.engines[torch.device("cpu")] = CopyEngine(torch.device("cpu"), delay=delay) if delay else \
            CopyEngine(torch.device("cpu"), hold=True)
        for f in fractions:
            lp.set_budget(int(lp.min_budget_bytes + f * (top - lp.min_budget_bytes)))
            for k in (1, 2):
                got = step(model, k, size, meter)
                equal = same(want[k], got)
                bitwise = bitwise and equal
                runs.append(dict(delay=delay, fraction=f, step=k, plan=str(lp.plan), bitwise=equal, peak_bytes=got[2],
                                 predicted_bytes=lp.predicted_peak_bytes,
                                 error=got[2] / lp.predicted_peak_bytes - 1))
    row.update(bitwise=bitwise, runs=runs)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS),
                    help="model types, comma-separated (AutoConfig's names); 'more': the 52 swept since 2026-12-06, "
                         "'further': the 57 swept since the session after, 'vision': the 7 vision-language models "
                         "of VISION (batches with an image each), 'all': the four lists")
    ap.add_argument("--budgets", default="0,0.2,0.4,0.7",
                    help="shares of the way from the least budget to the plain step's predicted peak")
    ap.add_argument("--delay", type=int, default=100, help="the late engine's delay (copies waited for); 0: none")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--autocast", choices=["bf16"], help="the forward and the loss under CPU autocast")
    ap.add_argument("--json", help="write every step's figures here")
    ap.add_argument("--random", type=int, default=0, metavar="N",
                    help="N random per-layer plans per model in place of the budgets' (every way, group assignments)")
    ap.add_argument("--seed", type=int, default=0, help="with --random: the plans' seed")
    ap.add_argument("--checkpointed", action="store_true",
                    help="also (or with --random 0, only) the plan that checkpoints every layer, in place of the "
                         "budgets'")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True): without it GPT-OSS's plain CPU step is itself not "
                         "always the same (its experts' bias gradients, summed by parallel atomic adds)")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(args.deterministic)
    global AUTOCAST
    AUTOCAST = args.autocast == "bf16"
    warnings.simplefilter("ignore")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    fractions = [float(f) for f in args.budgets.split(",")]
    delays = [0] + ([args.delay] if args.delay else [])
    meter = remat.cpu_meter()
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; batch {args.batch}, sequence "
          f"{args.seq}; " + ("every layer checkpointed" + (", then " if args.random else "") if args.checkpointed
                             else "")
          + (f"{args.random} random plans each (seed {args.seed})" if args.random else
             "" if args.checkpointed else f"budgets {args.budgets} of the way up")
          + f"; copies at once and delayed {args.delay}"
          + ("; forward and loss under CPU bf16 autocast" if AUTOCAST else "")
          + ("; deterministic algorithms" if args.deterministic else ""))
    rows = []
    head = f"{'model':16} {'bitwise':8} {'least/hf':>8}   {'at once: error min..max':>24}   {'delayed':>16}   warned"
    print(head)
    kinds = {"more": MORE, "further": FURTHER, "vision": VISION,
             "all": MODELS + MORE + FURTHER + VISION}.get(args.models, args.models.split(","))
    for kind in kinds:
        try:
            row = sweep(kind, fractions, delays, (args.batch, args.seq), meter, args.random, args.seed,
                        args.checkpointed)
        except Exception as e:  # an architecture this transformers lacks, or a config it refuses
            print(f"{kind:16} not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            if os.environ.get("REMAT_DEBUG"):
                traceback.print_exc()
            rows.append(dict(model=kind, error=f"{type(e).__name__}: {e}"))
            continue
        rows.append(row)
        cells = []
        for delay in delays:
            errs = [r["error"] for r in row["runs"] if r["delay"] == delay]
            cells.append(f"{100 * min(errs):+7.2f}%..{100 * max(errs):+6.2f}%")
        least = f"{row['least_bytes'] / row['hf_peak_bytes']:8.3f}" if row["hf_peak_bytes"] else f"{'-':>8}"
        print(f"{kind:16} {'yes' if row['bitwise'] else 'NO':8} {least}   "
              f"{cells[0]:>24}   {cells[-1] if len(cells) > 1 else '':>16}   {'yes' if row['warnings'] else 'no'}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r.get("bitwise", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
