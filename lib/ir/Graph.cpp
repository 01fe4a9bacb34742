#include "rgpu/ir/Graph.h"
#include "rgpu/ir/Digest.h"
#include "rgpu/ir/Symbolic.h"

#include <llvm/ADT/DenseMap.h>
#include <llvm/ADT/STLExtras.h>
#include <llvm/ADT/StringMap.h>
#include <llvm/Support/Allocator.h>
#include <llvm/Support/Endian.h>
#include <llvm/Support/ErrorHandling.h>
#include <llvm/Support/raw_ostream.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

using namespace llvm;

namespace rgpu::ir {

namespace {
struct SymbolTable {
  std::mutex mu;
  StringMap<uint32_t, BumpPtrAllocator> ids;
  std::vector<StringRef> names{StringRef()};
};
SymbolTable &symbols() {
  static SymbolTable *table = new SymbolTable; // never destroyed: used from static destructors
  return *table;
}
} // namespace

Symbol Symbol::get(StringRef name) {
  auto &t = symbols();
  std::lock_guard<std::mutex> lock(t.mu);
  auto [it, inserted] = t.ids.try_emplace(name, uint32_t(t.names.size()));
  if (inserted)
    t.names.push_back(it->getKey());
  Symbol s;
  s.id_ = it->second;
  return s;
}

StringRef Symbol::str() const {
  auto &t = symbols();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.names[id_];
}

std::pair<StringRef, StringRef> splitOpName(StringRef name) {
  size_t ns = name.find("::");
  size_t dot = name.find('.', ns == StringRef::npos ? 0 : ns + 2);
  if (dot == StringRef::npos)
    return {name, StringRef()};
  return {name.substr(0, dot), name.substr(dot + 1)};
}


TensorMeta TensorMeta::contiguous(int8_t dtype, ArrayRef<int64_t> sizes) {
  TensorMeta m;
  m.dtype = dtype;
  m.sizes.assign(sizes.begin(), sizes.end());
  m.strides.resize(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    m.strides[i] = stride;
    stride *= std::max<int64_t>(sizes[i], 1);
  }
  return m;
}

int64_t TensorMeta::numel() const {
  if (std::find(sizes.begin(), sizes.end(), 0) != sizes.end())
    return 0;
  int64_t n = 1;
  for (int64_t s : sizes)
    if (s < 0 || __builtin_mul_overflow(n, s, &n))
      return -1;
  return n;
}

bool TensorMeta::isContiguous() const {
  if (numel() == 0)
    return true;
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] == 1)
      continue;
    if (i >= strides.size() || strides[i] != expected)
      return false;
    expected *= sizes[i];
  }
  return true;
}

int64_t TensorMeta::storageBytes() const {
  int64_t n = numel();
  if (n <= 0)
    return n;
  int64_t span = 1, bytes = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    int64_t step = 0;
    if (i >= strides.size() || strides[i] < 0 ||
        __builtin_mul_overflow(sizes[i] - 1, strides[i], &step) ||
        __builtin_add_overflow(span, step, &span))
      return -1;
  }
  if (__builtin_mul_overflow(span, int64_t(dtype::itemSize(dtype)), &bytes))
    return -1;
  return bytes;
}

namespace {
bool isContiguous(const TensorMeta &m) {
  int64_t expect = 1;
  for (size_t i = m.sizes.size(); i-- > 0;) {
    if (i >= m.strides.size() || (m.sizes[i] != 1 && m.strides[i] != expect))
      return false;
    if (__builtin_mul_overflow(expect, m.sizes[i], &expect)) // a peer's sizes: never contiguous
      return false;
  }
  return true;
}

/// "f32[8,32]", strides appended if \p layout is not contiguous; each integer's text comes from
/// \p text(position offset within the meta, value).
template <class F> std::string metaText(const TensorMeta &m, const TensorMeta &layout, F &&text) {
  std::string s = dtype::name(m.dtype) + "[";
  for (size_t i = 0; i < m.sizes.size(); ++i)
    s += (i ? "," : "") + text(i, m.sizes[i]);
  s += "]";
  if (!isContiguous(layout)) {
    s += "{";
    for (size_t i = 0; i < m.strides.size(); ++i)
      s += (i ? "," : "") + text(m.sizes.size() + i, m.strides[i]);
    s += "}";
  }
  return s;
}
} // namespace

