//===- lib/client/Tracing.h - What the tracer's files share ---------------===//
//
// The tracer is one boxed kernel (`fallback`, Tracer.cpp) that every op on an rgpu tensor
// reaches after autograd and functionalization, with the parts it leans on beside it: the
// recorder and its meta cache (Recorder.h), the kernels for ops
// defined outside aten (CustomOps.cpp), the device hooks (DeviceHooks.cpp) and the dispatcher
// registrations (Registrations.cpp).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/client/LazyTensor.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>
#include <vector>

namespace rgpu::client {

/// The math bits of a tensor: conjugate (1) and negative (2), kept as CPU keeps them.
uint8_t mathBits(const c10::TensorImpl &t);
uint8_t mathBits(const at::Tensor &t);

/// Replaces the tensor \p v holds, or each tensor of the list it holds, with \p fn of it.
template <class Fn> void mapTensors(c10::IValue &v, const Fn &fn) {
  if (v.isTensor()) {
    v = fn(v.toTensor());
  } else if (v.isTensorList()) {
    std::vector<at::Tensor> items;
    for (const at::Tensor &t : v.toTensorList())
      items.push_back(fn(t));
    v = c10::List<at::Tensor>(items);
  }
}

/// A meta twin with \p bits set, as `_conj` and `_neg_view` set them.
at::Tensor withMathBits(at::Tensor t, uint8_t bits);

/// A lazy tensor on rgpu:\p device holding \p v, with math bits \p bits.
at::Tensor makeLazy(Value v, const ir::TensorMeta &m, c10::DeviceIndex device, uint8_t bits = 0);

/// The rgpu device index \p d names: its own, else the current device.
c10::DeviceIndex indexOf(const c10::Device &d);

/// "aten::add.Tensor": the operator's name and overload.
std::string fullName(const c10::OperatorHandle &op);

/// Refuses a write, below functionalization, into a tensor that a view op made there: that
/// tensor is a copy, and the write would not reach the tensor it views.
void checkWritable(const LazyTensorImpl &target, const c10::OperatorHandle &op);

/// Wraps outputs for the user unless we are already inside functionalization (which wraps them
/// itself). Factories reach the backend directly, so their results are wrapped here.
at::Tensor forUser(at::Tensor t);

/// A backend nothing registers kernels for: an op's entry for it is the op's composite kernel,
/// whatever kernels it has for CPU or CUDA.
constexpr c10::DispatchKey kCompositeEntry = c10::DispatchKey::PrivateUse3;

/// A mutation that reached the backend from inside a composite kernel (functionalization is
/// switched off there): functionalize it here. Its tensors are wrapped, the op is dispatched
/// again with functionalization on, and each mutated argument takes the resulting value.
/// With \p composite, the op's composite kernel runs instead (see CustomOps), with the wrapped
/// tensors, so every op inside it is functionalized.
void functionalizeHere(const c10::OperatorHandle &op, torch::jit::Stack *stack,
                       bool composite = false);

/// True for a call whose tensors are meta tensors carrying rgpu's dispatch keys: fake tensors
/// (dynamo, torch.compile) that describe rgpu tensors. They compute metadata only.
bool isFakeCall(const c10::OperatorHandle &op, const torch::jit::Stack &stack);

/// The tracing kernel: records \p op on the stack's rgpu tensors as a node of the trace (or runs
/// it at once where its output shapes depend on data) and leaves lazy tensors for its outputs.
void fallback(const c10::OperatorHandle &op, torch::jit::Stack *stack);

/// The kernel CustomOps gives an op outside aten: its composite kernel, run with
/// functionalization on. The server runs aten ops only, so an op without one (kernels for CPU
/// or CUDA only) cannot run on rgpu.
void compositeAboveFunctionalization(const c10::OperatorHandle &op, torch::jit::Stack *stack);

/// Gives the ops outside aten defined since the last call their kernel for rgpu
/// (compositeAboveFunctionalization); the first call installs the listener that notes them.
void registerPendingCustomOps();

} // namespace rgpu::client
