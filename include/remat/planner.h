#pragma once
/// \file
/// Forwarding header: <remat/planner.h> is now <remat/planner/planner.h>, the torch-free planner library's.
/// This path keeps working for code written against it.

#include <remat/planner/planner.h>
