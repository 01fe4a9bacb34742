#include "rgpu/wire/Wire.h"

namespace rgpu::wire {

namespace {
template <typename Vec, typename List> void copyList(Vec &out, List in) {
  out.clear();
  out.reserve(in.size());
  for (auto v : in)
    out.push_back(v);
}
} // namespace

capnp::ReaderOptions readerOptions(const Limits &limits, uint64_t frameBytes, bool packed) {
  capnp::ReaderOptions o;
  uint64_t bytes = packed ? std::min(limits.maxFrameBytes, 64 * frameBytes + (1u << 20))
                          : 2 * frameBytes;
  o.traversalLimitInWords = bytes / sizeof(capnp::word) + 1024;
  o.nestingLimit = limits.nestingLimit;
  return o;
}

void encodeMeta(const ir::TensorMeta &m, TensorMeta::Builder b) {
  b.setDtype(m.dtype);
  auto sizes = b.initSizes(m.sizes.size());
  for (size_t i = 0; i < m.sizes.size(); ++i)
    sizes.set(i, m.sizes[i]);
  auto strides = b.initStrides(m.strides.size());
  for (size_t i = 0; i < m.strides.size(); ++i)
    strides.set(i, m.strides[i]);
}

bool decodeMeta(TensorMeta::Reader r, ir::TensorMeta &m) {
  m.dtype = r.getDtype();
  auto sizes = r.getSizes();
  auto strides = r.getStrides();
  if (!ir::dtype::isValid(m.dtype) || sizes.size() != strides.size() || sizes.size() > 64)
    return false;
  copyList(m.sizes, sizes);
  copyList(m.strides, strides);
  for (int64_t s : m.sizes)
    if (s < 0)
      return false;
  for (int64_t s : m.strides)
    if (s < 0)
      return false;
  return true;
}

void encodeScalar(const ir::ScalarValue &v, ScalarValue::Builder b) {
  switch (v.kind) {
  case ir::ScalarValue::Kind::Int: b.setInt(v.i); break;
  case ir::ScalarValue::Kind::Double: b.setDouble(v.d); break;
  case ir::ScalarValue::Kind::Bool: b.setBool(v.i != 0); break;
  case ir::ScalarValue::Kind::Complex: {
    auto c = b.initComplex();
    c.setReal(v.d);
    c.setImag(v.imag);
    break;
  }
  }
}

ir::ScalarValue decodeScalar(ScalarValue::Reader r) {
  ir::ScalarValue v;
  switch (r.which()) {
  case ScalarValue::INT: v.kind = ir::ScalarValue::Kind::Int; v.i = r.getInt(); break;
  case ScalarValue::DOUBLE: v.kind = ir::ScalarValue::Kind::Double; v.d = r.getDouble(); break;
  case ScalarValue::BOOL: v.kind = ir::ScalarValue::Kind::Bool; v.i = r.getBool(); break;
  case ScalarValue::COMPLEX:
    v.kind = ir::ScalarValue::Kind::Complex;
    v.d = r.getComplex().getReal();
    v.imag = r.getComplex().getImag();
    break;
  }
  return v;
}

void encodeGraph(const ir::Graph &g, Graph::Builder b) {
  auto inputs = b.initInputs(g.inputs.size());
  for (size_t i = 0; i < g.inputs.size(); ++i)
    encodeMeta(g.inputs[i], inputs[i]);
  auto scalars = b.initScalars(g.scalars.size());
  for (size_t i = 0; i < g.scalars.size(); ++i) {
    scalars[i].setDtype(g.scalars[i].dtype);
    scalars[i].setForm(wire::ScalarForm(g.scalars[i].form));
  }
  auto nodes = b.initNodes(g.nodes.size());
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    const ir::Node &node = g.nodes[n];
    auto nb = nodes[n];
    nb.setOp(node.op.str().str());
    auto args = nb.initArgs(node.args.size());
    for (size_t a = 0; a < node.args.size(); ++a) {
      const ir::Arg &arg = node.args[a];
      auto ab = args[a];
      switch (arg.kind) {
      case ir::Arg::Kind::None: ab.setNone(); break;
      case ir::Arg::Kind::Bool: ab.setBool(arg.i != 0); break;
      case ir::Arg::Kind::Int: ab.setInt(arg.i); break;
      case ir::Arg::Kind::Double: ab.setDouble(arg.d); break;
      case ir::Arg::Kind::Str: ab.setStr(node.strings[arg.i]); break;
      case ir::Arg::Kind::Device: ab.setDevice(node.strings[arg.i]); break;
      case ir::Arg::Kind::Tensor: ab.setTensor(arg.i); break;
      case ir::Arg::Kind::Scalar: ab.setScalar(arg.i); break;
      case ir::Arg::Kind::List: ab.setList(arg.i); break;
      }
    }
    auto operands = nb.initOperands(node.operands.size());
    for (size_t i = 0; i < node.operands.size(); ++i)
      operands.set(i, node.operands[i]);
    auto sl = nb.initScalars(node.scalars.size());
    for (size_t i = 0; i < node.scalars.size(); ++i)
      sl.set(i, node.scalars[i]);
    auto outputs = nb.initOutputs(node.outputs.size());
    for (size_t i = 0; i < node.outputs.size(); ++i)
      encodeMeta(node.outputs[i], outputs[i]);
    nb.setLoc(node.loc);
  }
  auto outputs = b.initOutputs(g.outputs.size());
  for (size_t i = 0; i < g.outputs.size(); ++i)
    outputs.set(i, g.outputs[i]);
  auto locs = b.initLocations(g.locations.size());
  for (size_t i = 0; i < g.locations.size(); ++i)
    locs.set(i, g.locations[i]);
  b.setSymbolCount(g.symbolCount);
  auto symbolic = b.initSymbolic(g.symbolic.size());
  for (size_t i = 0; i < g.symbolic.size(); ++i) {
    const ir::SymbolicInt &s = g.symbolic[i];
    symbolic[i].setPosition(s.position);
    symbolic[i].setCoef(s.expr.coef);
    symbolic[i].setOffset(s.expr.offset);
    auto factors = symbolic[i].initFactors(s.expr.factors.size());
    for (size_t k = 0; k < s.expr.factors.size(); ++k)
      factors.set(k, s.expr.factors[k]);
  }
}

