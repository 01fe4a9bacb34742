//===- rgpu/ir/Symbolic.h - Graphs generalized over their shapes ------------===//
//
// A generation loop or a run over variable-length batches cuts graphs that differ only in
// sizes, strides and integer arguments computed from them (slice ends, view sizes, pad
// amounts). Those integers are a graph's *positions*. Graphs with the same *skeleton* (the graph
// with every position blanked, and each input's stride order) form a family; once a family has
// been seen with two different sets of positions (or once, with sizes declared dynamic), the
// client generalizes it into one symbolic graph whose varying positions are expressions of a
// few size symbols, and every later member runs as that graph plus the values of its symbols.
//
// Soundness does not rest on the generalization: a graph runs as a symbolic one only if
// instantiating it with the extracted symbol values gives back exactly that graph, position
// for position. An expression guessed from too few observations only makes a later member
// fail to match, which then generalizes again from more observations.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <llvm/ADT/DenseMap.h>

#include <memory>
#include <map>
#include <vector>

namespace rgpu::ir {

/// Calls \p f(int64_t &) on every position of \p g, in a fixed order: each input's sizes then
/// strides; then, node by node, its Int arguments (list elements included, list counts not),
/// then each output's sizes then strides. \p G is Graph or const Graph.
template <class G, class F> void forEachPosition(G &g, F &&f) {
  auto meta = [&](auto &m) {
    for (auto &s : m.sizes)
      f(s);
    for (auto &s : m.strides)
      f(s);
  };
  for (auto &m : g.inputs)
    meta(m);
  for (auto &n : g.nodes) {
    for (auto &a : n.args)
      if (a.kind == Arg::Kind::Int)
        f(a.i);
    for (auto &m : n.outputs)
      meta(m);
  }
}

/// The integers at the positions of \p g, in forEachPosition order.
std::vector<int64_t> positions(const Graph &g);

/// A hash of everything but the positions' values, plus each input's stride order (row-major
/// or the permutation): graphs with the same skeleton hash differ only in their positions, and
/// a permuted view is not of one family with a contiguous tensor.
Hash256 skeletonHash(const Graph &g);

/// Symbols and expressions that explain every observation of one family: positions equal in
/// all of them stay constants; the others become expressions of symbols, each symbol read from
/// the first position that varies in a way no expression of the earlier symbols explains. An
/// input's size is either a symbol already met (the same size in every observation) or a new
/// one; other positions may be `c*s+d` or `c*s*t+d` of earlier symbols. \p sample is a member
/// of the family; at least two observations, each of its positions(); false if nothing varies
/// or more than \p maxSymbols are needed.
bool generalize(const Graph &sample, llvm::ArrayRef<std::vector<int64_t>> observations,
                uint32_t &symbolCount, std::vector<SymbolicInt> &symbolic,
                uint32_t maxSymbols = 16);

/// Symbols from one observation, for input sizes the user or torch.compile has declared
/// dynamic: each \p hinted position (an input size of \p sample, ascending) is a symbol,
/// equal sizes sharing one; every other position equal to a symbol's value, or to the product
/// of two, becomes that symbol or product, except the sizes of undeclared inputs. A guess: a
/// later member it does not fit generalizes from two observations instead. False if no hinted
/// size is 2 or more, or more than \p maxSymbols are needed.
bool generalizeHinted(const Graph &sample, llvm::ArrayRef<uint32_t> hinted,
                      uint32_t &symbolCount, std::vector<SymbolicInt> &symbolic,
                      uint32_t maxSymbols = 16);

/// \p concrete with the symbolic positions given (blanked to 0) and its symbols counted.
Graph makeSymbolic(const Graph &concrete, uint32_t symbolCount,
                   std::vector<SymbolicInt> symbolic);

/// The symbol values under which symbolic graph \p g, whose positions are \p gPositions, is
/// exactly the graph with positions \p concrete (of the same skeleton). Each symbol is read at
/// its first position, which is its bare self. False if any position disagrees.
bool matchPositions(const Graph &g, llvm::ArrayRef<int64_t> gPositions,
                    llvm::ArrayRef<int64_t> concrete, llvm::SmallVectorImpl<int64_t> &symbols);

/// Writes the values of \p g's symbolic positions for \p symbols, making it the static graph it
/// stands for (its symbolic list is emptied). False, leaving \p g unspecified, if \p symbols has
/// the wrong length or an expression overflows.
bool instantiate(Graph &g, llvm::ArrayRef<int64_t> symbols);

/// Where each symbol of \p g is first met, one line per symbol: "s0 = input 0 size 2",
/// "s1 = node 4 (aten::slice_copy.Tensor) integer argument 1".
std::vector<std::string> symbolSources(const Graph &g);

/// The client's families of graphs, keyed by skeleton.
class ShapeFamilies {
public:
  /// How a concrete graph is to run: as symbolic graph \p graph with \p symbols.
  struct Fit {
    std::shared_ptr<const Graph> graph;
    Hash256 hash;
    llvm::SmallVector<int64_t, 4> symbols;
    bool isNew = false;     ///< The graph was generalized just now,
    bool fromHints = false; ///< from declared dynamic sizes alone.
  };
  /// Finds or makes the symbolic graph that \p concrete (canonical, of hash \p hash) runs as.
  /// False if it runs as itself: the first of its family (until the family is generalized),
  /// a member that no symbolic graph fits, or one of a family generalized kMaxGraphs times
  /// already. A graph asked about before is answered from a memo, so a training step of fixed
  /// shapes pays one lookup.
  /// \p hinted lists input-size positions declared dynamic (see generalizeHinted): the first
  /// of a family then runs as a symbolic graph at once.
  bool fit(const Graph &concrete, const Hash256 &hash, Fit &out,
           llvm::ArrayRef<uint32_t> hinted = {});
  /// The symbolic graphs of \p concrete's family, newest first: what fit tries, in its order.
  struct Candidate {
    std::shared_ptr<const Graph> graph;
    Hash256 hash;
    std::vector<int64_t> positions;
  };
  std::vector<Candidate> candidates(const Graph &concrete) const;
  /// Counts the symbolic graphs made so far: until it changes, fit answers a graph as before
  /// and tries the same candidates.
  uint64_t generation() const { return generation_; }
  static constexpr size_t kMaxGraphs = 4;   ///< Symbolic graphs per family.
  static constexpr size_t kMaxObserved = 8; ///< Observations kept per family.

private:
  struct Family {
    std::unique_ptr<Graph> first;
    std::vector<std::vector<int64_t>> observed;
    std::vector<Candidate> graphs;
  };
  bool fitNew(const Graph &concrete, llvm::ArrayRef<uint32_t> hinted, Fit &out);
  bool adopt(Family &family, uint32_t count, std::vector<SymbolicInt> symbolic, Fit &out);
  std::map<Hash256, Family> families_;
  /// Per concrete graph hash, how it runs: as itself (no graph) or as a symbolic graph. Cleared
  /// whenever a family gains a symbolic graph.
  std::map<Hash256, Fit> memo_;
  static constexpr size_t kMaxMemo = 4096;
  uint64_t generation_ = 0;
};

} // namespace rgpu::ir
