#include "device_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

namespace dtr {

// The allocator is reached through c10's device-generic interface, so this builds against
// a CPU-only torch as well; on a machine without CUDA it is never called (dtr/device.py
// refuses measure="allocator" there first).
int64_t cuda_allocated_bytes(int64_t index) {
  c10::DeviceAllocator* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  const c10::CachingDeviceAllocator::DeviceStats stats =
      allocator->getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
      .current;
}

namespace device_memory {
void bind(pybind11::module_& m) {
  m.def("cuda_allocated_bytes", &cuda_allocated_bytes, pybind11::arg("index"),
        "Bytes the CUDA caching allocator has handed out on device `index`.");
}
}  // namespace device_memory

}  // namespace dtr
