//===- lib/client/Tracer.cpp - One boxed kernel records every aten op ------===//
//
// Every op on an rgpu tensor arrives here after autograd and functionalization, so it is always
// functional. The kernel records it (Recorder.h): it runs the same op on meta tensors to learn
// output sizes, strides and dtype (shape errors raise right here, with PyTorch's own message,
// without contacting the server), then appends a node to the trace and returns lazy tensors for
// its outputs. What the tracer knows of ops by name is in the op-facts table (rgpu/ir/OpFacts.h);
// the ops that move data between the client and the server are its special ops, below.
//
//===----------------------------------------------------------------------===//
#include "Recorder.h"

#include "rgpu/client/InplaceChecks.h"
#include "rgpu/client/KnownValues.h"
#include "rgpu/client/Session.h"

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace rgpu::client {

uint8_t mathBits(const c10::TensorImpl &t) { return (t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0); }
uint8_t mathBits(const at::Tensor &t) { return mathBits(*t.unsafeGetTensorImpl()); }

at::Tensor withMathBits(at::Tensor t, uint8_t bits) {
  if (bits & 1)
    t = at::_conj(t);
  if (bits & 2)
    t = at::_neg_view(t);
  return t;
}

at::Tensor makeLazy(Value v, const ir::TensorMeta &m, c10::DeviceIndex device, uint8_t bits) {
  at::Tensor t = at::detail::make_tensor<LazyTensorImpl>(std::move(v), m, device);
  // The server's tensor carries the same bits: it ran the same `_conj`/`_neg_view` views.
  if (bits & 1)
    t.unsafeGetTensorImpl()->_set_conj(true);
  if (bits & 2)
    t.unsafeGetTensorImpl()->_set_neg(true);
  return t;
}

c10::DeviceIndex indexOf(const c10::Device &d) { return d.has_index() ? d.index() : currentDevice(); }

std::string fullName(const c10::OperatorHandle &op) {
  const auto &n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

void checkWritable(const LazyTensorImpl &target, const c10::OperatorHandle &op) {
  TORCH_CHECK(!target.rawView, "rgpu: ", fullName(op), " writes into a view made inside a "
              "composite kernel that runs after functionalization, where the write would not "
              "reach the viewed tensor. An op outside aten defined after rgpu tensors existed "
              "runs so until rgpu's next traced op; its later calls run correctly.");
}

at::Tensor forUser(at::Tensor t) {
  if (!t.defined() || c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Functionalize))
    return t;
  return at::functionalization::impl::to_functional_tensor(t);
}

namespace {

at::Tensor download(const at::Tensor &t) {
  LazyTensorImpl *impl = lazyImpl(t);
  return Session::get().download(impl, impl->downloadLayout());
}

/// The special cases. Returns true if it handled the op.
bool special(ir::SpecialOp kind, const c10::OperatorHandle &op, torch::jit::Stack *stack) {
  if (kind == ir::SpecialOp::None)
    return false;
  const size_t nargs = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, nargs);

  // Download: .item(), bool(), and everything that reads one value.
  if (kind == ir::SpecialOp::ReadScalar) {
    c10::Scalar s = download(args[0].toTensor()).item();
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(s);
    return true;
  }
  // torch.equal answers a Python bool: same sizes, then an all-equal reduction read back.
  if (kind == ir::SpecialOp::Equal) {
    const at::Tensor &a = args[0].toTensor(), &b = args[1].toTensor();
    bool same = a.sizes() == b.sizes() && (a == b).all().item<bool>();
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(same);
    return true;
  }
  // Download: .cpu(), .to("cpu"), .tolist(), printing.
  if (kind == ir::SpecialOp::ToCopy) {
    auto device = args[3].toOptional<c10::Device>();
    const at::Tensor &self = args[0].toTensor();
    if (!lazyImpl(self)) {
      // Upload: x.to("rgpu"). The dispatcher routes it here by its device argument.
      auto dtype = args[1].toOptional<at::ScalarType>();
      auto fmt = args[6].toOptional<at::MemoryFormat>();
      at::Tensor src = self.to(dtype.value_or(self.scalar_type()), false, false,
                               fmt.value_or(at::MemoryFormat::Preserve));
      ir::TensorMeta meta;
      c10::DeviceIndex index = indexOf(device.value_or(c10::Device(c10::DeviceType::PrivateUse1)));
      Value v = Session::get().upload(src, meta, index);
      torch::jit::drop(*stack, nargs);
      stack->emplace_back(forUser(makeLazy(std::move(v), meta, index)));
      return true;
    }
    if (!device || !device->is_cpu())
      return false;
    at::Tensor cpu = download(args[0].toTensor());
    if (auto dtype = args[1].toOptional<at::ScalarType>(); dtype && *dtype != cpu.scalar_type())
      cpu = cpu.to(*dtype);
    if (auto fmt = args[6].toOptional<at::MemoryFormat>(); fmt && *fmt != at::MemoryFormat::Preserve)
      cpu = cpu.contiguous(*fmt);
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(cpu);
    return true;
  }
  // Download into an existing CPU tensor: cpu_tensor.copy_(rgpu_tensor).
  if (kind == ir::SpecialOp::CopyFrom || kind == ir::SpecialOp::CopyFromAndResize) {
    at::Tensor src = args[0].toTensor(), dst = args[1].toTensor();
    if (LazyTensorImpl *target = lazyImpl(dst)) {
      // Into an rgpu tensor (a composite kernel's copy_): trace the functional copy and let the
      // destination take its value.
      checkWritable(*target, op);
      at::Tensor result = at::_ops::copy::call(dst, src, false);
      target->value = lazyImpl(result)->value;
      torch::jit::drop(*stack, nargs);
      stack->emplace_back(dst);
      return true;
    }
    TORCH_CHECK(lazyImpl(src) && dst.device().is_cpu(),
                "rgpu: unsupported copy from ", src.device(), " to ", dst.device());
    at::Tensor cpu = download(src);
    if (kind == ir::SpecialOp::CopyFromAndResize)
      dst.resize_(cpu.sizes());
    dst.copy_(cpu);
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(dst);
    return true;
  }
  // Upload: x.to("rgpu") is empty() followed by copy() from the CPU tensor. When the copy
  // replaces the whole tensor, the uploaded data is the result.
  if (kind == ir::SpecialOp::Copy) {
    at::Tensor self = args[0].toTensor(), src = args[1].toTensor();
    if (!src.device().is_cpu() || lazyImpl(src) || src.sizes() != self.sizes() ||
        src.scalar_type() != self.scalar_type())
      return false;
    // `x.t().copy_(cpu)` keeps the view's layout (InplaceChecks.h): the upload takes it.
    if (auto strides = inplaceLayout().take(op.operator_name(), src.sizes(), self.scalar_type())) {
      at::Tensor laid = at::empty_strided(src.sizes(), *strides, src.options());
      if (laid.is_non_overlapping_and_dense())
        src = laid.copy_(src);
    }
    ir::TensorMeta meta;
    c10::DeviceIndex index = self.device().index();
    Value v = Session::get().upload(src, meta, index);
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(forUser(makeLazy(std::move(v), meta, index)));
    return true;
  }
  return false;
}

/// The functional form of the in-place op functionalization just checked gives its result the
/// layout the in-place op keeps (InplaceChecks.h).
void keepInplaceLayout(const c10::OperatorHandle &op, llvm::SmallVectorImpl<ir::TensorMeta> &outputs) {
  if (outputs.empty())
    return;
  if (auto strides = inplaceLayout().take(op.operator_name(), outputs[0].sizes,
                                          bridge::scalarType(outputs[0].dtype)))
    outputs[0].strides.assign(strides->begin(), strides->end());
}

} // namespace

