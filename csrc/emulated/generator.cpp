// Emu generators. Each wraps a CPU generator: the CPU kernels serving emu ops check that
// their generator is a CPU one, so the fallback hands them the wrapped one, and seeding or
// setting the state of the emu generator moves exactly the stream those kernels draw from.
#include "emulated.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include <array>
#include <mutex>

namespace dtr_emulated {
namespace {

class EmuGenerator final : public c10::GeneratorImpl {
 public:
  EmuGenerator(c10::DeviceIndex index, at::Generator cpu)
      : c10::GeneratorImpl(dtr_emulated::device(index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu_(std::move(cpu)) {}

  const at::Generator& cpu() const { return cpu_; }

  void set_current_seed(uint64_t seed) override { impl()->set_current_seed(seed); }
  void set_offset(uint64_t offset) override { impl()->set_offset(offset); }
  uint64_t get_offset() const override { return impl()->get_offset(); }
  uint64_t current_seed() const override { return impl()->current_seed(); }
  uint64_t seed() override { return impl()->seed(); }
  void set_state(const c10::TensorImpl& state) override { impl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return impl()->get_state(); }
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

 private:
  c10::GeneratorImpl* impl() const { return cpu_.unsafeGetGeneratorImpl(); }
  EmuGenerator* clone_impl() const override {
    return new EmuGenerator(device().index(), cpu_.clone());
  }

  at::Generator cpu_;
};

}  // namespace

at::Generator new_generator(c10::DeviceIndex index) {
  if (index < 0) index = current_device();
  check_index(index);
  return at::make_generator<EmuGenerator>(index, at::detail::createCPUGenerator());
}

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::array<at::Generator, kDeviceCount> defaults = [] {
    std::array<at::Generator, kDeviceCount> made;
    for (c10::DeviceIndex i = 0; i < kDeviceCount; ++i) made[i] = new_generator(i);
    return made;
  }();
  if (index < 0) index = current_device();
  check_index(index);
  return defaults[index];
}

at::Generator cpu_generator_of(const at::Generator& gen) {
  if (gen.device().type() != c10::DeviceType::PrivateUse1) return gen;
  return static_cast<const EmuGenerator*>(gen.unsafeGetGeneratorImpl())->cpu();
}

}  // namespace dtr_emulated
