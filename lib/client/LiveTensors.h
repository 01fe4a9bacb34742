//===- lib/client/LiveTensors.h - Every lazy tensor that exists ------------===//
//
// The live-tensor registry: a cut walks it to find the pending values someone can still read,
// and a new session walks it to unbind the old session's tensors. An intrusive list
// (LazyTensorImpl::prev/next), so that making and freeing a tensor allocates nothing here.
// Guarded by the session lock.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/client/LazyTensor.h"

#include <cstdint>

namespace rgpu::client {

class LiveTensors {
public:
  void add(LazyTensorImpl *impl) {
    impl->next = head_;
    if (head_)
      head_->prev = impl;
    head_ = impl;
    ++count_;
  }
  void remove(LazyTensorImpl *impl) {
    if (impl->prev)
      impl->prev->next = impl->next;
    else
      head_ = impl->next;
    if (impl->next)
      impl->next->prev = impl->prev;
    --count_;
  }
  /// Calls \p fn on every live tensor, newest first.
  template <class Fn> void forEach(Fn fn) const {
    for (LazyTensorImpl *impl = head_; impl; impl = impl->next)
      fn(impl);
  }
  uint64_t size() const { return count_; }

private:
  LazyTensorImpl *head_ = nullptr;
  uint64_t count_ = 0;
};

} // namespace rgpu::client