std::string TensorMeta::str() const {
  return metaText(*this, *this, [](size_t, int64_t v) { return std::to_string(v); });
}

bool Arg::operator==(const Arg &o) const {
  if (kind != o.kind)
    return false;
  if (kind == Kind::Double)
    return std::memcmp(&d, &o.d, sizeof d) == 0;
  return i == o.i;
}

bool sameStructure(const Graph &a, const Graph &b) {
  if (a.inputs != b.inputs || a.scalars != b.scalars || a.outputs != b.outputs ||
      a.nodes.size() != b.nodes.size() || a.symbolCount != b.symbolCount ||
      a.symbolic != b.symbolic)
    return false;
  for (size_t i = 0; i < a.nodes.size(); ++i) {
    const Node &x = a.nodes[i], &y = b.nodes[i];
    if (x.op != y.op || x.args != y.args || x.strings != y.strings || x.operands != y.operands ||
        x.scalars != y.scalars || x.outputs != y.outputs)
      return false;
  }
  return true;
}

std::string Hash256::hex() const {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(64);
  for (uint64_t word : w)
    for (size_t b = 0; b < 8; ++b) { // the digest's bytes in order, as b2sum prints them
      const unsigned byte = (word >> (8 * b)) & 0xff;
      out += digits[byte >> 4];
      out += digits[byte & 15];
    }
  return out;
}

bool Hash256::parse(StringRef text, Hash256 &out) {
  if (text.size() != 64)
    return false;
  Hash256 h;
  for (size_t k = 0; k < 32; ++k) {
    unsigned byte = 0;
    if (text.substr(2 * k, 2).getAsInteger(16, byte))
      return false;
    h.w[k / 8] |= uint64_t(byte) << (8 * (k % 8));
  }
  out = h;
  return true;
}

uint32_t Graph::valueCount() const {
  uint32_t n = inputs.size();
  for (const Node &node : nodes)
    n += node.outputs.size();
  return n;
}

std::vector<const TensorMeta *> Graph::valueMetas() const {
  std::vector<const TensorMeta *> metas;
  metas.reserve(valueCount());
  for (const TensorMeta &m : inputs)
    metas.push_back(&m);
  for (const Node &node : nodes)
    for (const TensorMeta &m : node.outputs)
      metas.push_back(&m);
  return metas;
}

uint32_t Graph::addLocation(StringRef loc) {
  if (loc.empty())
    return 0;
  if (locations.back() == loc)
    return locations.size() - 1;
  locations.push_back(loc.str());
  return locations.size() - 1;
}

//===----------------------------------------------------------------------===//
// Canonical form
//===----------------------------------------------------------------------===//