void functionalizeHere(const c10::OperatorHandle &op, torch::jit::Stack *stack,
                       bool composite) {
  namespace fz = at::functionalization::impl;
  const auto &schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  std::vector<at::Tensor> originals(nargs), wrappers(nargs);
  for (size_t i = 0; i < nargs; ++i) {
    c10::IValue &v = (*stack)[base + i];
    if (v.isTensor() && lazyImpl(v.toTensor())) {
      const c10::AliasInfo *alias = schema.arguments()[i].alias_info();
      if (alias && alias->isWrite())
        checkWritable(*lazyImpl(v.toTensor()), op);
      originals[i] = v.toTensor();
      wrappers[i] = fz::to_functional_tensor(originals[i]);
      v = wrappers[i];
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> wrapped;
      for (const at::Tensor &t : v.toTensorList())
        wrapped.push_back(lazyImpl(t) ? fz::to_functional_tensor(t) : t);
      v = c10::List<at::Tensor>(wrapped);
    }
  }
  {
    auto tls = c10::impl::tls_local_dispatch_key_set();
    c10::impl::ForceDispatchKeyGuard on(tls.included_,
                                        tls.excluded_.remove(c10::DispatchKey::Functionalize));
    if (composite)
      op.redispatchBoxed(c10::DispatchKeySet(kCompositeEntry), stack);
    else
      op.callBoxed(stack);
  }
  for (size_t i = 0; i < nargs; ++i) {
    const c10::AliasInfo *alias = schema.arguments()[i].alias_info();
    if (!alias || !alias->isWrite() || !wrappers[i].defined())
      continue;
    fz::sync(wrappers[i]);
    LazyTensorImpl *result = lazyImpl(wrappers[i]);
    LazyTensorImpl *target = lazyImpl(originals[i]);
    target->value = result->value;
    target->set_sizes_and_strides(result->sizes(), result->strides());
  }
  // Results that are wrapped arguments become the caller's own tensors again; the others are
  // unwrapped, with the writes into views of them that are still pending.
  auto unwrap = [&](const at::Tensor &t) {
    if (!fz::isFunctionalTensor(t))
      return t;
    for (size_t i = 0; i < nargs; ++i)
      if (wrappers[i].defined() && wrappers[i].is_same(t))
        return originals[i];
    fz::sync(t);
    return fz::from_functional_tensor(t);
  };
  for (size_t r = base; r < stack->size(); ++r)
    mapTensors((*stack)[r], unwrap);
}

