#include "remat/models/forum_cnn.h"

namespace remat::models {
namespace {
constexpr const char* kForumCnnWho = "remat::models::ForumCnn";
torch::nn::Conv2d conv(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}
}  // namespace

ForumCnnImpl::ForumCnnImpl(const ForumCnnOptions& options) : options_(options) {
  const std::string& v = options.variant();
  TORCH_CHECK(v == "small" || v == "full", kForumCnnWho, ": unknown variant '", v, "' (small, full)");
  full_ = v == "full";
  const std::string& p = options.placement();
  TORCH_CHECK(p == "each-op" || p == "conv-relu" || p == "all-convs" || p == "heads", kForumCnnWho,
              ": unknown placement '", p, "' (each-op, conv-relu, all-convs, heads)");
  TORCH_CHECK(p != "heads" || full_, kForumCnnWho,
              ": placement 'heads' needs the full variant (it has three heads)");
  TORCH_CHECK(options.head_features() >= 0, kForumCnnWho, ": head_features must be >= 0, got ",
              options.head_features());
  if (full_) height_ = 45, width_ = 43;
  conv1 = register_module("conv1", conv(20, 50));
  conv2 = register_module("conv2", conv(50, 25));
  conv3 = register_module("conv3", conv(25, 10));
  const int64_t flat = height_ * width_ * 10;
  const int64_t out = options.head_features() > 0 ? options.head_features() : (full_ ? 29913 : 3258);
  for (int i = 0; i < (full_ ? 3 : 1); ++i) {
    heads.push_back(
        register_module(full_ ? "param" + std::to_string(i + 1) : "fc1", torch::nn::Linear(flat, out)));
  }
}

std::vector<int64_t> ForumCnnImpl::sample_shape() const {
  return {20, height_, width_};
}

torch::Tensor ForumCnnImpl::run(const TensorFn& fn, const torch::Tensor& x, bool checkpointed) {
  if (!checkpointed || !checkpointing_enabled_) return fn(x);
  CheckpointOptions opts = checkpoint_options_;
  opts.modules().push_back(shared_from_this());
  return remat::checkpoint(fn, x, opts);
}

torch::Tensor ForumCnnImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == 20 && x.size(2) == height_ && x.size(3) == width_, kForumCnnWho,
              ": input must be [batch, 20, ", height_, ", ", width_, "] for the ", options_.variant(),
              " variant, got ", x.sizes());
  const std::string& p = options_.placement();
  const bool each = p == "each-op", blocks = p == "conv-relu", convs = p == "all-convs";
  auto relu = [](const torch::Tensor& t) { return torch::relu(t); };
  auto flat = [](const torch::Tensor& t) { return torch::flatten(t, 1); };
  auto c1 = [this](const torch::Tensor& t) { return conv1(t); };
  auto c2 = [this](const torch::Tensor& t) { return conv2(t); };
  auto c3 = [this](const torch::Tensor& t) { return conv3(t); };

  torch::Tensor h = run(c1, x, each && full_);
  h = run(relu, h, each && full_);
  if (convs) {
    h = run([&](const torch::Tensor& t) { return torch::relu(conv3(torch::relu(conv2(t)))); }, h, true);
  } else if (blocks) {
    h = run([&](const torch::Tensor& t) { return torch::relu(conv2(t)); }, h, true);
    h = run([&](const torch::Tensor& t) { return torch::relu(conv3(t)); }, h, true);
  } else {
    h = run(c2, h, each);
    h = run(relu, h, each);
    h = run(c3, h, each);
    h = run(relu, h, each);
  }
  if (!full_) {
    if (blocks) return run([&](const torch::Tensor& t) { return heads[0](torch::flatten(t, 1)); }, h, true);
    h = run(flat, h, each);
    return run([&](const torch::Tensor& t) { return heads[0](t); }, h, each);
  }
  auto all_heads = [&](const torch::Tensor& t) {
    return torch::cat({torch::sigmoid(heads[0](t)), heads[1](t), heads[2](t)}, 1);
  };
  h = run(flat, h, each);
  if (p == "heads") return run(all_heads, h, true);
  if (!each || !checkpointing_enabled_) return all_heads(h);
  auto x1 = run([&](const torch::Tensor& t) { return heads[0](t); }, h, true);
  x1 = run([](const torch::Tensor& t) { return torch::sigmoid(t); }, x1, true);
  auto x2 = run([&](const torch::Tensor& t) { return heads[1](t); }, h, true);
  auto x3 = run([&](const torch::Tensor& t) { return heads[2](t); }, h, true);
  return remat::checkpoint(
      [](const std::vector<torch::Tensor>& t) {
        return std::vector<torch::Tensor>{torch::cat({t[0], t[1], t[2]}, 1)};
      },
      {x1, x2, x3}, checkpoint_options_)[0];
}

}  // namespace remat::models
