//===- rgpu/client/Generator.h - torch.Generator(device="rgpu") -------------===//
//
// A generator the user makes for rgpu is a generator of the session on the server; this object
// names it. Seeding and setting its state happen at their point of the trace (ops traced before
// draw from the old state); reading its state is a round trip. A random op given it as
// generator= carries its id in a scalar slot, so one graph serves every generator.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

namespace rgpu::client {

class RgpuGenerator final : public c10::GeneratorImpl {
public:
  /// torch.Generator(device="rgpu"): a new generator of rgpu:\p device seeded with \p seed.
  static at::Generator make(c10::DeviceIndex device, uint64_t seed);
  /// A generator in the state the session's generator of rgpu:\p device is in at this point of
  /// the trace (torch.random.fork_rng and checkpointing save the device's state so).
  static at::Generator snapshot(c10::DeviceIndex device);
  /// Names the session's generator \p id, which the server already has.
  RgpuGenerator(c10::DeviceIndex device, uint64_t id, uint64_t seed);
  ~RgpuGenerator() override;

  uint64_t id() const { return id_; }

  void set_current_seed(uint64_t seed) override;
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  void set_state(const c10::TensorImpl &state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;

private:
  RgpuGenerator *clone_impl() const override;
  uint64_t id_;
  uint64_t seed_;
};

} // namespace rgpu::client
