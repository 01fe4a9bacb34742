//===- lib/client/DeviceHooks.cpp - What PyTorch asks of the rgpu device ---===//
//
// The device guard (current device, streams, events), the accelerator hooks and the allocator
// PyTorch asks an accelerator backend for. rgpu's devices, memory and generators are the
// server's: these answer from the session, or say why they cannot.
//
//===----------------------------------------------------------------------===//
#include "Tracing.h"

#include "rgpu/client/Generator.h"
#include "rgpu/client/PinnedMemory.h"
#include "rgpu/client/Session.h"
#include "rgpu/wire/Wire.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace rgpu::client {
namespace {

thread_local c10::DeviceIndex tlsDevice = 0;

/// rgpu's devices are the server's (--devices); the current one is per thread, as CUDA's is.
/// There are no streams: one per device, in order; every stream asked for is that one.
struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {type(), tlsDevice}; }
  void setDevice(c10::Device d) const override { uncheckedSetDevice(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index())
      tlsDevice = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  // Every stream is the device's one stream: work runs in trace order, which is at least as
  // ordered as any streams a program asks for.
  c10::Stream getDefaultStream(c10::Device d) const override { return getStream(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getStream(d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  bool queryStream(const c10::Stream &) const override {
    Session::get().synchronize();
    return true;
  }
  void synchronizeStream(const c10::Stream &) const override { Session::get().synchronize(); }
  /// Until this process starts its session, the most devices a server may have: torch's
  /// autograd engine sizes its device threads by this at the first backward, a CPU one too,
  /// which must not start a session (nor fail for want of a server).
  c10::DeviceIndex deviceCount() const noexcept override {
    return Session::get().started() ? c10::DeviceIndex(Session::get().deviceCount())
                                    : c10::DeviceIndex(wire::kMaxDevices);
  }
  // An event marks a point of the trace; waiting for it waits for everything traced so far
  // (a superset of what came before it). There is no device clock to time it by.
  void record(void **, const c10::Stream &, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void *, const c10::Stream &) const override {}
  bool queryEvent(void *) const override {
    Session::get().synchronize();
    return true;
  }
  void synchronizeEvent(void *) const override { Session::get().synchronize(); }
  double elapsedTime(void *, void *, const c10::DeviceIndex) const override {
    TORCH_CHECK_NOT_IMPLEMENTED(
        false, "rgpu: Event.elapsed_time is not supported (rgpu has no device clock); time "
        "with time.perf_counter() around torch.rgpu.synchronize(), or read the server's "
        "execute_ms in rgpu.server_stats()[\"session\"]");
  }
  void destroyEvent(void *, const c10::DeviceIndex) const noexcept override {}
  void synchronizeDevice(const c10::DeviceIndex) const override { Session::get().synchronize(); }
};

/// What PyTorch asks of an accelerator backend (the autograd engine asks before running
/// backward on rgpu tensors). rgpu's generator lives on the server; the client-side one
/// exists only to satisfy callers that ask for a default generator and never draws.
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return c10::DeviceIndex(Session::get().deviceCount()); }
  c10::DeviceIndex getCurrentDevice() const override { return tlsDevice; }
  const at::Generator &getDefaultGenerator(c10::DeviceIndex) const override {
    static at::Generator generator = at::make_generator<at::CPUGeneratorImpl>();
    return generator;
  }
  /// torch.Generator(device="rgpu"): seeded as CPU's and CUDA's new generators are.
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return RgpuGenerator::make(device < 0 ? tlsDevice : device, c10::default_rng_seed_val);
  }
  at::Device getDeviceFromPtr(void *) const override { return {c10::DeviceType::PrivateUse1, tlsDevice}; }
  bool isPinnedPtr(const void *p) const override { return isPinned(p); }
  at::Allocator *getPinnedMemoryAllocator() const override { return pinnedAllocator(); }
};

const bool hooksRegistered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

/// rgpu's bytes live on the server: nothing allocates them here. Code that asks for the
/// device's allocator (`torch.UntypedStorage(n, device="rgpu")`) gets a clear error, not a
/// null allocator.
/// It is also rgpu's DeviceAllocator for torch.accelerator's memory functions, which the
/// server answers (Session::deviceMemory, one round trip each), as torch.rgpu's do.
struct NoAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    TORCH_CHECK_NOT_IMPLEMENTED(n == 0, "rgpu: a storage of ", n, " bytes cannot be allocated on "
                                "the client; rgpu tensors are made by ops (torch.empty(..., "
                                "device=\"rgpu\"), tensor.to(\"rgpu\")), and their bytes live on "
                                "the server");
    return {nullptr, nullptr, &deleteNothing, c10::Device(c10::DeviceType::PrivateUse1, tlsDevice)};
  }
  void copy_data(void *, const void *, std::size_t count) const override {
    TORCH_CHECK_NOT_IMPLEMENTED(count == 0, "rgpu: bytes on the server cannot be copied here");
  }
  static void deleteNothing(void *) {}

  /// As CUDA's allocator before CUDA starts: until this process starts its session, the server
  /// holds nothing of it, and torch.accelerator's memory functions do nothing (frameworks call
  /// them when they train on the CPU too).
  bool initialized() override { return Session::get().started(); }
  void emptyCache(c10::MempoolId_t) override {
    for (int d = 0, n = Session::get().deviceCount(); d < n; ++d)
      Session::get().deviceMemory(d, false, true);
  }
  void recordStream(const c10::DataPtr &, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    DeviceMemory m = Session::get().deviceMemory(device < 0 ? tlsDevice : device);
    c10::CachingDeviceAllocator::DeviceStats stats;
    auto &allocated = stats.allocated_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)];
    allocated.current = int64_t(m.allocated);
    allocated.peak = int64_t(m.allocatedPeak);
    auto &reserved = stats.reserved_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)];
    reserved.current = int64_t(m.reserved);
    reserved.peak = int64_t(m.reservedPeak);
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex device) override {
    Session::get().deviceMemory(device < 0 ? tlsDevice : device, true);
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    DeviceMemory m = Session::get().deviceMemory(device < 0 ? tlsDevice : device);
    return {size_t(m.free), size_t(m.total)};
  }
};
NoAllocator noAllocator;
const bool allocatorRegistered = [] {
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &noAllocator);
  return true;
}();

} // namespace

c10::DeviceIndex currentDevice() { return tlsDevice; }
void setCurrentDevice(c10::DeviceIndex index) { tlsDevice = index; }

} // namespace rgpu::client

C10_REGISTER_GUARD_IMPL(PrivateUse1, rgpu::client::GuardImpl);
