// An emulated accelerator for tests: PyTorch's PrivateUse1 backend (renamed "emu" by
// tests/emulated_device.py) whose memory is host memory from a capped, counting
// allocator, with its own random generators, and every op served by the CPU kernel on
// CPU tensors that alias the emu tensors' memory. It lets CI run dtr's device paths
// (allocator measure, OOM retry, per-device generators, device placement) without a GPU.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace dtr_emulated {

constexpr c10::DeviceIndex kDeviceCount = 1;

c10::DeviceIndex current_device();
void set_device(c10::DeviceIndex index);
void check_index(c10::DeviceIndex index);
inline c10::Device device(c10::DeviceIndex index) {
  return c10::Device(c10::DeviceType::PrivateUse1, index);
}

// allocator.cpp: the capped allocator and its counters, per device.
c10::Allocator* allocator();
int64_t memory_allocated(c10::DeviceIndex index);
int64_t max_memory_allocated(c10::DeviceIndex index);
void reset_peak_memory_stats(c10::DeviceIndex index);
void set_memory_cap(c10::DeviceIndex index, int64_t cap);  // cap < 0: no cap
int64_t memory_cap(c10::DeviceIndex index);

// generator.cpp: an emu generator draws from a CPU generator it owns, so the CPU kernels
// that serve emu ops take it as their generator.
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);
// The CPU generator that gen draws from; gen itself when it is not an emu generator.
at::Generator cpu_generator_of(const at::Generator& gen);

// aliases.cpp: CPU tensors over emu memory, and emu tensors back from CPU results.
at::Tensor cpu_view(const at::Tensor& emu);

}  // namespace dtr_emulated
