// Precompiled for the library, the tests and the tools: parsing LibTorch's headers costs ~15 s per source
// file.
#pragma once
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/torch.h>
