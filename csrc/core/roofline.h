#pragma once
// The roofline cost model in C++ (dtr/cost.py): the seconds an op would take on a nominal
// machine, the larger of FLOPs / 100 GFLOP/s and bytes moved / 10 GB/s, with FLOPs from
// torch.utils.flop_counter's formulas and bytes the sizes of the op's tensor arguments
// and results. The native engine prices ops with it when asked for a deterministic cost.
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <pybind11/pybind11.h>

#include <string>

namespace dtr {

// FLOPs of one call of the op named `name` ("aten::mm"), from its arguments and results;
// 0 for ops torch's flop counter has no formula for.
double roofline_flops(const std::string& name, c10::ArrayRef<c10::IValue> args,
                      c10::ArrayRef<c10::IValue> results);

// Estimated seconds of one call (see the header comment).
double roofline_seconds(const std::string& name, c10::ArrayRef<c10::IValue> args,
                        c10::ArrayRef<c10::IValue> results);

namespace roofline {
void bind(pybind11::module_& m);  // dtr._C.roofline_seconds, for tests
}  // namespace roofline

}  // namespace dtr
