#pragma once
/// \file
/// A BERT encoder (Devlin et al. 2019) with the configuration fields users know from Hugging Face, and
/// gradient_checkpointing_enable() as in transformers.
///
///   auto config = remat::models::BertConfig::base().num_hidden_layers(12);
///   remat::models::BertModel bert(config);
///   bert->gradient_checkpointing_enable();                    // every layer is a checkpoint
///   bert->gradient_checkpointing_enable(remat::PlannedOptions().budget(1LL << 30));   // or planned, 1 GiB
///   auto hidden = bert->forward(input_ids, attention_mask);   // last_hidden_state [batch, seq, hidden]
///   hidden.mean().backward();

#include <remat/models/checkpointable.h>
#include <remat/planner/plan.h>
#include <remat/sequential.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <optional>

namespace remat::models {

/// The configuration of BertModel (the fields and defaults of Hugging Face's BertConfig).
struct BertConfig {
  /// BERT-base: 12 layers, hidden 768, 12 heads, intermediate 3072.
  static BertConfig base() { return BertConfig(); }
  /// BERT-large, as in the gradient checkpointing article: 24 layers, hidden 1024, 16 heads, intermediate
  /// 4096.
  static BertConfig large() {
    return BertConfig().num_hidden_layers(24).hidden_size(1024).num_attention_heads(16).intermediate_size(
        4096);
  }

  TORCH_ARG(int64_t, vocab_size) = 30522;
  TORCH_ARG(int64_t, hidden_size) = 768;
  TORCH_ARG(int64_t, num_hidden_layers) = 12;
  TORCH_ARG(int64_t, num_attention_heads) = 12;
  TORCH_ARG(int64_t, intermediate_size) = 3072;
  TORCH_ARG(int64_t, max_position_embeddings) = 512;
  TORCH_ARG(int64_t, type_vocab_size) = 2;
  TORCH_ARG(double, hidden_dropout_prob) = 0.1;
  TORCH_ARG(double, attention_probs_dropout_prob) = 0.1;
  TORCH_ARG(double, layer_norm_eps) = 1e-12;
  /// Standard deviation of the normal initialisation of weights (biases 0, LayerNorm 1 and 0), as in BERT.
  TORCH_ARG(double, initializer_range) = 0.02;
};

/// Word, position and token-type embeddings, summed, then LayerNorm and dropout.
class BertEmbeddingsImpl : public torch::nn::Module {
 public:
  /// Initialised as BERT: weights normal(0, initializer_range), LayerNorm 1 and 0.
  explicit BertEmbeddingsImpl(const BertConfig& config);
  /// [batch, seq, hidden] for ids and token types [batch, seq] (int64; checked by BertModel, not here).
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& token_type_ids);

  torch::nn::Embedding word_embeddings{nullptr}, position_embeddings{nullptr}, token_type_embeddings{nullptr};
  torch::nn::LayerNorm layer_norm{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(BertEmbeddings);

/// One encoder layer: multi-head self-attention with the attention mask, output projection, residual +
/// LayerNorm, GELU feed-forward, residual + LayerNorm.
class BertLayerImpl : public torch::nn::Module {
 public:
  /// Linear weights normal(0, initializer_range), biases 0.
  explicit BertLayerImpl(const BertConfig& config);
  /// hidden [batch, seq, hidden]; extended_mask [batch, 1, 1, seq], 0 where attended and -10000 where masked.
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& extended_mask);

  /// forward() in five pieces, the sub-layer stages (Granularity::kSublayer): each takes the previous one's
  /// output, and the residual a later piece needs rides along, concatenated on the last dimension (H hidden,
  /// I intermediate). Their composition equals forward(), dropout masks included.
  /// qkv: hidden [B,S,H] -> [B,S,4H] (query | key | value | hidden).
  torch::Tensor qkv(const torch::Tensor& hidden);
  /// attention_core: scores, mask, softmax, dropout, context: [B,S,4H] -> [B,S,2H] (context | hidden).
  torch::Tensor attention_core(const torch::Tensor& qkv_hidden, const torch::Tensor& extended_mask);
  /// attention_out: projection, dropout, residual, LayerNorm: [B,S,2H] -> attended [B,S,H].
  torch::Tensor attention_out(const torch::Tensor& context_hidden);
  /// ffn_up: intermediate projection and GELU: attended [B,S,H] -> [B,S,I+H] (gelu | attended).
  torch::Tensor ffn_up(const torch::Tensor& attended);
  /// ffn_down: output projection, dropout, residual, LayerNorm: [B,S,I+H] -> [B,S,H].
  torch::Tensor ffn_down(const torch::Tensor& gelu_attended);

  torch::nn::Linear query{nullptr}, key{nullptr}, value{nullptr}, attention_output{nullptr};
  torch::nn::Linear intermediate{nullptr}, output{nullptr};
  torch::nn::LayerNorm attention_norm{nullptr}, output_norm{nullptr};
  torch::nn::Dropout attention_dropout{nullptr}, hidden_dropout{nullptr};

 private:
  int64_t heads_, head_size_;
};
TORCH_MODULE(BertLayer);

/// The encoder: embeddings, N layers, and a pooler (dense + tanh over the first token).
class BertModelImpl : public torch::nn::Module, public Checkpointable {
 public:
  /// Throws c10::Error naming the field, its value and the limit when a size is < 1, hidden_size is not
  /// divisible by num_attention_heads, or a dropout probability is not in [0, 1).
  explicit BertModelImpl(const BertConfig& config = BertConfig::base());

