//===- lib/client/Registrations.cpp - Where rgpu's kernels enter the dispatcher -===//
//
// The tracing kernel is rgpu's backend fallback, and some ops get it (or a kernel of their own
// at the Functionalize and ADInplaceOrView keys) by name, each with the reason it needs one.
//
//===----------------------------------------------------------------------===//
#include "Tracing.h"

#include "rgpu/client/Session.h"

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

namespace rgpu::client {
namespace {

/// What the generated Functionalize kernel of an op that writes nothing does: syncs and unwraps
/// the functional arguments, runs the op below functionalization, and wraps each tensor result
/// for which \p wrap(result, whether the first argument was an rgpu tensor) is true.
template <class Wrap>
void runUnwrapped(const c10::OperatorHandle &op, torch::jit::Stack *stack, Wrap wrap) {
  namespace fz = at::functionalization::impl;
  const size_t base = stack->size() - op.schema().arguments().size();
  bool rgpuInput = false;
  for (size_t i = base; i < stack->size(); ++i) {
    c10::IValue &v = (*stack)[i];
    if (!v.isTensor() || !fz::isFunctionalTensor(v.toTensor()))
      continue;
    fz::sync(v.toTensor());
    v = fz::from_functional_tensor(v.toTensor());
    rgpuInput |= i == base && lazyImpl(v.toTensor());
  }
  {
    c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::Functionalize);
    op.callBoxed(stack);
  }
  for (size_t r = base; r < stack->size(); ++r) {
    c10::IValue &v = (*stack)[r];
    if (v.isTensor() && wrap(v.toTensor(), rgpuInput))
      v = fz::to_functional_tensor(v.toTensor());
  }
}

/// Functionalization's kernel for `_pack_padded_sequence`, which takes its lengths and answers
/// its batch sizes on the host on every device: torch's RNN kernels read the batch sizes, so
/// for rgpu input they stay a plain host tensor, where the generated kernel would wrap them
/// with the packed data. Otherwise it does what the generated kernel does.
void packPaddedSequence(const c10::OperatorHandle &op, torch::jit::Stack *stack) {
  runUnwrapped(op, stack,
               [](const at::Tensor &t, bool rgpuInput) { return !rgpuInput || lazyImpl(t); });
}

/// native_batch_norm writes its running statistics in training mode, but its schema does not
/// say so and torch has no functionalization kernel for it: on rgpu the write happened on the
/// server as a side effect of running the node, and was lost whenever nothing read the op's
/// outputs (a forward whose result is dropped, torch.optim.swa_utils.update_bn), since such a
/// node never runs. With running statistics in training it runs as _native_batch_norm_legit,
/// whose schema names the writes, so functionalization gives the statistics their new values
/// as traced results. Otherwise (no writes) it does what the generated kernel would.
void nativeBatchNorm(const c10::OperatorHandle &op, torch::jit::Stack *stack) {
  namespace fz = at::functionalization::impl;
  auto args = torch::jit::last(*stack, 8);
  if (args[5].toBool() && args[3].isTensor() && args[4].isTensor() &&
      fz::isFunctionalTensor(args[3].toTensor()) && fz::isFunctionalTensor(args[4].toTensor())) {
    at::Tensor input = args[0].toTensor(), mean = args[3].toTensor(), var = args[4].toTensor();
    auto weight = args[1].toOptional<at::Tensor>(), bias = args[2].toOptional<at::Tensor>();
    double momentum = args[6].toDouble(), eps = args[7].toDouble();
    torch::jit::drop(*stack, 8);
    at::AutoDispatchBelowADInplaceOrView below; // autograd recorded native_batch_norm already
    auto [out, saveMean, saveInvstd] =
        at::_native_batch_norm_legit(input, weight, bias, mean, var, true, momentum, eps);
    torch::jit::push(*stack, std::move(out), std::move(saveMean), std::move(saveInvstd));
    return;
  }
  runUnwrapped(op, stack, [](const at::Tensor &, bool) { return true; });
}

/// `x.half()` on an rgpu tensor: functionalization's own _to_copy kernel takes every backend it
/// reaches with functionalization off for a lazy backend leaving the pass (torch._lazy's
/// convention), and returns the result unwrapped. rgpu tensors stay functional: this kernel sits
/// just above functionalization (ADInplaceOrView, which has no kernel of its own for _to_copy)
/// and wraps what an rgpu -> rgpu conversion of a functional tensor returned bare.
void toCopyStaysFunctional(const c10::OperatorHandle &op, c10::DispatchKeySet keys,
                           torch::jit::Stack *stack) {
  namespace fz = at::functionalization::impl;
  const size_t nargs = op.schema().arguments().size();
  const at::Tensor self = (*stack)[stack->size() - nargs].toTensor();
  bool functionalRgpu = self.device().is_privateuseone() && fz::isFunctionalTensor(self);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER,
                                                c10::DispatchKey::ADInplaceOrView),
                     stack);
  at::Tensor out = stack->back().toTensor();
  if (functionalRgpu && out.device().is_privateuseone() && !fz::isFunctionalTensor(out))
    stack->back() = fz::to_functional_tensor(out);
}

