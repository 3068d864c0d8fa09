// The kernels an emu device needs of its own: allocation (from the capped allocator),
// copies between emu and CPU, reading a scalar, resize and set_, and the view ops, which
// use at::native's device-generic implementations on emu storage.
#include "emulated.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

namespace dtr_emulated {

at::Tensor cpu_view(const at::Tensor& emu) {
  const c10::StorageImpl* storage = emu.storage().unsafeGetStorageImpl();
  c10::Storage cpu_storage(c10::Storage::use_byte_size_t(), storage->nbytes(),
                           c10::DataPtr(const_cast<void*>(storage->data()), c10::Device(c10::kCPU)),
                           /*allocator=*/nullptr, /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(cpu_storage), c10::DispatchKeySet(c10::DispatchKey::CPU), emu.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(emu.sizes(), emu.strides(),
                                                 emu.storage_offset());
  return t;
}

namespace {

c10::DispatchKeySet emu_keys() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

c10::Device checked_device(std::optional<c10::Device> device_opt,
                           std::optional<c10::Layout> layout_opt,
                           std::optional<bool> pin_memory_opt) {
  const c10::Device d = c10::device_or_default(device_opt);
  TORCH_CHECK(d.is_privateuseone(), "emu: expected an emu device, got ", d);
  TORCH_CHECK(c10::layout_or_default(layout_opt) == c10::Layout::Strided,
              "emu: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory_opt),
              "emu: pinned memory is host memory; pin on the CPU");
  return d;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device_opt,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(checked_device(device_opt, layout, pin_memory));
  return at::detail::empty_generic(size, allocator(), emu_keys(), c10::dtype_or_default(dtype),
                                   memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device_opt, std::optional<bool> pin_memory) {
  const c10::DeviceGuard guard(checked_device(device_opt, layout, pin_memory));
  return at::detail::empty_strided_generic(size, stride, allocator(), emu_keys(),
                                           c10::dtype_or_default(dtype));
}

at::Tensor host_side(const at::Tensor& t) { return t.is_privateuseone() ? cpu_view(t) : t; }

// Synchronous whatever non_blocking says: every emu kernel has finished when it returns.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  host_side(dst).copy_(host_side(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  host_side(dst).copy_(host_side(self));
  return dst;
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  return at::native::_local_scalar_dense_cpu(cpu_view(self));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                        c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  at::native::checkSetStorage(self, source, offset, size, stride);
  self.unsafeGetTensorImpl()->set_storage_offset(offset.expect_int());
  const std::optional<c10::IntArrayRef> strides =
      stride.data() != nullptr ? std::optional<c10::IntArrayRef>(C10_AS_INTARRAYREF_SLOW(stride))
                               : std::nullopt;
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), C10_AS_INTARRAYREF_SLOW(size),
                               strides);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, c10::SymIntArrayRef({c10::SymInt(numel)}),
                     c10::SymIntArrayRef({c10::SymInt(1)}));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  return set_storage(self, source.storage(), source.sym_storage_offset(), source.sym_sizes(),
                     source.sym_strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, allocator(), /*resizable=*/true);
  return set_storage(self, std::move(storage), 0, c10::SymIntArrayRef({c10::SymInt(0)}), {});
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size,
                      c10::SymIntArrayRef stride, std::optional<c10::SymInt> offset) {
  return at::native::as_strided_tensorimpl(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
      offset.has_value() ? std::optional<int64_t>(offset->expect_int()) : std::nullopt);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

}  // namespace
}  // namespace dtr_emulated

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace dtr_emulated;
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
  m.impl("_copy_from", &copy_from);
  m.impl("_copy_from_and_resize", &copy_from_and_resize);
  m.impl("_local_scalar_dense", &local_scalar_dense);
  m.impl("resize_", &resize_);
  m.impl("set_.source_Storage", &set_source_storage);
  m.impl("set_.source_Storage_storage_offset", &set_storage);
  m.impl("set_.source_Tensor", &set_source_tensor);
  m.impl("set_", &set_empty);
  m.impl("as_strided", &as_strided);
  m.impl("view", &view);
  m.impl("_reshape_alias", &reshape_alias);
}