llvm::Error decodeGraph(Graph::Reader r, const Limits &limits, ir::Graph &g, OpCheck check) {
  g = ir::Graph();
  if (r.getNodes().size() > limits.maxNodes)
    return failure("graph has " + llvm::Twine(r.getNodes().size()) +
                   " nodes, more than the limit of " + llvm::Twine(limits.maxNodes));
  for (auto m : r.getInputs()) {
    g.inputs.emplace_back();
    if (!decodeMeta(m, g.inputs.back()))
      return failure("malformed input tensor meta");
  }
  for (auto s : r.getScalars()) {
    // An enumerant this side does not know stays one the verifier refuses (not truncated).
    const uint16_t form = uint16_t(s.getForm());
    g.scalars.push_back({s.getDtype(), ir::ScalarForm(form > 0xff ? 0xff : form)});
  }
  g.locations.clear();
  for (auto l : r.getLocations())
    g.locations.push_back(l);
  if (g.locations.empty())
    g.locations.emplace_back();
  g.nodes.reserve(r.getNodes().size());
  for (auto nr : r.getNodes()) {
    g.nodes.emplace_back();
    ir::Node &node = g.nodes.back();
    llvm::StringRef op(nr.getOp().cStr());
    if (check)
      if (llvm::Error why = check(op))
        return failure("node " + llvm::Twine(g.nodes.size() - 1) + " (" + op + "): " +
                       message(std::move(why)));
    node.op = ir::Symbol::get(op);
    for (auto ar : nr.getArgs()) {
      ir::Arg arg;
      switch (ar.which()) {
      case Arg::NONE: break;
      case Arg::BOOL: arg = ir::Arg::boolean(ar.getBool()); break;
      case Arg::INT: arg = ir::Arg::integer(ar.getInt()); break;
      case Arg::DOUBLE: arg = ir::Arg::real(ar.getDouble()); break;
      case Arg::STR:
        arg = ir::Arg::ref(ir::Arg::Kind::Str, node.strings.size());
        node.strings.push_back(ar.getStr());
        break;
      case Arg::DEVICE:
        arg = ir::Arg::ref(ir::Arg::Kind::Device, node.strings.size());
        node.strings.push_back(ar.getDevice());
        break;
      case Arg::TENSOR: arg = ir::Arg::ref(ir::Arg::Kind::Tensor, ar.getTensor()); break;
      case Arg::SCALAR: arg = ir::Arg::ref(ir::Arg::Kind::Scalar, ar.getScalar()); break;
      case Arg::LIST: arg = ir::Arg::ref(ir::Arg::Kind::List, ar.getList()); break;
      default: return failure("unknown argument kind");
      }
      node.args.push_back(arg);
    }
    copyList(node.operands, nr.getOperands());
    copyList(node.scalars, nr.getScalars());
    for (auto m : nr.getOutputs()) {
      node.outputs.emplace_back();
      if (m.getDtype() == ir::dtype::Undefined && m.getSizes().size() == 0) {
        node.outputs.back().dtype = ir::dtype::Undefined;
        continue;
      }
      if (!decodeMeta(m, node.outputs.back()))
        return failure("malformed output tensor meta in " + node.op.str());
    }
    node.loc = nr.getLoc();
  }
  copyList(g.outputs, r.getOutputs());
  g.symbolCount = r.getSymbolCount();
  for (auto sr : r.getSymbolic()) {
    if (sr.getFactors().size() > ir::SymExpr::kMaxFactors)
      return failure("a symbolic integer with too many factors");
    ir::SymbolicInt s;
    s.position = sr.getPosition();
    s.expr.coef = sr.getCoef();
    s.expr.offset = sr.getOffset();
    copyList(s.expr.factors, sr.getFactors());
    g.symbolic.push_back(std::move(s));
  }
  return ir::verifyStructure(g);
}

} // namespace rgpu::wire