/// `view.copy_(src)`, and so `x[:, i:j] = y`, on an rgpu tensor: functionalization's own kernel
/// for it, but for its last step. After recording the write for the base, that kernel
/// regenerates the view from the updated base at once: the base's pending writes are applied
/// (a `slice_scatter` traced) and the view sliced from the result again (another op traced).
/// The view of a cache write (`cache[:, :, i:i + 1] = k`) is never read again, so that second
/// op was traced for nothing. Here the view is left behind its storage, as any alias of it is
/// after a write: it regenerates at its next use. Until then its value is the copy, which holds
/// the view's elements, and its layout where the copy kept it (InplaceChecks.h). This kernel
/// replaces ADInplaceOrView's for copy_ (registered below), so other tensors get what that one
/// does.
at::Tensor &copyInto(c10::DispatchKeySet keys, at::Tensor &self, const at::Tensor &src,
                     bool nonBlocking) {
  namespace fz = at::functionalization::impl;
  if (!keys.has(c10::DispatchKey::Functionalize) || !self.device().is_privateuseone() ||
      !fz::isFunctionalTensor(self)) {
    {
      at::AutoDispatchBelowADInplaceOrView below;
      at::_ops::copy_::redispatch(keys & c10::after_ADInplaceOrView_keyset, self, src,
                                  nonBlocking);
    }
    torch::autograd::impl::bump_version(self);
    return self;
  }
  at::AutoDispatchBelowADInplaceOrView below; // as ADInplaceOrView's kernel leaves it
  {
    // The check functionalization runs first: broadcasting src into self fails as in eager.
    auto meta = [](const at::Tensor &t) {
      return at::empty_strided_symint(t.sym_sizes(), t.sym_strides(),
                                      t.options().device(c10::kMeta));
    };
    at::Tensor selfMeta = meta(self), srcMeta = meta(src);
    at::AutoDispatchSkipFunctionalize skip;
    c10::impl::ExcludeDispatchKeyGuard modes(
        c10::functorch_transforms_ks |
        c10::DispatchKeySet({c10::DispatchKey::FuncTorchDynamicLayerBackMode,
                             c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
                             c10::DispatchKey::Python, c10::DispatchKey::PreDispatch}));
    at::_ops::copy_::call(selfMeta, srcMeta, nonBlocking);
  }
  fz::sync(self);
  at::Tensor src_ = src;
  if (fz::isFunctionalTensor(src)) {
    fz::sync(src);
    src_ = fz::from_functional_tensor(src);
  }
  at::Tensor copied;
  {
    at::AutoDispatchSkipFunctionalize skip;
    copied = at::_ops::copy::call(fz::from_functional_tensor(self), src_, nonBlocking);
  }
  const bool sameLayout = copied.sym_sizes() == self.sym_sizes() &&
                          copied.sym_strides() == self.sym_strides() &&
                          copied.sym_storage_offset() == self.sym_storage_offset();
  fz::replace_(self, copied);
  fz::commit_update(self);
  if (!sameLayout) // a copy from the CPU, say: the view's layout comes back from its base
    fz::sync(self);
  torch::autograd::impl::bump_version(self);
  return self;
}

