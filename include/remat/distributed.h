#pragma once
/// \file
/// Data-parallel training on c10d, PyTorch's distributed engine (its TCPStore and ProcessGroupGloo), with
/// every remat checkpointing strategy. Start the processes with `remat launch`, `torchrun --no-python`, or
/// any launcher that sets torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
///
///   auto group = remat::distributed::init_process_group();       // reads the environment
///   remat::distributed::DataParallel dp(model.ptr(), group);      // rank 0's weights everywhere
///   auto loss = loss_fn(model->forward(shard));                   // this rank's part of the batch
///   loss.backward();                                              // gradients averaged over the group
///   optimizer.step();
///
/// Gradients are reduced in buckets (about bucket_bytes each; in the first step, parameters in reverse
/// registration order; from the second, as DDP does, in the order their gradients arrived in the first, rank
/// 0's): a bucket's all-reduce starts as soon as its last parameter has its gradient, on c10d's worker
/// threads, and overlaps the rest of the backward pass, recomputation included. This is not c10d::Reducer
/// (DDP's): the Reducer counts a parameter ready on every firing of its gradient accumulator, including the
/// firings with no gradient and the ones inside a kReentrant region's or the plan executor's nested backward
/// passes, and queues its end-of-backward work on whichever backward pass (possibly a nested one) marks the
/// last bucket. Here a parameter is ready once per step, on its first defined gradient, and the step ends
/// with the user's outermost backward pass.

#include <remat/distributed/data_parallel.h>
#include <remat/distributed/launch.h>
#include <remat/distributed/process_group.h>
