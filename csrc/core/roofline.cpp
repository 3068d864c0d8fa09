#include "core/roofline.h"

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace dtr {
namespace {

// dtr/cost.py's nominal machine
constexpr double kFlopsPerSecond = 100e9;
constexpr double kBytesPerSecond = 10e9;

using Shape = std::vector<int64_t>;

double prod(const Shape& s, size_t from = 0) {
  double p = 1;
  for (size_t i = from; i < s.size(); ++i) p *= static_cast<double>(s[i]);
  return p;
}

Shape shape_of(const c10::IValue& v) { return v.isTensor() ? v.toTensor().sizes().vec() : Shape(); }

// flop_counter.mm_flop / bmm_flop: 2 m n k (times the batch)
double matmul_flops(const Shape& a, const Shape& b) {
  if (a.size() == 2 && b.size() == 2) return 2.0 * a[0] * b[1] * a[1];
  if (a.size() == 3 && b.size() == 3) return 2.0 * a[0] * a[1] * b[2] * a[2];
  return 0;
}

// flop_counter.conv_flop_count: only multiplications, bias ignored; a transposed
// convolution counts each point of its input's spatial dimensions.
double conv_flops(const Shape& x, const Shape& w, const Shape& out, bool transposed) {
  const Shape& spatial = transposed ? x : out;
  if (x.empty() || w.size() < 2 || spatial.size() < 2) return 0;
  return prod(spatial, 2) * prod(w, 2) * static_cast<double>(x[0]) * w[0] * w[1] * 2;
}

Shape swap01(Shape s) {  // flop_counter.conv_backward_flop's t()
  if (s.size() >= 2) std::swap(s[0], s[1]);
  return s;
}

double tensor_bytes(const c10::IValue& v) {  // dtr/cost.py's _tensor_bytes
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() ? static_cast<double>(t.numel()) * t.element_size() : 0;
  }
  double total = 0;
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec())
      if (t.defined()) total += static_cast<double>(t.numel()) * t.element_size();
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) total += tensor_bytes(item);
  } else if (v.isTuple()) {
    for (const c10::IValue& item : v.toTupleRef().elements()) total += tensor_bytes(item);
  }
  return total;
}

}  // namespace

double roofline_flops(const std::string& name, c10::ArrayRef<c10::IValue> args,
                      c10::ArrayRef<c10::IValue> results) {
  auto arg = [&](size_t i) { return i < args.size() ? shape_of(args[i]) : Shape(); };
  auto result = [&](size_t i) { return i < results.size() ? shape_of(results[i]) : Shape(); };
  if (name == "aten::mm" || name == "aten::bmm") return matmul_flops(arg(0), arg(1));
  if (name == "aten::addmm" || name == "aten::baddbmm") return matmul_flops(arg(1), arg(2));
  if (name == "aten::convolution" || name == "aten::_convolution" ||
      name == "aten::convolution_overrideable") {
    const bool transposed = args.size() > 6 && args[6].isBool() && args[6].toBool();
    return conv_flops(arg(0), arg(1), result(0), transposed);
  }
  if (name == "aten::convolution_backward") {
    // (grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed,
    //  output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)
    const Shape grad_out = arg(0), x = arg(1), w = arg(2);
    const bool transposed = args.size() > 7 && args[7].isBool() && args[7].toBool();
    std::vector<bool> mask(3, false);
    if (args.size() > 10 && args[10].isBoolList()) {
      auto m = args[10].toBoolList();
      for (size_t i = 0; i < m.size() && i < 3; ++i) mask[i] = m.get(i);
    }
    double flops = 0;
    if (mask[0]) flops += conv_flops(grad_out, w, result(0), !transposed);
    if (mask[1])
      flops += transposed ? conv_flops(swap01(grad_out), swap01(x), swap01(result(1)), false)
                          : conv_flops(swap01(x), swap01(grad_out), swap01(result(1)), false);
    return flops;
  }
  // The attention kernels torch has formulas for (flash, efficient, cuDNN) and _scaled_mm
  // run on CUDA only; the native engine manages CPU tensors, where attention is
  // _scaled_dot_product_flash_attention_for_cpu, which torch's counter does not price
  // either. Every other op: bytes only, as in dtr/cost.py.
  return 0;
}

double roofline_seconds(const std::string& name, c10::ArrayRef<c10::IValue> args,
                        c10::ArrayRef<c10::IValue> results) {
  double moved = 0;
  for (const c10::IValue& v : args) moved += tensor_bytes(v);
  for (const c10::IValue& v : results) moved += tensor_bytes(v);
  return std::max(roofline_flops(name, args, results) / kFlopsPerSecond, moved / kBytesPerSecond);
}

namespace roofline {
namespace {
// What an op's argument is in a test's call: a tensor, a bool, an int, None, or a list of
// tensors, bools or ints.
c10::IValue from_python(pybind11::handle h) {
  if (THPVariable_Check(h.ptr())) return h.cast<at::Tensor>();
  if (h.is_none()) return c10::IValue();
  if (pybind11::isinstance<pybind11::bool_>(h)) return h.cast<bool>();
  if (pybind11::isinstance<pybind11::int_>(h)) return h.cast<int64_t>();
  if (pybind11::isinstance<pybind11::list>(h) || pybind11::isinstance<pybind11::tuple>(h)) {
    auto seq = h.cast<pybind11::sequence>();
    if (seq.size() > 0 && THPVariable_Check(seq[0].ptr())) {
      c10::List<at::Tensor> l;
      for (pybind11::handle x : seq) l.push_back(x.cast<at::Tensor>());
      return l;
    }
    if (seq.size() > 0 && pybind11::isinstance<pybind11::bool_>(seq[0])) {
      c10::List<bool> l;
      for (pybind11::handle x : seq) l.push_back(x.cast<bool>());
      return l;
    }
    c10::List<int64_t> l;
    for (pybind11::handle x : seq) l.push_back(x.cast<int64_t>());
    return l;
  }
  throw std::invalid_argument("dtr: roofline_seconds takes tensors, bools, ints, None and lists");
}
}  // namespace

void bind(pybind11::module_& m) {
  // The C++ estimate of a call from Python values, to compare with dtr/cost.py's.
  m.def(
      "roofline_seconds",
      [](const std::string& name, pybind11::sequence args, pybind11::sequence results) {
        std::vector<c10::IValue> a, r;
        for (pybind11::handle h : args) a.push_back(from_python(h));
        for (pybind11::handle h : results) r.push_back(from_python(h));
        return roofline_seconds(name, a, r);
      },
      pybind11::arg("name"), pybind11::arg("args"), pybind11::arg("results"));
}
}  // namespace roofline

}  // namespace dtr
