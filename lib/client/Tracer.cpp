//===- lib/client/Tracer.cpp - One boxed kernel records every aten op ------===//
//
// Every op on an rgpu tensor arrives here after autograd and functionalization, so it is always
// functional. The kernel runs the same op on meta tensors to learn output sizes, strides and
// dtype (shape errors raise right here, with PyTorch's own message, without contacting the
// server), then appends a node to the trace and returns lazy tensors for its outputs.
//
// The only per-op code is the table in `special()`: the ops that move data between the client
// and the server, and the ops whose output shape depends on data.
//
//===----------------------------------------------------------------------===//
#include "rgpu/client/Generator.h"
#include "rgpu/client/InplaceChecks.h"
#include "rgpu/client/KnownValues.h"
#include "rgpu/client/LazyTensor.h"
#include "rgpu/client/MetaKernels.h"
#include "rgpu/client/PinnedMemory.h"
#include "rgpu/client/Session.h"
#include "rgpu/bridge/Bridge.h"
#include "rgpu/ir/Bytes.h"
#include "rgpu/wire/Wire.h"

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <llvm/ADT/DenseMap.h>
#include <llvm/ADT/StringSet.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace rgpu::client {
namespace {

using ir::Arg;

/// The math bits of a tensor: conjugate (1) and negative (2), kept as CPU keeps them.
uint8_t mathBits(const c10::TensorImpl &t) { return (t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0); }
uint8_t mathBits(const at::Tensor &t) { return mathBits(*t.unsafeGetTensorImpl()); }

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
at::Tensor withMathBits(at::Tensor t, uint8_t bits) {
  if (bits & 1)
    t = at::_conj(t);
  if (bits & 2)
    t = at::_neg_view(t);
  return t;
}

at::Tensor makeLazy(Value v, const ir::TensorMeta &m, c10::DeviceIndex device, uint8_t bits = 0) {
  at::Tensor t = at::detail::make_tensor<LazyTensorImpl>(std::move(v), m, device);
  // The server's tensor carries the same bits: it ran the same `_conj`/`_neg_view` views.
  if (bits & 1)
    t.unsafeGetTensorImpl()->_set_conj(true);
  if (bits & 2)
    t.unsafeGetTensorImpl()->_set_neg(true);
  return t;
}

using bridge::metaOf;

/// Ops whose output shapes depend on tensor data. They cannot be traced ahead: the graph is cut
/// and the op runs on the server at once, which answers with the output shapes.
bool isDataDependent(llvm::StringRef name) {
  static const llvm::StringSet<> ops = {
      "aten::nonzero",           "aten::masked_select",       "aten::unique_consecutive",
      "aten::_unique",           "aten::_unique2",            "aten::unique_dim",
      "aten::unique_dim_consecutive", "aten::bincount",       "aten::repeat_interleave",
      "aten::_ctc_loss",
  };
  return ops.count(name) != 0;
}

/// A boolean-mask assignment whose value needs no count of the mask's true elements
/// (`x[mask] = 0.0`, top-k sampling's `logits[logits < v] = -inf`): its output has `self`'s
/// shape, so it is traced, and the server runs it as the CPU does. Only where the CPU could
/// raise nothing the server would raise later: one bool mask after only Nones, of exactly the
/// sizes of the dimensions it covers, and a value of self's dtype, of one element and at most
/// one dimension (which broadcasts to any count, zero too).
bool maskNeedsNoCount(llvm::StringRef name, c10::ArrayRef<c10::IValue> args) {
  if (name != "aten::index_put" && name != "aten::index_put_" &&
      name != "aten::_index_put_impl" && name != "aten::_index_put_impl_")
    return false;
  if (args.size() < 3 || !args[0].isTensor() || !args[1].isList() || !args[2].isTensor())
    return false;
  const at::Tensor &self = args[0].toTensor(), &values = args[2].toTensor();
  if (values.sym_numel() != 1 || values.dim() > 1 || values.scalar_type() != self.scalar_type())
    return false;
  int64_t at = 0;
  bool mask = false;
  for (const c10::IValue &item : args[1].toListRef()) {
    const bool none = item.isNone() || !item.toTensor().defined();
    if (mask)
      return false; // anything after the mask
    if (none) {
      ++at;
      continue;
    }
    const at::Tensor &m = item.toTensor();
    if (m.scalar_type() != at::kBool || at + m.dim() > self.dim())
      return false;
    for (int64_t d = 0; d < m.dim(); ++d)
      if (m.sym_sizes()[d] != self.sym_sizes()[at + d])
        return false;
    mask = true;
  }
  return mask;
}

/// Ops that produce layouts other than strided (sparse, mkldnn, quantized, nested). The server
/// holds strided tensors only, so they are refused at the call.
bool producesOtherLayouts(llvm::StringRef name) {
  name.consume_front("aten::");
  name = name.ltrim('_');
  return name.startswith("to_sparse") || name.startswith("sparse_") ||
         name.startswith("to_mkldnn") || name.startswith("mkldnn_") ||
         name.startswith("quantize_per") || name.startswith("nested_") ||
         name.startswith("make_per_") || name.startswith("coo_") || name.startswith("csr_");
}

/// The rgpu device index \p d names: its own, else the current device.
c10::DeviceIndex indexOf(const c10::Device &d) { return d.has_index() ? d.index() : currentDevice(); }

/// Ops whose tensors may be on different rgpu devices: copies between them, which the server
/// runs (the result is on the destination's device).
bool crossesDevices(llvm::StringRef name) { return name == "aten::copy"; }

/// Ops that accept CPU tensors with an rgpu self, as they do with CUDA: the CPU tensors are
/// uploaded (copy's source, the index tensors of indexing).
bool acceptsCpuTensors(llvm::StringRef name) {
  return name == "aten::copy" || name == "aten::index" || name == "aten::index_put" ||
         name == "aten::_index_put_impl";
}

/// What a meta call tells: output metas, flattened, and for each return of the op the length of
/// its list (-1 for a single tensor).
struct OpMetas {
  std::vector<ir::TensorMeta> outputs;
  std::vector<uint8_t> bits; ///< Each output's mathBits.
  std::vector<int32_t> listSizes;
};

/// Output metas by everything they can depend on: op, constant arguments, operand metas and math
/// bits, scalar types. Many ops' meta kernels are Python functions (torch's decompositions
/// registered for the Meta key), ~100 us a call; a training loop repeats the same calls every step.
class MetaCache {
public:
  const OpMetas *find(const std::string &key) const {
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : &it->second;
  }
  const OpMetas *insert(std::string key, OpMetas metas) {
    if (map_.size() >= kMaxEntries)
      map_.clear();
    return &map_.insert_or_assign(std::move(key), std::move(metas)).first->second;
  }

private:
  static constexpr size_t kMaxEntries = 1 << 16;
  std::unordered_map<std::string, OpMetas> map_;
};

MetaCache &metaCache() {
  static MetaCache cache; // used under the session lock
  return cache;
}

/// Ops whose output shape follows the values of their Scalar arguments.
bool shapeFollowsScalars(llvm::StringRef name) {
  return name == "aten::arange" || name == "aten::range" || name == "aten::linspace" ||
         name == "aten::logspace";
}

/// The value of a CPU 0-dim tensor. Python numbers arrive as double, int64, bool or complex
/// tensors, read here without a dispatch; other dtypes and math bits take item().
c10::Scalar cpuScalar(const at::Tensor &t) {
  if (t.is_conj() || t.is_neg())
    return t.item();
  const void *p = t.const_data_ptr();
  switch (t.scalar_type()) {
  case at::kDouble: return *static_cast<const double *>(p);
  case at::kLong: return *static_cast<const int64_t *>(p);
  case at::kBool: return *static_cast<const bool *>(p);
  case at::kComplexDouble: return *static_cast<const c10::complex<double> *>(p);
  default: return t.item();
  }
}

/// "aten::add.Tensor": the operator's name and overload.
std::string fullName(const c10::OperatorHandle &op) {
  const auto &n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

/// What the tracer asks of an operator, worked out once per operator: its interned name, the
/// tables above, and how to read each argument (its schema type, without casting types per op).
struct OpInfo {
  struct ArgInfo {
    bridge::ArgType type;
    bool optional;
    bridge::ArgType elem; ///< A list's element type.
    bool elemOptional;
  };
  c10::OperatorName name; ///< An operator registered after another was removed may reuse its
                          ///< schema's address: the name is compared too.
  ir::Symbol symbol;
  bool mutableSchema, otherLayouts, dataDependent, followsScalars, acceptsCpu,
      crossesDevices, viewOp;
  /// A view op, or the *_copy op functionalization runs for one.
  bool anyView;
  /// Draws random numbers (see ir::Node::random).
  bool random;
  /// Its results may be computed here (KnownValues.h).
  bool knowable;
  std::vector<ArgInfo> args;

  explicit OpInfo(const c10::OperatorHandle &op);
  static const OpInfo &of(const c10::OperatorHandle &op);
};

OpInfo::OpInfo(const c10::OperatorHandle &op) : name(op.operator_name()) {
  llvm::StringRef n = name.name;
  symbol = ir::Symbol::get(fullName(op));
  mutableSchema = op.schema().is_mutable();
  otherLayouts = producesOtherLayouts(n);
  dataDependent = isDataDependent(n);
  followsScalars = shapeFollowsScalars(n);
  acceptsCpu = acceptsCpuTensors(n);
  crossesDevices = rgpu::client::crossesDevices(n);
  const auto &returns = op.schema().returns();
  viewOp = !returns.empty() && returns[0].alias_info() && !returns[0].alias_info()->isWrite();
  anyView = viewOp || bridge::viewOf(name).has_value();
  random = bridge::drawsRandom(op);
  knowable = client::knowable(n);
  for (const c10::Argument &a : op.schema().arguments()) {
    c10::TypePtr type = a.type();
    ArgInfo info{};
    if (auto opt = type->cast<c10::OptionalType>()) {
      info.optional = true;
      type = opt->getElementType();
    }
    info.type = bridge::argType(type);
    if (info.type == bridge::ArgType::List) {
      c10::TypePtr elem = type->containedType(0);
      if (auto opt = elem->cast<c10::OptionalType>()) {
        info.elemOptional = true;
        elem = opt->getElementType();
      }
      info.elem = bridge::argType(elem);
    }
    args.push_back(info);
  }
}

const OpInfo &OpInfo::of(const c10::OperatorHandle &op) {
  static llvm::DenseMap<const void *, std::unique_ptr<OpInfo>> infos; // under the session lock
  std::unique_ptr<OpInfo> &info = infos[&op.schema()];
  if (!info || info->name != op.operator_name())
    info = std::make_unique<OpInfo>(op);
  return *info;
}

/// Records one op: collects its arguments into a TraceNode and a meta-device twin of the stack.
class Recorder {
public:
  Recorder(const c10::OperatorHandle &op, const OpInfo &info)
      : op_(op), info_(info), node_(new TraceNode) {
    node_->node.op = info.symbol;
    node_->node.random = info.random;
  }

  void addArgs(c10::ArrayRef<c10::IValue> args) {
    const auto &schema = op_.schema();
    meta_.reserve(args.size());
    for (size_t i = 0; i < args.size(); ++i)
      addArg(args[i], info_.args[i], schema.arguments()[i]);
    if (dataDependent && maskNeedsNoCount(info_.name.name, args))
      dataDependent = false;
  }

  bool dataDependent = false;

  /// The rgpu device of the op's outputs: the one its device argument names, else its first
  /// rgpu operand's, else the current device.
  c10::DeviceIndex outputDevice() const {
    return namedDevice_ >= 0 ? namedDevice_ : operandDevice_ >= 0 ? operandDevice_ : currentDevice();
  }

  /// Output metas, from the meta cache or computed on the meta device (valid until the next op
  /// is recorded). Null if the op's output shape depends on data (or it has no meta kernel), in
  /// which case the caller runs it on the server at once.
  const OpMetas *inferMetas() {
    if (dataDependent || info_.dataDependent)
      return nullptr;
    static std::string key; // under the session lock; keeps its capacity from op to op
    cacheKey(key);
    if (const OpMetas *hit = metaCache().find(key))
      return hit;
    std::string missed = key; // the meta call may trace again, and reuse `key`
    try {
      metaCall();
    } catch (const c10::NotImplementedError &) {
      return nullptr; // no meta kernel: the server will tell us the shapes
    } catch (const c10::Error &e) {
      std::string msg = e.what_without_backtrace();
      if (msg.find("data-dependent") != std::string::npos ||
          msg.find("data dependent") != std::string::npos ||
          msg.find("Cannot copy out of meta tensor") != std::string::npos ||
          msg.find("meta tensor") != std::string::npos)
        return nullptr;
      throw;
    }
    return metaCache().insert(std::move(missed), metasOf(meta_));
  }

  llvm::IntrusiveRefCntPtr<TraceNode> node() { return node_; }

private:
  /// The output metas of a meta call's \p results.
  OpMetas metasOf(const torch::jit::Stack &results) const {
    OpMetas outs;
    for (const c10::IValue &r : results) {
      auto checkLayout = [&](const at::Tensor &t) {
        TORCH_CHECK_NOT_IMPLEMENTED(!t.defined() || t.layout() == at::kStrided, "rgpu: ",
                                    fullName(op_), " returns a ", t.layout(),
                                    " tensor; rgpu supports strided tensors only");
      };
      if (r.isTensor())
        checkLayout(r.toTensor());
      if (r.isTensorList())
        for (const at::Tensor &t : r.toTensorList())
          checkLayout(t);
      if (r.isTensor()) {
        outs.outputs.push_back(metaOf(r.toTensor()));
        outs.bits.push_back(r.toTensor().defined() ? mathBits(r.toTensor()) : 0);
        outs.listSizes.push_back(-1);
      } else if (r.isTensorList()) {
        for (const at::Tensor &t : r.toTensorList()) {
          outs.outputs.push_back(metaOf(t));
          outs.bits.push_back(t.defined() ? mathBits(t) : 0);
        }
        outs.listSizes.push_back(int32_t(r.toTensorList().size()));
      } else {
        TORCH_CHECK_NOT_IMPLEMENTED(false, "rgpu: ", fullName(op_),
                                    " returns a non-tensor value, which rgpu cannot trace");
      }
    }
    return outs;
  }

  void cacheKey(std::string &key) const {
    key.clear();
    ir::ByteWriter writer(key);
    auto put = [&](const void *p, size_t n) { writer.write(p, n); };
    auto putMeta = [&](const ir::TensorMeta &m) {
      put(&m.dtype, 1);
      uint32_t rank = m.sizes.size();
      put(&rank, 4);
      put(m.sizes.data(), rank * 8);
      put(m.strides.data(), rank * 8);
    };
    const ir::Node &n = node_->node;
    uint32_t op = n.op.id();
    put(&op, 4);
    for (const Arg &a : n.args) {
      put(&a.kind, 1);
      put(&a.i, 8);
      put(&a.d, 8);
    }
    for (const std::string &s : n.strings)
      put(s.c_str(), s.size() + 1);
    for (const ir::TensorMeta &m : operandMetas_)
      putMeta(m);
    put(operandBits_.data(), operandBits_.size());
    for (const ir::ScalarSlot &s : node_->scalarSlots) {
      put(&s.dtype, 1);
      put(&s.form, 1);
    }
    bool values = info_.followsScalars;
    for (const ir::ScalarValue &v : node_->scalarValues) {
      put(&v.kind, 1);
      if (values) {
        put(&v.i, 8);
        put(&v.d, 8);
        put(&v.imag, 8);
      }
    }
    writer.finish();
  }

  /// Runs the op on the meta twins. A functionalized view (`transpose_copy`) gets the strides of
  /// the view itself, as CPU eager would give it; the server runs it as that view, so tensors
  /// keep CPU's layouts (a transposed result downloads transposed, is_contiguous() agrees).
  void metaCall() {
    makeTwins();
    if (auto handle = bridge::viewOf(op_.operator_name())) {
      torch::jit::Stack twin = meta_;
      try {
        handle->callBoxed(twin);
        for (c10::IValue &r : twin) {
          // A view's result aliases its input; the value rgpu holds is a fresh tensor with
          // the same sizes, strides and math bits.
          mapTensors(r, [](const at::Tensor &t) {
            return withMathBits(at::empty_strided(t.sizes(), t.strides(), t.options()),
                                mathBits(t));
          });
        }
        meta_ = std::move(twin);
        return;
      } catch (const c10::Error &) {
        // e.g. view() on strides it cannot view: the copy's own layout is right then.
      }
    }
    if (!cppMetaCall())
      op_.callBoxed(meta_);
  }

  /// Runs the op with ATen's C++ meta kernel where one is bound (MetaKernels.h). Its errors are
  /// CPU eager's own: they propagate.
  bool cppMetaCall() {
    if (!checkCppMetas())
      return callCppMeta(op_, meta_);
    torch::jit::Stack slow = meta_;
    if (!callCppMeta(op_, meta_))
      return false;
    std::string diff;
    try {
      op_.callBoxed(slow);
      diff = compareOutputs(meta_, slow);
    } catch (const std::exception &e) {
      diff = std::string("the dispatcher's raised: ") + e.what();
      diff = diff.substr(0, diff.find('\n'));
    }
    if (!diff.empty())
      noteCppMetaDisagreement(fullName(op_) + ": " + diff);
    return true;
  }

  /// Where the outputs of two meta calls differ in sizes, strides, dtype or math bits; empty if
  /// nowhere.
  std::string compareOutputs(const torch::jit::Stack &a, const torch::jit::Stack &b) const {
    OpMetas x = metasOf(a), y = metasOf(b);
    if (x.listSizes != y.listSizes)
      return "the outputs differ in number";
    for (size_t i = 0; i < x.outputs.size(); ++i)
      if (x.outputs[i] != y.outputs[i] || x.bits[i] != y.bits[i])
        return "output " + std::to_string(i) + ": " + x.outputs[i].str() + " bits " +
               std::to_string(x.bits[i]) + " against " + y.outputs[i].str() + " bits " +
               std::to_string(y.bits[i]);
    return "";
  }

  void addArg(const c10::IValue &v, const OpInfo::ArgInfo &info, const c10::Argument &sa) {
    if (info.optional && v.isNone()) {
      push(Arg::none(), v);
      return;
    }
    switch (info.type) {
    case bridge::ArgType::Tensor:
      addTensor(v.toTensor(), sa.name());
      return;
    case bridge::ArgType::Number:
      addScalar(v.toScalar(), ir::ScalarForm::Scalar, v);
      return;
    case bridge::ArgType::Device: {
      c10::Device d = v.toDevice();
      if (d.is_privateuseone()) { // "rgpu" is the current device: named, so graphs agree
        d = c10::Device(d.type(), indexOf(d));
        namedDevice_ = d.index();
      }
      node_->node.args.push_back(Arg::ref(Arg::Kind::Device, node_->node.strings.size()));
      node_->node.strings.push_back(d.str());
      meta_.emplace_back(c10::Device(at::kMeta));
      return;
    }
    case bridge::ArgType::Generator: {
      // The generator's id rides in a scalar slot: one graph serves every generator.
      at::Generator g = v.toGenerator();
      auto *rg = dynamic_cast<RgpuGenerator *>(g.unsafeGetGeneratorImpl());
      TORCH_CHECK_TYPE(rg, "rgpu: ", fullName(op_), " was given a generator of device ",
                       g.device(), "; ops on rgpu tensors draw from an rgpu generator "
                       "(torch.Generator(device=\"rgpu\")), or without generator= from the "
                       "session's, seeded by torch.manual_seed");
      ir::ScalarValue id;
      id.kind = ir::ScalarValue::Kind::Int;
      id.i = int64_t(rg->id());
      node_->node.args.push_back(Arg::ref(Arg::Kind::Scalar, node_->scalarSlots.size()));
      node_->scalarSlots.push_back({ir::dtype::Long, ir::ScalarForm::Generator});
      node_->scalarValues.push_back(id);
      meta_.emplace_back(); // the meta kernel draws nothing
      return;
    }
    case bridge::ArgType::List:
      addList(v, info, sa);
      return;
    default:
      push(constant(v, info.type, sa), v);
    }
  }

  Arg constant(const c10::IValue &v, bridge::ArgType type, const c10::Argument &sa) {
    switch (bridge::constantKind(type)) {
    case Arg::Kind::Int:
      return Arg::integer(v.isSymInt() ? v.toSymInt().expect_int() : v.toInt());
    case Arg::Kind::Double:
      return Arg::real(v.toDouble());
    case Arg::Kind::Bool:
      return Arg::boolean(v.isSymBool() ? v.toSymBool().guard_bool(__FILE__, __LINE__) : v.toBool());
    case Arg::Kind::Str:
      node_->node.strings.push_back(v.toStringRef());
      return Arg::ref(Arg::Kind::Str, node_->node.strings.size() - 1);
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "rgpu cannot carry argument '", sa.name(), "' of type ",
                                  sa.type()->str(), " of ", fullName(op_));
    }
  }

  void push(Arg a, const c10::IValue &metaValue) {
    node_->node.args.push_back(a);
    meta_.push_back(metaValue);
  }

  void addList(const c10::IValue &v, const OpInfo::ArgInfo &info, const c10::Argument &sa) {
    const std::string &argName = sa.name();
    bool optional = info.elemOptional;
    if (info.elem == bridge::ArgType::Tensor) {
      // Tensor[] or Tensor?[]: each element becomes an operand (or None).
      auto items = v.toListRef();
      node_->node.args.push_back(Arg::ref(Arg::Kind::List, items.size()));
      llvm::SmallVector<int32_t, 4> operands;
      if (!optional) {
        for (const c10::IValue &item : items)
          operands.push_back(operand(item.toTensor(), argName));
        defer(Deferred::List, std::move(operands));
        return;
      }
      for (const c10::IValue &item : items) {
        if (item.isNone() || !item.toTensor().defined()) {
          node_->node.args.push_back(Arg::none());
          operands.push_back(-1);
          continue;
        }
        const at::Tensor &t = item.toTensor();
        if (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte)
          dataDependent = true; // boolean mask indexing: the result size is the mask's count
        operands.push_back(operand(t, argName));
      }
      defer(Deferred::OptionalList, std::move(operands));
      return;
    }
    if (info.elem == bridge::ArgType::Number) {
      auto items = v.toListRef();
      node_->node.args.push_back(Arg::ref(Arg::Kind::List, items.size()));
      for (const c10::IValue &item : items)
        liftScalar(item.toScalar(), ir::ScalarForm::Scalar);
      meta_.push_back(v);
      return;
    }
    std::vector<c10::IValue> items;
    if (v.isIntList()) {
      for (int64_t i : v.toIntList())
        items.emplace_back(i);
    } else {
      for (const c10::IValue &i : v.toListRef())
        items.push_back(i);
    }
    node_->node.args.push_back(Arg::ref(Arg::Kind::List, items.size()));
    for (const c10::IValue &item : items)
      node_->node.args.push_back(constant(item, info.elem, sa));
    meta_.push_back(v);
  }

  void addTensor(const at::Tensor &t, const std::string &argName) {
    if (!t.defined()) {
      push(Arg::none(), c10::IValue());
      return;
    }
    if (!lazyImpl(t) && t.device().is_cpu() && t.dim() == 0 && !info_.acceptsCpu) {
      // A Python number (wrapped) or a CPU scalar tensor: lifted, so its value is not hashed.
      addScalar(cpuScalar(t), t.unsafeGetTensorImpl()->is_wrapped_number() ? ir::ScalarForm::WrappedNumber
                                                                       : ir::ScalarForm::Tensor0d,
                t, t.scalar_type());
      return;
    }
    defer(Deferred::One, {operand(t, argName)});
  }

  /// A slot of the meta stack whose twins are made on a miss (makeTwins).
  struct Deferred {
    enum Kind { One, List, OptionalList } kind;
    size_t slot;
    llvm::SmallVector<int32_t, 4> operands; ///< -1: None, in an optional list.
  };
  void defer(Deferred::Kind kind, llvm::SmallVector<int32_t, 4> operands) {
    deferred_.push_back({kind, meta_.size(), std::move(operands)});
    meta_.emplace_back();
  }

  /// Appends \p t as an operand and returns its index.
  int32_t operand(const at::Tensor &t, const std::string &argName) {
    Value v;
    ir::TensorMeta meta;
    uint8_t bits = 0;
    if (LazyTensorImpl *impl = lazyImpl(t)) {
      v = impl->value;
      Session::get().checkCurrent(v);
      meta = impl->meta();
      bits = mathBits(*impl);
      c10::DeviceIndex d = impl->device().index();
      TORCH_CHECK(operandDevice_ < 0 || d == operandDevice_ || info_.crossesDevices,
                  "Expected all tensors to be on the same device, but found at least two "
                  "devices, rgpu:", int(operandDevice_), " and rgpu:", int(d),
                  "! (when checking argument '", argName, "' of ", fullName(op_), ")");
      if (operandDevice_ < 0)
        operandDevice_ = d;
    } else if (t.device().is_cpu() && info_.acceptsCpu) {
      v = Session::get().upload(t, meta, outputDevice());
    } else {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                  "devices, rgpu:", int(outputDevice()), " and ", t.device(),
                  "! (when checking argument '", argName,
                  "' of ", fullName(op_), ")");
    }
    node_->node.args.push_back(Arg::ref(Arg::Kind::Tensor, node_->inputs.size()));
    node_->inputs.push_back(std::move(v));
    operandMetas_.push_back(std::move(meta));
    operandBits_.push_back(char(bits));
    return int32_t(operandMetas_.size() - 1);
  }

