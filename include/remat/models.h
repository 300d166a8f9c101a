#pragma once
/// \file
/// Every model of remat::models: the reference articles' models and a BERT encoder. Each has
/// gradient_checkpointing_enable(), gradient_checkpointing_disable() and is_gradient_checkpointing().

#include <remat/models/bert.h>
#include <remat/models/checkpointable.h>
#include <remat/models/cifar_net.h>
#include <remat/models/forum_cnn.h>
#include <remat/models/heavy_chain.h>
#include <remat/models/residual_mlp.h>
#include <remat/models/resnet.h>
