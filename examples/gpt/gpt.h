#pragma once
// A GPT as LibTorch users write it: a C++ port of nanoGPT's model.py (Karpathy), with its blocks in a
// torch::nn::ModuleList, causal self-attention with a registered mask buffer, the token embedding tied to the
// head, and dropout everywhere. Nothing in it knows about remat but the one place a model offers
// checkpointing, as Hugging Face's models do: GPTImpl::blocks runs each block through remat::checkpoint when
// asked to. Used by examples/gpt/main.cpp.
#include <torch/torch.h>

#include <remat/checkpoint.h>
#include <remat/planned.h>

#include <cmath>
#include <optional>

namespace gpt_example {

struct GPTConfig {
  int64_t vocab_size = 65;  // nanoGPT's Shakespeare characters
  int64_t block_size = 256;
  int64_t n_layer = 6;
  int64_t n_head = 6;
  int64_t n_embd = 384;
  double dropout = 0.2;
};

struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& c) : n_head(c.n_head), n_embd(c.n_embd) {
    c_attn = register_module("c_attn", torch::nn::Linear(c.n_embd, 3 * c.n_embd));
    c_proj = register_module("c_proj", torch::nn::Linear(c.n_embd, c.n_embd));
    attn_dropout = register_module("attn_dropout", torch::nn::Dropout(c.dropout));
    resid_dropout = register_module("resid_dropout", torch::nn::Dropout(c.dropout));
    // The causal mask, a buffer as in nanoGPT's manual attention path.
    bias = register_buffer(
        "bias",
        torch::tril(torch::ones({c.block_size, c.block_size})).view({1, 1, c.block_size, c.block_size}));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    using torch::indexing::Slice;
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto qkv = c_attn(x).split(n_embd, 2);
    auto q = qkv[0].view({B, T, n_head, C / n_head}).transpose(1, 2);  // (B, nh, T, hs)
    auto k = qkv[1].view({B, T, n_head, C / n_head}).transpose(1, 2);
    auto v = qkv[2].view({B, T, n_head, C / n_head}).transpose(1, 2);
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(k.size(-1))));
    att = att.masked_fill(bias.index({Slice(), Slice(), Slice(0, T), Slice(0, T)}) == 0,
                          -std::numeric_limits<float>::infinity());
    att = attn_dropout(torch::softmax(att, -1));
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
    return resid_dropout(c_proj(y));
  }

  int64_t n_head, n_embd;
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
  torch::nn::Dropout attn_dropout{nullptr}, resid_dropout{nullptr};
  torch::Tensor bias;
};
TORCH_MODULE(CausalSelfAttention);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const GPTConfig& c) {
    c_fc = register_module("c_fc", torch::nn::Linear(c.n_embd, 4 * c.n_embd));
    c_proj = register_module("c_proj", torch::nn::Linear(4 * c.n_embd, c.n_embd));
    dropout = register_module("dropout", torch::nn::Dropout(c.dropout));
  }
  torch::Tensor forward(const torch::Tensor& x) { return dropout(c_proj(torch::gelu(c_fc(x)))); }

  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(MLP);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
    attn = register_module("attn", CausalSelfAttention(c));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
    mlp = register_module("mlp", MLP(c));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c) : config(c) {
    wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd));
    wpe = register_module("wpe", torch::nn::Embedding(c.block_size, c.n_embd));
    drop = register_module("drop", torch::nn::Dropout(c.dropout));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_layer; ++i)
      h->push_back(Block(c));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
    // nanoGPT's initialisation: N(0, 0.02) weights, zero biases, the residual projections scaled down.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.key().find("ln_") != std::string::npos) continue;
      if (p.key().size() >= 4 && p.key().compare(p.key().size() - 4, 4, "bias") == 0) {
        p.value().zero_();
      } else {
        const bool residual = p.key().find("c_proj.weight") != std::string::npos;
        p.value().normal_(0.0, residual ? 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer)) : 0.02);
      }
    }
  }

  /// Token and position embeddings: idx (B, T) of token ids -> (B, T, n_embd).
  torch::Tensor embed(const torch::Tensor& idx) {
    const auto pos = torch::arange(idx.size(1), idx.options());
    return drop(wte(idx) + wpe(pos));
  }
  /// The blocks, each checkpointed with `checkpointing` when it is set (the one remat-aware line: what the
  /// ModuleList hands out, given its type).
  torch::Tensor blocks(torch::Tensor x) {
    if (planned) return planned->forward(x);  // planning in place: the loop below, planned for a budget
    for (size_t i = 0; i < h->size(); ++i) {
      BlockImpl* block = (*h)[i]->as<BlockImpl>();
      x = checkpointing ? remat::checkpoint(block, x, *checkpointing) : block->forward(x);
    }
    return x;
  }
  /// The final LayerNorm and the head, tied to the token embedding: (B, T, n_embd) -> (B, T, vocab) logits.
  torch::Tensor head(const torch::Tensor& x) { return torch::nn::functional::linear(ln_f(x), wte->weight); }

  torch::Tensor forward(const torch::Tensor& idx) { return head(blocks(embed(idx))); }

  /// The cross-entropy of the next-token logits against targets (B, T).
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets) {
    const auto logits = forward(idx);
    return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), targets.view({-1}));
  }

  GPTConfig config;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  std::optional<remat::CheckpointOptions> checkpointing;  // per block when set
  remat::Planned planned{nullptr};                        // the blocks planned in place when set

  /// Planning in place, in one line: the blocks become a remat::Planned for `options`' budget.
  void gradient_checkpointing_enable(const remat::PlannedOptions& options) {
    planned = remat::Planned(remat::stages_at<BlockImpl>(*this, {"h"}), options);
  }
};
TORCH_MODULE(GPT);

}  // namespace gpt_example
