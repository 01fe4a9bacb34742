#include "Plan.h"
#include "Policy.h"

#include <ATen/ATen.h>
#include <ATen/core/jit_type.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <mutex>

namespace rgpu::server {

using ir::Arg;

namespace {

/// The op a plan runs for \p name: the view that a functionalized `*_copy` op stands for (see
/// bridge::viewOf), and reshape for view, which fails on layouts it cannot view without a copy.
c10::OperatorHandle runnable(const c10::OperatorName &name, const c10::OperatorHandle &handle) {
  const std::string full = name.overload_name.empty() ? name.name
                                                      : name.name + "." + name.overload_name;
  if (ir::opFacts(full).has(ir::OpFact::RunsAsReshape))
    return *c10::Dispatcher::singleton().findSchema({"aten::reshape", ""});
  if (auto view = bridge::viewOf(name))
    return *view;
  return handle;
}

std::string kindName(Arg::Kind k) {
  switch (k) {
  case Arg::Kind::None: return "None";
  case Arg::Kind::Bool: return "bool";
  case Arg::Kind::Int: return "int";
  case Arg::Kind::Double: return "float";
  case Arg::Kind::Str: return "str";
  case Arg::Kind::Device: return "Device";
  case Arg::Kind::Tensor: return "Tensor";
  case Arg::Kind::Scalar: return "Scalar";
  case Arg::Kind::List: return "list";
  }
  return "?";
}

/// A constant IValue for a non-tensor arg of schema type \p type, or false on a kind mismatch.
bool constant(const c10::TypePtr &type, const Arg &a, const ir::Node &n, c10::IValue &out) {
  ir::Arg::Kind want = bridge::constantKind(bridge::argType(type));
  if (want == Arg::Kind::Double && a.kind == Arg::Kind::Int) {
    out = double(a.i);
    return true;
  }
  if (want == Arg::Kind::None || a.kind != want)
    return false;
  switch (want) {
  case Arg::Kind::Int: out = a.i; break;
  case Arg::Kind::Double: out = a.d; break;
  case Arg::Kind::Bool: out = a.i != 0; break;
  default: out = n.strings[a.i]; break;
  }
  return true;
}

/// The constant IValue of schema argument \p sa (of type \p type, any Optional unwrapped) from
/// \p args at \p at, where a List arg is followed by its elements; or why not.
llvm::Error constantOf(const c10::Argument &sa, const c10::TypePtr &type, llvm::StringRef base,
                       const ir::Node &n, llvm::ArrayRef<Arg> args, size_t at,
                       c10::IValue &out) {
  std::string where = "argument '" + sa.name() + "'";
  const Arg &arg = args[at];
  if (bridge::argType(type) != bridge::ArgType::List) {
    if (!constant(type, arg, n, out))
      return failure(where + " expects " + type->str() + ", got " + kindName(arg.kind));
    return policy::checkConstant(base, sa, bridge::argType(sa.real_type()), arg,
                                 arg.kind == Arg::Kind::Str ? n.strings[arg.i] : "");
  }
  c10::TypePtr elem = type->containedType(0);
  std::vector<c10::IValue> items;
  for (int64_t k = 0; k < arg.i; ++k) {
    c10::IValue v;
    if (!constant(elem, args[at + 1 + k], n, v))
      return failure(where + " element " + std::to_string(k) + " does not match " + elem->str());
    if (v.isInt())
      if (llvm::Error e = policy::checkListElement(base, sa, v.toInt()))
        return e;
    items.push_back(std::move(v));
  }
  switch (elem->kind()) {
  case c10::TypeKind::IntType:
  case c10::TypeKind::SymIntType: {
    std::vector<int64_t> v;
    for (auto &i : items)
      v.push_back(i.toInt());
    out = v;
    return llvm::Error::success();
  }
  case c10::TypeKind::FloatType: {
    std::vector<double> v;
    for (auto &i : items)
      v.push_back(i.toDouble());
    out = v;
    return llvm::Error::success();
  }
  case c10::TypeKind::BoolType: {
    c10::List<bool> v;
    for (auto &i : items)
      v.push_back(i.toBool());
    out = v;
    return llvm::Error::success();
  }
  default:
    return failure(where + ": unsupported list type " + type->str());
  }
}

/// Runs a random op that has no generator argument with the session's generator standing in for
/// the process default one, so sessions never see each other's random streams.
void callWithSessionGenerator(const c10::OperatorHandle &op, torch::jit::Stack &stack,
                              const at::Device &device, at::Generator generator) {
  static std::mutex swapMutex;
  std::lock_guard<std::mutex> lock(swapMutex);
  at::Generator global = at::globalContext().defaultGenerator(device);
  at::Tensor saved = global.get_state();
  global.set_state(generator.get_state());
  try {
    op.callBoxed(stack);
  } catch (...) {
    global.set_state(saved);
    throw;
  }
  generator.set_state(global.get_state());
  global.set_state(saved);
}

/// Runs `resize` or `_resize_output`, then zeroes the bytes of its result's storage past its
/// input's: the kernel copies the input's bytes into a larger storage and leaves the rest as
/// the allocator gave it, which on CUDA is memory another session may have written.
void callZeroingGrowth(const c10::OperatorHandle &op, torch::jit::Stack &stack) {
  const at::Tensor &self = stack.front().toTensor();
  const int64_t kept = self.numel() * int64_t(self.element_size());
  op.callBoxed(stack);
  const at::Tensor &out = stack.front().toTensor();
  const int64_t total = int64_t(out.storage().nbytes());
  if (total <= kept)
    return;
  at::Tensor bytes = at::empty({0}, out.options().dtype(at::kByte)).set_(out.storage());
  bytes.narrow(0, kept, total - kept).zero_();
}

/// Where in ctx.devices a step runs: on the device its Device argument names (\p named, -1 if
/// none), else on its first tensor operand's, else on rgpu:0.
size_t deviceOf(int32_t named, const torch::jit::Stack &stack, const RunContext &ctx) {
  if (named >= 0)
    return size_t(named);
  for (const c10::IValue &v : stack)
    if (v.isTensor() && v.toTensor().defined()) {
      for (size_t i = 0; i < ctx.devices.size(); ++i)
        if (ctx.devices[i] == v.toTensor().device())
          return i;
      break;
    }
  return 0;
}

/// Gives a kernel's output the dtype and size its meta kernel promised, which is what the client
/// believes it holds. Some kernels disagree with their meta kernels on this device: CPU's
/// layer and batch norms keep bf16 statistics where the meta kernels (like CUDA's kernels)
/// promise float32, and batch norm in eval mode returns empty saved statistics where the meta
/// kernels promise one per channel (those are never read; they come back as zeros). Any other
/// disagreement is left for the output check, which names it.
void conformToMeta(at::Tensor &t, const ir::TensorMeta &m) {
  c10::ScalarType want = bridge::scalarType(m.dtype);
  bool sameSizes = t.sizes().equals(m.sizes);
  if (sameSizes && t.scalar_type() == want)
    return;
  if (sameSizes) {
    t = t.to(want);
    return;
  }
  if (t.numel() == 0)
    t = at::zeros(m.sizes, t.options().dtype(want));
}

} // namespace

std::string pythonTypeOf(const std::exception &e) {
  // In torch's order of translation (torch/csrc/Exceptions.h): subclasses first.
  if (dynamic_cast<const c10::OutOfMemoryError *>(&e))
    return "OutOfMemoryError";
  if (dynamic_cast<const c10::LinAlgError *>(&e))
    return "LinAlgError";
  if (dynamic_cast<const c10::IndexError *>(&e))
    return "IndexError";
  if (dynamic_cast<const c10::ValueError *>(&e))
    return "ValueError";
  if (dynamic_cast<const c10::TypeError *>(&e))
    return "TypeError";
  if (dynamic_cast<const c10::NotImplementedError *>(&e))
    return "NotImplementedError";
  return "";
}

at::Tensor restride(const at::Tensor &t, const ir::TensorMeta &meta) {
  if (!t.defined() || (t.strides().equals(meta.strides) && t.storage_offset() == 0))
    return t;
  // A layout that repeats elements (stride 0, as expand() makes) cannot be copied into: one of
  // each is copied, then expanded.
  std::vector<int64_t> once(meta.sizes.begin(), meta.sizes.end());
  at::Tensor src = t;
  bool repeats = false;
  for (size_t d = 0; d < once.size(); ++d)
    if (meta.strides[d] == 0 && once[d] > 1) {
      once[d] = 1;
      src = src.narrow(int64_t(d), 0, 1);
      repeats = true;
    }
  // The copy keeps the math bits the client believes this value has (a `_conj` view of a
  // slice, say): the client resolves them where CPU eager would.
  at::Tensor r = at::empty_strided(once, meta.strides, t.options());
  if (t.is_conj())
    r = at::_conj(r);
  if (t.is_neg())
    r = at::_neg_view(r);
  r.copy_(src);
  return repeats ? r.expand(meta.sizes) : r;
}

llvm::Expected<std::unique_ptr<Plan>> Plan::build(ir::Graph graph, uint64_t maxValueBytes) {
  std::unique_ptr<Plan> plan(new Plan());
  plan->graph_ = std::move(graph);
  if (llvm::Error e = ir::verifyStructure(plan->graph_))
    return std::move(e);
  plan->metas_ = plan->graph_.valueMetas();
  // Sizes are peer numbers: a layout whose byte span overflows, or exceeds the limit, is refused
  // before anything is sized from it.
  for (size_t v = 0; v < plan->metas_.size(); ++v) {
    const ir::TensorMeta &m = *plan->metas_[v];
    if (m.dtype == ir::dtype::Undefined)
      continue;
    if (m.storageBytes() < 0)
      return failure("value " + std::to_string(v) + " has a layout whose size overflows");
    if (uint64_t(m.storageBytes()) > maxValueBytes)
      return failure("value " + std::to_string(v) + " " + m.str() + " needs " +
                     std::to_string(m.storageBytes() >> 20) +
                     " MiB, more than this server's limit of " +
                     std::to_string(maxValueBytes >> 20) + " MiB per tensor");
  }
  plan->producer_.assign(plan->graph_.inputs.size(), 0);
  for (uint32_t n = 0; n < plan->graph_.nodes.size(); ++n)
    plan->producer_.insert(plan->producer_.end(), plan->graph_.nodes[n].outputs.size(), n);
  uint32_t next = plan->graph_.inputs.size();
  for (uint32_t n = 0; n < plan->graph_.nodes.size(); ++n) {
    if (llvm::Error e = plan->addStep(n, next))
      return failure("node " + std::to_string(n) + " (" + plan->graph_.nodes[n].op.str().str() +
                     "): " + message(std::move(e)));
    next += plan->graph_.nodes[n].outputs.size();
  }
  plan->maxValueBytes_ = maxValueBytes;
  plan->locateSymbolic();
  // Free every intermediate after its last use; graph outputs and inputs are never freed here.
  std::vector<int64_t> lastUse(next, -1);
  for (size_t s = 0; s < plan->steps_.size(); ++s)
    for (uint32_t v : plan->graph_.nodes[plan->steps_[s].node].operands)
      lastUse[v] = s;
  for (uint32_t v : plan->graph_.outputs)
    lastUse[v] = -1;
  for (uint32_t v = plan->graph_.inputs.size(); v < next; ++v)
    if (lastUse[v] >= 0)
      plan->steps_[lastUse[v]].release.push_back(v);
  return std::move(plan);
}

llvm::Error Plan::addStep(uint32_t nodeIndex, uint32_t firstOutput) {
  const ir::Node &n = graph_.nodes[nodeIndex];
  llvm::StringRef full = n.op.str();
  auto [base, overload] = ir::splitOpName(full);
  if (llvm::Error why = policy::admit(full))
    return why;
  c10::OperatorName name{base.str(), overload.str()};
  auto handle = c10::Dispatcher::singleton().findSchema(name);
  if (!handle)
    return failure("unknown op");
  const c10::FunctionSchema &schema = handle->schema();
  bool listReturns = false;
  for (const auto &ret : schema.returns())
    listReturns |= ret.type()->kind() == c10::TypeKind::ListType;
  // A list's length is known only when the op runs; the run checks the total then.
  if (!listReturns && schema.returns().size() != n.outputs.size())
    return failure("expects " + std::to_string(schema.returns().size()) +
                   " outputs, graph has " + std::to_string(n.outputs.size()));

  Step step;
  step.node = nodeIndex;
  step.firstOutput = firstOutput;
  step.numOutputs = n.outputs.size();
  step.restrideOperands = bridge::isStridedView(base);
  const bool draws = bridge::drawsRandom(*handle);
  random_ |= draws;
  compilable_ &= policy::compilable(base);
  step.seeded = draws &&
                std::none_of(schema.arguments().begin(), schema.arguments().end(),
                             [](const c10::Argument &a) {
                               return a.type()->str().find("Generator") != std::string::npos;
                             });
  step.zeroFill = ir::opFacts(base).has(ir::OpFact::Uninitialized);
  step.zeroGrown = policy::growsStorage(base);
  step.op = runnable(name, *handle);

  step.schema = *handle;
  const llvm::StringRef opBase = base; // a structured binding a lambda may capture (C++17)
  auto addConst = [&](const c10::Argument &sa, const c10::TypePtr &type, uint32_t at,
                      uint32_t si) -> llvm::Error {
    c10::IValue v;
    if (llvm::Error e = constantOf(sa, type, opBase, n, n.args, at, v))
      return e;
    if (step.restrideOperands && sa.name() == "size")
      step.viewSize = step.consts.size();
    if (step.restrideOperands && sa.name() == "stride")
      step.viewStride = step.consts.size();
    if (step.restrideOperands && sa.name() == "storage_offset")
      step.viewOffset = step.consts.size();
    step.slots.push_back({Slot::Const, uint32_t(step.consts.size())});
    step.consts.push_back(std::move(v));
    step.constSources.push_back({at, si});
    return llvm::Error::success();
  };
  size_t a = 0;
  auto take = [&]() -> const Arg * { return a < n.args.size() ? &n.args[a++] : nullptr; };
  for (uint32_t si = 0; si < schema.arguments().size(); ++si) {
    const c10::Argument &sa = schema.arguments()[si];
    const uint32_t at = a;
    const Arg *arg = take();
    if (!arg)
      return failure("too few arguments for " + schema.name());
    c10::TypePtr type = sa.type();
    std::string where = "argument '" + sa.name() + "'";
    if (auto opt = type->cast<c10::OptionalType>()) {
      if (arg->kind == Arg::Kind::None) {
        if (opt->getElementType()->kind() == c10::TypeKind::GeneratorType) {
          step.slots.push_back({Slot::Generator});
          continue;
        }
        step.slots.push_back({Slot::Const, uint32_t(step.consts.size())});
        step.consts.emplace_back();
        step.constSources.push_back({at, si});
        continue;
      }
      type = opt->getElementType();
    }
    auto mismatch = [&]() {
      return failure(where + " expects " + type->str() + ", got " + kindName(arg->kind));
    };
    switch (bridge::argType(type)) {
    case bridge::ArgType::Tensor:
      // A lifted Python number or CPU scalar tensor stands where the schema has a Tensor.
      if (arg->kind == Arg::Kind::Scalar &&
          (graph_.scalars[n.scalars[arg->i]].form == ir::ScalarForm::WrappedNumber ||
           graph_.scalars[n.scalars[arg->i]].form == ir::ScalarForm::Tensor0d)) {
        step.slots.push_back({Slot::Scalar, n.scalars[arg->i]});
        continue;
      }
      if (arg->kind != Arg::Kind::Tensor)
        return mismatch();
      step.slots.push_back({Slot::Tensor, n.operands[arg->i]});
      continue;
    case bridge::ArgType::Number:
      if (arg->kind != Arg::Kind::Scalar ||
          graph_.scalars[n.scalars[arg->i]].form == ir::ScalarForm::Generator)
        return mismatch();
      step.slots.push_back({Slot::Scalar, n.scalars[arg->i]});
      continue;
    case bridge::ArgType::Device: {
      if (arg->kind != Arg::Kind::Device)
        return mismatch();
      // "rgpu:i" (the client names every device by its index); anything else is rgpu:0.
      uint32_t index = 0;
      llvm::StringRef text =
          size_t(arg->i) < n.strings.size() ? llvm::StringRef(n.strings[arg->i]) : "";
      if (text.consume_front("rgpu:") && (text.getAsInteger(10, index) || index > 255))
        return failure(where + ": bad device '" + n.strings[arg->i] + "'");
      step.slots.push_back({Slot::Device, index});
      step.device = int32_t(index);
      maxDevice = std::max(maxDevice, index);
      continue;
    }
    case bridge::ArgType::Generator:
      if (arg->kind != Arg::Kind::Scalar ||
          graph_.scalars[n.scalars[arg->i]].form != ir::ScalarForm::Generator)
        return mismatch();
      step.slots.push_back({Slot::ExplicitGenerator, n.scalars[arg->i]});
      continue;
    case bridge::ArgType::List: {
      if (arg->kind != Arg::Kind::List)
        return mismatch();
      c10::TypePtr elem = type->containedType(0);
      uint32_t count = arg->i;
      bool optTensor = false;
      if (auto o = elem->cast<c10::OptionalType>()) {
        optTensor = o->getElementType()->kind() == c10::TypeKind::TensorType;
        if (!optTensor)
          return failure(where + ": unsupported list type " + type->str());
        elem = o->getElementType();
      }
      if (elem->kind() == c10::TypeKind::TensorType || elem->kind() == c10::TypeKind::NumberType) {
        bool scalars = elem->kind() == c10::TypeKind::NumberType;
        uint32_t start = listItems_.size();
        for (uint32_t k = 0; k < count; ++k) {
          const Arg *e = take();
          if (optTensor && e->kind == Arg::Kind::None) {
            listItems_.push_back(~0u);
            continue;
          }
          if (e->kind != (scalars ? Arg::Kind::Scalar : Arg::Kind::Tensor))
            return failure(where + " element " + std::to_string(k) + " is " + kindName(e->kind));
          listItems_.push_back(scalars ? n.scalars[e->i] : n.operands[e->i]);
        }
        Slot::Kind kind = scalars ? Slot::ScalarList : optTensor ? Slot::OptTensorList : Slot::TensorList;
        step.slots.push_back({kind, start, count});
        continue;
      }
      a += count;
      if (llvm::Error e = addConst(sa, type, at, si))
        return e;
      continue;
    }
    default:
      if (llvm::Error e = addConst(sa, type, at, si))
        return e;
      continue;
    }
  }
  if (a != n.args.size())
    return failure("too many arguments for " + schema.name());
  if (step.restrideOperands) {
    if (n.operands.empty())
      return failure("a strided view without a base");
    // A symbolic graph's sizes are blanks until a run gives them: resolve() checks its views.
    if (graph_.symbolCount == 0)
      if (llvm::Error e = checkView(step, step.consts, *metas_[n.operands[0]]))
        return e;
  }
  if (ir::opFacts(base).has(ir::OpFact::NormBackward)) {
    for (size_t i = 0; i < schema.arguments().size(); ++i) {
      const std::string &arg = schema.arguments()[i].name();
      if (arg == "input")
        step.statDtypeSlot = i;
      if (arg == "weight" || arg == "bias" || arg == "running_mean" || arg == "running_var")
        step.paramSlots.push_back(i);
      if (arg == "mean" || arg == "rstd" || arg == "save_mean" || arg == "save_invstd" ||
          arg == "save_var") // batch_norm_backward's name for the saved inverse deviation
        step.statSlots.push_back(i);
    }
  }
  step.cpuStandIn = cpuStandIn(full);
  cpuStandIns_ |= step.cpuStandIn != nullptr;
  steps_.push_back(std::move(step));
  return llvm::Error::success();
}

void Plan::locateSymbolic() {
  const auto &symbolic = graph_.symbolic;
  size_t k = 0;
  uint64_t p = 0;
  uint32_t value = 0;
  auto meta = [&](const ir::TensorMeta &m) {
    MetaPatch patch{value++, {}};
    for (uint32_t i = 0; i < m.sizes.size() + m.strides.size(); ++i, ++p)
      if (k < symbolic.size() && symbolic[k].position == p)
        patch.at.push_back({i, uint32_t(k++)});
    if (patch.at.empty())
      return;
    if (patch.value < graph_.inputs.size())
      symbolicInputs_.push_back(patch.value);
    metaPatches_.push_back(std::move(patch));
  };
  for (const ir::TensorMeta &m : graph_.inputs)
    meta(m);
  for (uint32_t n = 0; n < graph_.nodes.size(); ++n) {
    const ir::Node &node = graph_.nodes[n];
    ArgPatch patch{n, {}};
    for (uint32_t a = 0; a < node.args.size(); ++a) {
      if (node.args[a].kind != Arg::Kind::Int)
        continue;
      if (k < symbolic.size() && symbolic[k].position == p)
        patch.at.push_back({a, uint32_t(k++)});
      ++p;
    }
    if (!patch.at.empty())
      argPatches_.push_back(std::move(patch));
    for (const ir::TensorMeta &m : node.outputs)
      meta(m);
  }
}

llvm::Error Plan::checkView(const Step &step, const std::vector<c10::IValue> &consts,
                            const ir::TensorMeta &base) const {
  // The view must stay inside its base (the first operand, given exactly its graph layout).
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  if (step.viewSize >= 0 && consts[step.viewSize].isIntList())
    sizes = consts[step.viewSize].toIntVector();
  if (step.viewStride >= 0 && consts[step.viewStride].isIntList())
    strides = consts[step.viewStride].toIntVector();
  if (step.viewOffset >= 0 && consts[step.viewOffset].isInt())
    offset = consts[step.viewOffset].toInt();
  if (llvm::Error e = policy::checkStridedView(base, sizes, strides, offset))
    return failure("refused: " + message(std::move(e)));
  return llvm::Error::success();
}

ErrorPtr Plan::resolve(llvm::ArrayRef<int64_t> symbols, Shapes &out) const {
  auto fail = [&](std::string message) {
    return std::make_shared<RemoteError>(RemoteError{"", "run of graph " + hash.hex().substr(0, 12) +
                                                             ": " + std::move(message), ""});
  };
  // A node's error names its op and the user's line, as a failure while running it would.
  auto failAt = [&](uint32_t node, std::string message) {
    const ir::Node &n = graph_.nodes[node];
    return std::make_shared<RemoteError>(RemoteError{
        n.op.str().str(), std::move(message), graph_.locations[n.loc], hash, node});
  };
  if (symbols.size() != graph_.symbolCount)
    return fail("a run with " + std::to_string(symbols.size()) +
                " size symbols, of a graph with " + std::to_string(graph_.symbolCount));
  std::string sizes;
  for (size_t k = 0; k < symbols.size(); ++k)
    sizes += (k ? ", s" : "s") + std::to_string(k) + " = " + std::to_string(symbols[k]);
  std::vector<int64_t> values(graph_.symbolic.size());
  for (size_t k = 0; k < values.size(); ++k)
    if (!graph_.symbolic[k].expr.eval(symbols, values[k]))
      return fail("the size " + graph_.symbolic[k].expr.str() + " overflows for " + sizes);
  out.metas = metas_;
  out.owned.clear();
  out.consts.assign(steps_.size(), {});
  for (const MetaPatch &patch : metaPatches_) {
    ir::TensorMeta &m = out.owned.emplace_back(*metas_[patch.value]);
    for (auto [i, k] : patch.at)
      (i < m.sizes.size() ? m.sizes[i] : m.strides[i - m.sizes.size()]) = values[k];
    out.metas[patch.value] = &m;
    std::string why;
    for (int64_t size : m.sizes)
      if (size < 0)
        why = "a negative size";
    if (why.empty() && m.storageBytes() < 0)
      why = "a layout whose size overflows";
    else if (why.empty() && uint64_t(m.storageBytes()) > maxValueBytes_)
      why = std::to_string(m.storageBytes() >> 20) + " MiB, more than this server's limit of " +
            std::to_string(maxValueBytes_ >> 20) + " MiB per tensor";
    if (!why.empty()) {
      std::string what = m.str() + " (for " + sizes + ") would have " + why;
      if (patch.value < graph_.inputs.size())
        return fail("input " + std::to_string(patch.value) + " " + what);
      return failAt(producer_[patch.value], "its output " + what);
    }
  }
  for (const ArgPatch &patch : argPatches_) {
    const Step &step = steps_[patch.step];
    const ir::Node &n = graph_.nodes[step.node];
    llvm::SmallVector<Arg, 8> args(n.args.begin(), n.args.end());
    std::vector<bool> patched(args.size(), false);
    for (auto [a, k] : patch.at) {
      args[a].i = values[k];
      patched[a] = true;
    }
    std::vector<c10::IValue> &consts = out.consts[patch.step];
    consts = step.consts;
    const c10::FunctionSchema &schema = step.schema->schema();
    for (size_t c = 0; c < step.constSources.size(); ++c) {
      auto [at, si] = step.constSources[c];
      size_t end = args[at].kind == Arg::Kind::List ? at + 1 + args[at].i : at + 1;
      if (std::none_of(patched.begin() + at, patched.begin() + end, [](bool b) { return b; }))
        continue;
      const c10::Argument &sa = schema.arguments()[si];
      c10::TypePtr type = sa.type();
      if (auto opt = type->cast<c10::OptionalType>())
        type = opt->getElementType();
      if (llvm::Error e =
              constantOf(sa, type, ir::splitOpName(n.op.str()).first, n, args, at, consts[c]))
        return failAt(step.node, message(std::move(e)) + " (for " + sizes + ")");
    }
  }
  for (uint32_t s = 0; s < steps_.size(); ++s) {
    const Step &step = steps_[s];
    if (!step.restrideOperands)
      continue;
    const ir::Node &n = graph_.nodes[step.node];
    const auto &consts = out.consts[s].empty() ? step.consts : out.consts[s];
    if (llvm::Error e = checkView(step, consts, *out.metas[n.operands[0]]))
      return failAt(step.node, message(std::move(e)) + " (for " + sizes + ")");
  }
  return nullptr;
}

std::string Plan::runOp(uint32_t n) const {
  const c10::OperatorName &name = steps_[n].op->operator_name();
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

c10::Scalar toScalar(const ir::ScalarValue &v) {
  switch (v.kind) {
  case ir::ScalarValue::Kind::Int: return v.i;
  case ir::ScalarValue::Kind::Double: return v.d;
  case ir::ScalarValue::Kind::Bool: return bool(v.i);
  case ir::ScalarValue::Kind::Complex: return c10::complex<double>(v.d, v.imag);
  }
  return {};
}

c10::IValue Plan::scalarValue(uint32_t slot, llvm::ArrayRef<ir::ScalarValue> scalars) const {
  const ir::ScalarSlot &s = graph_.scalars[slot];
  c10::Scalar value = toScalar(scalars[slot]);
  if (s.form == ir::ScalarForm::Scalar)
    return value;
  at::Tensor t = at::scalar_tensor(value, at::TensorOptions().dtype(bridge::scalarType(s.dtype)));
  if (s.form == ir::ScalarForm::WrappedNumber)
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

ErrorPtr Plan::run(const std::vector<Entry> &inputs, llvm::ArrayRef<ir::ScalarValue> scalars,
                   const RunContext &ctx, std::vector<Entry> &outputs, bool exactLayout,
                   const Shapes *shapes) const {
  c10::InferenceMode inference;
  const std::vector<const ir::TensorMeta *> &metas = shapes ? shapes->metas : metas_;
  std::vector<Entry> values(metas.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    values[i] = inputs[i];
  ErrorPtr first;
  torch::jit::Stack stack;
  for (size_t s = 0; s < steps_.size(); ++s) {
    const Step &step = steps_[s];
    const std::vector<c10::IValue> &consts =
        shapes && !shapes->consts[s].empty() ? shapes->consts[s] : step.consts;
    const ir::Node &node = graph_.nodes[step.node];
    if (ctx.cancelled && ctx.cancelled()) {
      outputs.clear();
      return std::make_shared<RemoteError>(RemoteError{
          node.op.str().str(), "cancelled (Ctrl-C or rgpu.cancel()) before this op ran",
          graph_.locations[node.loc], hash, step.node, RemoteError::kCancelled});
    }
    ErrorPtr upstream;
    for (uint32_t v : node.operands)
      if (values[v].error) {
        upstream = values[v].error;
        break;
      }
    if (!upstream) {
      try {
        auto operand = [&](uint32_t v) -> at::Tensor {
          const at::Tensor &t = values[v].tensor;
          return step.restrideOperands ? restride(t, *metas[v]) : t;
        };
        stack.clear();
        for (const Slot &slot : step.slots) {
          switch (slot.kind) {
          case Slot::Const: stack.push_back(consts[slot.a]); break;
          case Slot::Tensor: stack.push_back(operand(slot.a)); break;
          case Slot::TensorList: {
            c10::List<at::Tensor> list;
            list.reserve(slot.b);
            for (uint32_t k = 0; k < slot.b; ++k)
              list.push_back(operand(listItems_[slot.a + k]));
            stack.push_back(std::move(list));
            break;
          }
          case Slot::OptTensorList: {
            c10::List<std::optional<at::Tensor>> list;
            for (uint32_t k = 0; k < slot.b; ++k) {
              uint32_t v = listItems_[slot.a + k];
              list.push_back(v == ~0u ? std::optional<at::Tensor>() : operand(v));
            }
            stack.push_back(std::move(list));
            break;
          }
          case Slot::Scalar: stack.push_back(scalarValue(slot.a, scalars)); break;
          case Slot::ScalarList: {
            c10::impl::GenericList list(c10::NumberType::get());
            for (uint32_t k = 0; k < slot.b; ++k)
              list.push_back(scalarValue(listItems_[slot.a + k], scalars));
            stack.push_back(std::move(list));
            break;
          }
          case Slot::Generator: stack.push_back(ctx.generators[deviceOf(step.device, stack, ctx)]); break;
          case Slot::ExplicitGenerator: {
            const uint64_t id = uint64_t(scalars[slot.a].i);
            const at::Generator *g = nullptr;
            if (ctx.explicitGenerators)
              if (auto it = ctx.explicitGenerators->find(id); it != ctx.explicitGenerators->end())
                g = &it->second;
            TORCH_CHECK(g, "rgpu: generator ", id, " does not exist in this session");
            stack.push_back(*g);
            break;
          }
          case Slot::Device: stack.push_back(ctx.devices[slot.a]); break;
          }
        }
        // The statistics are float32 as the meta kernels promise (conformToMeta); CPU's
        // backward kernels of bf16/fp16 norms want them in the input's dtype, as its forward
        // kernels made them, except in mixed precision (a bf16/fp16 input with float32
        // parameters or running statistics, as autocast leaves a batch norm), where they stay
        // float32.
        if (!step.statSlots.empty() && ctx.devices[0].is_cpu()) {
          c10::ScalarType want = stack[step.statDtypeSlot].toTensor().scalar_type();
          for (uint32_t i : step.paramSlots)
            if (stack[i].isTensor() && stack[i].toTensor().defined() &&
                stack[i].toTensor().scalar_type() == at::kFloat)
              want = at::kFloat;
          for (uint32_t i : step.statSlots)
            if (stack[i].isTensor() && stack[i].toTensor().defined() &&
                stack[i].toTensor().scalar_type() != want)
              stack[i] = stack[i].toTensor().to(want);
        }
        if (step.seeded) {
          size_t d = deviceOf(step.device, stack, ctx);
          callWithSessionGenerator(*step.op, stack, ctx.devices[d], ctx.generators[d]);
        } else if (step.cpuStandIn && ctx.devices[0].is_cpu())
          step.cpuStandIn(*step.op, stack);
        else if (step.zeroGrown)
          callZeroingGrowth(*step.op, stack);
        else
          step.op->callBoxed(stack);
        uint32_t out = step.firstOutput;
        for (c10::IValue &r : stack) {
          if (r.isTensorList()) {
            for (const at::Tensor &t : r.toTensorList())
              if (out < step.firstOutput + step.numOutputs)
                values[out++].tensor = t;
          } else if (out < step.firstOutput + step.numOutputs) {
            values[out++].tensor = r.toTensor();
          }
        }
        for (uint32_t k = step.firstOutput; k < out; ++k) {
          at::Tensor &t = values[k].tensor;
          if (!t.defined())
            continue;
          if (t.layout() != at::kStrided || t.is_quantized() || t.is_nested())
            throw std::runtime_error("returned a non-strided tensor; rgpu supports strided "
                                     "tensors only");
          if (step.zeroFill) // a CPU block the session freed is reused as it was
            t.zero_();
          if (exactLayout) // else the graph's metas are placeholders the run will answer
            conformToMeta(t, *metas[k]);
        }
        if (out != step.firstOutput + step.numOutputs)
          throw std::runtime_error("produced " + std::to_string(out - step.firstOutput) +
                                   " outputs, the client expected " +
                                   std::to_string(step.numOutputs));
      } catch (const std::exception &e) {
        const c10::Error *ce = dynamic_cast<const c10::Error *>(&e);
        upstream = std::make_shared<RemoteError>(
            RemoteError{node.op.str().str(), ce ? ce->what_without_backtrace() : e.what(),
                        graph_.locations[node.loc], hash, step.node, pythonTypeOf(e)});
        if (!first)
          first = upstream;
      }
    }
    if (upstream)
      for (uint32_t k = 0; k < step.numOutputs; ++k)
        values[step.firstOutput + k] = {at::Tensor(), upstream};
    for (uint32_t v : step.release)
      values[v] = Entry();
  }
  outputs.clear();
  outputs.reserve(graph_.outputs.size());
  for (uint32_t v : graph_.outputs) {
    Entry e = values[v];
    const ir::TensorMeta &m = *metas[v];
    if (!e.error && exactLayout && (e.tensor.sizes() != c10::IntArrayRef(m.sizes) ||
                                    e.tensor.scalar_type() != bridge::scalarType(m.dtype))) {
      // Only a value someone holds matters: an unused output of a kernel that disagrees with
      // its meta kernel (native_batch_norm's saved stats in eval mode) is harmless.
      uint32_t n = producer_[v];
      e = {at::Tensor(),
           std::make_shared<RemoteError>(RemoteError{
               graph_.nodes[n].op.str().str(),
               "produced " + ir::dtype::name(int8_t(e.tensor.scalar_type())) + "[" +
                   c10::Join(",", e.tensor.sizes()) + "] where its meta kernel promised " +
                   m.str() + "; this op's kernel on this device disagrees with its meta kernel",
               graph_.locations[graph_.nodes[n].loc], hash, n})};
      if (!first)
        first = e.error;
    }
    if (!e.error && exactLayout)
      e.tensor = restride(e.tensor, m);
    outputs.push_back(std::move(e));
  }
  return first;
}

} // namespace rgpu::server
