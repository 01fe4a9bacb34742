#pragma once

#include "rgpu/ir/Graph.h"

#include <llvm/Support/Error.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <sys/socket.h>

namespace rgpu::server {

/// torch.distributed process groups among the servers of a job, as one session sees them: a
/// rendezvous store it may host for the job, and the groups it joined. A joined group is
/// registered with c10d under a random name that only this session's graphs may use (their
/// _c10d_functional ops name it), and is unregistered when the session ends.
class Groups {
public:
  Groups();
  ~Groups();

  /// Starts the job's rendezvous store (Rendezvous.h) listening on \p host only, on a free
  /// port, its memory paid by \p charge; returns its address, "host:port#secret", which the
  /// job's other servers join through.
  std::string hostStore(const std::string &host, std::function<bool(int64_t)> charge);
  /// A join in progress: it waits for every rank of its group on a thread of its own, never on
  /// a worker of the pool.
  struct Join;
  /// Starts joining a group of \p size servers as \p rank through the store at \p store (an
  /// address hostStore gave; "" for the one this session's hostStore started), under \p prefix, its Gloo listener bound to \p host
  /// only, for at most \p timeout. \p ended is called, from the join's thread, when it ends.
  std::shared_ptr<Join> startJoin(const std::string &store, const std::string &prefix, int rank,
                                  int size, const std::string &host,
                                  std::chrono::milliseconds timeout, std::function<void()> ended);
  /// The group's name for graphs once \p join has ended, the group now this session's; none
  /// while it waits. Throws the join's error.
  std::optional<std::string> joinedGroupName(Join &join);
  /// Ends a join whose client left: its waits on the store stop within
  /// rendezvous::Client::kCancelPollMs.
  static void cancel(Join &join);
  /// Fails if \p graph names a process group this session did not join.
  llvm::Error check(const ir::Graph &graph) const;

  /// At most this many groups per session, of at most this many ranks, with key prefixes of at
  /// most this many bytes.
  static constexpr size_t kMaxGroups = 16;
  /// At most this many sessions of the server host a store at once (each is a thread and a
  /// listener).
  static constexpr int kMaxStores = 64;
  static constexpr int kMaxRanks = 4096;
  static constexpr size_t kMaxPrefix = 256;

  /// accept(2) for Gloo, which takes its connections with it and ends the process when one
  /// fails: the server's `accept` (main.cpp) is this, \p real being libc's. A listener whose
  /// connection would leave the process fewer than an eighth of its descriptors (at least 64)
  /// is closed to the network and the connection closed at once, and Gloo is answered EAGAIN
  /// (it waits for the next connection, which never comes).
  using AcceptFn = int (*)(int, sockaddr *, socklen_t *);
  static int acceptConnection(int fd, sockaddr *address, socklen_t *length, AcceptFn real);

private:
  struct State;
  std::unique_ptr<State> s_;
};

} // namespace rgpu::server