Canonical canonicalize(const Graph &g) {
  const uint32_t nin = g.inputs.size();
  // Owner of each node output value: (node index, output index).
  std::vector<std::pair<uint32_t, uint32_t>> owner;
  owner.reserve(g.valueCount() - nin);
  for (uint32_t n = 0; n < g.nodes.size(); ++n)
    for (uint32_t o = 0; o < g.nodes[n].outputs.size(); ++o)
      owner.push_back({n, o});

  // Pass 1: iterative depth-first walk from the outputs; records the post-order and numbers
  // inputs by first use. Iterative because a long chain of ops is thousands of levels deep.
  constexpr uint32_t kUnset = ~0u;
  std::vector<uint32_t> newInput(nin, kUnset);
  std::vector<uint8_t> state(g.nodes.size(), 0); // 0 new, 1 on stack, 2 emitted
  std::vector<uint32_t> order;
  Canonical c;
  // Each random node's predecessor among random nodes, in the given order: a random node
  // waits for it as for one more operand. Eager draws in call order; a checkpoint's
  // recomputation, another graph, must draw the forward's dropout masks in the same order.
  std::vector<uint32_t> prevRandom;
  for (uint32_t n = 0, last = kUnset; n < g.nodes.size(); ++n)
    if (g.nodes[n].random) {
      prevRandom.resize(g.nodes.size(), kUnset);
      prevRandom[n] = last;
      last = n;
    }
  SmallVector<std::pair<uint32_t, uint32_t>, 64> stack; // (node, next operand)
  auto touch = [&](uint32_t v) {
    if (v < nin) {
      if (newInput[v] == kUnset) {
        newInput[v] = c.inputOrder.size();
        c.inputOrder.push_back(v);
      }
      return;
    }
    uint32_t n = owner[v - nin].first;
    if (state[n] == 0) {
      state[n] = 1;
      stack.push_back({n, 0});
    }
  };
  for (uint32_t out : g.outputs) {
    touch(out);
    while (!stack.empty()) {
      auto &[n, next] = stack.back();
      const Node &node = g.nodes[n];
      if (next < node.operands.size()) {
        touch(node.operands[next++]);
        continue;
      }
      if (next == node.operands.size() && !prevRandom.empty() && prevRandom[n] != kUnset) {
        ++next;
        uint32_t p = prevRandom[n];
        if (state[p] == 0) {
          state[p] = 1;
          stack.push_back({p, 0});
        }
        continue;
      }
      state[n] = 2;
      order.push_back(n);
      stack.pop_back();
    }
  }

  // Pass 2: emit nodes in that order with final value ids.
  const uint32_t newNin = c.inputOrder.size();
  std::vector<uint32_t> firstValue(g.nodes.size(), kUnset);
  uint32_t nextValue = newNin;
  for (uint32_t n : order) {
    firstValue[n] = nextValue;
    nextValue += g.nodes[n].outputs.size();
  }
  auto mapValue = [&](uint32_t v) {
    if (v < nin)
      return newInput[v];
    auto [n, o] = owner[v - nin];
    return firstValue[n] + o;
  };
  std::vector<uint32_t> newScalar(g.scalars.size(), kUnset);
  Graph &out = c.graph;
  for (uint32_t i : c.inputOrder)
    out.inputs.push_back(g.inputs[i]);
  out.nodes.reserve(order.size());
  out.locations = g.locations;
  for (uint32_t n : order) {
    out.nodes.push_back(g.nodes[n]);
    Node &node = out.nodes.back();
    for (uint32_t &v : node.operands)
      v = mapValue(v);
    for (uint32_t &s : node.scalars) {
      if (newScalar[s] == kUnset) {
        newScalar[s] = c.scalarOrder.size();
        c.scalarOrder.push_back(s);
        out.scalars.push_back(g.scalars[s]);
      }
      s = newScalar[s];
    }
  }
  for (uint32_t v : g.outputs)
    out.outputs.push_back(mapValue(v));
  c.nodeOrder = std::move(order);
  c.hash = hashGraph(out);
  return c;
}

//===----------------------------------------------------------------------===//
// Hash
//===----------------------------------------------------------------------===//

