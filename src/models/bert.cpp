#include "remat/models/bert.h"

#include <torch/nn/init.h>

#include <cmath>

#include "kept.h"

namespace remat::models {
namespace {

constexpr const char* kWho = "remat::models::BertModel";

void init_linear(torch::nn::Linear& l, double std) {
  torch::nn::init::normal_(l->weight, 0.0, std);
  torch::nn::init::zeros_(l->bias);
}

torch::nn::LayerNorm layer_norm(const BertConfig& c) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size()}).eps(c.layer_norm_eps()));
}

}  // namespace

BertEmbeddingsImpl::BertEmbeddingsImpl(const BertConfig& c)
    : word_embeddings(
          register_module("word_embeddings", torch::nn::Embedding(c.vocab_size(), c.hidden_size()))),
      position_embeddings(register_module(
          "position_embeddings", torch::nn::Embedding(c.max_position_embeddings(), c.hidden_size()))),
      token_type_embeddings(register_module("token_type_embeddings",
                                            torch::nn::Embedding(c.type_vocab_size(), c.hidden_size()))),
      layer_norm(register_module("layer_norm", models::layer_norm(c))),
      dropout(register_module("dropout", torch::nn::Dropout(c.hidden_dropout_prob()))) {
  torch::NoGradGuard no_grad;
  for (auto* e : {&word_embeddings, &position_embeddings, &token_type_embeddings}) {
    torch::nn::init::normal_((*e)->weight, 0.0, c.initializer_range());
  }
}

torch::Tensor BertEmbeddingsImpl::forward(const torch::Tensor& input_ids,
                                          const torch::Tensor& token_type_ids) {
  const int64_t seq = input_ids.size(1);
  auto positions = torch::arange(seq, input_ids.options().dtype(torch::kLong)).unsqueeze(0);
  auto h =
      word_embeddings(input_ids) + position_embeddings(positions) + token_type_embeddings(token_type_ids);
  return dropout(layer_norm(h));
}

BertLayerImpl::BertLayerImpl(const BertConfig& c)
    : query(register_module("query", torch::nn::Linear(c.hidden_size(), c.hidden_size()))),
      key(register_module("key", torch::nn::Linear(c.hidden_size(), c.hidden_size()))),
      value(register_module("value", torch::nn::Linear(c.hidden_size(), c.hidden_size()))),
      attention_output(
          register_module("attention_output", torch::nn::Linear(c.hidden_size(), c.hidden_size()))),
      intermediate(
          register_module("intermediate", torch::nn::Linear(c.hidden_size(), c.intermediate_size()))),
      output(register_module("output", torch::nn::Linear(c.intermediate_size(), c.hidden_size()))),
      attention_norm(register_module("attention_norm", layer_norm(c))),
      output_norm(register_module("output_norm", layer_norm(c))),
      attention_dropout(
          register_module("attention_dropout", torch::nn::Dropout(c.attention_probs_dropout_prob()))),
      hidden_dropout(register_module("hidden_dropout", torch::nn::Dropout(c.hidden_dropout_prob()))),
      heads_(c.num_attention_heads()),
      head_size_(c.hidden_size() / c.num_attention_heads()) {
  torch::NoGradGuard no_grad;
  for (auto* l : {&query, &key, &value, &attention_output, &intermediate, &output})
    init_linear(*l, c.initializer_range());
}

torch::Tensor BertLayerImpl::forward(const torch::Tensor& hidden, const torch::Tensor& extended_mask) {
  const int64_t batch = hidden.size(0), seq = hidden.size(1), width = hidden.size(2);
  auto heads = [&](const torch::Tensor& t) {
    return t.view({batch, seq, heads_, head_size_}).transpose(1, 2);
  };
  using detail::kept_linear;
  using detail::kept_matmul;
  // The matrix multiplications are marked for selective checkpointing (CheckpointOptions::keep), their
  // operands made contiguous first (matmul would copy them anyway) so that what they save are views.
  auto q = heads(kept_linear(query, hidden)).contiguous(), k = heads(kept_linear(key, hidden)).contiguous(),
       v = heads(kept_linear(value, hidden)).contiguous();
  auto scores = kept_matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(head_size_));
  auto probs = attention_dropout(torch::softmax(scores + extended_mask, -1));
  auto context = kept_matmul(probs, v).transpose(1, 2).reshape({batch, seq, width});
  auto attended = attention_norm(hidden_dropout(kept_linear(attention_output, context)) + hidden);
  return output_norm(hidden_dropout(kept_linear(output, torch::gelu(kept_linear(intermediate, attended)))) +
                     attended);
}

