#pragma once
/// \file
/// Forwarding header: <remat/chain.h> is now <remat/planner/chain.h>, the torch-free planner library's. This
/// path keeps working for code written against it.

#include <remat/planner/chain.h>
