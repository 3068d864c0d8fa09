// A caching CPU allocator for the native engine's sessions (csrc/cpu_cache.cpp).
#pragma once
#include <pybind11/pybind11.h>

namespace dtr {
namespace cpu_cache {
void bind(pybind11::module_& m);
}  // namespace cpu_cache
}  // namespace dtr