namespace {
/// Serialises the hashed parts of a graph into a flat byte string.
class HashWriter {
public:
  std::string buf;
  void u64(uint64_t v) { buf.append(reinterpret_cast<const char *>(&v), sizeof v); }
  void str(StringRef s) {
    u64(s.size());
    buf.append(s.data(), s.size());
  }
  /// Writes 0 for every position (see Symbolic.h): the skeleton's hash.
  bool skeleton = false;
  void position(int64_t v) { u64(skeleton ? 0 : v); }
  void meta(const TensorMeta &m) {
    u64(uint64_t(uint8_t(m.dtype)) | uint64_t(m.sizes.size()) << 8);
    u64(m.strides.size());
    for (int64_t s : m.sizes)
      position(s);
    for (int64_t s : m.strides)
      position(s);
  }
  /// In a skeleton, whether an input is laid out in row-major order and, if not, its stride
  /// order (its dimensions of size > 1 from the largest stride down): graphs whose input is a
  /// permuted view in one and contiguous in the other are not one family, whose strides would
  /// then follow no expression of the sizes. Size-1 dimensions, whose strides say nothing, are
  /// left out.
  void strideOrder(const TensorMeta &m) {
    if (!skeleton)
      return;
    llvm::SmallVector<uint32_t, 8> dims;
    for (uint32_t d = 0; d < m.sizes.size() && d < m.strides.size(); ++d)
      if (m.sizes[d] > 1)
        dims.push_back(d);
    auto larger = [&](uint32_t a, uint32_t b) { return m.strides[a] > m.strides[b]; };
    const bool rowMajor = std::is_sorted(dims.begin(), dims.end(), larger);
    u64(rowMajor);
    if (rowMajor)
      return;
    std::stable_sort(dims.begin(), dims.end(), larger);
    u64(dims.size());
    for (uint32_t d : dims)
      u64(d);
  }
};

std::string canonicalBytes(const Graph &g, bool skeleton) {
  HashWriter w;
  w.skeleton = skeleton;
  w.buf.reserve(64 + g.nodes.size() * 96);
  w.u64(g.inputs.size());
  for (const TensorMeta &m : g.inputs) {
    w.meta(m);
    w.strideOrder(m);
  }
  w.u64(g.scalars.size());
  for (const ScalarSlot &s : g.scalars)
    w.u64(uint64_t(uint8_t(s.dtype)) | uint64_t(s.form) << 8);
  w.u64(g.nodes.size());
  for (const Node &n : g.nodes) {
    w.str(n.op.str());
    w.u64(n.args.size());
    for (const Arg &a : n.args) {
      w.u64(uint64_t(a.kind));
      switch (a.kind) {
      case Arg::Kind::Double: {
        uint64_t bits;
        std::memcpy(&bits, &a.d, sizeof bits);
        w.u64(bits);
        break;
      }
      case Arg::Kind::Str:
      case Arg::Kind::Device:
        w.str(size_t(a.i) < n.strings.size() ? StringRef(n.strings[a.i]) : StringRef());
        break;
      case Arg::Kind::Int:
        w.position(a.i);
        break;
      default:
        w.u64(a.i);
      }
    }
    w.u64(n.operands.size());
    for (uint32_t v : n.operands)
      w.u64(v);
    w.u64(n.scalars.size());
    for (uint32_t s : n.scalars)
      w.u64(s);
    w.u64(n.outputs.size());
    for (const TensorMeta &m : n.outputs)
      w.meta(m);
  }
  w.u64(g.outputs.size());
  for (uint32_t v : g.outputs)
    w.u64(v);
  if (!skeleton) {
    w.u64(g.symbolCount);
    w.u64(g.symbolic.size());
    for (const SymbolicInt &s : g.symbolic) {
      w.u64(s.position);
      w.u64(s.expr.coef);
      w.u64(s.expr.offset);
      w.u64(s.expr.factors.size());
      for (uint16_t f : s.expr.factors)
        w.u64(f);
    }
  }
  return std::move(w.buf);
}

Hash256 blake2b256(StringRef bytes) { return digestOf(bytes.data(), bytes.size()); }
} // namespace

std::string canonicalBytes(const Graph &g) { return canonicalBytes(g, false); }
Hash256 hashGraph(const Graph &g) { return blake2b256(canonicalBytes(g, false)); }
Hash256 skeletonHash(const Graph &g) { return blake2b256(canonicalBytes(g, true)); }

//===----------------------------------------------------------------------===//
// Structural verification
//===----------------------------------------------------------------------===//

