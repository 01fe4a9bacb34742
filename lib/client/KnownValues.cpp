#include "rgpu/client/KnownValues.h"
#include "rgpu/ir/OpFacts.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace rgpu::client {

namespace {

enum class Exact {
  No,
  Bytes,         ///< moves or converts bytes only: the same result for any dtype
  IntegerResult, ///< the same result wherever it is an integer or boolean one
};

/// How exactly \p name's result follows from known inputs (the op-facts table says).
Exact exactness(llvm::StringRef name) {
  const ir::OpFacts facts = ir::opFacts(name);
  if (facts.has(ir::OpFact::ExactBytes))
    return Exact::Bytes;
  return facts.has(ir::OpFact::ExactOnIntegers) ? Exact::IntegerResult : Exact::No;
}

/// The value of rgpu tensor \p t, if known, in \p t's own layout.
at::Tensor knownOf(const at::Tensor &t) {
  LazyTensorImpl *impl = lazyImpl(t);
  if (!impl)
    return {};
  const Value &v = impl->value;
  at::Tensor k;
  if (v.pending()) {
    if (v.index < v.node->known.size())
      k = v.node->known[v.index];
  } else if (v.data) {
    k = v.data->value;
  }
  // Elements are what an op reads; the strides too, where an op's result depends on them
  // (a view's), so they must be the tensor's.
  if (!k.defined() || k.scalar_type() != t.scalar_type() || !k.sizes().equals(t.sizes()) ||
      !k.strides().equals(t.strides()))
    return {};
  return k;
}

/// \p v with every rgpu tensor replaced by its known value and every device by the CPU; false
/// if some rgpu tensor's value is not known.
bool onCpu(const c10::IValue &v, c10::IValue &out) {
  if (v.isTensor()) {
    const at::Tensor &t = v.toTensor();
    if (!t.defined() || !t.device().is_privateuseone()) {
      out = v;
      return true;
    }
    at::Tensor k = knownOf(t);
    out = k;
    return k.defined();
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> list;
    for (const at::Tensor &t : v.toTensorList()) {
      c10::IValue k;
      if (!onCpu(t, k))
        return false;
      list.push_back(k.toTensor());
    }
    out = list;
    return true;
  }
  if (v.isDevice()) {
    out = c10::Device(c10::kCPU);
    return true;
  }
  if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
    // Tensor?[] (indexing's indices)
    c10::List<std::optional<at::Tensor>> list;
    for (const c10::IValue &item : v.toListRef()) {
      if (item.isNone()) {
        list.push_back(std::nullopt);
        continue;
      }
      c10::IValue k;
      if (!item.isTensor() || !onCpu(item, k) || !k.isTensor())
        return false;
      list.push_back(k.toTensor());
    }
    out = list;
    return true;
  }
  out = v;
  return true;
}

} // namespace

bool knowable(llvm::StringRef name) { return exactness(name) != Exact::No; }

void computeKnown(const c10::OperatorHandle &op, c10::ArrayRef<c10::IValue> args,
                  TraceNode &node) {
  const Exact exact = exactness(op.operator_name().name);
  if (exact == Exact::No)
    return;
  // A float out of an integer type's range converts to whatever the device's instruction
  // gives: not the same everywhere.
  if (ir::specialOp(op.operator_name().name) == ir::SpecialOp::ToCopy && !args.empty() && args[0].isTensor() &&
      args[0].toTensor().is_floating_point() && !node.node.outputs.empty() &&
      c10::isIntegralType(static_cast<c10::ScalarType>(node.node.outputs[0].dtype), true))
    return;
  for (const ir::TensorMeta &m : node.node.outputs)
    if (m.dtype == ir::dtype::Undefined || m.numel() > kKnownElements ||
        (exact == Exact::IntegerResult &&
         !c10::isIntegralType(static_cast<c10::ScalarType>(m.dtype), /*includeBool=*/true)))
      return;
  torch::jit::Stack stack;
  stack.reserve(args.size());
  for (const c10::IValue &a : args) {
    c10::IValue cpu;
    if (!onCpu(a, cpu))
      return;
    stack.push_back(std::move(cpu));
  }
  try {
    // The CPU's kernel, below autograd and functionalization, as the server calls it.
    c10::impl::ExcludeDispatchKeyGuard noAutograd(c10::autograd_dispatch_keyset);
    c10::impl::ExcludeDispatchKeyGuard noFunctionalize(c10::DispatchKey::Functionalize);
    op.callBoxed(stack);
  } catch (const std::exception &) {
    return; // the server will say what is wrong
  }
  if (stack.size() != node.node.outputs.size())
    return;
  llvm::SmallVector<at::Tensor, 1> known;
  for (size_t i = 0; i < stack.size(); ++i) {
    if (!stack[i].isTensor())
      return;
    at::Tensor t = stack[i].toTensor();
    const ir::TensorMeta &m = node.node.outputs[i];
    if (!t.defined() || t.device() != c10::Device(c10::kCPU) ||
        t.scalar_type() != static_cast<c10::ScalarType>(m.dtype) || !t.sizes().equals(m.sizes))
      return;
    if (!t.strides().equals(m.strides)) {
      // The rgpu tensor keeps a layout of its own (a view's, say): the same elements in it.
      // A layout that repeats elements cannot be written, and is not taken.
      at::Tensor laid = at::empty_strided(m.sizes, m.strides, t.options());
      try {
        laid.copy_(t);
      } catch (const std::exception &) {
        return;
      }
      t = laid;
    }
    known.push_back(t);
  }
  node.known = std::move(known);
}

} // namespace rgpu::client
