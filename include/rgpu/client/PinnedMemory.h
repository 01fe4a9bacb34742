//===- rgpu/client/PinnedMemory.h - Host memory torch calls pinned for rgpu --===//
//
// `Tensor.pin_memory()` and `DataLoader(pin_memory=True)` ask the current accelerator for
// pinned host memory, and `is_pinned()` asks it whether a pointer is pinned. rgpu's bytes travel
// over a socket, which page-locking does not speed up, so rgpu's pinned memory is ordinary
// host memory that this allocator remembers: `x.pin_memory().is_pinned()` is true (also for
// views into it), any other host tensor's is false, as with CUDA.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <c10/core/Allocator.h>

namespace rgpu::client {

/// The allocator of rgpu's pinned host memory.
c10::Allocator *pinnedAllocator();
/// Whether \p p points into a block pinnedAllocator() gave out and has not freed.
bool isPinned(const void *p);

} // namespace rgpu::client