namespace {
/// The first structural problem of \p g, or "".
std::string structureProblem(const Graph &g) {
  auto checkMeta = [](const TensorMeta &m) -> std::string {
    if (!dtype::isValid(m.dtype))
      return "invalid dtype " + std::to_string(int(m.dtype));
    if (m.sizes.size() != m.strides.size())
      return "sizes and strides differ in rank";
    for (int64_t s : m.sizes)
      if (s < 0)
        return "negative size";
    return "";
  };
  for (size_t i = 0; i < g.inputs.size(); ++i)
    if (std::string e = checkMeta(g.inputs[i]); !e.empty())
      return "input " + std::to_string(i) + ": " + e;
  uint32_t defined = g.inputs.size();
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    const Node &node = g.nodes[n];
    std::string where = "node " + std::to_string(n) + " (" + node.op.str().str() + "): ";
    for (uint32_t v : node.operands)
      if (v >= defined)
        return where + "operand %" + std::to_string(v) + " is not defined before use";
    for (uint32_t s : node.scalars)
      if (s >= g.scalars.size())
        return where + "scalar slot " + std::to_string(s) + " out of range";
    if (node.loc >= g.locations.size())
      return where + "location out of range";
    for (size_t a = 0; a < node.args.size(); ++a) {
      const Arg &arg = node.args[a];
      switch (arg.kind) {
      case Arg::Kind::Tensor:
        if (arg.i < 0 || size_t(arg.i) >= node.operands.size())
          return where + "tensor argument out of range";
        break;
      case Arg::Kind::Scalar:
        if (arg.i < 0 || size_t(arg.i) >= node.scalars.size())
          return where + "scalar argument out of range";
        break;
      case Arg::Kind::Str:
      case Arg::Kind::Device:
        if (arg.i < 0 || size_t(arg.i) >= node.strings.size())
          return where + "string argument out of range";
        break;
      case Arg::Kind::List:
        if (arg.i < 0 || size_t(arg.i) > node.args.size() - a - 1)
          return where + "list runs past the argument array";
        for (int64_t k = 1; k <= arg.i; ++k)
          if (node.args[a + k].kind == Arg::Kind::List)
            return where + "nested list";
        break;
      default:
        break;
      }
    }
    for (const TensorMeta &m : node.outputs)
      if (m.dtype != dtype::Undefined)
        if (std::string e = checkMeta(m); !e.empty())
          return where + e;
    defined += node.outputs.size();
  }
  for (uint32_t v : g.outputs)
    if (v >= defined)
      return "output %" + std::to_string(v) + " is not defined";
  for (const ScalarSlot &s : g.scalars)
    if (!dtype::isValid(s.dtype) || uint8_t(s.form) > uint8_t(ScalarForm::Generator) ||
        (s.form == ScalarForm::Generator && s.dtype != dtype::Long))
      return "invalid scalar slot";
  if (g.symbolic.empty() != (g.symbolCount == 0) || g.symbolCount > kMaxSymbols)
    return "invalid symbol count " + std::to_string(g.symbolCount);
  if (!g.symbolic.empty()) {
    std::vector<int64_t> values = positions(g);
    for (size_t k = 0; k < g.symbolic.size(); ++k) {
      const SymbolicInt &s = g.symbolic[k];
      if (s.position >= values.size() || (k && s.position <= g.symbolic[k - 1].position))
        return "symbolic position " + std::to_string(s.position) + " out of order or range";
      if (values[s.position] != 0)
        return "symbolic position " + std::to_string(s.position) + " holds a value";
      if (s.expr.factors.size() > SymExpr::kMaxFactors)
        return "symbolic position " + std::to_string(s.position) + " has too many factors";
      for (uint16_t f : s.expr.factors)
        if (f >= g.symbolCount)
          return "symbolic position " + std::to_string(s.position) + " names symbol s" +
                 std::to_string(f) + " of " + std::to_string(g.symbolCount);
    }
  }
  return "";
}
} // namespace

llvm::Error verifyStructure(const Graph &g) {
  if (std::string problem = structureProblem(g); !problem.empty())
    return failure(problem);
  return llvm::Error::success();
}

//===----------------------------------------------------------------------===//
// Diff
//===----------------------------------------------------------------------===//

namespace {
/// The text of every integer of a graph: symbolic ones by their expressions ("s0+1").
class PositionTexts {
public:
  explicit PositionTexts(const Graph &g) : g_(g), metas_(g.valueMetas()) {
    indexPositions();
    if (!g.symbolCount)
      return;
    // Layouts are judged contiguous or not with the symbols at some sizes no broadcast rule
    // treats specially.
    sample_ = std::make_unique<Graph>(g);
    llvm::SmallVector<int64_t, 8> values;
    for (uint32_t k = 0; k < g.symbolCount; ++k)
      values.push_back(1009 + 2 * k);
    if (instantiate(*sample_, values))
      sampleMetas_ = sample_->valueMetas();
    else
      sample_.reset();
  }
  /// The text of the integer at \p position, whose value is \p v.
  std::string at(uint64_t position, int64_t v) const {
    auto it = std::lower_bound(g_.symbolic.begin(), g_.symbolic.end(), position,
                               [](const SymbolicInt &s, uint64_t p) { return s.position < p; });
    if (it != g_.symbolic.end() && it->position == position)
      return it->expr.str();
    return std::to_string(v);
  }
  std::string meta(uint32_t value) const {
    const TensorMeta &m = *metas_[value];
    uint64_t start = valueStart_[value];
    return metaText(m, sample_ ? *sampleMetas_[value] : m,
                    [&](size_t i, int64_t v) { return at(start + i, v); });
  }
  /// Position of node \p n's first Int argument.
  uint64_t argStart(size_t n) const { return argStart_[n]; }

private:
  /// The first position of each value's layout and of each node's arguments, in
  /// forEachPosition's order.
  void indexPositions() {
    uint64_t p = 0;
    for (const TensorMeta &m : g_.inputs) {
      valueStart_.push_back(p);
      p += m.sizes.size() + m.strides.size();
    }
    for (const Node &n : g_.nodes) {
      argStart_.push_back(p);
      for (const Arg &a : n.args)
        p += a.kind == Arg::Kind::Int;
      for (const TensorMeta &m : n.outputs) {
        valueStart_.push_back(p);
        p += m.sizes.size() + m.strides.size();
      }
    }
  }
  const Graph &g_;
  std::vector<const TensorMeta *> metas_, sampleMetas_;
  std::unique_ptr<Graph> sample_;
  std::vector<uint64_t> valueStart_, argStart_;
};
} // namespace

