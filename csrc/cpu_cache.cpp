// A caching CPU allocator, installed while a session is open (docs/design.md, "The
// allocator at the step"): with a cache in the native engine, as a meter only (no idle
// blocks kept) in the subclass engine and with cache=0.
//
// Why: glibc hands large freed blocks back to the kernel (munmap, or trimming the top of
// the heap) and faults them in again at the next allocation of that size; how often
// depends on the order of frees, so a training step pays anywhere from a few hundred to
// tens of thousands of page faults, and the native engine, which frees in a different
// order than eager, paid up to 5x eager's. The CUDA caching allocator keeps freed blocks
// for the next request of the same size; this does the same on the CPU for blocks of
// kMinBytes and up, keeping at most `cap` bytes idle. Smaller requests go to the
// allocator that was installed before (glibc serves those from its arenas without
// faulting).
//
// Every block handed out and given back is reported to the profiler as the default
// allocator does (its requested size, not the rounded one), so torch.profiler's memory
// events (bench.common's measure) count what the program holds; idle cached bytes are
// "reserved", as on CUDA.
//
// It is also the engine's meter of what an op really allocates (window_mark/window_peak):
// the most bytes in use while a kernel ran, its workspace included, which the engine
// learns per op and input shapes and makes room for before the next such call; and the
// session's real peak (stats()'s peak_bytes). The allocator lives as long
// as the process: blocks outlive the session that allocated them, and a block given back
// when no session is open is freed at once.
#include "cpu_cache.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/extension.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace dtr {
namespace cpu_cache {
namespace {

constexpr size_t kMinBytes = size_t(64) << 10;  // below this, the previous allocator's
constexpr size_t kRound = 4096;                 // sizes are rounded up to pages
constexpr uint8_t kPriority = 200;              // above the default CPU allocator's

class CachingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    c10::Allocator* below = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!active_) below = prev_;
    }
    if (below != nullptr) return below->allocate(n);
    if (n < kMinBytes) return small(n);
    const size_t size = (n + kRound - 1) / kRound * kRound;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        idle_ -= size;
        hits_ += 1;
      } else {
        misses_ += 1;
      }
    }
    if (p == nullptr) p = c10::alloc_cpu(size);  // throws c10::OutOfMemoryError
    size_t allocated = 0, reserved = 0;
    const bool profiled = c10::memoryProfilingEnabled();
    {
      std::lock_guard<std::mutex> g(mu_);
      live_[p] = Block{size, n, profiled, false};
      note_allocated(size);
      allocated = allocated_;
      reserved = allocated_ + idle_;
    }
    if (profiled) report(p, static_cast<int64_t>(n), allocated, reserved);
    return {p, p, &give_back, cpu};
  }

  // The meter: bytes in use now (-1 while not attached), and the most in use since then.
  int64_t window_mark() {
    std::lock_guard<std::mutex> g(mu_);
    if (!active_) return -1;
    window_peak_ = allocated_;
    return static_cast<int64_t>(allocated_);
  }

  int64_t window_peak() {
    std::lock_guard<std::mutex> g(mu_);
    return active_ ? static_cast<int64_t>(window_peak_) : -1;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Install (once per session); cap: idle bytes kept at most.
  void attach(size_t cap) {
    std::lock_guard<std::mutex> g(mu_);
    if (active_) throw std::runtime_error("dtr: the CPU allocation cache is already attached");
    prev_ = c10::GetCPUAllocator();
    if (prev_ == this) throw std::runtime_error("dtr: the CPU allocation cache installed twice");
    prev_deleter_ = prev_->raw_deleter();
    cap_ = cap;
    hits_ = misses_ = 0;
    attach_base_ = attach_peak_ = allocated_;
    active_ = true;
    c10::SetCPUAllocator(this, kPriority);
  }

  // Restore the previous allocator and free what is cached; blocks still in use are
  // freed when given back.
  void detach() {
    std::vector<void*> drop;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!active_) return;
      active_ = false;
      c10::SetCPUAllocator(prev_, kPriority);
      for (auto& [size, blocks] : free_) drop.insert(drop.end(), blocks.begin(), blocks.end());
      free_.clear();
      idle_ = 0;
    }
    for (void* p : drop) c10::free_cpu(p);
  }

  py::dict stats() {
    std::lock_guard<std::mutex> g(mu_);
    py::dict d;
    d["hits"] = hits_;
    d["misses"] = misses_;
    d["idle_bytes"] = idle_;
    d["allocated_bytes"] = allocated_;
    d["active"] = active_;
    // the most in use at once since attach beyond what was in use then (the session's
    // real peak, dtr.Stats.real_peak_bytes); kept after detach until the next attach
    d["peak_bytes"] = attach_peak_ - attach_base_;
    return d;
  }

  static CachingCPUAllocator& get() {
    static auto* instance = new CachingCPUAllocator();  // never destroyed: see the header
    return *instance;
  }

 private:
  static void give_back(void* p) { get().release(p); }

  // A small block comes from the allocator below (glibc serves those from its arenas
  // without faulting) and goes back to it, but is counted by the meter: a kernel's small
  // buffers are memory too. The allocator below reports it to the profiler itself.
  c10::DataPtr small(size_t n) {
    c10::DataPtr dp = prev_->allocate(n);
    void* p = dp.get();
    // Only a block whose context is its address can be handed back through the raw
    // deleter (the default allocator's are); others stay the allocator's own, unmetered.
    if (prev_deleter_ == nullptr || p == nullptr || dp.get_context() != p ||
        dp.get_deleter() != prev_deleter_)
      return dp;
    dp.release_context();
    {
      std::lock_guard<std::mutex> g(mu_);
      live_[p] = Block{n, n, false, true, prev_deleter_};
      note_allocated(n);
    }
    return {p, p, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void note_allocated(size_t size) {  // (mu_ held)
    allocated_ += size;
    if (allocated_ > window_peak_) window_peak_ = allocated_;
    if (allocated_ > attach_peak_) attach_peak_ = allocated_;
  }

  void release(void* p) {
    bool keep = false, profiled = false, is_small = false;
    size_t size = 0, requested = 0, allocated = 0, reserved = 0;
    c10::Allocator* prev = nullptr;
    c10::DeleterFnPtr small_deleter = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(p);
      if (it == live_.end()) {
        prev = prev_;
      } else {
        size = it->second.size;
        requested = it->second.requested;
        profiled = it->second.profiled;
        is_small = it->second.small;
        small_deleter = it->second.deleter;
        live_.erase(it);
        allocated_ -= size;
        if (is_small) {
          // (freed below, outside mu_, by the allocator it came from)
        } else if (active_ && idle_ + size <= cap_) {
          free_[size].push_back(p);
          idle_ += size;
          keep = true;
        }
        allocated = allocated_;
        reserved = allocated_ + idle_;
      }
    }
    if (is_small) {
      small_deleter(p);  // (which reports the free to the profiler, as it reported the block)
      return;
    }
    if (size == 0) {
      // Not ours: code that took raw_allocate's deleter while another allocator was
      // installed frees through whichever is installed now (oneDNN's buffers). The one
      // before us is the default allocator, which frees with free_cpu.
      c10::DeleterFnPtr d = prev != nullptr ? prev->raw_deleter() : nullptr;
      if (d != nullptr && d != &give_back) {
        d(p);
      } else {
        c10::free_cpu(p);
      }
      return;
    }
    // as the default allocator does: a free is reported only for a block whose
    // allocation was (what was alive before profiling began is counted apart)
    if (profiled && c10::memoryProfilingEnabled())
      report(p, -static_cast<int64_t>(requested), allocated, reserved);
    if (!keep) c10::free_cpu(p);
  }

  // outside mu_: the profiler may allocate
  static void report(void* p, int64_t delta, size_t allocated, size_t reserved) {
    c10::reportMemoryUsageToProfiler(p, delta, allocated, reserved,
                                     c10::Device(c10::DeviceType::CPU));
  }

  struct Block {
    size_t size;       // as counted (rounded up to pages, for cached blocks)
    size_t requested;  // as asked for, and reported to the profiler
    bool profiled;     // its allocation was reported to the profiler
    bool small;        // the allocator below's block, given back to it
    c10::DeleterFnPtr deleter = nullptr;  // (small blocks) the allocator below's
  };

  std::mutex mu_;
  bool active_ = false;
  c10::Allocator* prev_ = nullptr;
  c10::DeleterFnPtr prev_deleter_ = nullptr;  // its raw deleter, for small blocks
  size_t cap_ = 0;
  size_t window_peak_ = 0;  // the meter's high-water mark since window_mark
  size_t attach_base_ = 0;  // in use at attach
  size_t attach_peak_ = 0;  // the high-water mark since attach
  size_t idle_ = 0;
  size_t allocated_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  std::unordered_map<size_t, std::vector<void*>> free_;  // idle blocks by size
  std::unordered_map<void*, Block> live_;                // blocks handed out
};

}  // namespace

int64_t window_mark() { return CachingCPUAllocator::get().window_mark(); }
int64_t window_peak() { return CachingCPUAllocator::get().window_peak(); }

void bind(py::module_& m) {
  m.def(
      "cpu_cache_attach", [](size_t cap) { CachingCPUAllocator::get().attach(cap); },
      py::arg("cap_bytes"));
  m.def("cpu_cache_detach", [] { CachingCPUAllocator::get().detach(); });
  m.def("cpu_cache_stats", [] { return CachingCPUAllocator::get().stats(); });
  m.def("cpu_cache_window_mark", &window_mark);
  m.def("cpu_cache_window_peak", &window_peak);
}

}  // namespace cpu_cache
}  // namespace dtr
