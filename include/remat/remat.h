#pragma once
/// \file
/// The umbrella header: the runtime, sequential checkpointing and the plan executor, the planners, the meter
/// and the measuring helpers, and data parallel (remat/distributed.h) when this build has it. Models are in
/// <remat/models.h>.

#include <remat/checkpoint.h>
#include <remat/measure.h>
#include <remat/memory.h>
#include <remat/offload.h>
#include <remat/planned.h>
#include <remat/planner/batch.h>
#include <remat/planner/chain.h>
#include <remat/planner/device.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>
#include <remat/planner/timeline.h>
#include <remat/planner/units.h>
#include <remat/profile.h>
#include <remat/sequential.h>
#include <remat/version.h>
#if REMAT_HAS_DISTRIBUTED
#include <remat/distributed.h>
#endif
