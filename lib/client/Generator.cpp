#include "rgpu/client/Generator.h"
#include "rgpu/client/Session.h"

#include <ATen/ATen.h>
#include <c10/core/GeneratorImpl.h>

#include <cstring>

namespace rgpu::client {

RgpuGenerator::RgpuGenerator(c10::DeviceIndex device, uint64_t id, uint64_t seed)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, device),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      id_(id), seed_(seed) {}

at::Generator RgpuGenerator::make(c10::DeviceIndex device, uint64_t seed) {
  uint64_t id = Session::get().newGenerator(device, NewGenerator::Seeded, seed);
  return at::make_generator<RgpuGenerator>(device, id, seed);
}

at::Generator RgpuGenerator::snapshot(c10::DeviceIndex device) {
  uint64_t id = Session::get().newGenerator(device, NewGenerator::Snapshot);
  return at::make_generator<RgpuGenerator>(device, id, uint64_t(0));
}

RgpuGenerator::~RgpuGenerator() { Session::get().dropGenerator(id_); }

void RgpuGenerator::set_current_seed(uint64_t seed) {
  Session::get().seedGenerator(device_.index(), id_, seed);
  seed_ = seed;
}

uint64_t RgpuGenerator::seed() {
  uint64_t random = c10::detail::getNonDeterministicRandom(true);
  set_current_seed(random);
  return random;
}

void RgpuGenerator::set_offset(uint64_t) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "rgpu: Generator.set_offset is not supported: save and "
                                     "restore an rgpu generator with get_state and set_state");
}

uint64_t RgpuGenerator::get_offset() const {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "rgpu: Generator.get_offset is not supported: save and "
                                     "restore an rgpu generator with get_state and set_state");
}

void RgpuGenerator::set_state(const c10::TensorImpl &state) {
  TORCH_CHECK_TYPE(state.dtype() == caffe2::TypeMeta::Make<uint8_t>() &&
                       state.device().is_cpu() && state.is_contiguous(),
                   "rgpu: Generator.set_state expects a contiguous CPU ByteTensor, as get_state "
                   "returns");
  std::string bytes(static_cast<const char *>(state.data()), size_t(state.numel()));
  Session::get().setRngState(device_.index(), std::move(bytes), id_);
}

c10::intrusive_ptr<c10::TensorImpl> RgpuGenerator::get_state() const {
  RngState s = Session::get().rngState(device_.index(), id_);
  at::Tensor out = at::empty({int64_t(s.state.size())}, at::kByte);
  std::memcpy(out.data_ptr(), s.state.data(), s.state.size());
  return out.getIntrusivePtr();
}

RgpuGenerator *RgpuGenerator::clone_impl() const {
  // In the state this one is in after the ops traced so far.
  uint64_t id = Session::get().newGenerator(device_.index(), NewGenerator::CloneOf, id_);
  return new RgpuGenerator(device_.index(), id, seed_);
}

} // namespace rgpu::client
