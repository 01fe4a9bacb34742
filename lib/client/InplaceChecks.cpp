#include "rgpu/client/InplaceChecks.h"
#include "rgpu/client/LazyTensor.h"
#include "rgpu/ir/OpFacts.h"

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

namespace rgpu::client {
namespace {

/// Appends what a check of \p v depends on to \p key; false if the check must run anyway.
bool addSignature(const c10::IValue &v, std::string &key) {
  auto put = [&](const void *p, size_t n) { key.append(static_cast<const char *>(p), n); };
  auto tag = [&](char c) { key.push_back(c); };
  auto tensor = [&](const at::Tensor &t) {
    if (!t.defined()) {
      tag('u');
      return true;
    }
    const c10::TensorImpl &impl = *t.unsafeGetTensorImpl();
    if (impl.has_symbolic_sizes_strides())
      return false;
    tag('t');
    int8_t dtype = int8_t(c10::typeMetaToScalarType(impl.dtype()));
    put(&dtype, 1);
    int64_t rank = impl.dim();
    put(&rank, 8);
    put(impl.sizes().data(), rank * 8);
    put(impl.strides().data(), rank * 8);
    uint8_t bits = (impl.is_conj() ? 1 : 0) | (impl.is_neg() ? 2 : 0);
    put(&bits, 1);
    return true;
  };
  auto scalar = [&](const c10::Scalar &s) {
    // Integers and bools decide what a check accepts (dims, sizes); a float or complex value
    // (lr, alpha) does not, only its type.
    if (s.isIntegral(false) || s.isBoolean()) {
      tag(s.isBoolean() ? 'b' : 'i');
      int64_t i = s.isBoolean() ? s.toBool() : s.toLong();
      put(&i, 8);
    } else {
      tag(s.isComplex() ? 'c' : 'f');
    }
  };
  if (v.isNone()) {
    tag('n');
  } else if (v.isTensor()) {
    return tensor(v.toTensor());
  } else if (v.isTensorList()) {
    tag('L');
    for (const at::Tensor &t : v.toTensorList())
      if (!tensor(t))
        return false;
    tag(';');
  } else if (v.isInt() || v.isBool()) {
    tag(v.isInt() ? 'I' : 'B');
    int64_t i = v.isInt() ? v.toInt() : v.toBool();
    put(&i, 8);
  } else if (v.isDouble() || v.isComplexDouble()) {
    tag(v.isDouble() ? 'D' : 'C');
  } else if (v.isScalar()) {
    scalar(v.toScalar());
  } else if (v.isString()) {
    tag('s');
    key += v.toStringRef();
    key.push_back('\0');
  } else if (v.isDevice()) {
    tag('d');
    key += v.toDevice().str();
    key.push_back('\0');
  } else if (v.isList()) {
    tag('[');
    for (const c10::IValue &item : v.toListRef())
      if (!addSignature(item, key))
        return false;
    tag(']');
  } else {
    return false; // a generator, a symbolic int, anything else: always checked
  }
  return true;
}

/// Writing through a tensor whose elements share memory (an expand()): CPU's kernels refuse,
/// except a few fills, which write a shared element again. torch's Python meta kernels check
/// neither, and functionalization would turn the write into a sum over the copies
/// (`x.expand(2, 3).add_(1)` added 2 to `x`). So functionalization's check of an in-place op
/// refuses it with CPU's message, and those fills with rgpu's own (Python's `fill_` and `zero_`
/// reach them with each repeated dimension narrowed to one element, and are CPU's).
void refuseWritesThroughOverlap(const c10::OperatorHandle &op, const c10::IValue &self) {
  if (!self.isTensor() || !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Functionalize))
    return; // functionalization's check runs with functionalization switched off
  const at::Tensor &t = self.toTensor();
  if (!t.defined() || at::has_internal_overlap(t) != at::MemOverlap::Yes)
    return;
  const std::string &name = op.operator_name().name;
  TORCH_CHECK(!ir::opFacts(name).has(ir::OpFact::WritesThroughOverlap), "rgpu: ", name,
              " writes through a tensor whose "
                "elements share memory (an expand()), which rgpu cannot do as CPU eager does; "
                "write to the tensor it expands, or clone() it first");
  at::assert_no_internal_overlap(t);
}

/// Notes \p self's layout for the functional form of in-place \p op (InplaceChecks.h).
void noteLayout(const c10::OperatorHandle &op, const c10::IValue &self) {
  const std::string &name = op.operator_name().name;
  if (!self.isTensor() || name.empty() || name.back() != '_' ||
      !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Functionalize))
    return;
  const at::Tensor &t = self.toTensor();
  if (!t.defined() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
    return;
  InplaceLayout &l = inplaceLayout();
  l.functional = {name.substr(0, name.size() - 1), op.operator_name().overload_name};
  l.sizes.assign(t.sizes().begin(), t.sizes().end());
  l.strides.assign(t.strides().begin(), t.strides().end());
  l.dtype = t.scalar_type();
  l.pending = true;
  l.opsSince = 0;
}

/// The Meta kernel: the signatures that passed, and the check for new ones.
class Memoized final : public c10::OperatorKernel {
public:
  explicit Memoized(MetaCheck check) : check_(std::move(check)) {}