  /// The meta twin of operand \p k.
  at::Tensor twin(int32_t k) const {
    const ir::TensorMeta &meta = operandMetas_[k];
    return withMathBits(at::empty_strided(meta.sizes, meta.strides,
                                          at::TensorOptions()
                                              .dtype(static_cast<c10::ScalarType>(meta.dtype))
                                              .device(at::kMeta)),
                        operandBits_[k]);
  }

  /// Puts the operands' meta twins into the meta stack (only a meta cache miss needs them).
  void makeTwins() {
    for (const Deferred &d : deferred_) {
      c10::IValue &slot = meta_[d.slot];
      if (d.kind == Deferred::One) {
        slot = twin(d.operands[0]);
      } else if (d.kind == Deferred::List) {
        std::vector<at::Tensor> list;
        for (int32_t k : d.operands)
          list.push_back(twin(k));
        slot = list;
      } else {
        c10::List<std::optional<at::Tensor>> list;
        for (int32_t k : d.operands)
          list.push_back(k < 0 ? std::optional<at::Tensor>() : twin(k));
        slot = list;
      }
    }
    deferred_.clear();
  }

  void addScalar(const c10::Scalar &s, ir::ScalarForm form, const c10::IValue &metaValue,
                 std::optional<at::ScalarType> dtype = std::nullopt) {
    liftScalar(s, form, dtype);
    meta_.push_back(metaValue);
  }

