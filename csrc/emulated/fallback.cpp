// The boxed fallback: every op without an emu kernel of its own runs its CPU kernel on
// CPU tensors aliasing the emu inputs' memory (same bytes, sizes, strides, offset), with
// the emu device's generator, and its results come back as emu tensors:
//  - a result that is one of the inputs (in-place ops, out=) is that emu input;
//  - a result over an input's memory (a view) is an emu view of that input's storage;
//  - a fresh result is copied into memory from the emu allocator, so the device's
//    counters and cap see every tensor an op makes.
// An argument the kernel resized (out= of the wrong size) or restrided in place has its
// new memory copied back into its emu storage, and its new shape set on the emu tensor.
#include "emulated.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <cstring>
#include <unordered_map>
#include <vector>

namespace dtr_emulated {
namespace {

// An emu storage and the CPU storage standing for it during one op.
struct StoragePair {
  c10::Storage emu;
  c10::Storage cpu;
  const void* data;  // the emu memory the CPU storage started over
};

struct Call {
  std::unordered_map<const c10::StorageImpl*, StoragePair> by_cpu_storage;
  std::unordered_map<const c10::StorageImpl*, c10::Storage> cpu_of_emu_storage;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> emu_of_cpu_tensor;
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;  // (emu input, its CPU alias)
  std::optional<c10::DeviceIndex> device;

  // Resizable with the CPU allocator: a kernel that grows an out= argument gets fresh
  // host memory, which copy_back moves into emu memory.
  c10::Storage& cpu_storage(const c10::Storage& emu) {
    const c10::StorageImpl* key = emu.unsafeGetStorageImpl();
    auto found = cpu_of_emu_storage.find(key);
    if (found != cpu_of_emu_storage.end()) return found->second;
    void* data = const_cast<void*>(emu.data());
    c10::Storage cpu(c10::Storage::use_byte_size_t(), emu.nbytes(),
                     c10::DataPtr(data, c10::Device(c10::kCPU)), c10::GetCPUAllocator(),
                     /*resizable=*/true);
    by_cpu_storage.emplace(cpu.unsafeGetStorageImpl(), StoragePair{emu, cpu, data});
    return cpu_of_emu_storage.emplace(key, cpu).first->second;
  }

  at::Tensor to_cpu(const at::Tensor& t) {
    if (!t.defined() || !t.is_privateuseone()) {
      if (t.defined()) emu_of_cpu_tensor.emplace(t.unsafeGetTensorImpl(), t);
      return t;
    }
    if (!device) device = t.device().index();
    auto cpu = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(cpu_storage(t.storage())), c10::DispatchKeySet(c10::DispatchKey::CPU),
        t.dtype());
    copy_metadata(t, cpu);
    emu_of_cpu_tensor.emplace(cpu.unsafeGetTensorImpl(), t);
    pairs.emplace_back(t, cpu);
    return cpu;
  }

  static void copy_metadata(const at::Tensor& from, const at::Tensor& to) {
    c10::TensorImpl* impl = to.unsafeGetTensorImpl();
    impl->set_sizes_and_strides(from.sizes(), from.strides(), from.storage_offset());
    impl->_set_conj(from.is_conj());
    impl->_set_neg(from.is_neg());
  }

  // After the kernel: storages it reallocated get emu memory with the new contents, and
  // arguments it restrided in place get their new shape.
  void copy_back() {
    for (auto& [key, pair] : by_cpu_storage) {
      if (pair.cpu.data() == pair.data) continue;
      const c10::DeviceGuard guard(pair.emu.device());
      const size_t nbytes = pair.cpu.nbytes();
      c10::DataPtr fresh = allocator()->allocate(nbytes);
      if (nbytes > 0) std::memcpy(fresh.get(), pair.cpu.data(), nbytes);
      pair.emu.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
      pair.emu.unsafeGetStorageImpl()->set_nbytes(nbytes);
    }
    for (auto& [emu, cpu] : pairs) {
      if (emu.sizes() != cpu.sizes() || emu.strides() != cpu.strides() ||
          emu.storage_offset() != cpu.storage_offset()) {
        emu.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(),
                                                         cpu.storage_offset());
      }
    }
  }

  at::Tensor to_emu(const at::Tensor& out) {
    if (!out.defined()) return out;
    auto same = emu_of_cpu_tensor.find(out.unsafeGetTensorImpl());
    if (same != emu_of_cpu_tensor.end()) return same->second;
    if (!out.is_cpu()) return out;
    auto over = by_cpu_storage.find(out.storage().unsafeGetStorageImpl());
    if (over != by_cpu_storage.end()) {
      auto view = at::detail::make_tensor<c10::TensorImpl>(
          c10::TensorImpl::VIEW, c10::Storage(over->second.emu),
          c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), out.dtype());
      copy_metadata(out, view);
      return view;
    }
    const c10::Device target = dtr_emulated::device(device.value_or(current_device()));
    const bool dense = out.is_non_overlapping_and_dense();
    auto fresh = at::empty_strided(out.sizes(), dense ? out.strides() : out.contiguous().strides(),
                                   out.options().device(target));
    cpu_view(fresh).copy_(out);
    return fresh;
  }
};

