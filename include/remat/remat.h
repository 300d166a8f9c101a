#pragma once
/// \file
/// The umbrella header: the runtime, the meter and the measuring helpers.
/// Models are in <remat/models.h>.

#include <remat/checkpoint.h>
#include <remat/measure.h>
#include <remat/memory.h>
#include <remat/units.h>
#include <remat/version.h>
