#pragma once

#include "rgpu/ir/Graph.h"

#include <chrono>
#include <memory>
#include <string>

namespace rgpu::server {

/// torch.distributed process groups among the servers of a job, as one session sees them: a
/// rendezvous store it may host for the job, and the groups it joined. A joined group is
/// registered with c10d under a random name that only this session's graphs may use (their
/// _c10d_functional ops name it), and is unregistered when the session ends.
class Groups {
public:
  Groups();
  ~Groups();

  /// Starts the job's rendezvous store listening on \p host only, on a free port; returns
  /// "host:port".
  std::string hostStore(const std::string &host, std::chrono::milliseconds timeout);
  /// Joins a group of \p size servers as \p rank through the store at \p store ("" for the one
  /// hostStore started), under \p prefix, its Gloo listener bound to \p host only. Blocks
  /// until every rank joined or \p timeout passed. Returns the group's name for graphs.
  std::string join(const std::string &store, const std::string &prefix, int rank, int size,
                   const std::string &host, std::chrono::milliseconds timeout);
  /// An error message if \p graph names a process group this session did not join.
  std::string check(const ir::Graph &graph) const;

  /// At most this many groups per session, of at most this many ranks, with key prefixes of at
  /// most this many bytes.
  static constexpr size_t kMaxGroups = 16;
  static constexpr int kMaxRanks = 4096;
  static constexpr size_t kMaxPrefix = 256;

private:
  struct State;
  std::unique_ptr<State> s_;
};

} // namespace rgpu::server
