//===- server/Peer.h - Who a session's peer is, and what its connection says -===//
//
// What the I/O loop hands a session about the connection it is served on: how its peer proves
// who it is, and the signals (the connection ended, a Cancel arrived) it sees as they happen.
// No ATen here: the I/O loop includes it.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace rgpu::server {

/// A name and the token that proves it: who a TCP session belongs to.
struct Principal {
  std::string name, token;
};

/// How a session's peer proves who it is, decided by the transport it came in on.
struct Admission {
  /// Empty: the peer is already known (a Unix-socket peer of this server's uid). Else the
  /// challenge sent to a TCP peer, which its Hello must answer with a MAC under the token of
  /// one of \p principals.
  std::string challenge;
  std::shared_ptr<const std::vector<Principal>> principals;
};

/// What the I/O loop tells the pool thread serving a connection's session, as it happens.
struct Signals {
  /// The connection ended: the commands of a frame still being served are dropped, not run.
  std::atomic<bool> closed{false};
  /// A Cancel arrived in frame cancelThrough + 1: the runs of frames up to cancelThrough stop
  /// (at the plan's next kernel) or are skipped.
  std::atomic<uint64_t> cancelThrough{0};
};

} // namespace rgpu::server
