//===- rgpu/client/Diagnostics.h - What the client tells the user about itself -===//
//
// Per graph and per sync site (the user's source line): runs, waits, where a graph was first
// cut and why; the recompile warning for a site that keeps cutting graphs differing only in
// shapes; and the graph cache files (RGPU_CACHE_DIR) that rgpu-trace-dump reads. Nothing here
// changes what runs. Used under the session lock.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <llvm/ADT/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace rgpu::client {

class Diagnostics {
public:
  /// What rgpu.metrics_report() shows about one graph.
  struct GraphInfo {
    uint32_t nodes = 0;
    uint64_t runs = 0, waitedRuns = 0, waitNs = 0;
    uint64_t firstSeen = 0, runsBefore = 0; ///< From an earlier process's cache file.
    std::string cutAt;
    std::string reason; ///< Why the cut that first made it happened ("item", "mark_step").
  };
  /// What rgpu.metrics_report() shows about one sync site (a user's source line).
  struct SiteInfo {
    uint64_t syncs = 0, waitNs = 0, newGraphs = 0, shapeOnlyGraphs = 0;
    uint64_t symbolicGraphs = 0; ///< Graphs generalized over sizes (not counted in newGraphs).
    std::shared_ptr<const ir::Graph> last; ///< The latest new graph this site cut.
    std::vector<std::string> lastDiff;     ///< How it differed from the one before.
    bool warned = false;
  };

  /// \p log takes (level, message) records.
  explicit Diagnostics(std::function<void(int, const std::string &)> log);

  /// Where shipped graphs are kept for rgpu-trace-dump; empty keeps none.
  void setCacheDir(std::string dir) { cacheDir_ = std::move(dir); }
  /// Warn when one sync site has cut more than this many graphs differing only in shapes.
  void setRecompileWarningThreshold(uint64_t n) { recompileWarnAfter_ = n; }

  bool known(const ir::Hash256 &hash) const { return graphs_.count(hash) != 0; }
  /// A graph seen for the first time, cut at \p site (\p where is its text) for \p reason.
  void newGraph(const ir::Hash256 &hash, std::shared_ptr<const ir::Graph> graph,
                const char *reason, uint32_t site, const std::string &where);
  void ran(const ir::Hash256 &hash) { ++graphs_[hash].runs; }
  /// A wait of \p ns at \p site for a frame that ran \p graphs.
  void waited(uint32_t site, const std::string &where, llvm::ArrayRef<ir::Hash256> graphs,
              uint64_t ns);
  /// Writes this process's run counts into the graph cache files (at exit).
  void flushCache();

  const std::map<ir::Hash256, GraphInfo> &graphs() const { return graphs_; }
  const std::map<uint32_t, SiteInfo> &sites() const { return sites_; }

private:
  std::function<void(int, const std::string &)> log_;
  std::string cacheDir_;
  uint64_t recompileWarnAfter_ = 5;
  std::map<ir::Hash256, GraphInfo> graphs_;
  std::map<uint32_t, SiteInfo> sites_;
};

} // namespace rgpu::client
