#pragma once
/// \file
/// Forwarding header: <remat/report.h> is now <remat/planner/report.h>, the torch-free planner library's.
/// This path keeps working for code written against it.

#include <remat/planner/report.h>
