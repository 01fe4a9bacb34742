//===- server/CompileJobModule.cpp - rgpu_compile_job: the worker's wire ----===//
//
// A Python module with no torch in it, next to inductor_worker.py: it reads the CompileJob the
// server wrote and writes the worker's CompileResult, both Cap'n Proto, with the same decoder
// the server uses. The worker therefore needs neither the rgpu client package nor a second
// implementation of the format.
//
//===----------------------------------------------------------------------===//
#include "rgpu/ir/Symbolic.h"
#include "rgpu/wire/Cache.h"
#include "rgpu/wire/Wire.h"

#include <capnp/serialize.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;
using namespace rgpu;

namespace {

/// A torch name from the op-facts table, or None for a number it does not name.
py::object torchName(const char *name) { return name ? py::object(py::str(name)) : py::none(); }

py::dict metaDict(const ir::TensorMeta &m) {
  py::dict d;
  d["dtype"] = torchName(ir::dtype::torchName(m.dtype));
  d["sizes"] = std::vector<int64_t>(m.sizes.begin(), m.sizes.end());
  d["strides"] = std::vector<int64_t>(m.strides.begin(), m.strides.end());
  return d;
}

py::object scalarObject(const ir::ScalarValue &v) {
  switch (v.kind) {
  case ir::ScalarValue::Kind::Int: return py::int_(v.i);
  case ir::ScalarValue::Kind::Bool: return py::bool_(v.i != 0);
  case ir::ScalarValue::Kind::Double: return py::float_(v.d);
  case ir::ScalarValue::Kind::Complex:
    return py::reinterpret_steal<py::object>(PyComplex_FromDoubles(v.d, v.imag));
  }
  return py::none();
}

ir::ScalarValue scalarValue(py::handle o) {
  ir::ScalarValue v;
  if (py::isinstance<py::bool_>(o)) {
    v.kind = ir::ScalarValue::Kind::Bool;
    v.i = o.cast<bool>();
  } else if (py::isinstance<py::int_>(o)) {
    v.kind = ir::ScalarValue::Kind::Int;
    v.i = o.cast<int64_t>();
  } else if (PyComplex_Check(o.ptr())) {
    v.kind = ir::ScalarValue::Kind::Complex;
    v.d = PyComplex_RealAsDouble(o.ptr());
    v.imag = PyComplex_ImagAsDouble(o.ptr());
  } else {
    v.kind = ir::ScalarValue::Kind::Double;
    v.d = o.cast<double>();
  }
  return v;
}

const char *formName(ir::ScalarForm form) {
  switch (form) {
  case ir::ScalarForm::Scalar: return "scalar";
  case ir::ScalarForm::WrappedNumber: return "wrapped_number";
  case ir::ScalarForm::Tensor0d: return "tensor_0d";
  case ir::ScalarForm::Generator: return "generator";
  }
  return "?";
}

/// The facts of the op-facts table the worker reads, by name.
py::frozenset factNames(ir::OpFacts facts) {
  static const std::pair<ir::OpFact, const char *> named[] = {
      {ir::OpFact::OverwritesFirst, "overwrites_first"},
      {ir::OpFact::RegionView, "region_view"},
      {ir::OpFact::CopiesIntoFirst, "copies_into_first"},
      {ir::OpFact::NeverDraws, "never_draws"},
  };
  py::set out;
  for (const auto &[fact, name] : named)
    if (facts.has(fact))
      out.add(name);
  return py::frozenset(out);
}

/// A size expression as (coef, offset, [symbol, ...]).
py::tuple exprTuple(const ir::SymExpr &e) {
  py::list factors;
  for (uint16_t f : e.factors)
    factors.append(int(f));
  return py::make_tuple(e.coef, e.offset, factors);
}

/// The job as plain Python data. Args stay flattened, as (kind, value) pairs; strings and
/// devices are resolved to their text, tensor and scalar references to value ids and slots.
/// A symbolic graph comes with the sizes of the run that asked for the compile, and with the
/// expression of every position that follows its symbols: an input's "dims" (an expression or
/// None per size) and "symbolic" (its layout holds a symbol), and ("symint", (value, coef,
/// offset, [symbol, ...])) arguments.
py::dict readJob(const std::string &path) {
  auto words = wire::readMessageFile(path);
  if (!words)
    throw std::runtime_error(message(words.takeError()));
  wire::Limits limits;
  capnp::FlatArrayMessageReader reader(*words,
                                       wire::readerOptions(limits, words->asBytes().size(), false));
  auto job = reader.getRoot<wire::CompileJob>();
  ir::Graph g;
  if (llvm::Error e = wire::decodeGraph(job.getGraph(), limits, g))
    throw std::runtime_error(path + ": " + message(std::move(e)));
  auto runOps = job.getRunOps(); // read once: every get counts against the traversal limit
  if (runOps.size() != g.nodes.size())
    throw std::runtime_error(path + ": one run op per node expected");
  // Per position, its expression (null where it is constant).
  std::vector<const ir::SymExpr *> exprAt;
  std::vector<ir::SymbolicInt> symbolic = g.symbolic;
  uint32_t symbolCount = g.symbolCount;
  if (symbolCount) {
    std::vector<int64_t> symbols;
    for (int64_t v : job.getSymbols())
      symbols.push_back(v);
    if (!ir::instantiate(g, symbols))
      throw std::runtime_error(path + ": the job's symbols do not fit its graph");
    exprAt.assign(ir::positions(g).size(), nullptr);
    for (const ir::SymbolicInt &s : symbolic)
      exprAt[s.position] = &s.expr;
  }
  size_t p = 0;
  auto next = [&]() -> const ir::SymExpr * { return exprAt.empty() ? nullptr : exprAt[p++]; };
  std::vector<bool> zeroFill(g.nodes.size());
  for (uint32_t n : job.getZeroFill())
    if (n < zeroFill.size())
      zeroFill[n] = true;
  py::list inputs, scalars, values, nodes;
  for (const auto &m : g.inputs) {
    py::dict d = metaDict(m);
    py::list dims;
    bool any = false;
    for (size_t k = 0; k < m.sizes.size(); ++k) {
      const ir::SymExpr *e = next();
      any |= e != nullptr;
      dims.append(e ? py::object(exprTuple(*e)) : py::none());
    }
    for (size_t k = 0; k < m.strides.size(); ++k)
      any |= next() != nullptr;
    d["dims"] = dims;
    d["symbolic"] = any;
    d["contiguous"] = m.isContiguous();
    inputs.append(d);
  }
  for (const auto &s : g.scalars)
    scalars.append(py::make_tuple(torchName(ir::dtype::torchName(s.dtype)), formName(s.form)));
  for (auto s : job.getScalars())
    values.append(scalarObject(wire::decodeScalar(s)));
  static const char *kinds[] = {"none", "bool", "int", "double", "str",
                                "device", "tensor", "scalar", "list"};
  for (size_t k = 0; k < g.nodes.size(); ++k) {
    const ir::Node &n = g.nodes[k];
    py::list args, outputs;
    for (const ir::Arg &a : n.args) {
      py::object v;
      switch (a.kind) {
      case ir::Arg::Kind::Str:
      case ir::Arg::Kind::Device: v = py::str(n.strings[a.i]); break;
      case ir::Arg::Kind::Tensor: v = py::int_(n.operands[a.i]); break;
      case ir::Arg::Kind::Scalar: v = py::int_(n.scalars[a.i]); break;
      case ir::Arg::Kind::Double: v = py::float_(a.d); break;
      case ir::Arg::Kind::Int:
        if (const ir::SymExpr *e = next()) {
          py::tuple t = exprTuple(*e);
          args.append(py::make_tuple("symint", py::make_tuple(a.i, t[0], t[1], t[2])));
          continue;
        }
        [[fallthrough]];
      default: v = py::int_(a.i);
      }
      args.append(py::make_tuple(kinds[int(a.kind)], v));
    }
    for (const auto &m : n.outputs) {
      outputs.append(metaDict(m));
      for (size_t k = 0; k < m.sizes.size() + m.strides.size(); ++k)
        next();
    }
    py::dict d;
    d["op"] = n.op.str().str();
    d["run_op"] = std::string(runOps[k].cStr());
    d["zero_fill"] = bool(zeroFill[k]);
    d["facts"] = factNames(ir::opFacts(n.op.str()));
    d["args"] = args;
    d["outputs"] = outputs;
    nodes.append(d);
  }
  py::dict out;
  out["hash"] = wire::decodeHash(job.getHash()).hex();
  out["inputs"] = inputs;
  out["scalars"] = scalars;
  out["values"] = values;
  out["nodes"] = nodes;
  out["outputs"] = std::vector<uint32_t>(g.outputs.begin(), g.outputs.end());
  out["symbol_count"] = symbolCount;
  out["device"] = std::string(job.getDevice().cStr());
  out["mode"] = std::string(job.getMode().cStr());
  out["package"] = std::string(job.getPackage().cStr());
  out["result"] = std::string(job.getResult().cStr());
  return out;
}

void writeOk(const std::string &path, const std::vector<std::pair<uint32_t, py::object>> &constants,
             uint32_t fxNodes, const std::vector<std::tuple<uint32_t, int64_t, int64_t>> &ranges,
             const std::vector<std::tuple<uint32_t, uint32_t, int64_t, int64_t>> &relations,
             const std::vector<std::pair<uint32_t, uint32_t>> &writes) {
  capnp::MallocMessageBuilder b;
  auto ok = b.initRoot<wire::CompileResult>().initOk();
  auto list = ok.initConstants(constants.size());
  for (size_t i = 0; i < constants.size(); ++i) {
    list[i].setSlot(constants[i].first);
    wire::encodeScalar(scalarValue(constants[i].second), list[i].initValue());
  }
  ok.setFxNodes(fxNodes);
  auto r = ok.initRanges(ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    r[i].setSymbol(std::get<0>(ranges[i]));
    r[i].setMin(std::get<1>(ranges[i]));
    r[i].setMax(std::get<2>(ranges[i]));
  }
  auto rel = ok.initRelations(relations.size());
  for (size_t i = 0; i < relations.size(); ++i) {
    rel[i].setSymbol(std::get<0>(relations[i]));
    rel[i].setOf(std::get<1>(relations[i]));
    rel[i].setCoef(std::get<2>(relations[i]));
    rel[i].setOffset(std::get<3>(relations[i]));
  }
  auto w = ok.initWrites(2 * writes.size());
  for (size_t i = 0; i < writes.size(); ++i) {
    w.set(2 * i, writes[i].first);
    w.set(2 * i + 1, writes[i].second);
  }
  if (llvm::Error e = wire::writeMessageFile(path, b))
    throw std::runtime_error(message(std::move(e)));
}

void writeError(const std::string &path, const std::string &message) {
  capnp::MallocMessageBuilder b;
  b.initRoot<wire::CompileResult>().setError(message);
  if (llvm::Error e = wire::writeMessageFile(path, b))
    throw std::runtime_error(rgpu::message(std::move(e)));
}

} // namespace