  void liftScalar(const c10::Scalar &s, ir::ScalarForm form,
                  std::optional<at::ScalarType> dtype = std::nullopt) {
    ir::ScalarValue value;
    if (s.isComplex()) {
      value.kind = ir::ScalarValue::Kind::Complex;
      auto c = s.toComplexDouble();
      value.d = c.real();
      value.imag = c.imag();
    } else if (s.isBoolean()) {
      value.kind = ir::ScalarValue::Kind::Bool;
      value.i = s.toBool();
    } else if (s.isIntegral(false)) {
      value.kind = ir::ScalarValue::Kind::Int;
      value.i = s.toLong();
    } else {
      value.kind = ir::ScalarValue::Kind::Double;
      value.d = s.toDouble();
    }
    node_->node.args.push_back(Arg::ref(Arg::Kind::Scalar, node_->scalarSlots.size()));
    node_->scalarSlots.push_back({static_cast<int8_t>(dtype.value_or(s.type())), form});
    node_->scalarValues.push_back(value);
  }

  const c10::OperatorHandle &op_;
  const OpInfo &info_;
  llvm::IntrusiveRefCntPtr<TraceNode> node_;
  torch::jit::Stack meta_; ///< The op's arguments for its meta kernel.
  llvm::SmallVector<Deferred, 3> deferred_;
  llvm::SmallVector<ir::TensorMeta, 3> operandMetas_;
  std::string operandBits_; ///< Each operand's mathBits, for the meta cache key.
  c10::DeviceIndex namedDevice_ = -1, operandDevice_ = -1;
};

