// The benchmark harness's workloads: remat's reference models with their inputs, losses and chains of stages.

#include <algorithm>
#include <sstream>

#include "remat/bench.h"
#include "remat/models.h"

namespace remat {
namespace {

int64_t batch_or(const WorkloadConfig& c, int64_t fallback) {
  return c.batch() > 0 ? c.batch() : fallback;
}

// --------------------------------------------------------------------------------------------------------------
// Workloads

// What every workload shares: a model holder with the Checkpointable methods, its input, and its config.
template <typename Holder>
class ModelWorkload : public Workload {
 public:
  ModelWorkload(const WorkloadConfig& c, int64_t default_batch) : c_(c), batch_(batch_or(c, default_batch)) {}
  torch::nn::Module& module() override { return *model_; }
  torch::Tensor input() const override { return x_; }
  void set_per_layer(std::optional<CheckpointOptions> o) override {
    o ? model_->gradient_checkpointing_enable(*o) : model_->gradient_checkpointing_disable();
  }
  torch::Tensor forward() override { return model_->forward(x_); }

 protected:
  void place(Holder model, torch::Tensor input) {
    model_ = std::move(model);
    model_->to(c_.device());
    x_ = std::move(input);
  }
  torch::TensorOptions on_device() const { return torch::TensorOptions().device(c_.device()); }

  WorkloadConfig c_;
  int64_t batch_;
  Holder model_{nullptr};
  torch::Tensor x_;  // the input of the model's chain
};

class BertWorkload final : public ModelWorkload<models::BertModel> {
 public:
  explicit BertWorkload(const WorkloadConfig& c) : ModelWorkload(c, 8) {
    place(models::BertModel(models::BertConfig()
                                .vocab_size(c.vocab())
                                .hidden_size(c.hidden())
                                .num_hidden_layers(c.layers())
                                .num_attention_heads(c.heads())
                                .intermediate_size(c.intermediate())
                                .max_position_embeddings(std::max<int64_t>(512, c.seq()))
                                .hidden_dropout_prob(c.dropout())
                                .attention_probs_dropout_prob(c.dropout())),
          torch::randint(0, c.vocab(), {batch_, c.seq()}, on_device().dtype(torch::kLong)));
    mask_ = torch::ones({batch_, c.seq()}, on_device());
    types_ = torch::zeros({batch_, c.seq()}, on_device().dtype(torch::kLong));
  }
  std::string description() const override {
    std::ostringstream os;
    os << "bert " << c_.layers() << " layers x " << c_.hidden() << " (" << c_.heads() << " heads, ffn "
       << c_.intermediate() << "), seq " << c_.seq() << ", batch " << batch_ << ", dropout " << c_.dropout();
    return os.str();
  }
  std::vector<StageFn> stages() override {
    return model_->stages(x_, mask_, types_, false, c_.granularity());
  }
  std::vector<int64_t> per_layer_stages() const override {
    if (c_.granularity() != Granularity::kLayer) return {};
    std::vector<int64_t> layers;
    for (int64_t i = 1; i <= c_.layers(); ++i)
      layers.push_back(i);  // stage 0 is the embeddings
    return layers;
  }
  torch::Tensor forward() override { return model_->forward(x_, mask_, types_); }

