//===- lib/client/CustomOps.cpp - Kernels for ops defined outside aten -----===//
#include "Tracing.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/op_registration/op_registration.h>

#include <llvm/ADT/StringRef.h>

#include <atomic>
#include <mutex>

namespace rgpu::client {
namespace {

/// True if \p op's kernel for a device it has no kernel of its own for is a composite one, which
/// its kCompositeEntry entry then is.
bool hasCompositeKernel(const c10::OperatorHandle &op) {
  return (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) &&
         !op.hasKernelForDispatchKey(kCompositeEntry);
}

/// Ops outside aten whose kernel for rgpu tensors is a composite one (torch.library.custom_op
/// without device types, an extension's CompositeExplicitAutograd kernel) run it after
/// functionalization, on unwrapped tensors, where a write into a view of a buffer it made would
/// be lost (`out[i:j] = y` would leave `out` as it was): a silent wrong answer. Each op outside
/// aten gets a kernel for rgpu that runs the composite with functionalization on instead, or
/// says that the op cannot run on rgpu (the server runs aten ops only). Ops are
/// defined at any time (an import), and the dispatcher calls its listeners under its lock, so
/// the listener only notes their names and the tracer registers the kernels on its next call.
/// That is before the op's first call unless the op was defined after rgpu tensors existed and
/// is called before anything else is traced; that first call runs unwrapped, and
/// checkWritable refuses a write into a view made there.
class CustomOps final : public c10::OpRegistrationListener {
public:
  static CustomOps &get() {
    static CustomOps *ops = [] {
      auto owned = std::make_unique<CustomOps>();
      CustomOps *raw = owned.get();
      // Kept to the end: released at exit, the handle would remove the listener under the
      // dispatcher's lock, and the listener's kernels would then be removed under it again.
      new c10::RegistrationHandleRAII(
          c10::Dispatcher::singleton().addRegistrationListener(std::move(owned)));
      return raw;
    }();
    return *ops;
  }

  void onOperatorRegistered(const c10::OperatorHandle &op) override {
    llvm::StringRef name(op.operator_name().name);
    if (name.startswith("aten::") || name.startswith("_c10d_functional::"))
      return;
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(op.operator_name());
    hasPending_.store(true, std::memory_order_release);
  }
  void onOperatorDeregistered(const c10::OperatorHandle &op) override {}

  /// Registers the kernels of the ops defined since the last call.
  void registerPending() {
    if (!hasPending_.load(std::memory_order_acquire))
      return;
    std::lock_guard<std::mutex> registering(registerMu_); // one thread fills handles_
    std::vector<c10::OperatorName> names;
    {
      std::lock_guard<std::mutex> lock(mu_);
      names.swap(pending_);
      hasPending_.store(false, std::memory_order_release);
    }
    auto &dispatcher = c10::Dispatcher::singleton();
    for (c10::OperatorName &name : names) {
      auto op = dispatcher.findOp(name);
      // A kernel for rgpu would also outrank a CompositeImplicitAutograd one, which must
      // decompose above autograd.
      if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
        continue;
      handles_.push_back(dispatcher.registerImpl(
          std::move(name), c10::DispatchKey::PrivateUse1,
          c10::KernelFunction::makeFromBoxedFunction<&compositeAboveFunctionalization>(),
          std::nullopt, nullptr, "rgpu: composite kernels run with functionalization on"));
    }
  }

private:
  std::mutex mu_, registerMu_;
  std::vector<c10::OperatorName> pending_;
  std::atomic<bool> hasPending_{false};
  std::vector<c10::RegistrationHandleRAII> handles_; // never released (see get())
};

} // namespace

void compositeAboveFunctionalization(const c10::OperatorHandle &op, torch::jit::Stack *stack) {
  if (isFakeCall(op, *stack))
    return fallback(op, stack);
  TORCH_CHECK_NOT_IMPLEMENTED(
      hasCompositeKernel(op), "Could not run '", op.operator_name().name,
      "' with arguments from the 'rgpu' backend: it has kernels for other devices only, and "
      "rgpu-opserver runs aten ops. A composite implementation (torch.library.custom_op "
      "without device_types) runs on rgpu, as the aten ops it calls.");
  functionalizeHere(op, stack, /*composite=*/true);
}

void registerPendingCustomOps() { CustomOps::get().registerPending(); }

} // namespace rgpu::client
