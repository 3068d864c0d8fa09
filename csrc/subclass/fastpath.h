// The live runtime's per-op fast path (see fastpath.cpp). Kept apart from core.h: the
// core has no Python or torch in it, so the simulator's replay stays free of both.
#pragma once

#include <pybind11/pybind11.h>

namespace dtr {

void bind_fastpath(pybind11::module_& m);

}  // namespace dtr
