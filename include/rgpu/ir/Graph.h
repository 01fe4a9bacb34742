//===- rgpu/ir/Graph.h - The lazy graph, independent of torch ---------------===//
//
// A Graph is what one sync point cuts out of the trace: a pure, functional DAG of aten ops with
// static shapes. It is the unit that is hashed, shipped once, cached and compiled on the server.
//
// This header deliberately knows nothing about ATen. Dtypes are c10::ScalarType numbers, ops are
// their schema names ("aten::add.Tensor"), and non-tensor arguments are a small closed set of
// kinds. The client, the server, the wire and rgpu-trace-dump all share it.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Error.h"
#include "rgpu/ir/OpFacts.h"

#include <llvm/ADT/ArrayRef.h>
#include <llvm/ADT/SmallVector.h>
#include <llvm/ADT/StringRef.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace llvm {
class raw_ostream;
}

namespace rgpu::ir {

/// An interned operator name such as "aten::add.Tensor". Ids are local to one process; anything
/// that leaves the process (hash, wire) uses the text.
class Symbol {
public:
  Symbol() = default;
  /// Interns \p name; thread-safe.
  static Symbol get(llvm::StringRef name);
  llvm::StringRef str() const;
  uint32_t id() const { return id_; }
  bool operator==(Symbol o) const { return id_ == o.id_; }
  bool operator!=(Symbol o) const { return id_ != o.id_; }

private:
  uint32_t id_ = 0;
};

/// Splits "aten::add.Tensor" into {"aten::add", "Tensor"}; the overload is empty if absent.
std::pair<llvm::StringRef, llvm::StringRef> splitOpName(llvm::StringRef name);


/// Dtype, sizes and strides of a tensor value. The storage offset is always 0: every value the
/// graph sees is a whole tensor (views are functionalized into *_copy ops).
struct TensorMeta {
  int8_t dtype = dtype::Float;
  llvm::SmallVector<int64_t, 4> sizes;
  llvm::SmallVector<int64_t, 4> strides;

  /// A contiguous (row-major) tensor of \p sizes.
  static TensorMeta contiguous(int8_t dtype, llvm::ArrayRef<int64_t> sizes);
  /// Elements; -1 if a size is negative or the product overflows int64.
  int64_t numel() const;
  /// Bytes the strided layout spans (0 for an empty tensor); -1 if a size or stride is negative
  /// or the span overflows int64, so a peer's meta can never wrap a bounds check.
  int64_t storageBytes() const;
  /// Whether the layout is row-major, as torch's is_contiguous() says: the strides of size-1
  /// dimensions do not matter, and an empty tensor is contiguous.
  bool isContiguous() const;
  bool operator==(const TensorMeta &o) const {
    return dtype == o.dtype && sizes == o.sizes && strides == o.strides;
  }
  bool operator!=(const TensorMeta &o) const { return !(*this == o); }
  /// "f32[8,32]", with the strides appended when they are not contiguous.
  std::string str() const;
};

/// A non-tensor argument, or a reference to a tensor operand or scalar input of the node.
///
/// Lists are flattened: a List arg with count N is followed by its N elements. This keeps a node
/// one flat array (cheap to hash, copy and encode) and bounds nesting to one level by design.
struct Arg {
  enum class Kind : uint8_t {
    None,   ///< None / an absent optional.
    Bool,   ///< i is 0 or 1.
    Int,    ///< i; also ScalarType, Layout and MemoryFormat, which are ints in a schema.
    Double, ///< d.
    Str,    ///< i indexes Node::strings.
    Device, ///< i indexes Node::strings ("rgpu:0"; the server substitutes its own device).
    Tensor, ///< i indexes Node::operands.
    Scalar, ///< i indexes Node::scalars: a lifted Python number, not part of the hash.
    List,   ///< i elements follow.
  };
  Kind kind = Kind::None;
  int64_t i = 0;
  double d = 0;

