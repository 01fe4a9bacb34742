#include "rgpu/client/Versions.h"
#include "rgpu/client/InplaceChecks.h"
#include "rgpu/client/LazyTensor.h"

#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <llvm/ADT/SmallVector.h>

#include <mutex>
#include <utility>
#include <vector>

namespace rgpu::client {
namespace {

/// The LazyTensorImpl a functional rgpu tensor holds now, or null. With \p sync, the updates
/// its views made are applied first (the op would apply them itself).
LazyTensorImpl *heldBy(const at::Tensor &t, bool sync) {
  if (!t.defined() || !t.device().is_privateuseone() ||
      !at::functionalization::impl::isFunctionalTensor(t))
    return nullptr;
  if (sync)
    at::functionalization::impl::sync(t);
  c10::TensorImpl *inner =
      at::functionalization::impl::unsafeGetFunctionalWrapper(t)->value().unsafeGetTensorImpl();
  return typeid(*inner) == typeid(LazyTensorImpl) ? static_cast<LazyTensorImpl *>(inner)
                                                   : nullptr;
}

class VersionWatch final : public c10::OperatorKernel {
public:
  VersionWatch(c10::SafeKernelFunction original, std::vector<size_t> written)
      : original_(std::move(original)), written_(std::move(written)) {}

  void operator()(const c10::OperatorHandle &op, c10::DispatchKeySet keys,
                  torch::jit::Stack *stack) {
    const size_t base = stack->size() - op.schema().arguments().size();
    // The written tensors and what each held before; the tensors are kept alive across the call.
    llvm::SmallVector<std::pair<at::Tensor, c10::intrusive_ptr<c10::TensorImpl>>, 4> before;
    auto note = [&](const at::Tensor &t) {
      if (LazyTensorImpl *held = heldBy(t, true))
        before.emplace_back(t, c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(held));
    };
    for (size_t i : written_) {
      const c10::IValue &v = (*stack)[base + i];
      if (v.isTensor())
        note(v.toTensor());
      else if (v.isTensorList())
        for (const at::Tensor &t : v.toTensorList())
          note(t);
    }
    original_.callBoxed(op, keys, stack);
    for (auto &[tensor, was] : before) {
      LazyTensorImpl *now = heldBy(tensor, false);
      auto *old = static_cast<LazyTensorImpl *>(was.get());
      // Only a version of the same layout can stand for it (resize_ makes another).
      if (!now || now == old || !(now->meta() == old->meta()))
        continue;
      now->versionOf = old->value.pending() ? old->versionOf
                       : old->value.data   ? old->value.data->handle
                                           : 0;
    }
  }

private:
  c10::SafeKernelFunction original_;
  std::vector<size_t> written_;
};

} // namespace

void trackVersions() {
  static std::once_flag once;
  std::call_once(once, [] {
    wrapFunctionalizeKernels([](const c10::FunctionSchema &schema, c10::SafeKernelFunction kernel)
                                 -> std::optional<torch::CppFunction> {
      std::vector<size_t> written;
      const auto &args = schema.arguments();
      for (size_t i = 0; i < args.size(); ++i)
        if (args[i].alias_info() && args[i].alias_info()->isWrite())
          written.push_back(i);
      if (written.empty())
        return std::nullopt;
      return torch::CppFunction::makeFromBoxedFunctor(
          std::make_unique<VersionWatch>(std::move(kernel), std::move(written)));
    });
  });
}

} // namespace rgpu::client
