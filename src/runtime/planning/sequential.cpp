// checkpoint_sequential and checkpoint_segments (each checkpointed segment one remat::checkpoint region), and
// the stages of a model's containers (stages_of, stages_at).

#include "remat/sequential.h"

#include <optional>
#include <string>
#include <vector>

#include <torch/nn/modules/container/modulelist.h>

namespace remat {

namespace {
std::string short_type(const torch::nn::Module& module) {
  std::string type = module.name();
  const size_t colons = type.rfind("::");
  if (colons != std::string::npos) type = type.substr(colons + 2);
  if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0) type.resize(type.size() - 4);
  return type;
}

bool is_index(const std::string& s) {
  return !s.empty() && s.size() < 10 && s.find_first_not_of("0123456789") == std::string::npos;
}
}  // namespace

namespace {
// Module i of seq as a stage named "<name>:<Type>", sharing the module.
StageFn stage_of(const torch::nn::Sequential& seq, size_t i, const std::string& name) {
  auto module = seq->ptr(i);
  torch::nn::Sequential shared = seq;
  return StageFn{name + ":" + short_type(*module),
                 [shared, i](const torch::Tensor& x) mutable { return shared->begin()[i].forward(x); },
                 module};
}
}  // namespace

std::vector<StageFn> stages_of(torch::nn::Sequential& seq) {
  TORCH_CHECK(!seq.is_empty() && seq->size() > 0, "remat::stages_of: the Sequential is empty");
  std::vector<StageFn> stages;
  for (size_t i = 0; i < seq->size(); ++i)
    stages.push_back(stage_of(seq, i, std::to_string(i)));
  return stages;
}

// -------------------------------------------------------------------------------------------------------------

namespace {
// checkpoint_segments over stages; `what` names the caller and `unit` what a stage is ("modules", "stages").
torch::Tensor run_segments(const std::vector<StageFn>& stages, const std::vector<int64_t>& starts,
                           const torch::Tensor& input, const SequentialOptions& options, const char* who,
                           const char* unit) {
  const int64_t n = static_cast<int64_t>(stages.size());
  try {
    segmented(n, starts, options.checkpoint_last_segment());  // checks the starts
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, who, ": ", e.what(), " (", n, " ", unit, ")");
  }
  TORCH_CHECK(input.defined(), who, ": the input is an undefined tensor");
  // Each segment is one remat::checkpoint region in the mode asked, its modules declared (in kReentrant their
  // parameters trained under torch::autograd::grad too), as PyTorch's checkpoint_sequential does with
  // use_reentrant. The last segment runs plainly unless asked.
  torch::Tensor h = input;
  for (size_t j = 0; j < starts.size(); ++j) {
    const int64_t begin = starts[j];
    const int64_t end = j + 1 < starts.size() ? starts[j + 1] : n;
    const bool last = j + 1 == starts.size();
    CheckpointOptions segment_options = options.checkpoint();
    bool can_get_grad = h.requires_grad();
    std::vector<TensorFn> fns;
    for (int64_t i = begin; i < end; ++i) {
      const StageFn& stage = stages[static_cast<size_t>(i)];
      fns.push_back(stage.fn);
      if (!stage.module) {
        can_get_grad = true;  // a lambda may use parameters nobody declared
        continue;
      }
      segment_options.modules().push_back(stage.module);
      for (const auto& p : stage.module->parameters())
        can_get_grad = can_get_grad || p.requires_grad();
    }
    auto run = [fns](const torch::Tensor& x) {
      torch::Tensor y = x;
      for (const auto& f : fns)
        y = f(y);
      return y;
    };
    // A segment nothing in which can receive a gradient records no graph and keeps nothing: it runs as is.
    if ((last && !options.checkpoint_last_segment()) || !at::GradMode::is_enabled() || !can_get_grad) {
      h = run(h);
    } else {
      h = remat::checkpoint(run, h, segment_options);
    }
  }
  return h;
}

}  // namespace

torch::Tensor checkpoint_segments(torch::nn::Sequential& seq, const std::vector<int64_t>& starts,
                                  const torch::Tensor& input, const SequentialOptions& options) {
  TORCH_CHECK(!seq.is_empty() && seq->size() > 0,
              "remat::checkpoint_segments: the Sequential is empty (0 modules)");
  return run_segments(stages_of(seq), starts, input, options, "remat::checkpoint_segments", "modules");
}

torch::Tensor checkpoint_segments(const std::vector<StageFn>& stages, const std::vector<int64_t>& starts,
                                  const torch::Tensor& input, const SequentialOptions& options) {
  TORCH_CHECK(!stages.empty(), "remat::checkpoint_segments: no stages (0 stages)");
  return run_segments(stages, starts, input, options, "remat::checkpoint_segments", "stages");
}