std::vector<std::string> diffGraphs(const Graph &a, const Graph &b, bool *shapesOnly) {
  std::vector<std::string> lines;
  bool structural = false;
  size_t intLines = 0; // lines that name integer arguments only
  auto count = [](const char *what, size_t x, size_t y) {
    return std::string(what) + ": " + std::to_string(x) + " vs " + std::to_string(y);
  };
  const PositionTexts ta(a), tb(b);
  if (a.symbolCount != b.symbolCount)
    lines.push_back(count("size symbols", a.symbolCount, b.symbolCount) + " (" +
                    std::to_string(a.symbolic.size()) + " vs " +
                    std::to_string(b.symbolic.size()) + " integers follow them)");
  // Another dtype is another program (other kernels, other promotions), not another shape.
  for (size_t i = 0; i < std::min(a.inputs.size(), b.inputs.size()); ++i)
    if (a.inputs[i] != b.inputs[i]) {
      lines.push_back("input " + std::to_string(i) + ": " + ta.meta(i) + " vs " + tb.meta(i));
      structural |= a.inputs[i].dtype != b.inputs[i].dtype;
    }
  if (a.inputs.size() != b.inputs.size()) {
    lines.push_back(count("inputs", a.inputs.size(), b.inputs.size()));
    structural = true;
  }
  if (a.scalars.size() != b.scalars.size() ||
      !std::equal(a.scalars.begin(), a.scalars.end(), b.scalars.begin())) {
    lines.push_back(count("scalar inputs", a.scalars.size(), b.scalars.size()) +
                    " (or their types differ)");
    structural = true;
  }
  size_t common = std::min(a.nodes.size(), b.nodes.size());
  size_t firstOpDiff = common;
  for (size_t n = 0; n < common; ++n)
    if (a.nodes[n].op != b.nodes[n].op) {
      firstOpDiff = n;
      break;
    }
  if (firstOpDiff == common && a.nodes.size() == b.nodes.size()) {
    // Same ops in the same order: report differing constants and the first few output metas.
    size_t metaLines = 0, moreMetas = 0;
    uint32_t va = a.inputs.size(), vb = b.inputs.size(); // node n's first output in each
    for (size_t n = 0; n < common;
         va += a.nodes[n].outputs.size(), vb += b.nodes[n].outputs.size(), ++n) {
      const Node &x = a.nodes[n], &y = b.nodes[n];
      std::string where = "node " + std::to_string(n) + " (" + x.op.str().str() + ")";
      if (x.args != y.args || x.strings != y.strings || x.operands != y.operands) {
        // Integer arguments that differ beside shapes that differ are taken as derived from
        // the sizes (slice ends, pad amounts, view sizes): still the same program.
        bool intsOnly = x.strings == y.strings && x.operands == y.operands &&
                        x.args.size() == y.args.size();
        std::string ints;
        uint64_t pa = ta.argStart(n), pb = tb.argStart(n);
        for (size_t k = 0; intsOnly && k < x.args.size(); ++k) {
          bool isInt = x.args[k].kind == Arg::Kind::Int && y.args[k].kind == Arg::Kind::Int;
          if (!(x.args[k] == y.args[k])) {
            intsOnly = isInt;
            ints += (ints.empty() ? "" : ", ") + ta.at(pa, x.args[k].i) + " vs " +
                    tb.at(pb, y.args[k].i);
          }
          pa += x.args[k].kind == Arg::Kind::Int;
          pb += y.args[k].kind == Arg::Kind::Int;
        }
        if (intsOnly) {
          lines.push_back(where + ": integer arguments " + ints);
          ++intLines;
        } else {
          lines.push_back(where + ": arguments differ");
          structural = true;
        }
      }
      if (x.outputs != y.outputs) {
        for (size_t o = 0; o < std::min(x.outputs.size(), y.outputs.size()); ++o)
          structural |= x.outputs[o].dtype != y.outputs[o].dtype;
        if (metaLines++ < 3) {
          std::string l = where + ": ";
          for (size_t o = 0; o < std::max(x.outputs.size(), y.outputs.size()); ++o)
            l += (o ? ", " : "") + (o < x.outputs.size() ? ta.meta(va + o) : "-") + " vs " +
                 (o < y.outputs.size() ? tb.meta(vb + o) : "-");
          lines.push_back(l);
        } else {
          ++moreMetas;
        }
      }
    }
    if (moreMetas)
      lines.push_back("... and " + std::to_string(moreMetas) + " more nodes with other shapes");
  } else {
    structural = true;
    if (firstOpDiff < common)
      lines.push_back("first difference at node " + std::to_string(firstOpDiff) + ": " +
                      a.nodes[firstOpDiff].op.str().str() + " vs " +
                      b.nodes[firstOpDiff].op.str().str());
    else
      lines.push_back(count("nodes", a.nodes.size(), b.nodes.size()));
    std::map<std::string, int> balance;
    for (const Node &n : a.nodes)
      --balance[n.op.str().str()];
    for (const Node &n : b.nodes)
      ++balance[n.op.str().str()];
    for (auto &[op, k] : balance)
      if (k)
        lines.push_back((k > 0 ? "+ " : "- ") + op + (std::abs(k) > 1 ? " x" + std::to_string(std::abs(k)) : ""));
  }
  if (a.outputs.size() != b.outputs.size()) {
    lines.push_back(count("outputs", a.outputs.size(), b.outputs.size()));
    structural = true;
  }
  if (shapesOnly) // integers alone differing are other constants, not other shapes
    *shapesOnly = !structural && lines.size() > intLines;
  return lines;
}

