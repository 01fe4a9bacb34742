//===- lib/client/Options.h - What the environment tells the client --------===//
//
// Every RGPU_* variable the client reads, read and parsed here and nowhere else. The session
// reads its options when it is made (at `import rgpu`); how to reach the server is read again
// as each new session starts on one, because a program may set RGPU_OPSERVER after the import,
// before its first tensor.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <llvm/ADT/STLFunctionalExtras.h>

#include <cstddef>
#include <string>

namespace rgpu::client {

/// The most frames whose replies may be outstanding, whatever RGPU_MAX_INFLIGHT says.
inline constexpr size_t kMaxInFlightFrames = 64;

/// Looks an environment variable up: null if unset (std::getenv, or a table in tests).
using Lookup = llvm::function_ref<const char *(const char *)>;

/// How to reach the server and prove who we are.
struct ConnectionOptions {
  /// RGPU_OPSERVER: "host:port" or "unix:PATH"; empty: the default Unix socket.
  std::string server;
  /// RGPU_TOKEN: the token itself, for a TCP server.
  std::string token;
  /// RGPU_TOKEN_FILE: where the token is; empty: net::auth::defaultTokenPath().
  std::string tokenFile;
  /// RGPU_RECONNECT_SECONDS: how long a dropped connection may take to resume (at least 1).
  int reconnectSeconds = 60;

  static ConnectionOptions read(Lookup getenv);
  static ConnectionOptions fromEnvironment();
};

struct Options {
  ConnectionOptions connection;
  /// RGPU_MAX_INFLIGHT: steps that may wait on the server beyond those in transit (1-64).
  size_t maxInflight = 8;
  /// RGPU_DYNAMIC (0: off): graphs that differ only in sizes run as one symbolic graph.
  bool dynamic = true;
  /// RGPU_STREAM_CUT: when autograd's backward starts with at least this many ops pending,
  /// they are cut and sent first, so that the server runs the forward while the backward and
  /// the optimizer are traced. 0: never.
  uint64_t streamCutNodes = kStreamCutNodes;
  static constexpr uint64_t kStreamCutNodes = 64;
  /// RGPU_COMPRESS (0/off, 1/on, else auto): uploads travel compressed by byte plane; auto
  /// does so on a link whose fastest exchange took 2 ms or more.
  enum class Compress { Never, Auto, Always } compress = Compress::Auto;
  /// RGPU_UPLOAD_STORE (0: off): uploads of 1 MiB or more are named by their digest, and the
  /// server's content store supplies those it holds for this principal.
  bool contentUploads = true;
  /// Where shipped graphs are kept for rgpu-trace-dump (RGPU_CACHE_DIR, see
  /// wire::defaultCacheDir); empty keeps none.
  std::string cacheDir;

  static Options read(Lookup getenv);
  static Options fromEnvironment();
};

} // namespace rgpu::client
