//===- lib/client/GraphCutter.h - The pending trace, cut into graphs -------===//
//
// At a sync point every pending value a live tensor holds (and every random op traced since
// the last cut, whose draws must happen as on CPU) becomes an output of one graph. The cutter
// finds the nodes those outputs need, builds their ir::Graph, puts it into canonical form and
// fits it to a family of graphs that differ only in sizes (rgpu/ir/Symbolic.h). A cut of a
// trace shape seen before skips all of that (rgpu/client/Replay.h). What to send for it, and
// where its outputs go, is the session's business.
//
// Used under the session lock.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "GraphBudget.h"
#include "LiveTensors.h"
#include "Locations.h"

#include "rgpu/client/Replay.h"
#include "rgpu/client/Session.h"
#include "rgpu/ir/Symbolic.h"

#include <functional>
#include <memory>
#include <vector>

namespace rgpu::client {

class GraphCutter {
public:
  using Log = std::function<void(int, const std::string &)>;
  GraphCutter(Stats &stats, Locations &locations, Log log)
      : stats_(stats), locations_(locations), log_(std::move(log)) {}

  /// A fresh node sequence number; also counts the node toward the node cap.
  uint64_t nextSeq() {
    ++nodesSinceCut_;
    ++stats_.opsTraced;
    return ++nodeSeq_;
  }
  /// Whether the trace has grown past the node cap since the last cut: a trace that never
  /// syncs is cut (without waiting) after this many nodes.
  bool pastNodeCap() const { return nodesSinceCut_ >= kNodeCap; }
  /// Ops traced since the last cut.
  uint64_t nodesSinceCut() const { return nodesSinceCut_; }
  static constexpr uint64_t kNodeCap = 20000;
  /// A random op was traced: the next cut runs it even if nothing holds its result.
  void noteRandom(llvm::IntrusiveRefCntPtr<TraceNode> node) { random_.push_back(std::move(node)); }
  /// Whether a random op is pending: what touches a generator's state cuts the trace first.
  bool randomPending() const { return !random_.empty(); }

  /// What one cut covers.
  struct Cut {
    /// Its outputs, in trace order, each with the live tensors that hold it.
    struct Out {
      TraceNode *node;
      uint32_t index;
      llvm::SmallVector<LazyTensorImpl *, 2> impls;
    };
    std::vector<Out> outs;
    std::vector<std::pair<TraceNode *, uint32_t>> outputs; ///< The outs, as (node, index).
    std::vector<TraceNode *> nodes; ///< Every node the outputs need, in trace order.
    /// (output, handle) pairs: outputs that are new versions of device data (Versions.h),
    /// which a cancelled run binds back (wire::Run.restores).
    std::vector<uint64_t> restores;
    /// The random ops it runs, kept alive through the cut.
    std::vector<llvm::IntrusiveRefCntPtr<TraceNode>> random;
  };
  /// Takes every pending value of \p live, and every random op traced since the last cut, as
  /// the outputs of one cut (none if nothing is pending), and restarts the node cap.
  Cut collect(const LiveTensors &live);

  /// A raw graph over traced nodes, with what its Run needs besides the graph.
  struct Traced {
    ir::Graph graph;
    std::vector<uint64_t> inputHandles;
    std::vector<uint64_t> inputDynamicDims; ///< DeviceData::dynamicDims, per input.
    std::vector<ir::ScalarValue> scalarValues;
    std::vector<uint32_t> clientLocs; ///< Graph location index -> the client's location id.
  };
  /// Builds the graph of \p nodes (in trace order) producing \p outputs.
  Traced buildGraph(llvm::ArrayRef<TraceNode *> nodes,
                    llvm::ArrayRef<std::pair<TraceNode *, uint32_t>> outputs);

  /// How a cut runs: which graph, with what.
  struct Resolved {
    ir::Hash256 hash;
    /// The graph a Define would send; null only if the server holds it.
    std::shared_ptr<const ir::Graph> graph;
    bool symbolic = false;
    llvm::SmallVector<int64_t, 4> symbols; ///< Of a symbolic graph.
    std::vector<uint64_t> handles;
    std::vector<ir::ScalarValue> scalars;
    uint32_t outputs = 0;
    std::vector<uint32_t> locations; ///< Each canonical node's client location id.
  };
  /// Canonicalises \p t and fits it to its family of graphs that differ in sizes (not with
  /// \p replyMetas: its output sizes are what the run is for). With \p key (the trace \p t was
  /// built from), records how it resolved for later cuts of the same shape. \p site (the
  /// user's line) is named if the graph starts running as a symbolic one.
  Resolved resolve(Traced t, bool replyMetas, const TraceKey *key, uint32_t site);
  /// Resolves \p cut, whose trace is \p key, as an earlier cut of its shape resolved, if it
  /// can; \p budget says which graphs the server holds. With checkReplays, it is also resolved
  /// in full, and a difference raises.
  bool replay(const TraceKey &key, const Cut &cut, const GraphBudget &budget, Resolved &out,
              uint32_t site);

  bool dynamic() const { return dynamic_; }
  void setDynamic(bool on) {
    dynamic_ = on;
    replays_.clear(); // they may run graphs as symbolic ones
  }
  void setCheckReplays(bool on) { checkReplays_ = on; }
  /// A new session: nothing traced counts toward its node cap.
  void restartNodeCap() { nodesSinceCut_ = 0; }

private:
  Stats &stats_;
  Locations &locations_;
  Log log_;
  uint64_t nodeSeq_ = 0, nodesSinceCut_ = 0;
  /// The random ops traced since the last cut (noteRandom).
  std::vector<llvm::IntrusiveRefCntPtr<TraceNode>> random_;
  bool dynamic_ = true, checkReplays_ = false;
  ir::ShapeFamilies families_;
  ReplayCache replays_;
};

} // namespace rgpu::client