/// Refuses a write, below functionalization, into a tensor that a view op made there: that
/// tensor is a copy, and the write would not reach the tensor it views.
void checkWritable(const LazyTensorImpl &target, const c10::OperatorHandle &op) {
  TORCH_CHECK(!target.rawView, "rgpu: ", fullName(op), " writes into a view made inside a "
              "composite kernel that runs after functionalization, where the write would not "
              "reach the viewed tensor. An op outside aten defined after rgpu tensors existed "
              "runs so until rgpu's next traced op; its later calls run correctly.");
}

/// Wraps outputs for the user unless we are already inside functionalization (which wraps them
/// itself). Factories reach the backend directly, so their results are wrapped here.
at::Tensor forUser(at::Tensor t) {
  if (!t.defined() || c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Functionalize))
    return t;
  return at::functionalization::impl::to_functional_tensor(t);
}

at::Tensor download(const at::Tensor &t) {
  LazyTensorImpl *impl = lazyImpl(t);
  return Session::get().download(impl, impl->downloadLayout());
}

/// The special cases. Returns true if it handled the op.
bool special(llvm::StringRef name, const c10::OperatorHandle &op, torch::jit::Stack *stack) {
  const size_t nargs = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, nargs);

  // Download: .item(), bool(), and everything that reads one value.
  if (name == "aten::_local_scalar_dense") {
    c10::Scalar s = download(args[0].toTensor()).item();
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(s);
    return true;
  }
  // torch.equal answers a Python bool: same sizes, then an all-equal reduction read back.
  if (name == "aten::equal") {
    const at::Tensor &a = args[0].toTensor(), &b = args[1].toTensor();
    bool same = a.sizes() == b.sizes() && (a == b).all().item<bool>();
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(same);
    return true;
  }
  // Download: .cpu(), .to("cpu"), .tolist(), printing.
  if (name == "aten::_to_copy") {
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
  if (name == "aten::_copy_from" || name == "aten::_copy_from_and_resize") {
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
    if (name == "aten::_copy_from_and_resize")
      dst.resize_(cpu.sizes());
    dst.copy_(cpu);
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(dst);
    return true;
  }
  // Upload: x.to("rgpu") is empty() followed by copy() from the CPU tensor. When the copy
  // replaces the whole tensor, the uploaded data is the result.
  if (name == "aten::copy") {
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

/// A backend nothing registers kernels for: an op's entry for it is the op's composite kernel,
/// whatever kernels it has for CPU or CUDA.
constexpr c10::DispatchKey kCompositeEntry = c10::DispatchKey::PrivateUse3;

/// A mutation that reached the backend from inside a composite kernel (functionalization is
/// switched off there): functionalize it here. Its tensors are wrapped, the op is dispatched
/// again with functionalization on, and each mutated argument takes the resulting value.
/// With \p composite, the op's composite kernel runs instead (see CustomOps), with the wrapped
/// tensors, so every op inside it is functionalized.
void functionalizeHere(const c10::OperatorHandle &op, torch::jit::Stack *stack,
                       bool composite = false) {
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

/// The functional form of the in-place op functionalization just checked gives its result the
/// layout the in-place op keeps (InplaceChecks.h).
void keepInplaceLayout(const c10::OperatorHandle &op, llvm::SmallVectorImpl<ir::TensorMeta> &outputs) {
  if (outputs.empty())
    return;
  if (auto strides = inplaceLayout().take(op.operator_name(), outputs[0].sizes,
                                          bridge::scalarType(outputs[0].dtype)))
    outputs[0].strides.assign(strides->begin(), strides->end());
}

/// True for a call whose tensors are meta tensors carrying rgpu's dispatch keys: fake tensors
/// (dynamo, torch.compile) that describe rgpu tensors. They compute metadata only.
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

void compositeAboveFunctionalization(const c10::OperatorHandle &op, torch::jit::Stack *stack);

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

void fallback(const c10::OperatorHandle &op, torch::jit::Stack *stack) {
  CustomOps::get().registerPending();
  if (isFakeCall(op, *stack))
    return op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  inplaceLayout().traced();
  Session &session = Session::get();
  // The user's line is found before taking the session lock: finding it takes the GIL.
  uint32_t location = session.currentLocation();
  Session::Lock lock(session);
  const auto &schema = op.schema();
  const OpInfo &info = OpInfo::of(op);
  if (special(op.operator_name().name, op, stack))
    return;
  TORCH_CHECK_NOT_IMPLEMENTED(!info.otherLayouts, "rgpu: ", fullName(op),
                              " makes a non-strided tensor; rgpu supports strided tensors only");
  if (info.mutableSchema)
    return functionalizeHere(op, stack);

  const size_t nargs = schema.arguments().size();
  Recorder rec(op, info);
  rec.addArgs(torch::jit::last(*stack, nargs));
  const OpMetas *traced = rec.inferMetas();
  const c10::DeviceIndex device = rec.outputDevice();
  llvm::IntrusiveRefCntPtr<TraceNode> node = rec.node();
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

/// The kernel CustomOps gives an op outside aten: its composite kernel, run with
/// functionalization on. The server runs aten ops only, so an op without one (kernels for CPU
/// or CUDA only) cannot run on rgpu.
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

thread_local c10::DeviceIndex tlsDevice = 0;

/// rgpu's devices are the server's (--devices); the current one is per thread, as CUDA's is.
/// There are no streams: one per device, in order; every stream asked for is that one.
struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {type(), tlsDevice}; }
  void setDevice(c10::Device d) const override { uncheckedSetDevice(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index())
      tlsDevice = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  // Every stream is the device's one stream: work runs in trace order, which is at least as
  // ordered as any streams a program asks for.
  c10::Stream getDefaultStream(c10::Device d) const override { return getStream(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getStream(d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  bool queryStream(const c10::Stream &) const override {
    Session::get().synchronize();
    return true;
  }
  void synchronizeStream(const c10::Stream &) const override { Session::get().synchronize(); }
  /// Until this process starts its session, the most devices a server may have: torch's
  /// autograd engine sizes its device threads by this at the first backward, a CPU one too,
  /// which must not start a session (nor fail for want of a server).
  c10::DeviceIndex deviceCount() const noexcept override {
    return Session::get().started() ? c10::DeviceIndex(Session::get().deviceCount())
                                    : c10::DeviceIndex(wire::kMaxDevices);
  }
  // An event marks a point of the trace; waiting for it waits for everything traced so far
  // (a superset of what came before it). There is no device clock to time it by.
  void record(void **, const c10::Stream &, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void *, const c10::Stream &) const override {}
  bool queryEvent(void *) const override {
    Session::get().synchronize();
    return true;
  }
  void synchronizeEvent(void *) const override { Session::get().synchronize(); }
  double elapsedTime(void *, void *, const c10::DeviceIndex) const override {
    TORCH_CHECK_NOT_IMPLEMENTED(
        false, "rgpu: Event.elapsed_time is not supported (rgpu has no device clock); time "
        "with time.perf_counter() around torch.rgpu.synchronize(), or read the server's "
        "execute_ms in rgpu.server_stats()[\"session\"]");
  }
  void destroyEvent(void *, const c10::DeviceIndex) const noexcept override {}
  void synchronizeDevice(const c10::DeviceIndex) const override { Session::get().synchronize(); }
};

/// What PyTorch asks of an accelerator backend (the autograd engine asks before running
/// backward on rgpu tensors). rgpu's generator lives on the server; the client-side one
/// exists only to satisfy callers that ask for a default generator and never draws.
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return c10::DeviceIndex(Session::get().deviceCount()); }
  c10::DeviceIndex getCurrentDevice() const override { return tlsDevice; }
  const at::Generator &getDefaultGenerator(c10::DeviceIndex) const override {
    static at::Generator generator = at::make_generator<at::CPUGeneratorImpl>();
    return generator;
  }
  /// torch.Generator(device="rgpu"): seeded as CPU's and CUDA's new generators are.
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return RgpuGenerator::make(device < 0 ? tlsDevice : device, c10::default_rng_seed_val);
  }
  at::Device getDeviceFromPtr(void *) const override { return {c10::DeviceType::PrivateUse1, tlsDevice}; }
  bool isPinnedPtr(const void *p) const override { return isPinned(p); }
  at::Allocator *getPinnedMemoryAllocator() const override { return pinnedAllocator(); }
};

const bool hooksRegistered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

/// rgpu's bytes live on the server: nothing allocates them here. Code that asks for the
/// device's allocator (`torch.UntypedStorage(n, device="rgpu")`) gets a clear error, not a
/// null allocator.
/// It is also rgpu's DeviceAllocator for torch.accelerator's memory functions, which the
/// server answers (Session::deviceMemory, one round trip each), as torch.rgpu's do.
struct NoAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    TORCH_CHECK_NOT_IMPLEMENTED(n == 0, "rgpu: a storage of ", n, " bytes cannot be allocated on "
                                "the client; rgpu tensors are made by ops (torch.empty(..., "
                                "device=\"rgpu\"), tensor.to(\"rgpu\")), and their bytes live on "
                                "the server");
    return {nullptr, nullptr, &deleteNothing, c10::Device(c10::DeviceType::PrivateUse1, tlsDevice)};
  }
  void copy_data(void *, const void *, std::size_t count) const override {
    TORCH_CHECK_NOT_IMPLEMENTED(count == 0, "rgpu: bytes on the server cannot be copied here");
  }
  static void deleteNothing(void *) {}

  /// As CUDA's allocator before CUDA starts: until this process starts its session, the server
  /// holds nothing of it, and torch.accelerator's memory functions do nothing (frameworks call
  /// them when they train on the CPU too).
  bool initialized() override { return Session::get().started(); }
  void emptyCache(c10::MempoolId_t) override {
    for (int d = 0, n = Session::get().deviceCount(); d < n; ++d)
      Session::get().deviceMemory(d, false, true);
  }
  void recordStream(const c10::DataPtr &, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    DeviceMemory m = Session::get().deviceMemory(device < 0 ? tlsDevice : device);
    c10::CachingDeviceAllocator::DeviceStats stats;
    auto &allocated = stats.allocated_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)];
    allocated.current = int64_t(m.allocated);
    allocated.peak = int64_t(m.allocatedPeak);
    auto &reserved = stats.reserved_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)];
    reserved.current = int64_t(m.reserved);
    reserved.peak = int64_t(m.reservedPeak);
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex device) override {
    Session::get().deviceMemory(device < 0 ? tlsDevice : device, true);
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    DeviceMemory m = Session::get().deviceMemory(device < 0 ? tlsDevice : device);
    return {size_t(m.free), size_t(m.total)};
  }
};
NoAllocator noAllocator;
const bool allocatorRegistered = [] {
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &noAllocator);
  return true;
}();

} // namespace

