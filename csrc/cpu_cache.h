// A caching CPU allocator for the native engine's sessions (csrc/cpu_cache.cpp).
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>

namespace dtr {
namespace cpu_cache {
void bind(pybind11::module_& m);

// The meter (while the cache is attached; both return -1 otherwise): window_mark() the
// bytes in use now, which starts a window; window_peak() the most in use since.
int64_t window_mark();
int64_t window_peak();
}  // namespace cpu_cache
}  // namespace dtr
