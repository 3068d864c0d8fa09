// The emu allocator: host memory, counted per device (allocated, peak), and refused past
// a settable cap with the error a device allocator raises (torch.OutOfMemoryError, with
// "Tried to allocate N bytes", the phrase dtr reads the request from).
#include "emulated.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>

namespace dtr_emulated {
namespace {

struct Counters {
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t cap = -1;
};

std::mutex mutex;
std::array<Counters, kDeviceCount> counters;

// What a DataPtr's deleter needs to give the bytes back to the right device's count.
struct Block {
  void* data;
  int64_t size;
  c10::DeviceIndex device;
};

void free_block(void* context) {
  auto* block = static_cast<Block*>(context);
  {
    std::lock_guard<std::mutex> lock(mutex);
    counters[block->device].allocated -= block->size;
  }
  c10::free_cpu(block->data);
  delete block;
}

void reserve(c10::DeviceIndex index, int64_t size) {
  std::lock_guard<std::mutex> lock(mutex);
  Counters& c = counters[index];
  TORCH_CHECK_WITH(OutOfMemoryError, c.cap < 0 || c.allocated + size <= c.cap,
                   "emu:", static_cast<int>(index), " out of memory. Tried to allocate ", size,
                   " bytes; ", c.allocated, " bytes allocated of a cap of ", c.cap, " bytes.");
  c.allocated += size;
  c.peak = std::max(c.peak, c.allocated);
}

struct EmuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex index = current_device();
    if (n == 0) return c10::DataPtr(nullptr, device(index));
    const auto size = static_cast<int64_t>(n);
    reserve(index, size);
    void* data = nullptr;
    try {
      data = c10::alloc_cpu(n);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      counters[index].allocated -= size;
      throw;
    }
    return c10::DataPtr(data, new Block{data, size, index}, &free_block, device(index));
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

EmuAllocator the_allocator;

}  // namespace

c10::Allocator* allocator() { return &the_allocator; }

int64_t memory_allocated(c10::DeviceIndex index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mutex);
  return counters[index].allocated;
}

int64_t max_memory_allocated(c10::DeviceIndex index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mutex);
  return counters[index].peak;
}

void reset_peak_memory_stats(c10::DeviceIndex index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mutex);
  counters[index].peak = counters[index].allocated;
}

void set_memory_cap(c10::DeviceIndex index, int64_t cap) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mutex);
  counters[index].cap = cap;
}

int64_t memory_cap(c10::DeviceIndex index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mutex);
  return counters[index].cap;
}

}  // namespace dtr_emulated

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, dtr_emulated::allocator());
