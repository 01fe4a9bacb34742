#include "rgpu/client/LazyTensor.h"
#include "rgpu/client/Session.h"
#include "rgpu/bridge/Bridge.h"

#include <ATen/FunctionalTensorWrapper.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

#include <typeinfo>

namespace rgpu::client {

DeviceData::~DeviceData() { Session::get().release(handle); }

LazyTensorImpl::LazyTensorImpl(Value v, const ir::TensorMeta &meta, c10::DeviceIndex index)
    : c10::TensorImpl(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                      c10::scalarTypeToTypeMeta(static_cast<c10::ScalarType>(meta.dtype)),
                      c10::Device(c10::DeviceType::PrivateUse1, index)),
      value(std::move(v)) {
  // A storage without data: it gives the tensor an identity and a size for tools that inspect
  // storages (dynamo's fake tensors), while data_ptr() raises, as nothing is allocated here.
  storage_ = c10::Storage(c10::Storage::use_byte_size_t(), meta.storageBytes(),
                          c10::DataPtr(nullptr, device()), /*allocator=*/nullptr,
                          /*resizable=*/false);
  set_sizes_and_strides(meta.sizes, meta.strides);
  Session::get().track(this);
}

LazyTensorImpl::~LazyTensorImpl() { Session::get().untrack(this); }

void LazyTensorImpl::setInference(bool inference) {
  if (inference) {
    key_set_ = key_set_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    version_counter_ = c10::VariableVersion(c10::VariableVersion::DISABLED);
  } else {
    key_set_ = key_set_ |
               c10::getAutogradRelatedKeySetFromBackend(c10::BackendComponent::PrivateUse1Bit);
    version_counter_ = c10::VariableVersion(0);
  }
}

ir::TensorMeta LazyTensorImpl::meta() const {
  return bridge::metaOf(*this);
}

ir::TensorMeta LazyTensorImpl::downloadLayout() const {
  ir::TensorMeta m = meta();
  if (is_non_overlapping_and_dense())
    return m;
  return ir::TensorMeta::contiguous(m.dtype, m.sizes);
}

c10::intrusive_ptr<c10::TensorImpl>
LazyTensorImpl::shallow_copy_and_detach(const c10::VariableVersion &version_counter,
                                        bool allow_tensor_metadata_change) const {
  Session::Lock lock(Session::get());
  auto impl = c10::make_intrusive<LazyTensorImpl>(value, meta(), device().index());
  copy_tensor_metadata(this, impl.get(), version_counter, allow_tensor_metadata_change);
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl>
LazyTensorImpl::shallow_copy_and_detach(c10::VariableVersion &&version_counter,
                                        bool allow_tensor_metadata_change) const {
  Session::Lock lock(Session::get());
  auto impl = c10::make_intrusive<LazyTensorImpl>(value, meta(), device().index());
  copy_tensor_metadata(this, impl.get(), std::move(version_counter), allow_tensor_metadata_change);
  return impl;
}

void LazyTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl> &impl) {
  auto *other = dynamic_cast<LazyTensorImpl *>(impl.get());
  TORCH_INTERNAL_ASSERT(other, "rgpu: shallow_copy_from a tensor of another kind");
  Session::Lock lock(Session::get());
  copy_tensor_metadata(other, this, version_counter(), allow_tensor_metadata_change());
  value = other->value;
}

namespace {
/// \p impl as a LazyTensorImpl, or null. The class is final: its exact type is the test, which
/// costs a pointer comparison where a dynamic_cast walks the class hierarchy (~150
/// instructions, for every tensor argument of every traced op).
LazyTensorImpl *asLazy(c10::TensorImpl *impl) {
  return typeid(*impl) == typeid(LazyTensorImpl) ? static_cast<LazyTensorImpl *>(impl) : nullptr;
}
} // namespace

LazyTensorImpl *lazyImpl(const at::Tensor &t) {
  if (!t.defined() || !t.device().is_privateuseone())
    return nullptr;
  if (at::functionalization::impl::isFunctionalTensor(t)) {
    at::functionalization::impl::sync(t);
    return asLazy(at::functionalization::impl::from_functional_tensor(t).unsafeGetTensorImpl());
  }
  return asLazy(t.unsafeGetTensorImpl());
}

} // namespace rgpu::client

namespace rgpu::client {
namespace {
/// DistributedDataParallel's timer for rgpu tensors: what the client sees (tracing, and waits),
/// on the host clock, as torch's CPU timer does. Without one, DDP warns at every start that it
/// keeps time for CPU and CUDA only.
class HostTimer : public c10d::Timer {
public:
  explicit HostTimer(c10::Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    int64_t a = getTimeRef(start), b = getTimeRef(end);
    if (a == c10d::kUnsetTime || b == c10d::kUnsetTime || b < a)
      return std::nullopt;
    return b - a;
  }
};
} // namespace
} // namespace rgpu::client

namespace c10d {
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kPrivateUse1, rgpu::client::HostTimer);
} // namespace c10d