PYBIND11_MODULE(rgpu_compile_job, m) {
  m.doc() = "The Inductor compile worker's CompileJob and CompileResult (Cap'n Proto).";
  m.def("read_job", &readJob, "The CompileJob in a file, as plain Python data.");
  m.def("write_ok", &writeOk, py::arg("path"), py::arg("constants"), py::arg("fx_nodes"),
        py::arg("ranges") = std::vector<std::tuple<uint32_t, int64_t, int64_t>>(),
        py::arg("relations") = std::vector<std::tuple<uint32_t, uint32_t, int64_t, int64_t>>(),
        py::arg("writes") = std::vector<std::pair<uint32_t, uint32_t>>(),
        "Writes a successful CompileResult: the (slot, value) pairs compiled as constants, "
        "the (symbol, min, max) sizes a symbolic graph's package holds for, the (symbol, "
        "of, coef, offset) relations symbol == coef * of + offset it requires and the "
        "(output, input) pairs the package writes into an input instead of returning.");
  m.def("write_error", &writeError, py::arg("path"), py::arg("message"),
        "Writes a failed CompileResult with its reason.");
  // How graphs number what schemas pass as ints (lib/ir/OpFacts.cpp): torch's names for them.
  m.def("dtype_name", [](int64_t n) { return torchName(ir::dtype::torchName(int8_t(n) == n ? int8_t(n) : -1)); },
        "The name in torch of the graph's dtype number (\"float32\"); None if graphs carry no such dtype.");
  m.def("layout_name", [](int64_t n) { return torchName(ir::layout::torchName(n)); },
        "The name in torch of a layout number graphs carry (\"strided\"); None otherwise.");
  m.def("memory_format_name", [](int64_t n) { return torchName(ir::memory_format::torchName(n)); },
        "The name in torch of a memory format number (\"channels_last\"); None otherwise.");
  m.def("compiled_as_constant", [](const std::string &op, const std::string &arg) {
          return ir::compiledAsConstant(op, arg);
        }, py::arg("op"), py::arg("arg"),
        "Whether Scalar argument `arg` of op `op` (\"aten::constant_pad_nd\") is compiled as a "
        "constant: decompositions branch on it, or Inductor lowers it as a Python number.");
  m.def("valid_dtypes", [] {
          std::vector<int> out;
          for (int n = 0; n < 128; ++n)
            if (ir::dtype::isValid(int8_t(n)))
              out.push_back(n);
          return out;
        }, "The dtype numbers graphs may carry (what the server's policy admits).");
}
