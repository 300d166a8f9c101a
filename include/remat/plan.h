#pragma once
/// \file
/// Forwarding header: <remat/plan.h> is now <remat/planner/plan.h>, the torch-free planner library's. This
/// path keeps working for code written against it.

#include <remat/planner/plan.h>