torch::Tensor checkpoint_sequential(torch::nn::Sequential& seq, int64_t segments, const torch::Tensor& input,
                                    const SequentialOptions& options) {
  const int64_t n = seq.is_empty() ? 0 : static_cast<int64_t>(seq->size());
  TORCH_CHECK(n > 0, "remat::checkpoint_sequential: the Sequential is empty (0 modules); segments was ",
              segments);
  TORCH_CHECK(segments >= 1 && segments <= n, "remat::checkpoint_sequential: segments must be in [1, ", n,
              "] (the Sequential has ", n, " modules), got ", segments);
  return run_segments(stages_of(seq), even_starts(n, segments), input, options,
                      "remat::checkpoint_sequential", "modules");
}

torch::Tensor checkpoint_sequential(const std::vector<StageFn>& stages, int64_t segments,
                                    const torch::Tensor& input, const SequentialOptions& options) {
  const int64_t n = static_cast<int64_t>(stages.size());
  TORCH_CHECK(n > 0, "remat::checkpoint_sequential: no stages (0 stages); segments was ", segments);
  TORCH_CHECK(segments >= 1 && segments <= n, "remat::checkpoint_sequential: segments must be in [1, ", n,
              "] (there are ", n, " stages), got ", segments);
  return run_segments(stages, even_starts(n, segments), input, options, "remat::checkpoint_sequential",
                      "stages");
}

namespace detail {

std::vector<StageFn> stages_at(torch::nn::Module& root, const std::vector<std::string>& paths,
                               const ElementStage& typed, const std::string& type) {
  constexpr const char* kWho = "remat::stages_at";
  TORCH_CHECK(!paths.empty(), kWho, ": no paths given");
  const auto named = root.named_modules(/*name_prefix=*/"", /*include_self=*/false);
  auto sequential_at = [&](const std::string& path) -> torch::nn::Sequential {
    const auto* found = named.find(path);
    if (found == nullptr) return nullptr;
    auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(*found);
    return seq ? torch::nn::Sequential(seq) : nullptr;
  };
  auto list_at = [&](const std::string& path) -> torch::nn::ModuleList {
    const auto* found = named.find(path);
    if (found == nullptr) return nullptr;
    auto list = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(*found);
    return list ? torch::nn::ModuleList(list) : nullptr;
  };
  std::vector<StageFn> stages;
  // Element i of the container at `container` (a Sequential or a ModuleList), as the stage named `name`.
  auto add = [&](const std::string& container, size_t i, const std::string& name) {
    torch::nn::Sequential seq = sequential_at(container);
    torch::nn::ModuleList list = seq ? nullptr : list_at(container);
    const size_t size = seq ? seq->size() : list->size();
    TORCH_CHECK(i < size, kWho, ": '", name, "': the ", seq ? "Sequential" : "ModuleList", " at '", container,
                "' has ", size, " modules");
    const std::shared_ptr<torch::nn::Module> element = seq ? seq->ptr(i) : list->ptr(i);
    if (typed) {
      std::optional<StageFn> stage = typed(element, name + ":" + short_type(*element));
      TORCH_CHECK(stage, kWho, "<", type, ">: '", name, "' is a ", short_type(*element), ", not a ", type);
      stages.push_back(std::move(*stage));
    } else {
      TORCH_CHECK(seq, kWho, ": '", container,
                  "' is a ModuleList, whose elements have no forward remat can call without their type: use "
                  "remat::stages_at<ElementImpl>(root, {\"",
                  container, "\"}) with the type of its elements (BlockImpl for a TORCH_MODULE(Block))");
      stages.push_back(stage_of(seq, i, name));
    }
  };
  for (const std::string& path : paths) {
    if (!named.contains(path)) {
      std::string children;
      for (const auto& item : root.named_children())
        children += (children.empty() ? "" : ", ") + item.key();
      TORCH_CHECK(false, kWho, ": '", path, "' names no submodule of ", root.name(),
                  " (its children: ", children.empty() ? "none" : children,
                  "; deeper ones are named with dots, as in \"layer1.0\")");
    }
    torch::nn::Sequential seq = sequential_at(path);
    torch::nn::ModuleList list = seq ? nullptr : list_at(path);
    if (seq || list) {
      const size_t size = seq ? seq->size() : list->size();
      TORCH_CHECK(size > 0, kWho, ": the ", seq ? "Sequential" : "ModuleList", " at '", path, "' is empty");
      for (size_t i = 0; i < size; ++i)
        add(path, i, path + "." + std::to_string(i));
      continue;
    }
    const size_t dot = path.rfind('.');
    const std::string parent = dot == std::string::npos ? "" : path.substr(0, dot);
    const std::string last = dot == std::string::npos ? path : path.substr(dot + 1);
    const bool in_container = !parent.empty() && (sequential_at(parent) || list_at(parent));
    TORCH_CHECK(
        in_container && is_index(last), kWho, ": '", path, "' is a ", short_type(**named.find(path)),
        ", which is neither a Sequential or a ModuleList nor an element of one: remat cannot call its "
        "forward from a path. Put it in a container, or make a StageFn for it");
    add(parent, static_cast<size_t>(std::stoul(last)), path);
  }
  return stages;
}

}  // namespace detail

std::vector<StageFn> stages_at(torch::nn::Module& root, const std::vector<std::string>& paths) {
  return detail::stages_at(root, paths, nullptr, "");
}

}  // namespace remat