 private:
  torch::Tensor mask_, types_;
};

class MlpWorkload final : public ModelWorkload<models::ResidualMlp> {
 public:
  explicit MlpWorkload(const WorkloadConfig& c) : ModelWorkload(c, 64) {
    // The input requires grad, as in bench/pytorch_reference.py (whose reentrant baseline needs it).
    place(models::ResidualMlp(models::ResidualMlpOptions().depth(c.depth()).width(c.width())),
          torch::randn({batch_, c.width()}, on_device().requires_grad(true)));
  }
  std::string description() const override {
    std::ostringstream os;
    os << "mlp " << c_.depth() << " residual blocks x " << c_.width() << " (hidden " << 4 * c_.width()
       << "), batch " << batch_;
    return os.str();
  }
  std::vector<StageFn> stages() override { return stages_of(model_->blocks()); }
  std::vector<int64_t> per_layer_stages() const override {
    std::vector<int64_t> blocks;
    for (int64_t i = 0; i < c_.depth(); ++i)
      blocks.push_back(i);
    return blocks;
  }
};

// A CIFAR-style ResNet: the chain is the stem, the nine (3 x blocks) BasicBlocks of layer1..layer3 (unequal:
// layer1's keep four times layer3's activations) and the head; per-layer checkpointing is one
// remat::checkpoint per block.
class ResNetWorkload final : public ModelWorkload<models::ResNet> {
 public:
  explicit ResNetWorkload(const WorkloadConfig& c) : ModelWorkload(c, 64) {
    TORCH_CHECK(c.blocks() >= 1, "remat::make_workload: blocks must be >= 1, got ", c.blocks());
    place(models::ResNet(c.blocks()), torch::randn({batch_, 3, 32, 32}, on_device()));
  }
  std::string description() const override {
    return "resnet (CIFAR, " + std::to_string(3 * c_.blocks()) + " BasicBlocks), batch " +
           std::to_string(batch_);
  }
  std::vector<StageFn> stages() override {
    auto m = model_;
    std::vector<StageFn> out{
        {"stem", [m](const torch::Tensor& x) mutable { return m->stem(x); }, stem_holder()}};
    for (auto& s : stages_at(*model_, {"layer1", "layer2", "layer3"}))
      out.push_back(std::move(s));
    out.push_back({"head", [m](const torch::Tensor& h) mutable { return m->head(h); }, m->fc.ptr()});
    return out;
  }
  std::vector<int64_t> per_layer_stages() const override {
    std::vector<int64_t> blocks;
    for (int64_t i = 1; i <= 3 * c_.blocks(); ++i)
      blocks.push_back(i);
    return blocks;
  }

