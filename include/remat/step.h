#pragma once
/// \file
/// Forwarding header: <remat/step.h> is now <remat/planner/step.h>, the torch-free planner library's. This
/// path keeps working for code written against it.

#include <remat/planner/step.h>
