#include "Device.h"
#include "Memory.h"

#include "rgpu/ir/Error.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <llvm/ADT/SmallVector.h>
#include <llvm/ADT/StringRef.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <thread>

namespace rgpu::server::device {
namespace {

/// The few driver calls the figures need, found in libcuda at run time: rgpu is built without
/// CUDA's headers, and the driver API's signatures and attribute numbers never change.
struct Driver {
  using GetFn = int (*)(int *, int);
  using NameFn = int (*)(char *, int, int);
  using AttributeFn = int (*)(int *, int, int);
  GetFn get = nullptr;
  NameFn name = nullptr;
  AttributeFn attribute = nullptr;
  enum Attribute { kMultiProcessors = 16, kMajor = 75, kMinor = 76 };

  static const Driver &instance() {
    static const Driver d = [] {
      Driver d;
      if (void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) ?: dlopen("libcuda.so.1", RTLD_NOW)) {
        d.get = reinterpret_cast<GetFn>(dlsym(lib, "cuDeviceGet"));
        d.name = reinterpret_cast<NameFn>(dlsym(lib, "cuDeviceGetName"));
        d.attribute = reinterpret_cast<AttributeFn>(dlsym(lib, "cuDeviceGetAttribute"));
      }
      return d;
    }();
    return d;
  }
};

void cudaFacts(int index, wire::DeviceMemory::Builder out) {
  const Driver &d = Driver::instance();
  int dev = 0;
  if (!d.get || !d.name || !d.attribute || d.get(&dev, index) != 0)
    return;
  char name[256] = {};
  if (d.name(name, sizeof name - 1, dev) == 0)
    out.setName(name);
  int value = 0;
  if (d.attribute(&value, Driver::kMultiProcessors, dev) == 0)
    out.setMultiProcessors(value);
  if (d.attribute(&value, Driver::kMajor, dev) == 0)
    out.setMajor(value);
  if (d.attribute(&value, Driver::kMinor, dev) == 0)
    out.setMinor(value);
}

/// The stream transfers run on, one per device, taken from libtorch's pool (its streams do not
/// synchronize with the default stream the kernels run on).
c10::Stream copyStream(c10::Device dev) {
  static const c10::Stream stream =
      c10::impl::VirtualGuardImpl(dev.type()).getStreamFromGlobalPool(dev, /*isHighPriority=*/false);
  return stream;
}

c10::Stream computeStream(c10::Device dev) {
  return c10::impl::VirtualGuardImpl(dev.type()).getStream(dev);
}

/// Read once: every memory request of a CPU server names it.
const std::string &processorName() {
  static const std::string name = [] {
    std::ifstream in("/proc/cpuinfo");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("model name", 0) == 0) {
        size_t start = line.find_first_not_of(" \t", line.find(':') + 1);
        if (line.find(':') != std::string::npos && start != std::string::npos)
          return line.substr(start);
      }
    return std::string("CPU");
  }();
  return name;
}

} // namespace

void apply(c10::Device dev, wire::MemoryRequest::Reader request, memory::Account &account,
           bool deviceWide) {
  if (request.getResetPeak())
    account.peak = account.owned();
  if (!dev.is_cuda())
    return;
  c10::DeviceAllocator *allocator = c10::getDeviceAllocator(c10::kCUDA);
  if (request.getEmptyCache())
    allocator->emptyCache();
  if (request.getResetPeak() && deviceWide)
    allocator->resetPeakStats(dev.index());
}

void figures(c10::Device dev, wire::DeviceMemory::Builder out, const memory::Account &account) {
  out.setDevice(dev.str());
  if (dev.is_cuda()) {
    c10::DeviceAllocator *allocator = c10::getDeviceAllocator(c10::kCUDA);
    auto stats = allocator->getDeviceStats(dev.index());
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out.setAllocated(stats.allocated_bytes[all].current);
    out.setAllocatedPeak(stats.allocated_bytes[all].peak);
    out.setReserved(stats.reserved_bytes[all].current);
    out.setReservedPeak(stats.reserved_bytes[all].peak);
    auto [free, total] = allocator->getMemoryInfo(dev.index());
    out.setFree(free);
    out.setTotal(total);
    cudaFacts(dev.index(), out);
    return;
  }
  // A CPU server: libtorch's CPU allocator caches nothing, so reserved is what is held.
  const uint64_t held = memory::held(), mine = account.owned(),
                 peak = std::max<uint64_t>(account.peak, mine);
  out.setAllocated(mine);
  out.setAllocatedPeak(peak);
  out.setReserved(mine);
  out.setReservedPeak(peak);
  const uint64_t page = sysconf(_SC_PAGESIZE);
  uint64_t total = uint64_t(sysconf(_SC_PHYS_PAGES)) * page;
  uint64_t free = uint64_t(sysconf(_SC_AVPHYS_PAGES)) * page;
  if (uint64_t limit = memory::limit()) {
    total = std::min(total, limit);
    free = std::min(free, total - std::min(total, held));
  }
  out.setFree(free);
  out.setTotal(total);
  out.setName(processorName());
  out.setMultiProcessors(std::thread::hardware_concurrency());
}

