//===- rgpu/wire/Cache.h - Graph cache files ---------------------------------===//
//
// Every graph a client ships is also kept as one file, `<64 hex digits>.rgraph`, in its graph
// cache directory, so that rgpu-trace-dump can list, show and diff what was traced. Files are
// written whole to a temporary name and renamed, so a reader never sees half a file.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <capnp/message.h>
#include <kj/array.h>

#include <string>
#include <vector>

namespace rgpu::wire {

struct GraphRecord {
  ir::Hash256 hash;
  ir::Graph graph;
  uint64_t firstSeen = 0;
  uint64_t runs = 0;
  std::string cutAt;
};

/// The cache directory used when none is given: $RGPU_CACHE_DIR ("off" for none), else
/// $XDG_CACHE_HOME/rgpu/graphs, else ~/.cache/rgpu/graphs.
std::string defaultCacheDir();

/// The path of \p hash's file inside the cache directory \p dir.
std::string cacheFilePath(const std::string &dir, const ir::Hash256 &hash);
/// Writes \p g into \p dir (created if missing).
[[nodiscard]] llvm::Error writeCachedGraph(const std::string &dir, const GraphRecord &g);
/// Reads one cache file; a failure says why it cannot be read (missing, corrupt, wrong hash).
[[nodiscard]] llvm::Expected<GraphRecord> readCachedGraph(const std::string &path);
/// Writes \p message to \p path whole: to a temporary name, then renamed.
[[nodiscard]] llvm::Error writeMessageFile(const std::string &path, capnp::MessageBuilder &message);
/// Reads a file holding one flat message.
[[nodiscard]] llvm::Expected<kj::Array<capnp::word>> readMessageFile(const std::string &path);

/// The hashes of every cache file in \p dir, sorted; empty if the directory does not exist.
std::vector<ir::Hash256> listCachedGraphs(const std::string &dir);

} // namespace rgpu::wire
