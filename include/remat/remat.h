#pragma once
/// \file
/// The umbrella header: the runtime, sequential checkpointing and the plan executor, the planners, the meter
/// and the measuring helpers. Models are in <remat/models.h>.

#include <remat/chain.h>
#include <remat/checkpoint.h>
#include <remat/measure.h>
#include <remat/memory.h>
#include <remat/plan.h>
#include <remat/planner.h>
#include <remat/profile.h>
#include <remat/sequential.h>
#include <remat/units.h>
#include <remat/version.h>