/// True if autograd would record \p op called with \p stack: grad mode is on and an argument
/// requires grad, or an argument carries a forward-mode tangent (which grad mode does not
/// switch off).
bool autogradRecords(const c10::OperatorHandle &op, const torch::jit::Stack &stack) {
  const bool grad = c10::GradMode::is_enabled();
  for (const c10::IValue &v : torch::jit::last(stack, op.schema().arguments().size())) {
    if (!v.isTensor())
      continue;
    const at::Tensor &t = v.toTensor();
    if (!t.defined())
      continue;
    if (grad && t.requires_grad())
      return true;
    auto *meta = torch::autograd::impl::get_autograd_meta(t);
    if (meta && meta->fw_grad_ && !meta->fw_grad_->empty())
      return true;
  }
  return false;
}

/// The kernel for rgpu's autograd key of a composite op in registerWholeWithoutGrad(): its
/// composite kernel when autograd records the call, which then decomposes as before; otherwise
/// the op goes below autograd whole, through functionalization to the tracer, as one node (or,
/// for an op without a kernel of rgpu's own, to its composite below functionalization).
class WholeWithoutGrad final : public c10::OperatorKernel {
public:
  explicit WholeWithoutGrad(c10::SafeKernelFunction composite) : composite_(std::move(composite)) {}

  void operator()(const c10::OperatorHandle &op, c10::DispatchKeySet keys,
                  torch::jit::Stack *stack) {
    if (autogradRecords(op, *stack))
      return composite_.callBoxed(op, keys, stack);
    const size_t base = stack->size() - op.schema().arguments().size();
    torch::jit::Stack args(stack->begin() + base, stack->end());
    const uint64_t traced = Session::get().counters().opsTraced.load();
    try {
      at::AutoDispatchBelowADInplaceOrView below;
      op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
    } catch (const std::exception &) {
      // An error after the op was traced (a cut at the node cap that lost the session) is the
      // call's own.
      if (Session::get().counters().opsTraced.load() != traced)
        throw;
      // A bad call (shapes that cannot be multiplied) raises from the composite's own ops, so
      // that its message is CPU eager's, not the whole op's meta kernel's.
      stack->resize(base);
      stack->insert(stack->end(), args.begin(), args.end());
      composite_.callBoxed(op, keys, stack);
    }
  }

private:
  c10::SafeKernelFunction composite_;
};

/// CompositeImplicitAutograd ops decompose above autograd, into several ops each traced on its own:
/// linear on a 3-d input is a view, a transpose, addmm and another view, four trips through
/// autograd, functionalization and the tracer, and four nodes for the server. Under torch.no_grad
/// (inference, generation) nothing needs the decomposition, so these ops are recorded whole there,
/// and the server runs the op itself. Only ops whose result never aliases an argument and which
/// write nothing are listed in the op-facts table (not einsum, which may answer a view, nor
/// batch_norm, which writes its running statistics).
/// repeat_interleave with an integer count is two views, a clone and a view; recorded whole, its
/// output length would no longer be tied to its input's in a symbolic graph (Inductor then compiles
/// it for one length), so its composite runs below functionalization instead, where the views are
/// traced as views without a wrapper, a meta twin or autograd's bookkeeping.
void registerWholeWithoutGrad(torch::Library &backend) {
  static torch::Library *autograd = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1, __FILE__, __LINE__);
  auto &dispatcher = c10::Dispatcher::singleton();
  // The op-facts table lists them: CompositeWithoutGrad, and RecordedWhole for one node (else
  // the composite runs below functionalization).
  for (const std::string &listed : ir::opsWith(ir::OpFact::CompositeWithoutGrad)) {
    auto [full, overload] = llvm::StringRef(listed).split('.');
    auto op = dispatcher.findOp({full.str(), overload == "default" ? "" : overload.str()});
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::AutogradPrivateUse1))
      continue;
    // Taken before the registrations below change what rgpu's autograd key computes to.
    c10::SafeKernelFunction composite =
        op->getComputedKernelForDispatchKey(c10::DispatchKey::AutogradPrivateUse1);
    std::string name = full.drop_front(6).str(); // registered without "aten::"
    if (overload != "default")
      name += "." + overload.str();
    autograd->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                     std::make_unique<WholeWithoutGrad>(std::move(composite))));
    if (ir::opFacts(listed).has(ir::OpFact::RecordedWhole))
      backend.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