//===----------------------------------------------------------------------===//
// Printing
//===----------------------------------------------------------------------===//

namespace {
using IntText = llvm::function_ref<std::string(int64_t)>;

void printArg(const Node &n, const Arg &a, raw_ostream &os, IntText intText) {
  switch (a.kind) {
  case Arg::Kind::None: os << "None"; break;
  case Arg::Kind::Bool: os << (a.i ? "True" : "False"); break;
  case Arg::Kind::Int: os << intText(a.i); break;
  case Arg::Kind::Double: os << a.d; break;
  case Arg::Kind::Str: os << '"' << n.strings[a.i] << '"'; break;
  case Arg::Kind::Device: os << "device(" << n.strings[a.i] << ")"; break;
  case Arg::Kind::Tensor: os << "%" << n.operands[a.i]; break;
  case Arg::Kind::Scalar: os << "$" << n.scalars[a.i]; break;
  case Arg::Kind::List: break; // handled by printArgs
  }
}

void printArgs(const Node &n, raw_ostream &os, IntText intText) {
  for (size_t i = 0; i < n.args.size(); ++i) {
    if (i)
      os << ", ";
    const Arg &a = n.args[i];
    if (a.kind != Arg::Kind::List) {
      printArg(n, a, os, intText);
      continue;
    }
    os << "[";
    for (int64_t k = 1; k <= a.i; ++k) {
      if (k > 1)
        os << ", ";
      printArg(n, n.args[i + k], os, intText);
    }
    os << "]";
    i += a.i;
  }
}

/// Index of the node producing each value, or -1 for graph inputs.
std::vector<int64_t> producers(const Graph &g) {
  std::vector<int64_t> p(g.inputs.size(), -1);
  for (size_t n = 0; n < g.nodes.size(); ++n)
    p.insert(p.end(), g.nodes[n].outputs.size(), int64_t(n));
  return p;
}
} // namespace

