// dtr._emulated: loading it registers the emu device (PrivateUse1) with PyTorch; these
// functions are what tests/emulated_device.py builds the torch.emu module from.
#include "emulated.h"

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace dtr_emulated;
  m.def("device_count", [] { return static_cast<int>(kDeviceCount); });
  m.def("current_device", [] { return static_cast<int>(current_device()); });
  m.def("set_device", [](int index) { set_device(static_cast<c10::DeviceIndex>(index)); });
  m.def("memory_allocated", [](int index) { return memory_allocated(index); });
  m.def("max_memory_allocated", [](int index) { return max_memory_allocated(index); });
  m.def("reset_peak_memory_stats", [](int index) { reset_peak_memory_stats(index); });
  m.def("set_memory_cap", [](int index, int64_t cap) { set_memory_cap(index, cap); },
        "cap < 0: no cap");
  m.def("memory_cap", [](int index) { return memory_cap(index); });
  m.def("default_generator", [](int index) { return default_generator(index); });
}