/// An op that would make a sparse or quantized rgpu tensor (nn.Embedding(sparse=True)'s
/// backward, torch.sparse_coo_tensor(..., device="rgpu")): refused by name, not with the
/// dispatcher's "Could not run ... with arguments from the 'Sparsergpu' backend".
void refuseOtherLayouts(const c10::OperatorHandle &op, torch::jit::Stack *) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "rgpu: ", fullName(op), " would make a sparse or quantized "
                              "tensor; rgpu supports strided tensors only (for an embedding, "
                              "use sparse=False: its gradient is then dense)");
}

} // namespace

void registerWholeOps() {
  registerPendingCustomOps(); // installs the listener; ops defined so far are noted
  // Composite kernels outrank a backend fallback in the dispatcher, and the generated ones
  // implement functional ops through their out= variants: the backend would then see mutations.
  // So every functional aten op with a CompositeExplicitAutograd(NonFunctional) kernel gets this
  // same boxed kernel: rgpu records it whole, and the server runs its real kernel.
  // CompositeImplicitAutograd ops still decompose above autograd, before functionalization.
  static torch::Library *lib = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto &dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName &name : dispatcher.getAllOpNames()) {
    llvm::StringRef full(name.name);
    if (!full.consume_front("aten::"))
      continue;
    auto op = dispatcher.findOp(name);
    if (!op || op->schema().is_mutable() || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
      continue;
    // Ops answering a Python value (allclose, is_same_size) decompose into ops that sync.
    const auto &returns = op->schema().returns();
    if (returns.empty() || std::any_of(returns.begin(), returns.end(), [](const c10::Argument &r) {
          return !r.type()->isSubtypeOf(*c10::TensorType::get()) &&
                 !r.type()->isSubtypeOf(*c10::ListType::ofTensors());
        }))
      continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    // Takes its lengths on the host, as on CUDA, and answers its batch sizes there: its
    // composite kernel reads them and slices the input, which is traced.
    if (full == "_pack_padded_sequence")
      continue;
    std::string impl = full.str();
    if (!name.overload_name.empty())
      impl += "." + name.overload_name;
    lib->impl(impl.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  registerWholeWithoutGrad(*lib);
  // torch.distributed's functional collectives (python/rgpu/distributed.py) have composite
  // kernels too, which would run them on the client: they are recorded, and the server runs
  // them in the process group its session joined.
  static torch::Library *collectives = new torch::Library(
      torch::Library::IMPL, "_c10d_functional", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const char *op : {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                         "broadcast", "wait_tensor"})
    if (dispatcher.findOp({std::string("_c10d_functional::") + op, ""}))
      collectives->impl(op, torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

} // namespace rgpu::client

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&rgpu::client::fallback>());
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&rgpu::client::refuseOtherLayouts>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&rgpu::client::refuseOtherLayouts>());
}

TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&rgpu::client::refuseOtherLayouts>());
}

TORCH_LIBRARY_IMPL(aten, Functionalize, m) {
  m.impl("_pack_padded_sequence",
         torch::CppFunction::makeFromBoxedFunction<&rgpu::client::packPaddedSequence>());
  m.impl("native_batch_norm",
         torch::CppFunction::makeFromBoxedFunction<&rgpu::client::nativeBatchNorm>());
}

TORCH_LIBRARY_IMPL(aten, ADInplaceOrView, m) {
  m.impl("_to_copy", torch::CppFunction::makeFromBoxedFunction<&rgpu::client::toCopyStaysFunctional>());
}

namespace {
// copyInto replaces ADInplaceOrView's kernel for copy_, which the dispatcher warns about.
const bool copyIntoRegistered = [] {
  static torch::Library *lib = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
  struct Silent : c10::WarningHandler {
    void process(const c10::Warning &) override {}
  } silent;
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  lib->impl("copy_", TORCH_FN(rgpu::client::copyInto));
  return true;
}();
} // namespace

// Composite kernels would otherwise win over the fallback for these; rgpu needs to see them whole.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_to_copy", torch::CppFunction::makeFromBoxedFunction<&rgpu::client::fallback>());
}
