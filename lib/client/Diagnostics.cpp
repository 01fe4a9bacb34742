#include "rgpu/client/Diagnostics.h"

#include "rgpu/wire/Cache.h"

#include <cstdio>
#include <ctime>

namespace rgpu::client {

namespace {
/// A wait this long is logged at INFO.
constexpr uint64_t kSlowWaitNs = 1'000'000'000;
} // namespace

Diagnostics::Diagnostics(std::function<void(int, const std::string &)> log)
    : log_(std::move(log)), cacheDir_(wire::defaultCacheDir()) {}

void Diagnostics::newGraph(const ir::Hash256 &hash, std::shared_ptr<const ir::Graph> graph,
                           const char *reason, uint32_t siteId, const std::string &where) {
  GraphInfo &info = graphs_[hash];
  info.nodes = graph->nodes.size();
  info.cutAt = where;
  info.reason = reason;
  info.firstSeen = uint64_t(std::time(nullptr));
  log_(10, "define graph " + hash.hex().substr(0, 12) + " (" + std::to_string(info.nodes) +
               " nodes), first cut at " + info.cutAt);
  if (!cacheDir_.empty()) {
    if (auto cached = wire::readCachedGraph(wire::cacheFilePath(cacheDir_, hash))) {
      info.firstSeen = cached->firstSeen;
      info.runsBefore = cached->runs;
    } else {
      llvm::consumeError(cached.takeError()); // not cached yet: it is now
      wire::GraphRecord record{hash, *graph, info.firstSeen, 0, info.cutAt};
      if (llvm::Error e = wire::writeCachedGraph(cacheDir_, record))
        log_(30, "rgpu: graph cache disabled: " + message(std::move(e)));
    }
  }

  // A site that keeps cutting new graphs which differ only in shapes recompiles every step,
  // unless they run as one symbolic graph: that one is not such a graph, nor compared with one.
  SiteInfo &site = sites_[siteId];
  if (graph->symbolCount) {
    ++site.symbolicGraphs;
    return;
  }
  ++site.newGraphs;
  if (site.last) {
    bool shapesOnly = false;
    site.lastDiff = ir::diffGraphs(*site.last, *graph, &shapesOnly);
    if (shapesOnly)
      ++site.shapeOnlyGraphs;
  }
  site.last = std::move(graph);
  if (!site.warned && site.shapeOnlyGraphs >= recompileWarnAfter_) {
    site.warned = true;
    std::string why;
    for (size_t i = 0; i < site.lastDiff.size() && i < 3; ++i)
      why += (i ? "; " : "") + site.lastDiff[i];
    log_(30, "rgpu: " + where + " has cut " + std::to_string(site.newGraphs) +
                 " different graphs that differ only in tensor shapes (latest: " + why +
                 "). Each new shape is a new graph to ship and compile; keep shapes fixed "
                 "(pad or bucket them) to reuse one" +
                 (site.symbolicGraphs ? ": they did not fit the symbolic graphs made for them"
                                      : "") +
                 ". `rgpu-trace-dump diff` shows the details.");
  }
}

void Diagnostics::waited(uint32_t siteId, const std::string &where,
                         llvm::ArrayRef<ir::Hash256> graphs, uint64_t ns) {
  SiteInfo &site = sites_[siteId];
  ++site.syncs;
  site.waitNs += ns;
  for (const ir::Hash256 &h : graphs) {
    graphs_[h].waitNs += ns;
    ++graphs_[h].waitedRuns;
  }
  if (ns >= kSlowWaitNs) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.1f", ns / 1e9);
    log_(20, std::string("rgpu: waited ") + secs + " s for rgpu-opserver at " + where);
  } else {
    log_(10, "wait at " + where + ": " + std::to_string(ns / 1000) + " us");
  }
}

void Diagnostics::flushCache() {
  if (cacheDir_.empty())
    return;
  for (auto &[hash, info] : graphs_) {
    auto record = wire::readCachedGraph(wire::cacheFilePath(cacheDir_, hash));
    if (!record) { // gone or unwritable: the counts are a courtesy
      llvm::consumeError(record.takeError());
      continue;
    }
    record->runs = info.runsBefore + info.runs;
    llvm::consumeError(wire::writeCachedGraph(cacheDir_, *record));
  }
}

} // namespace rgpu::client
