//===- server/Loop.h - rgpu-opserver's one libuv loop ----------------------===//
//
// One libuv loop does all socket I/O: it accepts connections, reads and decodes their frames,
// queues them for the worker pool (Pool.h) and writes the replies a pool thread did not send
// itself. A malformed frame closes only its own connection. Peers prove who they are before
// anything of theirs is kept: a Unix-socket peer by its uid, a TCP peer by answering a
// challenge with the token (rgpu/net/Auth.h). Nothing is computed on the loop.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Peer.h"

#include <llvm/Support/Error.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace rgpu::server {

class Context;

/// The limits the I/O loop applies to each connection.
struct ConnectionLimits {
  uint64_t helloTimeoutMs = 10000; ///< to authenticate
  uint64_t frameTimeoutMs = 60000; ///< between two bytes of a frame that has begun
  uint64_t bufferedBytes = 64 << 20; ///< frames read and not yet served; replies not yet sent
  size_t bufferedFrames = 64;
  size_t maxWaiting = 1024; ///< unauthenticated connections at once; the oldest goes first
  /// Frames before the Hello is accepted are small: a peer that has not proved who it is cannot
  /// make the server buffer much.
  uint64_t helloFrameBytes = 64 << 10;
};

/// The server's I/O loop and its worker pool, serving the sessions of one Context.
class Loop {
public:
  /// Takes over \p ctx's closeConnection and wakeDeferred; SIGINT and SIGTERM end the server.
  Loop(Context &ctx, ConnectionLimits limits, int spinUs);
  ~Loop();

  /// Listens on the Unix-domain socket \p path, in a directory only this user can open. A
  /// socket left by a server that died is replaced; one that answers belongs to a live server.
  llvm::Error listenUnix(const std::string &path);
  /// Listens on TCP \p bind:\p port for peers that prove they are one of \p principals;
  /// returns the port bound (for port 0).
  llvm::Expected<int> listenTcp(const std::string &bind, int port,
                                std::shared_ptr<const std::vector<Principal>> principals);
  /// Starts the pool's \p workers threads.
  llvm::Error startWorkers(size_t workers);
  /// Runs until a signal or a lost CUDA context ends the process.
  int run();

  struct State; ///< the libuv handles, connections and pool (Loop.cpp)

private:
  std::unique_ptr<State> s_;
};

} // namespace rgpu::server
