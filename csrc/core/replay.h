// Trace replay: the compiled replay loop of dtr/sim/replay.py (its Python twin). It drives a
// Core with the same calls, in the same order, as the live runtime or the paper's simulator.
#pragma once

#include <cstdint>
#include <string>

#include "core/core.h"

namespace dtr {

enum ReplayMode : int { kPrototype = 0, kLive = 1 };

// Returns "ok", "oom" or "thrash". code/costs: see dtr/sim/program.py.
std::string replay(Core& core, const int64_t* code, int64_t ncode, const double* costs,
                   int64_t nslots, int mode, bool stress, double thrash, double baseline);

}  // namespace dtr
