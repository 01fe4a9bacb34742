//===- lib/client/PinnedMemory.cpp - Host memory torch calls pinned for rgpu -===//
#include "rgpu/client/PinnedMemory.h"

#include <c10/core/impl/alloc_cpu.h>

#include <cstring>
#include <map>
#include <mutex>

namespace rgpu::client {
namespace {

/// Pinned blocks by start address, with their sizes. DataLoader pins in its own thread.
struct Blocks {
  std::mutex mu;
  std::map<uintptr_t, size_t> sizes;
};

Blocks &blocks() {
  static Blocks *b = new Blocks(); // tensors freed at exit may still return their blocks
  return *b;
}

void freePinned(void *p) {
  {
    Blocks &b = blocks();
    std::lock_guard<std::mutex> lock(b.mu);
    b.sizes.erase(reinterpret_cast<uintptr_t>(p));
  }
  c10::free_cpu(p);
}

class PinnedAllocator final : public c10::Allocator {
public:
  c10::DataPtr allocate(size_t n) override {
    void *p = c10::alloc_cpu(n);
    if (n > 0) {
      Blocks &b = blocks();
      std::lock_guard<std::mutex> lock(b.mu);
      b.sizes[reinterpret_cast<uintptr_t>(p)] = n;
    }
    return {p, p, &freePinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &freePinned; }
  void copy_data(void *dest, const void *src, std::size_t count) const override {
    if (count > 0)
      std::memcpy(dest, src, count);
  }
};

} // namespace

c10::Allocator *pinnedAllocator() {
  static PinnedAllocator allocator;
  return &allocator;
}

bool isPinned(const void *p) {
  if (!p)
    return false;
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  Blocks &b = blocks();
  std::lock_guard<std::mutex> lock(b.mu);
  auto it = b.sizes.upper_bound(at);
  if (it == b.sizes.begin())
    return false;
  --it;
  return at < it->first + it->second;
}

} // namespace rgpu::client
