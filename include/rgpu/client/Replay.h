//===- rgpu/client/Replay.h - Cuts that repeat skip building their graph ---===//
//
// A training loop cuts the same graph every step, and a generation loop cuts graphs that differ
// only in sizes. Building the ir::Graph of such a cut, putting it into canonical form and
// hashing it costs a few microseconds per node, every step. A replay skips all three: the
// trace's *shape* (everything the canonical graph depends on except its positions, as exact
// bytes) keys what an earlier cut of that shape resolved to, and the trace's positions (sizes,
// strides, integer arguments) decide whether it is the same graph again or an instance of one of
// its family's symbolic graphs (rgpu/ir/Symbolic.h). Anything else takes the full path.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/client/LazyTensor.h"
#include "rgpu/ir/Symbolic.h"

#include <string>
#include <unordered_map>
#include <vector>

namespace rgpu::client {

/// A cut's trace, read once: its shape, its positions and the operands a Run needs.
struct TraceKey {
  /// Ops, constant arguments, wiring, dtypes and ranks, scalar slot types, declared dynamic
  /// sizes: everything of the canonical graph and its fit but the positions.
  std::string shape;
  /// The positions in the order ir::forEachPosition gives for the graph built in trace order
  /// (inputs by first use, then nodes).
  std::vector<int64_t> positions;
  std::vector<DeviceData *> inputs;              ///< By first use.
  std::vector<const ir::ScalarValue *> scalars; ///< Node by node, in trace order.
};

/// Reads \p nodes (in trace order) and the \p outputs the cut produces.
TraceKey readTrace(llvm::ArrayRef<TraceNode *> nodes,
                   llvm::ArrayRef<std::pair<TraceNode *, uint32_t>> outputs);

/// What a cut of one trace shape resolved to.
struct Replay {
  /// The canonical graph's positions, inputs, scalar slots and nodes, as indices into the trace's.
  std::vector<uint32_t> positionOrder, inputOrder, scalarOrder, nodeOrder;
  uint32_t outputs = 0;
  /// The last concrete graph of this shape: its canonical positions and hash, and the symbolic
  /// graph it ran as (none: it ran as itself).
  std::vector<int64_t> positions;
  ir::Hash256 hash;
  ir::ShapeFamilies::Fit fit;
  /// Its family's symbolic graphs and ShapeFamilies::generation() when they were read.
  std::vector<ir::ShapeFamilies::Candidate> candidates;
  uint64_t generation = 0;
};

/// Replays by trace shape, bounded.
class ReplayCache {
public:
  Replay *find(const std::string &shape);
  Replay &insert(const std::string &shape);
  void clear() { map_.clear(); }
  static constexpr size_t kMaxEntries = 1024;

private:
  std::unordered_map<std::string, Replay> map_;
};

} // namespace rgpu::client
