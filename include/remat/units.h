#pragma once
/// \file
/// Forwarding header: <remat/units.h> is now <remat/planner/units.h>, the torch-free planner library's. This
/// path keeps working for code written against it.

#include <remat/planner/units.h>
