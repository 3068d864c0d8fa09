#pragma once
// What a device's caching allocator says is allocated, read without Python: the ground
// truth a budget on CUDA is held to with measure="allocator" (dtr/device.py).
#include <pybind11/pybind11.h>

#include <cstdint>

namespace dtr {

// Bytes in blocks handed out by the CUDA caching allocator on device `index` (what
// torch.cuda.memory_allocated(index) reports, without building its stats dictionary).
int64_t cuda_allocated_bytes(int64_t index);

namespace device_memory {
void bind(pybind11::module_& m);  // dtr._C.cuda_allocated_bytes
}  // namespace device_memory

}  // namespace dtr