  void operator()(const c10::OperatorHandle &op, c10::DispatchKeySet, torch::jit::Stack *stack) {
    const auto &schema = op.schema();
    const size_t nargs = schema.arguments().size();
    auto args = torch::jit::last(*stack, nargs);
    if (nargs)
      refuseWritesThroughOverlap(op, args[0]);
    std::string key;
    key.reserve(128);
    bool keyed = true;
    for (const c10::IValue &a : args)
      if (!(keyed = addSignature(a, key)))
        break;
    c10::IValue self = nargs ? args[0] : c10::IValue();
    if (keyed) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = passed_.find(key);
      if (it != passed_.end()) {
        noteLayout(op, self);
        torch::jit::drop(*stack, nargs);
        if (it->second)
          stack->push_back(std::move(self));
        return;
      }
    }
    const size_t base = stack->size() - nargs;
    check_(op, stack); // raises if the op is invalid on these arguments
    noteLayout(op, self);
    // Remembered only when it answered as in-place ops do: `self`, or nothing.
    const size_t results = stack->size() - base;
    bool returnsSelf = results == 1 && self.isTensor() && (*stack)[base].isTensor() &&
                       (*stack)[base].toTensor().is_same(self.toTensor());
    if (keyed && (results == 0 || returnsSelf)) {
      std::lock_guard<std::mutex> lock(mu_);
      if (passed_.size() >= kMaxSignatures)
        passed_.clear();
      passed_.emplace(std::move(key), returnsSelf);
    }
  }

private:
  static constexpr size_t kMaxSignatures = 4096;
  MetaCheck check_;
  std::mutex mu_;
  std::unordered_map<std::string, bool> passed_; ///< signature -> the check returned self
};

} // namespace

void memoizeMetaCheck(const c10::OperatorName &op, MetaCheck check) {
  static std::mutex mu;
  static std::set<std::pair<std::string, std::string>> done;
  static torch::Library *lib =
      new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__);
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert({op.name, op.overload_name}).second)
    return;
  std::string name = op.name.substr(op.name.find("::") + 2);
  if (!op.overload_name.empty())
    name += "." + op.overload_name;
  // The dispatcher warns that a kernel (the Python one) is overridden: that is the point.
  struct Silent : c10::WarningHandler {
    void process(const c10::Warning &) override {}
  } silent;
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  lib->impl(name.c_str(),
            torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Memoized>(std::move(check))));
}

namespace {

/// The meta twin of \p t (functional or not), with its sizes, strides and math bits.
at::Tensor metaTwin(const at::Tensor &t) {
  namespace fz = at::functionalization::impl;
  if (!t.defined())
    return t;
  const at::Tensor &v = fz::isFunctionalTensor(t) ? fz::from_functional_tensor(t) : t;
  at::Tensor m = at::empty_strided(v.sizes(), v.strides(), v.options().device(at::kMeta));
  if (v.is_conj())
    m = m.conj();
  if (v.is_neg())
    m = m._neg_view();
  return m;
}

bool isRgpu(const c10::IValue &v) {
  namespace fz = at::functionalization::impl;
  if (!v.isTensor() || !fz::isFunctionalTensor(v.toTensor()))
    return false;
  return lazyImpl(fz::from_functional_tensor(v.toTensor())) != nullptr;
}

class OutCheck final : public c10::OperatorKernel {
public:
  explicit OutCheck(c10::SafeKernelFunction original) : original_(std::move(original)) {}