  static Arg none() { return {}; }
  static Arg boolean(bool v) { return {Kind::Bool, v ? 1 : 0, 0}; }
  static Arg integer(int64_t v) { return {Kind::Int, v, 0}; }
  static Arg real(double v) { return {Kind::Double, 0, v}; }
  static Arg ref(Kind k, int64_t index) { return {k, index, 0}; }
  bool operator==(const Arg &o) const;
};

/// How a lifted scalar is handed to the kernel. Wrapped numbers are the 0-dim CPU tensors that
/// PyTorch makes from Python numbers in `x * 2.0`; they promote like Python scalars.
/// How a scalar slot's value reaches its op: a Python number, a wrapped-number or 0-dim CPU
/// tensor, or (an int64) the id of the generator a Generator? argument names.
enum class ScalarForm : uint8_t { Scalar = 0, WrappedNumber = 1, Tensor0d = 2, Generator = 3 };

/// The type of one scalar input of a graph. Its value travels in each Run.
struct ScalarSlot {
  int8_t dtype = dtype::Double;
  ScalarForm form = ScalarForm::Scalar;
  bool operator==(const ScalarSlot &o) const { return dtype == o.dtype && form == o.form; }
};

/// A scalar value; which member is meaningful follows the slot's dtype.
struct ScalarValue {
  enum class Kind : uint8_t { Int, Double, Bool, Complex } kind = Kind::Double;
  int64_t i = 0;
  double d = 0, imag = 0;
  bool operator==(const ScalarValue &o) const {
    return kind == o.kind && i == o.i && d == o.d && imag == o.imag;
  }
};

/// One aten op application.
struct Node {
  Symbol op;
  llvm::SmallVector<Arg, 8> args;
  llvm::SmallVector<std::string, 0> strings;
  /// Graph value ids of the tensor operands, in the order Tensor args refer to them.
  llvm::SmallVector<uint32_t, 4> operands;
  /// Scalar input slots, in the order Scalar args refer to them.
  llvm::SmallVector<uint32_t, 2> scalars;
  llvm::SmallVector<TensorMeta, 1> outputs;
  /// Index into Graph::locations of the user's source line; metadata, not hashed.
  uint32_t loc = 0;
  /// The op draws random numbers (torch's nondeterministic_seeded tag): canonicalize keeps such
  /// nodes in the order given. Set by the tracer; not hashed, not sent (the canonical node order
  /// carries it).
  bool random = false;
};

/// A graph's identity: the BLAKE2b-256 digest of its canonical bytes (hashGraph). Peers name
/// graphs by it and the server finds plans and compiled packages by it, so it must be a digest
/// no peer can collide on purpose (docs/security.md).
struct Hash256 {
  std::array<uint64_t, 4> w{};
  bool operator==(const Hash256 &o) const { return w == o.w; }
  bool operator!=(const Hash256 &o) const { return w != o.w; }
  bool operator<(const Hash256 &o) const { return w < o.w; }
  /// 64 lowercase hex digits: the digest's bytes in order (as b2sum -l 256 prints a file's).
  std::string hex() const;
  /// Parses 64 hex digits; false if malformed.
  static bool parse(llvm::StringRef text, Hash256 &out);
};

/// The most size symbols a graph may have.
constexpr uint32_t kMaxSymbols = 64;

/// An integer of a symbolic graph as a function of the graph's size symbols s0, s1, ...:
/// `coef * s[factors[0]] * s[factors[1]] + offset`, with at most kMaxFactors factors.
struct SymExpr {
  static constexpr size_t kMaxFactors = 2;
  int64_t coef = 1, offset = 0;
  llvm::SmallVector<uint16_t, 2> factors;
  /// The value for the symbols \p s; false if it overflows int64 or names a symbol past \p s.
  bool eval(llvm::ArrayRef<int64_t> s, int64_t &out) const;
  /// "s0", "64*s1", "s0+1", "s0*s1".
  std::string str() const;
  bool operator==(const SymExpr &o) const {
    return coef == o.coef && offset == o.offset && factors == o.factors;
  }
};

/// One integer of a symbolic graph that follows its symbols: the integer at \p position in
/// forEachPosition's order (rgpu/ir/Symbolic.h).
struct SymbolicInt {
  uint64_t position = 0;
  SymExpr expr;
  bool operator==(const SymbolicInt &o) const {
    return position == o.position && expr == o.expr;
  }
};

/// A functional graph. Value ids number the inputs first, then every node output in node order.
///
/// A symbolic graph stands for every graph that differs from it only in the integers listed in
/// `symbolic` (sizes, strides and integer arguments), each a function of `symbolCount` size
/// symbols whose values travel with each Run; it holds 0 in those places.
struct Graph {
  llvm::SmallVector<TensorMeta, 8> inputs;
  llvm::SmallVector<ScalarSlot, 8> scalars;
  std::vector<Node> nodes;
  llvm::SmallVector<uint32_t, 8> outputs;
  /// Source locations ("file.py:12"); entry 0 is the empty location. Not hashed.
  std::vector<std::string> locations{std::string()};
  uint32_t symbolCount = 0;
  std::vector<SymbolicInt> symbolic; ///< By increasing position.