bool isFakeCall(const c10::OperatorHandle &op, const torch::jit::Stack &stack) {
  bool meta = false;
  for (const c10::IValue &v : torch::jit::last(stack, op.schema().arguments().size())) {
    if (!v.isTensor())
      continue;
    const at::Tensor &t = v.toTensor();
    if (lazyImpl(t))
      return false;
    meta |= t.defined() && t.is_meta();
  }
  return meta;
}

void fallback(const c10::OperatorHandle &op, torch::jit::Stack *stack) {
  registerPendingCustomOps();
  if (isFakeCall(op, *stack))
    return op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  inplaceLayout().traced();
  Session &session = Session::get();
  // The user's line is found before taking the session lock: finding it takes the GIL.
  uint32_t location = session.currentLocation();
  Session::Lock lock(session);
  const auto &schema = op.schema();
  const OpInfo &info = OpInfo::of(op);
  if (special(info.special, op, stack))
    return;
  TORCH_CHECK_NOT_IMPLEMENTED(!info.otherLayouts, "rgpu: ", fullName(op),
                              " makes a non-strided tensor; rgpu supports strided tensors only");
  if (info.mutableSchema)
    return functionalizeHere(op, stack);

  const size_t nargs = schema.arguments().size();
  Recording rec = record(op, info, torch::jit::last(*stack, nargs));
  const OpMetas *traced = rec.metas;
  const c10::DeviceIndex device = rec.device;
  llvm::IntrusiveRefCntPtr<TraceNode> node = rec.node;
  if (info.random)
    session.noteRandom(node);
  node->location = location;
  node->seq = session.nextSeq();

  std::vector<at::Tensor> outs;
  std::vector<int32_t> listSizes;
  if (traced) {
    const OpMetas &metas = *traced;
    node->node.outputs.assign(metas.outputs.begin(), metas.outputs.end());
    keepInplaceLayout(op, node->node.outputs);
    for (uint32_t i = 0; i < metas.outputs.size(); ++i)
      outs.push_back(metas.outputs[i].dtype == ir::dtype::Undefined
                         ? at::Tensor()
                         : makeLazy(Value{node, i, nullptr}, node->node.outputs[i], device,
                                    metas.bits[i]));
    listSizes = metas.listSizes;
    if (info.knowable)
      computeKnown(op, torch::jit::last(*stack, nargs), *node);
  } else {
    size_t count = schema.returns().size();
    TORCH_CHECK_NOT_IMPLEMENTED(
        std::all_of(schema.returns().begin(), schema.returns().end(),
                    [](const c10::Argument &r) { return r.type()->kind() == c10::TypeKind::TensorType; }),
        "rgpu: ", fullName(op), " has data-dependent output shapes and returns a list");
    node->node.outputs.assign(count, ir::TensorMeta());
    for (auto &[value, meta] : session.runNow(node))
      outs.push_back(makeLazy(std::move(value), meta, device));
    listSizes.assign(count, -1);
  }
  if (info.viewOp && c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Functionalize))
    for (const at::Tensor &t : outs)
      if (LazyTensorImpl *impl = lazyImpl(t))
        impl->rawView = true;
  // A view is an inference tensor if its input is one, inside torch.inference_mode or not
  // (torch's rule, which ADInplaceOrView relies on when it gives a view its base's version
  // counter). The wrapper functionalization puts around this output takes its keys from it.
  if (info.anyView)
    for (const c10::IValue &arg : torch::jit::last(*stack, nargs))
      if (arg.isTensor()) {
        const bool inference = arg.toTensor().is_inference();
        for (const at::Tensor &t : outs)
          if (t.defined() && t.is_inference() != inference)
            static_cast<LazyTensorImpl *>(t.unsafeGetTensorImpl())->setInference(inference);
        break;
      }
  torch::jit::drop(*stack, nargs);
  // Outputs are flat; each return takes one tensor or its list's length of them.
  size_t next = 0;
  for (int32_t size : listSizes) {
    if (size < 0) {
      stack->emplace_back(forUser(std::move(outs[next++])));
      continue;
    }
    c10::List<at::Tensor> list;
    for (int32_t k = 0; k < size; ++k)
      list.push_back(forUser(std::move(outs[next++])));
    stack->emplace_back(std::move(list));
  }
  session.maybeCutAtCap();
}

} // namespace rgpu::client
