#pragma once
/// \file
/// The three methods every remat model has, so that a user learns them once:
///   model->gradient_checkpointing_enable();            // checkpoint with the default options
///   model->gradient_checkpointing_disable();
///   bool on = model->is_gradient_checkpointing();

#include <remat/checkpoint.h>
#include <remat/planned.h>

#include <optional>
#include <string>

namespace remat::models {

/// Mixin holding whether checkpointing is on and with which options. Models derive from it next to
/// torch::nn::Module and decide in forward() what to checkpoint.
class Checkpointable {
 public:
  virtual ~Checkpointable() = default;
  /// Turns checkpointing on (or updates its options). Takes effect from the next forward pass.
  void gradient_checkpointing_enable(CheckpointOptions options = {}) {
    checkpoint_options_ = std::move(options);
    checkpointing_enabled_ = true;
    planned_options_.reset();
    planned_ = nullptr;
  }
  /// Turns checkpointing off. Takes effect from the next forward pass.
  void gradient_checkpointing_disable() { checkpointing_enabled_ = false; }
  /// Whether checkpointing is on.
  bool is_gradient_checkpointing() const { return checkpointing_enabled_; }
  /// The options checkpointing runs with.
  const CheckpointOptions& gradient_checkpointing_options() const { return checkpoint_options_; }

 protected:
  // For the models whose blocks can be planned in place (their
  // gradient_checkpointing_enable(PlannedOptions)): the blocks' remat::Planned is made at the first forward
  // pass after this, from the model's stages.
  void enable_planning(PlannedOptions options, const char* who) {
    TORCH_CHECK(options.budget() > 0 || options.fit_device() != 0, who,
                ": the budget must be a positive number of bytes (or PlannedOptions::fit_device), got ",
                options.budget());
    planned_options_ = std::move(options);
    planned_ = nullptr;
    checkpointing_enabled_ = true;
  }
  bool planning() const { return checkpointing_enabled_ && planned_options_.has_value(); }

  bool checkpointing_enabled_ = false;
  CheckpointOptions checkpoint_options_;
  std::optional<PlannedOptions> planned_options_;
  Planned planned_{nullptr};
};

}  // namespace remat::models