bool is_optional_generator(const c10::Argument& arg) {
  const auto& type = arg.type();
  if (type->kind() != c10::TypeKind::OptionalType) return false;
  return type->castRaw<c10::OptionalType>()->getElementType()->kind() ==
         c10::TypeKind::GeneratorType;
}

// Returns whether the schema takes a generator.
bool to_cpu_arguments(const c10::FunctionSchema& schema, c10::IValue* args, Call& call) {
  std::vector<size_t> default_generators;
  bool emu_device_arg = false;
  bool takes_generator = false;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    c10::IValue& v = args[i];
    if (v.isTensor()) {
      v = call.to_cpu(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) list.push_back(call.to_cpu(t));
      v = list;
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        list.push_back(t.has_value() ? std::optional<at::Tensor>(call.to_cpu(*t)) : t);
      }
      v = list;
    } else if (v.isDevice() && v.toDevice().is_privateuseone()) {
      if (!call.device && v.toDevice().index() >= 0) call.device = v.toDevice().index();
      emu_device_arg = true;
      v = c10::Device(c10::kCPU);
    } else if (v.isGenerator()) {
      takes_generator = true;
      v = cpu_generator_of(v.toGenerator());
    } else if (v.isNone() && is_optional_generator(schema.arguments()[i])) {
      takes_generator = true;
      default_generators.push_back(i);
    }
  }
  if (emu_device_arg && !call.device) call.device = current_device();
  // A random op on emu tensors draws from the emu device's default generator, as it
  // would on a real device; the CPU default generator is the CPU's own.
  if (call.device) {
    for (size_t i : default_generators) {
      args[i] = cpu_generator_of(default_generator(*call.device));
    }
  }
  return takes_generator;
}

// A random op without a generator argument (native_dropout) draws from the CPU's default
// generator inside its CPU kernel: for the call, that generator holds the emu device's
// stream, which moves on by what the op drew, and the CPU's own stream is left as it was.
class DrawingFromDevice {
 public:
  explicit DrawingFromDevice(c10::DeviceIndex index)
      : cpu_(at::detail::getDefaultCPUGenerator()),
        emu_(cpu_generator_of(default_generator(index))),
        saved_(cpu_.get_state()) {
    cpu_.set_state(emu_.get_state());
  }
  ~DrawingFromDevice() {
    emu_.set_state(cpu_.get_state());
    cpu_.set_state(saved_);
  }
  DrawingFromDevice(const DrawingFromDevice&) = delete;
  DrawingFromDevice& operator=(const DrawingFromDevice&) = delete;

 private:
  at::Generator cpu_;
  at::Generator emu_;
  at::Tensor saved_;
};



void to_emu_results(size_t count, c10::IValue* results, Call& call) {
  for (size_t i = 0; i < count; ++i) {
    c10::IValue& v = results[i];
    if (v.isTensor()) {
      v = call.to_emu(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) list.push_back(call.to_emu(t));
      v = list;
    }
  }
}

// Runs cpu_op's CPU kernel on the stack, which holds the arguments of an op with cpu_op's
// schema, and leaves its results on the stack as emu tensors.
void run_on_cpu(const c10::OperatorHandle& cpu_op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = cpu_op.schema();
  const size_t num_args = schema.arguments().size();
  Call call;
  const bool takes_generator =
      to_cpu_arguments(schema, stack->data() + stack->size() - num_args, call);
  const c10::DeviceIndex index = call.device.value_or(current_device());
  const c10::DeviceGuard guard(dtr_emulated::device(index));
  {
    std::optional<DrawingFromDevice> drawing;
    if (call.device && !takes_generator && cpu_op.hasTag(at::Tag::nondeterministic_seeded)) {
      drawing.emplace(index);
    }
    cpu_op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  call.copy_back();
  const size_t num_returns = schema.returns().size();
  to_emu_results(num_returns, stack->data() + stack->size() - num_returns, call);
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { run_on_cpu(op, stack); }

c10::OperatorHandle aten_op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

// at::convolution sends a device it has no backend for to convolution_overrideable, whose
// arguments are aten::convolution's: the CPU's convolution serves it.
void convolution_overrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const c10::OperatorHandle cpu_op = aten_op("aten::convolution", "");
  run_on_cpu(cpu_op, stack);
}

// convolution_backward_overrideable has aten::convolution_backward's arguments but for
// bias_sizes (the bias gradient's size), which the weight's shape gives.
void convolution_backward_overrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const c10::OperatorHandle cpu_op = aten_op("aten::convolution_backward", "");
  // grad_output, input, weight, stride, padding, dilation, transposed, output_padding,
  // groups, output_mask: bias_sizes goes after weight
  const auto first = static_cast<std::ptrdiff_t>(stack->size() - 10);
  const at::Tensor weight = (*stack)[first + 2].toTensor();
  const bool transposed = (*stack)[first + 6].toBool();
  const int64_t groups = (*stack)[first + 8].toInt();
  const int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
  stack->insert(stack->begin() + first + 3, c10::IValue(std::vector<int64_t>{channels}));
  run_on_cpu(cpu_op, stack);
}

}  // namespace
}  // namespace dtr_emulated

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&dtr_emulated::fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&dtr_emulated::convolution_overrideable>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<
             &dtr_emulated::convolution_backward_overrideable>());
}
