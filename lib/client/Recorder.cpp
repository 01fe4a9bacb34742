#include "Recorder.h"

#include "rgpu/client/Generator.h"
#include "rgpu/client/KnownValues.h"
#include "rgpu/client/MetaKernels.h"
#include "rgpu/client/Session.h"
#include "rgpu/ir/Bytes.h"
#include "rgpu/ir/Error.h"

#include <ATen/ATen.h>

#include <llvm/ADT/DenseMap.h>

#include <unordered_map>

namespace rgpu::client {
namespace {

using ir::Arg;

using bridge::metaOf;

/// A boolean-mask assignment whose value needs no count of the mask's true elements
/// (`x[mask] = 0.0`, top-k sampling's `logits[logits < v] = -inf`): its output has `self`'s
/// shape, so it is traced, and the server runs it as the CPU does. Only where the CPU could
/// raise nothing the server would raise later: one bool mask after only Nones, of exactly the
/// sizes of the dimensions it covers, and a value of self's dtype, of one element and at most
/// one dimension (which broadcasts to any count, zero too).
bool maskNeedsNoCount(c10::ArrayRef<c10::IValue> args) {
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
    if (dataDependent && info_.maskAssignment && maskNeedsNoCount(args))
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
      diff = message(sameOutputs(meta_, slow));
    } catch (const std::exception &e) {
      diff = std::string("the dispatcher's raised: ") + e.what();
      diff = diff.substr(0, diff.find('\n'));
    }
    if (!diff.empty())
      noteCppMetaDisagreement(fullName(op_) + ": " + diff);
    return true;
  }

  /// Fails, saying where, if the outputs of two meta calls differ in sizes, strides, dtype or
  /// math bits.
  llvm::Error sameOutputs(const torch::jit::Stack &a, const torch::jit::Stack &b) const {
    OpMetas x = metasOf(a), y = metasOf(b);
    if (x.listSizes != y.listSizes)
      return failure("the outputs differ in number");
    for (size_t i = 0; i < x.outputs.size(); ++i)
      if (x.outputs[i] != y.outputs[i] || x.bits[i] != y.bits[i])
        return failure("output " + std::to_string(i) + ": " + x.outputs[i].str() + " bits " +
                       std::to_string(x.bits[i]) + " against " + y.outputs[i].str() + " bits " +
                       std::to_string(y.bits[i]));
    return llvm::Error::success();
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

} // namespace

OpInfo::OpInfo(const c10::OperatorHandle &op) : name(op.operator_name()) {
  llvm::StringRef n = name.name;
  symbol = ir::Symbol::get(fullName(op));
  mutableSchema = op.schema().is_mutable();
  const ir::OpFacts facts = ir::opFacts(n);
  otherLayouts = facts.has(ir::OpFact::OtherLayout);
  dataDependent = facts.has(ir::OpFact::DataDependent);
  maskAssignment = facts.has(ir::OpFact::MaskAssignment);
  followsScalars = facts.has(ir::OpFact::ShapeFollowsScalars);
  acceptsCpu = facts.has(ir::OpFact::AcceptsCpuTensors);
  crossesDevices = facts.has(ir::OpFact::CrossesDevices);
  special = ir::specialOp(n);
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

Recording record(const c10::OperatorHandle &op, const OpInfo &info,
                 c10::ArrayRef<c10::IValue> args) {
  Recorder rec(op, info);
  rec.addArgs(args);
  const OpMetas *metas = rec.inferMetas();
  return {rec.node(), metas, rec.outputDevice()};
}

} // namespace rgpu::client