 private:
  // The stem's convolution and BatchNorm as one module, so that the executor restores the BatchNorm's
  // statistics when it recomputes the stem.
  std::shared_ptr<torch::nn::Module> stem_holder() {
    if (!stem_) {
      stem_ = std::make_shared<torch::nn::Module>("stem");
      stem_->register_module("conv1", model_->conv1);
      stem_->register_module("bn1", model_->bn1);
    }
    return stem_;
  }
  std::shared_ptr<torch::nn::Module> stem_;
};

class CifarWorkload final : public ModelWorkload<models::CifarNet> {
 public:
  explicit CifarWorkload(const WorkloadConfig& c) : ModelWorkload(c, 64) {
    place(models::CifarNet(), torch::randn({batch_, 3, 32, 32}, on_device()));
  }
  std::string description() const override { return "cifar (CifarNet), batch " + std::to_string(batch_); }
  std::vector<StageFn> stages() override {
    auto m = model_;
    return {
        {"cnn_block_1",
         [m](const torch::Tensor& x) mutable { return m->dropout_1(m->cnn_block_1->forward(x)); },
         m->cnn_block_1.ptr()},
        {"cnn_block_2", [m](const torch::Tensor& x) mutable { return m->cnn_block_2->forward(x); },
         m->cnn_block_2.ptr()},
        {"linearize",
         [m](const torch::Tensor& x) mutable {
           return m->dropout_3(m->linearize->forward(torch::flatten(m->dropout_2(x), 1)));
         },
         m->linearize.ptr()},
        {"out", [m](const torch::Tensor& x) mutable { return m->out(x); }, m->out.ptr()},
    };
  }
};

class HeavyWorkload final : public ModelWorkload<models::HeavyChain> {
 public:
  explicit HeavyWorkload(const WorkloadConfig& c) : ModelWorkload(c, 1) {
    place(models::HeavyChain(models::HeavyChainOptions().calls(c.calls()).adds(c.adds())),
          torch::zeros({}, on_device().requires_grad(true)));
  }
  std::string description() const override {
    return "heavy: " + std::to_string(c_.calls()) + " calls of " + std::to_string(c_.adds()) + " additions";
  }
  std::vector<StageFn> stages() override {
    std::vector<StageFn> out;
    const torch::Tensor a = model_->a;
    const int64_t adds = c_.adds();
    for (int64_t i = 0; i < c_.calls(); ++i) {
      out.push_back({"call" + std::to_string(i),
                     [a, adds](const torch::Tensor& x) { return models::heavy_function(x, a, adds); },
                     model_.ptr()});  // every call uses the parameter
    }
    return out;
  }
  torch::Tensor loss_of(const torch::Tensor& output) const override { return output.sum(); }
};

class ForumWorkload final : public ModelWorkload<models::ForumCnn> {
 public:
  explicit ForumWorkload(const WorkloadConfig& c) : ModelWorkload(c, 100) {
    models::ForumCnn model(models::ForumCnnOptions().variant(c.variant()).placement(c.placement()));
    auto shape = model->sample_shape();
    shape.insert(shape.begin(), batch_);
    place(model, torch::randn(shape, on_device()));
  }
  std::string description() const override {
    return "forum-cnn " + c_.variant() + " (placement " + c_.placement() + "), batch " +
           std::to_string(batch_);
  }
  std::vector<StageFn> stages() override {
    auto m = model_;
    const bool full = c_.variant() == "full";
    return {
        {"conv1+relu", [m](const torch::Tensor& x) mutable { return torch::relu(m->conv1(x)); },
         m->conv1.ptr()},
        {"conv2+relu", [m](const torch::Tensor& x) mutable { return torch::relu(m->conv2(x)); },
         m->conv2.ptr()},
        {"conv3+relu", [m](const torch::Tensor& x) mutable { return torch::relu(m->conv3(x)); },
         m->conv3.ptr()},
        {full ? "heads" : "fc1",
         [m, full](const torch::Tensor& x) mutable {
           auto f = torch::flatten(x, 1);
           if (!full) return m->heads[0](f);
           return torch::cat({torch::sigmoid(m->heads[0](f)), m->heads[1](f), m->heads[2](f)}, 1);
         },
         m.ptr()},  // the heads' parameters (and the convolutions', unused here)
    };
  }
};

}  // namespace

torch::Tensor Workload::loss_of(const torch::Tensor& output) const {
  return output.to(torch::kFloat).pow(2).mean();
}

const std::vector<std::string>& workload_models() {
  static const std::vector<std::string> models{"bert", "cifar", "heavy", "forum-cnn", "mlp", "resnet"};
  return models;
}

std::unique_ptr<Workload> make_workload(const WorkloadConfig& c) {
  const std::string& m = c.model();
  TORCH_CHECK(c.batch() >= 0, "remat::make_workload: batch must be >= 0, got ", c.batch());
  TORCH_CHECK(c.granularity() == Granularity::kLayer || m == "bert", "remat::make_workload: model '", m,
              "' has no sub-layer stages (Granularity::kSublayer is for bert)");
  torch::manual_seed(c.seed());  // the weights and inputs drawn below
  if (m == "bert") return std::make_unique<BertWorkload>(c);
  if (m == "mlp") return std::make_unique<MlpWorkload>(c);
  if (m == "cifar") return std::make_unique<CifarWorkload>(c);
  if (m == "resnet") return std::make_unique<ResNetWorkload>(c);
  if (m == "heavy") return std::make_unique<HeavyWorkload>(c);
  if (m == "forum-cnn") return std::make_unique<ForumWorkload>(c);
  std::string known;
  for (const auto& name : workload_models())
    known += (known.empty() ? "" : ", ") + name;
  TORCH_CHECK(false, "remat::make_workload: unknown model '", m, "' (", known, ")");
}

}  // namespace remat