torch::Tensor BertLayerImpl::qkv(const torch::Tensor& hidden) {
  return torch::cat({query(hidden), key(hidden), value(hidden), hidden}, -1);
}

torch::Tensor BertLayerImpl::attention_core(const torch::Tensor& qkvh, const torch::Tensor& extended_mask) {
  const int64_t batch = qkvh.size(0), seq = qkvh.size(1), width = qkvh.size(2) / 4;
  auto heads = [&](int64_t part) {
    return qkvh.narrow(-1, part * width, width).view({batch, seq, heads_, head_size_}).transpose(1, 2);
  };
  auto q = heads(0), k = heads(1), v = heads(2);
  auto scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(head_size_));
  auto probs = attention_dropout(torch::softmax(scores + extended_mask, -1));
  auto context = torch::matmul(probs, v).transpose(1, 2).reshape({batch, seq, width});
  return torch::cat({context, qkvh.narrow(-1, 3 * width, width)}, -1);
}

torch::Tensor BertLayerImpl::attention_out(const torch::Tensor& ch) {
  const int64_t width = ch.size(2) / 2;
  return attention_norm(hidden_dropout(attention_output(ch.narrow(-1, 0, width))) +
                        ch.narrow(-1, width, width));
}

torch::Tensor BertLayerImpl::ffn_up(const torch::Tensor& attended) {
  return torch::cat({torch::gelu(intermediate(attended)), attended}, -1);
}

torch::Tensor BertLayerImpl::ffn_down(const torch::Tensor& ga) {
  const int64_t inner = output->options.in_features(), width = ga.size(2) - inner;
  return output_norm(hidden_dropout(output(ga.narrow(-1, 0, inner))) + ga.narrow(-1, inner, width));
}

BertModelImpl::BertModelImpl(const BertConfig& c) : config_(c) {
  auto positive = [](const char* field, int64_t v) {
    TORCH_CHECK(v >= 1, kWho, ": ", field, " must be >= 1, got ", v);
  };
  positive("vocab_size", c.vocab_size());
  positive("hidden_size", c.hidden_size());
  positive("num_hidden_layers", c.num_hidden_layers());
  positive("num_attention_heads", c.num_attention_heads());
  positive("intermediate_size", c.intermediate_size());
  positive("max_position_embeddings", c.max_position_embeddings());
  positive("type_vocab_size", c.type_vocab_size());
  TORCH_CHECK(c.hidden_size() % c.num_attention_heads() == 0, kWho, ": hidden_size ", c.hidden_size(),
              " is not divisible by num_attention_heads ", c.num_attention_heads());
  for (auto [field, p] : {std::pair{"hidden_dropout_prob", c.hidden_dropout_prob()},
                          std::pair{"attention_probs_dropout_prob", c.attention_probs_dropout_prob()}}) {
    TORCH_CHECK(p >= 0 && p < 1, kWho, ": ", field, " must be in [0, 1), got ", p);
  }
  embeddings = register_module("embeddings", BertEmbeddings(c));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers(); ++i)
    layers->push_back(BertLayer(c));
  pooler = register_module("pooler", torch::nn::Linear(c.hidden_size(), c.hidden_size()));
  torch::NoGradGuard no_grad;
  init_linear(pooler, c.initializer_range());
}