  void operator()(const c10::OperatorHandle &op, c10::DispatchKeySet keys,
                  torch::jit::Stack *stack) {
    const auto &args = op.schema().arguments();
    auto values = torch::jit::last(*stack, args.size());
    bool rgpu = false;
    for (size_t i = 0; i < args.size() && !rgpu; ++i)
      rgpu = args[i].is_out() && isRgpu(values[i]);
    if (rgpu)
      check(op, values);
    original_.callBoxed(op, keys, stack);
  }

private:
  void check(const c10::OperatorHandle &op, c10::ArrayRef<c10::IValue> values) {
    std::string key;
    for (const c10::IValue &v : values)
      if (!addSignature(v, key))
        return; // a symbolic size or a generator: left to the op
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (passed_.count(key))
        return;
    }
    torch::jit::Stack twin;
    for (const c10::IValue &v : values) {
      if (v.isTensor())
        twin.emplace_back(metaTwin(v.toTensor()));
      else if (v.isTensorList()) {
        c10::List<at::Tensor> list;
        for (const at::Tensor &t : v.toTensorList())
          list.push_back(metaTwin(t));
        twin.emplace_back(std::move(list));
      } else
        twin.push_back(v);
    }
    try {
      at::AutoDispatchSkipFunctionalize skip;
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &twin);
    } catch (const c10::NotImplementedError &) {
      return; // no meta kernel: nothing to check with
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (passed_.size() >= kMaxSignatures)
      passed_.clear();
    passed_.insert(std::move(key));
  }

  static constexpr size_t kMaxSignatures = 4096;
  c10::SafeKernelFunction original_;
  std::mutex mu_;
  std::set<std::string> passed_;
};

} // namespace

void wrapFunctionalizeKernels(const FunctionalizeWrapper &wrap) {
  // One library per caller: a registration outlives the process.
  auto *lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::Functionalize,
                                 __FILE__, __LINE__);
  struct Silent : c10::WarningHandler {
    void process(const c10::Warning &) override {}
  } silent;
  c10::WarningUtils::WarningHandlerGuard guard(&silent); // "overriding a kernel": the point
  auto &dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName &name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0)
      continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasSchema() ||
        !op->hasComputedKernelForDispatchKey(c10::DispatchKey::Functionalize))
      continue;
    std::optional<torch::CppFunction> kernel =
        wrap(op->schema(), op->getComputedKernelForDispatchKey(c10::DispatchKey::Functionalize));
    if (!kernel)
      continue;
    std::string impl = name.name.substr(6);
    if (!name.overload_name.empty())
      impl += "." + name.overload_name;
    lib->impl(impl.c_str(), std::move(*kernel));
  }
}

void checkOutOps() {
  static std::once_flag once;
  std::call_once(once, [] {
    wrapFunctionalizeKernels([](const c10::FunctionSchema &schema, c10::SafeKernelFunction kernel)
                                 -> std::optional<torch::CppFunction> {
      const auto &args = schema.arguments();
      if (std::none_of(args.begin(), args.end(), [](const c10::Argument &a) { return a.is_out(); }))
        return std::nullopt;
      return torch::CppFunction::makeFromBoxedFunctor(
          std::make_unique<OutCheck>(std::move(kernel)));
    });
  });
}

InplaceLayout &inplaceLayout() {
  thread_local InplaceLayout layout;
  return layout;
}

std::optional<std::vector<int64_t>> InplaceLayout::take(const c10::OperatorName &op,
                                                        c10::IntArrayRef sizes_,
                                                        c10::ScalarType result) {
  if (!pending || op != functional)
    return std::nullopt;
  pending = false;
  TORCH_CHECK(c10::canCast(result, dtype), "result type ", result,
              " can't be cast to the desired output type ", dtype);
  if (sizes_ != c10::IntArrayRef(sizes))
    return std::nullopt;
  return strides;
}

void guardMetaKernel(const c10::OperatorName &name) {
  auto op = c10::Dispatcher::singleton().findOp(name);
  if (!op || !op->hasComputedKernelForDispatchKey(c10::DispatchKey::Meta))
    return;
  auto kernel = std::make_shared<c10::SafeKernelFunction>(
      op->getComputedKernelForDispatchKey(c10::DispatchKey::Meta));
  memoizeMetaCheck(name, [kernel](const c10::OperatorHandle &op, torch::jit::Stack *stack) {
    kernel->callBoxed(op, c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  });
}

} // namespace rgpu::client