bool pinned(c10::Device dev) { return dev.is_cuda(); }

at::Tensor toDevice(const at::Tensor &host, c10::Device dev) {
  const c10::Stream copy = copyStream(dev), compute = computeStream(dev);
  at::Tensor out;
  {
    // Allocated on the copy stream, so the allocator gives it a block no queued kernel uses.
    c10::StreamGuard guard(copy);
    out = at::empty_strided(host.sizes(), host.strides(), host.options().device(dev).pinned_memory(false));
    out.copy_(host, /*non_blocking=*/true);
  }
  // Used on the compute stream from now on: freeing it must wait for that stream too.
  if (out.storage().data_ptr().get())
    c10::getDeviceAllocator(dev.type())->recordStream(out.storage().data_ptr(), compute);
  c10::Event copied(dev.type());
  copied.record(copy);
  copied.block(compute);
  return out;
}

void toHost(const at::Tensor &t, const at::Tensor &host) {
  const c10::Device dev = t.device();
  const c10::Stream copy = copyStream(dev);
  c10::Event computed(dev.type());
  computed.record(computeStream(dev));
  computed.block(copy);
  {
    c10::StreamGuard guard(copy);
    host.copy_(t, /*non_blocking=*/true);
  }
  c10::Event copied(dev.type());
  copied.record(copy);
  copied.synchronize();
}

bool afterError(c10::Device dev, const std::string &message) {
  if (!dev.is_cuda())
    return false;
  if (message.find("CUDA out of memory") != std::string::npos) {
    c10::getDeviceAllocator(dev.type())->emptyCache();
    return false;
  }
  // CUDA's sticky errors: every later call in this process fails the same way.
  for (const char *sticky : {"device-side assert", "illegal memory access", "unspecified launch failure",
                             "misaligned address", "illegal instruction", "uncorrectable ECC error",
                             "hardware stack error"})
    if (message.find(sticky) != std::string::npos)
      return true;
  return false;
}

llvm::Expected<std::vector<c10::Device>> parseList(const std::string &list) {
  const bool cuda = at::globalContext().hasCUDA();
  const std::string given = list.empty() ? (cuda ? "cuda" : "cpu") : list;
  std::vector<c10::Device> devices;
  llvm::SmallVector<llvm::StringRef, 8> items;
  llvm::StringRef(given).split(items, ',', -1, /*KeepEmpty=*/true);
  for (llvm::StringRef item : items) {
    if (item == "cpu") {
      devices.emplace_back(c10::kCPU);
      continue;
    }
    unsigned index = 0;
    llvm::StringRef number = item;
    if (item != "cuda" && (!number.consume_front("cuda:") || number.getAsInteger(10, index)))
      return failure("unknown device '" + item + "': use cuda, cuda:N or cpu (--devices "
                     "cuda:0,cuda:1)");
    if (!cuda)
      return failure("--device " + given + ": no usable CUDA device on this machine (use cpu)");
    int count = at::detail::getCUDAHooks().deviceCount();
    if (int(index) >= count)
      return failure("--device " + given + ": this machine has " + std::to_string(count) +
                     " CUDA device(s), numbered from 0");
    devices.emplace_back(c10::kCUDA, c10::DeviceIndex(index));
  }
  if (devices.empty() || devices.size() > size_t(wire::kMaxDevices))
    return failure("--devices takes 1 to " + std::to_string(wire::kMaxDevices) +
                   " devices, not '" + given + "'");
  if (std::any_of(devices.begin(), devices.end(),
                  [&](const c10::Device &d) { return d.type() != devices[0].type(); }))
    return failure("--devices " + given + " mixes CPU and CUDA devices");
  return devices;
}

} // namespace rgpu::server::device