void BertModelImpl::check_inputs(const torch::Tensor& ids, const torch::Tensor& mask,
                                 const torch::Tensor& types) const {
  TORCH_CHECK(ids.defined() && ids.dim() == 2, kWho, ": input_ids must be [batch, seq], got ",
              ids.defined() ? ids.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool, kWho,
              ": input_ids must be integer token ids, got ", ids.scalar_type());
  TORCH_CHECK(ids.size(1) <= config_.max_position_embeddings(), kWho, ": sequence length ", ids.size(1),
              " is longer than max_position_embeddings ", config_.max_position_embeddings());
  if (ids.numel() > 0) {
    const auto [lo, hi] = torch::aminmax(ids);
    const int64_t min_id = lo.item<int64_t>(), max_id = hi.item<int64_t>();
    TORCH_CHECK(min_id >= 0, kWho, ": input_ids contains ", min_id, "; ids must be in [0, vocab_size ",
                config_.vocab_size(), ")");
    TORCH_CHECK(max_id < config_.vocab_size(), kWho, ": input_ids contains ", max_id,
                ", out of range for vocab_size ", config_.vocab_size());
  }
  if (mask.defined()) {
    TORCH_CHECK(mask.sizes() == ids.sizes(), kWho, ": attention_mask has shape ", mask.sizes(),
                " but input_ids has ", ids.sizes());
  }
  if (types.defined()) {
    TORCH_CHECK(types.sizes() == ids.sizes(), kWho, ": token_type_ids has shape ", types.sizes(),
                " but input_ids has ", ids.sizes());
    if (types.numel() > 0) {
      const auto [lo, hi] = torch::aminmax(types);
      const int64_t min_t = lo.item<int64_t>(), max_t = hi.item<int64_t>();
      TORCH_CHECK(min_t >= 0 && max_t < config_.type_vocab_size(), kWho, ": token_type_ids contains ",
                  min_t < 0 ? min_t : max_t, ", out of range for type_vocab_size ",
                  config_.type_vocab_size());
    }
  }
}

torch::Tensor BertModelImpl::extended_mask(const torch::Tensor& ids, const torch::Tensor& mask) const {
  const auto dtype = embeddings->word_embeddings->weight.scalar_type();
  torch::Tensor m = mask.defined() ? mask.to(dtype) : torch::ones(ids.sizes(), ids.options().dtype(dtype));
  return ((1.0 - m) * -10000.0).unsqueeze(1).unsqueeze(2);
}

torch::Tensor BertModelImpl::token_types(const torch::Tensor& ids, const torch::Tensor& types) const {
  return types.defined() ? types.to(torch::kLong) : torch::zeros_like(ids, ids.options().dtype(torch::kLong));
}

void BertModelImpl::gradient_checkpointing_enable(PlannedOptions options) {
  enable_planning(std::move(options), "remat::models::BertModel::gradient_checkpointing_enable");
}

void BertModelImpl::gradient_checkpointing_enable(CheckpointOptions options, int64_t every_n_layers) {
  TORCH_CHECK(every_n_layers >= 1, kWho, ": every_n_layers must be >= 1, got ", every_n_layers);
  every_n_layers_ = every_n_layers;
  Checkpointable::gradient_checkpointing_enable(std::move(options));
}

int64_t BertModelImpl::stages_per_layer(Granularity granularity) {
  return granularity == Granularity::kSublayer ? 5 : 1;
}

std::vector<StageFn> BertModelImpl::stages(const torch::Tensor& ids, const torch::Tensor& mask,
                                           const torch::Tensor& types, bool with_pooler,
                                           Granularity granularity) {
  check_inputs(ids, mask, types);
  const torch::Tensor ext = extended_mask(ids, mask), tt = token_types(ids, types);
  std::vector<StageFn> out;
  BertEmbeddings emb = embeddings;
  out.push_back({"embeddings", [emb, tt](const torch::Tensor& x) mutable { return emb->forward(x, tt); },
                 embeddings.ptr()});
  for (size_t i = 0; i < layers->size(); ++i) {
    auto layer = BertLayer(layers->ptr<BertLayerImpl>(i));
    const std::string name = "layer" + std::to_string(i);
    if (granularity == Granularity::kLayer) {
      out.push_back({name, [layer, ext](const torch::Tensor& h) mutable { return layer->forward(h, ext); },
                     layer.ptr()});
      continue;
    }
    // Each piece declares the modules it uses (an unregistered holder: nothing is registered twice).
    auto owner = [](std::initializer_list<std::pair<const char*, std::shared_ptr<torch::nn::Module>>> parts) {
      auto m = std::make_shared<torch::nn::Module>("BertSublayer");
      for (const auto& [n, part] : parts)
        m->register_module(n, part);
      return m;
    };
    out.push_back(
        {name + ".qkv", [layer](const torch::Tensor& h) mutable { return layer->qkv(h); },
         owner({{"query", layer->query.ptr()}, {"key", layer->key.ptr()}, {"value", layer->value.ptr()}})});
    out.push_back({name + ".attention_core",
                   [layer, ext](const torch::Tensor& x) mutable { return layer->attention_core(x, ext); },
                   owner({{"attention_dropout", layer->attention_dropout.ptr()}})});
    out.push_back({name + ".attention_out",
                   [layer](const torch::Tensor& x) mutable { return layer->attention_out(x); },
                   owner({{"attention_output", layer->attention_output.ptr()},
                          {"attention_norm", layer->attention_norm.ptr()},
                          {"hidden_dropout", layer->hidden_dropout.ptr()}})});
    out.push_back({name + ".ffn_up", [layer](const torch::Tensor& x) mutable { return layer->ffn_up(x); },
                   owner({{"intermediate", layer->intermediate.ptr()}})});
    out.push_back({name + ".ffn_down", [layer](const torch::Tensor& x) mutable { return layer->ffn_down(x); },
                   owner({{"output", layer->output.ptr()},
                          {"output_norm", layer->output_norm.ptr()},
                          {"hidden_dropout", layer->hidden_dropout.ptr()}})});
  }
  if (with_pooler) {
    torch::nn::Linear p = pooler;
    out.push_back({"pooler",
                   [p](const torch::Tensor& h) mutable { return torch::tanh(p->forward(h.select(1, 0))); },
                   pooler.ptr()});
  }
  return out;
}

