//===- rgpu/client/InplaceChecks.h - Functionalization's checks, remembered -===//
//
// Functionalization checks every in-place op (`p.lerp_(g, w)`, `x.add_(y)`) by running it on
// meta tensors before it runs the functional op, so that broadcasting a larger tensor into
// `self` fails as in eager. torch registers Python meta kernels for ~170 in-place ops, and the
// optimizers' `_foreach_*_` ops call them once per parameter: ~13 ms of Python on the small
// GPT's AdamW step, four times the whole eager step.
//
// A check depends only on the arguments' sizes, strides and dtypes, on their constant values
// (ints, bools, dtypes, strings), and on the floating scalars' types, never their values (a
// learning rate changes every step). The kernel registered here remembers the signatures that
// passed: one seen before returns at once, in C++; anything new (or symbolic) runs the
// original check, which raises as before.
//
//===----------------------------------------------------------------------===//
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <functional>
#include <optional>
#include <vector>

namespace rgpu::client {

/// Runs an op's original meta check on a stack, as a boxed kernel would.
using MetaCheck = std::function<void(const c10::OperatorHandle &, torch::jit::Stack *)>;

/// Registers, for the Meta key of \p op (an in-place op that returns `self` or nothing), a
/// kernel that remembers the signatures \p check accepted. Registering an op twice keeps the
/// first.
void memoizeMetaCheck(const c10::OperatorName &op, MetaCheck check);

/// An in-place op keeps its tensor's layout; its functional form, which functionalization runs
/// instead, may not (CPU's masked_fill, cumsum, tril return contiguous results): after
/// `x.t().masked_fill_(m, 0)` the view would report contiguous strides. Functionalization's
/// check of the in-place op (below) notes the layout, and the tracer gives it to the functional
/// form's result when that op is traced on this thread within the next few ops (the view
/// replays functionalization traces first).
struct InplaceLayout {
  c10::OperatorName functional{"", ""};
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined; ///< the tensor's, which the result must fit
  bool pending = false;
  uint32_t opsSince = 0;
  /// The strides for the result of \p op of \p sizes, if it is the pending functional form.
  /// Raises CPU's error if that result's \p dtype cannot be cast to the tensor's (`bools.mul_(2)`:
  /// torch's Python meta kernels do not check, and functionalization would cast).
  std::optional<std::vector<int64_t>> take(const c10::OperatorName &op, c10::IntArrayRef sizes,
                                           c10::ScalarType dtype);
  /// Counts a traced op; a layout nobody took within a few ops is dropped.
  void traced() {
    if (pending && ++opsSince > kMaxOps)
      pending = false;
  }
  static constexpr uint32_t kMaxOps = 8;
};
InplaceLayout &inplaceLayout();

/// Functionalization checks in-place ops on meta tensors but not `out=` ops, and it gives an
/// out= tensor the op's result converted to the tensor's dtype, whatever it was: on rgpu
/// `torch.add(ints, 1.5, out=ints)` truncated where CPU raises "result type Float can't be
/// cast to the desired output type Long". This puts, in front of the Functionalize kernel of
/// every aten out= op, the check functionalization makes for in-place ops: the op run on meta
/// twins (torch's meta kernels refuse unsafe casts), remembered per signature. Only calls whose
/// out tensors are rgpu's are checked.
void checkOutOps();

/// For every aten op with a Functionalize kernel: \p wrap, given its schema and that kernel,
/// returns a kernel to register there instead (which calls it), or none to leave it.
using FunctionalizeWrapper = std::function<std::optional<torch::CppFunction>(
    const c10::FunctionSchema &, c10::SafeKernelFunction)>;
void wrapFunctionalizeKernels(const FunctionalizeWrapper &wrap);

/// The same memo, and the check of writes through repeating tensors, in front of \p op's
/// C++ Meta kernel (torch has no Python one for it), which then runs for new signatures.
void guardMetaKernel(const c10::OperatorName &op);

} // namespace rgpu::client
