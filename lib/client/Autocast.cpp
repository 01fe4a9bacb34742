//===- lib/client/Autocast.cpp - torch.autocast("rgpu") follows CUDA's policy --===//
//
// rgpu stands for a remote GPU, so under autocast it casts exactly as CUDA does: the ops of
// ATen's lower-precision list run in the autocast dtype (float16 by default, bfloat16 when
// asked), those of its float32 lists (pointwise ops that lose range, reductions, norms,
// losses, softmax) in float32, and the promote list at the widest input type. ATen's own
// wrappers do the casting; they run in the client, above functionalization, so the casts are
// traced like any other op and the server sees plain dtype conversions.
//
// Only functional overloads are listed, as for CUDA: an `out=` variant passes through and never
// casts into a fresh tensor. binary_cross_entropy is refused with CUDA's message.
//
//===----------------------------------------------------------------------===//
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

at::Tensor binaryCrossEntropyRefused(const at::Tensor &, const at::Tensor &,
                                     const std::optional<at::Tensor> &, int64_t) {
  AT_ERROR("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
           "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
           "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
           "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
           "safe to autocast.");
}

} // namespace

namespace {

/// Every op without an autocast kernel passes through unchanged. A mutating op (`out=`, in-place)
/// also switches autocast off below it: on CUDA its kernel writes the result directly, while here
/// functionalization turns it into the functional op plus a copy, and that functional op must
/// not be cast as if the user had called it.
void passThrough(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
  constexpr auto below = c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER,
                                             c10::DispatchKey::AutocastPrivateUse1);
  if (!op.schema().is_mutable())
    return op.redispatchBoxed(keys & below, stack);
  c10::impl::ExcludeDispatchKeyGuard off(c10::DispatchKey::AutocastPrivateUse1);
  op.redispatchBoxed(keys & below, stack);
}

} // namespace

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&passThrough>());
}

// The op lists spell their signatures with ATen's unqualified names (which names depends on
// the torch version), so they are registered from inside namespace at, as ATen's own are.
namespace at::autocast {
namespace {

#define ADD_NS(RAW_OP) at::RAW_OP
#define RGPU_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define RGPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define RGPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define RGPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(RGPU_LOWER_PRECISION)
  AT_FORALL_FP32(RGPU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(RGPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(RGPU_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binaryCrossEntropyRefused));
}

} // namespace
} // namespace at::autocast