c10::DeviceIndex currentDevice() { return tlsDevice; }
void setCurrentDevice(c10::DeviceIndex index) { tlsDevice = index; }

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

/// CompositeImplicitAutograd ops decompose above autograd, into several ops each traced on its
/// own: linear on a 3-d input is a view, a transpose, addmm and another view, four trips
/// through autograd, functionalization and the tracer, and four nodes for the server. Under
/// torch.no_grad (inference, generation) nothing needs the decomposition, so these ops are
/// recorded whole there, and the server runs the op itself. Only ops whose result never
/// aliases an argument and which write nothing are listed (not einsum, which may answer a
/// view, nor batch_norm, which writes its running statistics).
/// repeat_interleave with an integer count is two views, a clone and a view; recorded whole,
/// its output length would no longer be tied to its input's in a symbolic graph (Inductor then
/// compiles it for one length), so its composite runs below functionalization instead, where
/// the views are traced as views without a wrapper, a meta twin or autograd's bookkeeping.
void registerWholeWithoutGrad(torch::Library &backend) {
  static torch::Library *autograd = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1, __FILE__, __LINE__);
  auto &dispatcher = c10::Dispatcher::singleton();
  struct Listed {
    const char *name, *overload;
    bool whole; ///< one node; else the composite runs below functionalization
  };
  const Listed ops[] = {{"linear", "", true},     {"matmul", "", true},
                        {"layer_norm", "", true}, {"group_norm", "", true},
                        {"bilinear", "", true},   {"repeat_interleave", "self_int", false}};
  for (const Listed &l : ops) {
    auto op = dispatcher.findOp({std::string("aten::") + l.name, l.overload});
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::AutogradPrivateUse1))
      continue;
    // Taken before the registrations below change what rgpu's autograd key computes to.
    c10::SafeKernelFunction composite =
        op->getComputedKernelForDispatchKey(c10::DispatchKey::AutogradPrivateUse1);
    const std::string name = *l.overload ? std::string(l.name) + "." + l.overload : l.name;
    autograd->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                     std::make_unique<WholeWithoutGrad>(std::move(composite))));
    if (l.whole)
      backend.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

void registerWholeOps() {
  CustomOps::get().registerPending(); // installs the listener; ops defined so far are noted
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

/// An op that would make a sparse or quantized rgpu tensor (nn.Embedding(sparse=True)'s
/// backward, torch.sparse_coo_tensor(..., device="rgpu")): refused by name, not with the
/// dispatcher's "Could not run ... with arguments from the 'Sparsergpu' backend".
void refuseOtherLayouts(const c10::OperatorHandle &op, torch::jit::Stack *) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "rgpu: ", fullName(op), " would make a sparse or quantized "
                              "tensor; rgpu supports strided tensors only (for an embedding, "
                              "use sparse=False: its gradient is then dense)");
}

} // namespace rgpu::client

C10_REGISTER_GUARD_IMPL(PrivateUse1, rgpu::client::GuardImpl);

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
