// The native engine (csrc/native/engine.cpp): its Python bindings.
#pragma once
#include <pybind11/pybind11.h>

namespace dtr {
namespace native {
void bind(pybind11::module_& m);
}  // namespace native
}  // namespace dtr
