#pragma once
/// \file
/// Forwarding header: <remat/strategy.h> is now <remat/planner/strategy.h>, the torch-free planner library's.
/// This path keeps working for code written against it.

#include <remat/planner/strategy.h>
