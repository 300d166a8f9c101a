// What the remat command's subcommands share (common.h).

#include "common.h"

#include "progress_bar.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include <remat/memory.h>
#include <remat/planner/units.h>
#include <torch/cuda.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace remat::cli {

void ModelArgs::add(CLI::App* app) {
  std::string models;
  for (const auto& m : workload_models())
    models += (models.empty() ? "" : ", ") + m;
  app->add_option("--model", model, models)->check(CLI::IsMember(workload_models()))->capture_default_str();
  app->add_option("--layers", layers, "bert: encoder layers")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app->add_option("--hidden", hidden, "bert: hidden size")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  app->add_option("--heads", heads, "bert: attention heads")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_option("--intermediate", intermediate, "bert: feed-forward size")
      ->check(CLI::Range(1, 1 << 18))
      ->capture_default_str();
  app->add_option("--seq", seq, "bert: sequence length")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  app->add_option("--vocab", vocab, "bert: vocabulary size")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app->add_option("--dropout", dropout, "bert: dropout probability")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  app->add_option("--batch", batch, "rows per batch (0: the model's default)")->check(CLI::Range(0, 1 << 24));
  app->add_option("--depth", depth, "mlp: residual blocks")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app->add_option("--width", width, "mlp: block width")->check(CLI::Range(1, 1 << 18))->capture_default_str();
  app->add_option("--blocks", blocks, "resnet: BasicBlocks per layer (layer1..layer3)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app->add_option("--calls", calls, "heavy: calls of the function")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app->add_option("--adds", adds, "heavy: additions per call")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app->add_option("--variant", variant, "forum-cnn: small or full")
      ->check(CLI::IsMember({"small", "full"}))
      ->capture_default_str();
  app->add_option("--placement", placement, "forum-cnn: each-op, conv-relu, all-convs or heads")
      ->check(CLI::IsMember({"each-op", "conv-relu", "all-convs", "heads"}))
      ->capture_default_str();
  app->add_option("--device", device, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app->add_option("--seed", seed, "seed of weights and inputs")->capture_default_str();
  app->add_option("--granularity", granularity,
                  "bert: the chain's stages, per layer or per piece of a layer (sublayer: attention core, "
                  "projections, feed-forward halves)")
      ->check(CLI::IsMember({"layer", "sublayer"}))
      ->capture_default_str();
  app->add_option(
         "--policy", policies,
         std::string("operator-level policy presets (comma-separated: ") + policy::kPresetNames +
             "): also profile each stage under them, so that plans may use Fk[NAME] on untagged models")
      ->check(
          [](const std::string& text) -> std::string {
            for (const auto& name : split(text))
              if (!policy::is_preset(name))
                return "'" + name + "' is not a policy preset (" + policy::kPresetNames + ")";
            return "";
          },
          "PRESET[,PRESET...]");
  app->add_option("--keep", keep,
                  "remat::keep tags (comma-separated, e.g. matmul): also profile each stage keeping those "
                  "calls' outputs, so that plans may keep a layer's matrix multiplications (Fk)");
  app->add_option("--offload-min-bytes", offload_min,
                  "also profile for offloading (saved tensors of at least SIZE go to host memory; the "
                  "bandwidths each way, each way of running a stage offloaded), so that plans may use @host");
}

ProfileOptions ModelArgs::profile_options(int64_t repeats) const {
  std::vector<Policy> presets;
  for (const auto& name : split(policies))
    presets.push_back(policy::preset(name));
  return ProfileOptions()
      .warmup(1)
      .repeats(repeats)
      .keep(split(keep))
      .policies(presets)
      .offload_min_bytes(offload_min.empty() ? -1 : size_arg(offload_min, "--offload-min-bytes"))
      .progress(profile_progress("remat: profiling"));
}

WorkloadConfig ModelArgs::config(int64_t batch_override) const {
  return WorkloadConfig()
      .model(model)
      .layers(layers)
      .hidden(hidden)
      .heads(heads)
      .intermediate(intermediate)
      .seq(seq)
      .vocab(vocab)
      .dropout(dropout)
      .batch(batch_override >= 0 ? batch_override : batch)
      .granularity(granularity == "sublayer" ? Granularity::kSublayer : Granularity::kLayer)
      .depth(depth)
      .width(width)
      .calls(calls)
      .adds(adds)
      .blocks(blocks)
      .variant(variant)
      .placement(placement)
      .device(torch::Device(device))
      .seed(seed);
}

std::unique_ptr<Workload> ModelArgs::make(int64_t batch_override) const {
  if (device == "cuda") {
    TORCH_CHECK(torch::cuda::is_available(), "--device cuda: no CUDA device is available");
  } else {
    memory::track_cpu();
  }
  return make_workload(config(batch_override));
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string mib(int64_t bytes) {
  return format_mib(bytes);
}

void progress(const std::string& message) {
  clear_progress_bar();
  std::cerr << "remat: " << message << std::endl;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) throw std::invalid_argument("cannot write '" + path + "'");
  out << text;
}

int64_t size_arg(const std::string& text, const char* flag) {
  try {
    return parse_size(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(flag) + ": " + e.what());
  }
}

void add_exclude(CLI::App* app, std::string& exclude) {
  app->add_option(
      "--exclude", exclude,
      "operations the planner may not use (comma-separated): Fk (none at all), Fk[tags] (none with the "
      "keep tags), Fk[NAME] (none under policy NAME)");
}

PlannerOptions planner_options(const std::string& exclude, int64_t slots) {
  PlannerOptions options;
  options.slots = slots;
  options.exclude = split(exclude);
  return options;
}

void run_plot_script(const std::string& who, const char* env_var, const std::string& built,
                     const std::vector<std::string>& args) {
  const char* env_script = std::getenv(env_var);
  const std::string script = env_script ? env_script : built;
  TORCH_CHECK(std::ifstream(script).good(), who, ": the plotting script '", script, "' is not there; set ",
              env_var, " to ", built, " of remat's sources");
  const char* env_python = std::getenv("REMAT_PYTHON");
  std::vector<std::string> argv{env_python ? env_python : "python3", script};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& x : argv)
    cargv.push_back(x.data());
  cargv.push_back(nullptr);
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, cargv[0], nullptr, nullptr, cargv.data(), ::environ);
  TORCH_CHECK(err == 0, who, ": cannot run '", argv[0], "': ", std::strerror(err));
  int status = 0;
  waitpid(pid, &status, 0);
  TORCH_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, who, ": '", argv[0], " ", script,
              "' failed (exit status ", WIFEXITED(status) ? WEXITSTATUS(status) : -1,
              "); it needs matplotlib");
}

}  // namespace remat::cli
