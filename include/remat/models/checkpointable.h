#pragma once
/// \file
/// The three methods every remat model has, so that a user learns them once:
///   model->gradient_checkpointing_enable();            // checkpoint with the default options
///   model->gradient_checkpointing_disable();
///   bool on = model->is_gradient_checkpointing();

#include <remat/checkpoint.h>

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
  }
  /// Turns checkpointing off. Takes effect from the next forward pass.
  void gradient_checkpointing_disable() { checkpointing_enabled_ = false; }
  /// Whether checkpointing is on.
  bool is_gradient_checkpointing() const { return checkpointing_enabled_; }
  /// The options checkpointing runs with.
  const CheckpointOptions& gradient_checkpointing_options() const { return checkpoint_options_; }

 protected:
  bool checkpointing_enabled_ = false;
  CheckpointOptions checkpoint_options_;
};

}  // namespace remat::models