  /// last_hidden_state [batch, seq, hidden] for input_ids [batch, seq] (int64). attention_mask [batch, seq]
  /// (1 attend, 0 masked; any dtype) defaults to all ones, token_type_ids to all zeros. Throws c10::Error,
  /// before any compute, naming the value and the limit when the sequence is longer than
  /// max_position_embeddings, an id is negative or >= vocab_size (or a type id >= type_vocab_size), or shapes
  /// disagree.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask = {},
                        const torch::Tensor& token_type_ids = {});

  /// The pooled output [batch, hidden]: tanh(dense(last_hidden_state[:, 0])).
  torch::Tensor pool(const torch::Tensor& last_hidden_state);

  /// Checkpoints every n-th encoder layer (layers 0, n, 2n, ...; every layer by default) with `options`.
  /// Throws c10::Error when every_n_layers < 1.
  void gradient_checkpointing_enable(CheckpointOptions options = {}, int64_t every_n_layers = 1);
  /// Plans the encoder layers in place for a budget (remat::Planned, remat/planned.h; the attention mask
  /// is passed to them as its extra argument): the first training step (per input shape) profiles them where
  /// they run, the next runs the plan optimal() finds; the embeddings' output and what they saved are the
  /// base the budget is above. Replaces per-layer checkpointing until the next
  /// gradient_checkpointing_enable(CheckpointOptions). Throws c10::Error when the budget is not positive,
  /// and, at the planning step, as PlannedImpl::forward does.
  ///
  ///   bert->gradient_checkpointing_enable(remat::PlannedOptions().budget(2LL << 30));   // 2 GiB
  void gradient_checkpointing_enable(PlannedOptions options);
  /// The layers' Planned (its plan, profile, predicted and measured peaks), or nullptr before the first
  /// forward pass after gradient_checkpointing_enable(PlannedOptions).
  const PlannedImpl* planned() const { return planned_.is_empty() ? nullptr : planned_.get(); }
  /// The n of gradient_checkpointing_enable.
  int64_t checkpoint_every_n_layers() const { return every_n_layers_; }

  /// The model as a chain of stages for the profiler and the plan executor: "embeddings" (input_ids to
  /// hidden), then per layer "layer{i}" (kLayer), or its five pieces "layer{i}.qkv", ".attention_core",
  /// ".attention_out", ".ffn_up", ".ffn_down" (kSublayer, see BertLayerImpl::qkv), and with_pooler a "pooler"
  /// head. The mask and token types are captured. kSublayer stages pass the residual along by concatenation,
  /// which costs a copy per piece: it pays where a plan keeps some pieces and recomputes others (the
  /// selective preset), not for plans that only cut at layer boundaries.
  std::vector<StageFn> stages(const torch::Tensor& input_ids, const torch::Tensor& attention_mask = {},
                              const torch::Tensor& token_type_ids = {}, bool with_pooler = false,
                              Granularity granularity = Granularity::kLayer);
  /// Stages per layer at a granularity (1 or 5).
  static int64_t stages_per_layer(Granularity granularity);

  /// Runs forward() with a plan (remat/planner/plan.h) over stages() instead of per-layer checkpointing: the
  /// plan must have num_hidden_layers + 1 stages; the preserve_rng_state and determinism_check of the last
  /// gradient_checkpointing_enable apply. Throws c10::Error when it does not.
  void use_plan(Plan plan, Granularity granularity = Granularity::kLayer);
  /// Megatron-style selective checkpointing: runs forward() with use_plan over the sub-layer stages,
  /// recomputing only each layer's attention core (scores, softmax, dropout, context: the [batch, heads, seq,
  /// seq] tensors) and keeping everything else, projections included.
  void selective_checkpointing_enable();
  /// The plan of selective_checkpointing_enable: remat::checkpoint_stages over the ".attention_core" stages.
  Plan selective_checkpointing_plan() const;
  /// Back to plain or per-layer checkpointed forward().
  void clear_plan() { plan_.reset(); }
  const std::optional<Plan>& plan() const { return plan_; }
  /// The granularity of the plan in use.
  Granularity plan_granularity() const { return plan_granularity_; }

  const BertConfig& config() const { return config_; }
  BertEmbeddings embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::Linear pooler{nullptr};

 private:
  void check_inputs(const torch::Tensor& input_ids, const torch::Tensor& attention_mask,
                    const torch::Tensor& token_type_ids) const;
  torch::Tensor extended_mask(const torch::Tensor& input_ids, const torch::Tensor& attention_mask) const;
  torch::Tensor token_types(const torch::Tensor& input_ids, const torch::Tensor& token_type_ids) const;

  BertConfig config_;
  int64_t every_n_layers_ = 1;
  std::optional<Plan> plan_;
  Granularity plan_granularity_ = Granularity::kLayer;
};
TORCH_MODULE(BertModel);

}  // namespace remat::models