void printText(const Graph &g, raw_ostream &os) {
  const PositionTexts texts(g);
  if (g.symbolCount)
    os << "# symbolic over s0.." << "s" << g.symbolCount - 1 << ": " << g.symbolic.size()
       << " integers follow the sizes of each run\n";
  for (size_t i = 0; i < g.inputs.size(); ++i)
    os << "%" << i << " = input " << i << " : " << texts.meta(i) << "\n";
  for (size_t s = 0; s < g.scalars.size(); ++s)
    os << "$" << s << " = "
       << (g.scalars[s].form == ScalarForm::Generator
               ? std::string("generator")
               : "scalar " + std::string(dtype::name(g.scalars[s].dtype)) +
                     (g.scalars[s].form == ScalarForm::Scalar ? "" : " tensor"))
       << "\n";
  uint32_t v = g.inputs.size();
  for (size_t k = 0; k < g.nodes.size(); ++k) {
    const Node &n = g.nodes[k];
    std::string results;
    for (size_t o = 0; o < n.outputs.size(); ++o)
      results += (o ? ", %" : "%") + std::to_string(v + o);
    os << (results.empty() ? "()" : results) << " = " << n.op.str() << "(";
    uint64_t position = texts.argStart(k);
    printArgs(n, os, [&](int64_t i) { return texts.at(position++, i); });
    os << ") : ";
    for (size_t o = 0; o < n.outputs.size(); ++o)
      os << (o ? ", " : "") << texts.meta(v + o);
    if (n.loc)
      os << "  # " << g.locations[n.loc];
    os << "\n";
    v += n.outputs.size();
  }
  os << "return (";
  for (size_t i = 0; i < g.outputs.size(); ++i)
    os << (i ? ", %" : "%") << g.outputs[i];
  os << ")\n";
}

void printDot(const Graph &g, raw_ostream &os) {
  std::vector<int64_t> producer = producers(g);
  auto source = [&](uint32_t v) {
    return producer[v] < 0 ? "v" + std::to_string(v) : "n" + std::to_string(producer[v]);
  };
  os << "digraph rgpu {\n  node [shape=box, fontname=\"monospace\"];\n";
  for (size_t i = 0; i < g.inputs.size(); ++i)
    os << "  v" << i << " [shape=ellipse, label=\"input " << i << "\\n" << g.inputs[i].str()
       << "\"];\n";
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    const Node &node = g.nodes[n];
    os << "  n" << n << " [label=\"" << node.op.str() << "\\n";
    for (size_t o = 0; o < node.outputs.size(); ++o)
      os << (o ? ", " : "") << node.outputs[o].str();
    os << "\"];\n";
    for (uint32_t operand : node.operands)
      os << "  " << source(operand) << " -> n" << n << ";\n";
  }
  for (size_t i = 0; i < g.outputs.size(); ++i)
    os << "  out" << i << " [shape=ellipse, label=\"output " << i << "\"];\n  "
       << source(g.outputs[i]) << " -> out" << i << ";\n";
  os << "}\n";
}

uint64_t graphBytes(const Graph &g) {
  auto meta = [](const TensorMeta &m) { return sizeof(TensorMeta) + 16 * m.sizes.size(); };
  auto text = [](const std::string &s) { return sizeof(std::string) + s.size(); };
  uint64_t bytes = sizeof(Graph) + g.scalars.size() * sizeof(ScalarSlot) +
                   g.outputs.size() * sizeof(uint32_t) + g.symbolic.size() * sizeof(SymbolicInt);
  for (const TensorMeta &m : g.inputs)
    bytes += meta(m);
  for (const std::string &l : g.locations)
    bytes += text(l);
  for (const Node &n : g.nodes) {
    bytes += sizeof(Node) + n.args.size() * sizeof(Arg) +
             (n.operands.size() + n.scalars.size()) * sizeof(uint32_t);
    for (const std::string &s : n.strings)
      bytes += text(s);
    for (const TensorMeta &m : n.outputs)
      bytes += meta(m);
  }
  return bytes;
}

} // namespace rgpu::ir