  /// Total number of values (inputs plus node outputs).
  uint32_t valueCount() const;
  /// The meta of every value, indexed by value id.
  std::vector<const TensorMeta *> valueMetas() const;
  /// Adds \p loc to the location table (deduplicated against the last entry only).
  uint32_t addLocation(llvm::StringRef loc);
};

/// The canonical form of a graph plus the permutations that map the caller's inputs onto it.
struct Canonical {
  Graph graph;
  /// inputOrder[k] is the caller's input index that became canonical input k.
  llvm::SmallVector<uint32_t, 8> inputOrder;
  /// scalarOrder[k] is the caller's scalar slot that became canonical slot k.
  llvm::SmallVector<uint32_t, 8> scalarOrder;
  /// nodeOrder[k] is the caller's node that became canonical node k.
  std::vector<uint32_t> nodeOrder;
  Hash256 hash;
};

/// Puts \p g into canonical form: nodes in post-order of a depth-first walk from the outputs (in
/// their given order), inputs and scalar slots numbered by first use, and nodes no output needs
/// removed. Two traces of the same program get the same canonical graph whatever their handle
/// numbers or the order in which their inputs were met. Random nodes keep their given (trace)
/// order among themselves: each is walked after the random node before it, as if that were an
/// operand, so draws happen as eager makes them. \p g must be well formed (see verify) and
/// static: the canonical form of a symbolic graph keeps none of its symbols.
Canonical canonicalize(const Graph &g);

/// The canonical bytes of a graph: an unambiguous serialization of what makes two graphs the
/// same program (ops, args, operand wiring, input/output metas, scalar slot types and symbolic
/// integers), and nothing else (not data, scalar values, symbol values or locations).
std::string canonicalBytes(const Graph &g);

/// The structural hash of a graph: BLAKE2b-256 of its canonical bytes.
Hash256 hashGraph(const Graph &g);

/// What \p g costs to hold, in bytes: an estimate of its size in memory from its content alone,
/// so that a client and a server holding the same graph count the same (a session's graph
/// budget, HelloReply.graphBudget, is in these bytes).
uint64_t graphBytes(const Graph &g);

/// True if \p a and \p b agree on everything hashGraph hashes: the same hash then means the
/// same graph, not a collision.
bool sameStructure(const Graph &a, const Graph &b);

/// Checks internal consistency (operand ids refer to earlier values, arg indices in range, list
/// counts in bounds, valid dtypes); a failure says the first problem. This is structural only;
/// the server checks ops against their schemas as well.
[[nodiscard]] llvm::Error verifyStructure(const Graph &g);

/// What differs between two graphs, one readable line per difference (empty if the structure is
/// the same): differing input metas (`input 0: f32[8,16] vs f32[12,16]`), the first differing
/// node, added and removed ops. \p shapesOnly is set when both run the same ops in the same
/// order with the same constants and dtypes and differ only in sizes and strides: a
/// shape-driven recompile.
std::vector<std::string> diffGraphs(const Graph &a, const Graph &b, bool *shapesOnly = nullptr);

/// Prints one node per line: `%5 = aten::addmm.default(%1, %3, %4) : f32[8,32]  # train.py:12`.
void printText(const Graph &g, llvm::raw_ostream &os);
/// Prints the graph as Graphviz dot.
void printDot(const Graph &g, llvm::raw_ostream &os);

} // namespace rgpu::ir