void BertModelImpl::use_plan(Plan plan, Granularity granularity) {
  const int64_t per = stages_per_layer(granularity), n = config_.num_hidden_layers() * per + 1;
  TORCH_CHECK(plan.num_stages == n, kWho, ": the plan has ", plan.num_stages, " stages; this model runs as ",
              n, " (embeddings and ", config_.num_hidden_layers(), " layers of ", per, " stage",
              per > 1 ? "s" : "", ")");
  plan_ = std::move(plan);
  plan_granularity_ = granularity;
}

Plan BertModelImpl::selective_checkpointing_plan() const {
  std::vector<int64_t> cores;
  for (int64_t i = 0; i < config_.num_hidden_layers(); ++i)
    cores.push_back(1 + 5 * i + 1);  // after the embeddings: qkv, attention_core, ...
  Plan plan = checkpoint_stages(config_.num_hidden_layers() * 5 + 1, cores);
  plan.planner = "selective";
  return plan;
}

void BertModelImpl::selective_checkpointing_enable() {
  use_plan(selective_checkpointing_plan(), Granularity::kSublayer);
}

torch::Tensor BertModelImpl::forward(const torch::Tensor& ids, const torch::Tensor& mask,
                                     const torch::Tensor& types) {
  if (plan_) {
    // The executor is its own mode: only the per-layer options that apply to it carry over.
    const auto options = CheckpointOptions()
                             .preserve_rng_state(checkpoint_options_.preserve_rng_state())
                             .determinism_check(checkpoint_options_.determinism_check());
    return run_plan(stages(ids, mask, types, false, plan_granularity_), *plan_, ids, options);
  }
  check_inputs(ids, mask, types);
  const torch::Tensor ext = extended_mask(ids, mask);
  torch::Tensor h = embeddings(ids, token_types(ids, types));
  if (planning()) {
    if (planned_.is_empty()) {
      std::vector<ArgsStageFn> layer_stages;
      for (size_t i = 0; i < layers->size(); ++i) {
        auto layer = BertLayer(layers->ptr<BertLayerImpl>(i));
        layer_stages.push_back(
            {"layer" + std::to_string(i),
             [layer](const torch::Tensor& x, const std::vector<torch::Tensor>& args) mutable {
               return layer->forward(x, args[0]);
             },
             layer.ptr()});
      }
      planned_ = Planned(std::move(layer_stages), *planned_options_);
    }
    return planned_->forward(h, {ext});
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    auto layer = BertLayer(layers->ptr<BertLayerImpl>(i));
    if (checkpointing_enabled_ && static_cast<int64_t>(i) % every_n_layers_ == 0) {
      CheckpointOptions options = checkpoint_options_;
      options.modules().push_back(layer.ptr());
      h = remat::checkpoint([layer, ext](const torch::Tensor& x) mutable { return layer->forward(x, ext); },
                            h, options);
    } else {
      h = layer->forward(h, ext);
    }
  }
  return h;
}

torch::Tensor BertModelImpl::pool(const torch::Tensor& last_hidden_state) {
  return torch::tanh(pooler(last_hidden_state.select(1, 0)));
}

}  // namespace remat::models
