//===- server/Rendezvous.h - The job's rendezvous store, behind the job's secret ---------===//
//
// A job spread over servers (torch.distributed with the "rgpu" backend) needs a store where
// its servers meet to set up their process groups. One session of the job hosts it
// (HostStore): a Service listening on --store-host, on a port of its own, that answers only
// servers proving they hold the job's secret, a random key the HostStore reply gives to that
// session's client alone (its rendezvous address, "host:port#secret"). The handshake and the
// requests are lib/wire/store.capnp; after the handshake everything travels sealed
// (rgpu/net/Seal.h) under keys derived from the secret and both nonces.
//
// The keys and values the store holds are charged to the hosting session's memory; requests,
// connections and the time a peer may take to prove itself are bounded (the k* constants),
// and a peer past a bound is refused or disconnected without touching the others. The store
// ends with its session.
//
// No torch here: the c10d::Store that Gloo talks to wraps a Client (Groups.cpp).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/net/Frame.h"

#include <llvm/Support/Error.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace rgpu::server::rendezvous {

/// Bounds of one store.
constexpr size_t kMaxKeyBytes = 4096;
constexpr size_t kMaxValueBytes = 1 << 20;        ///< Gloo's largest: 136 bytes per rank
constexpr size_t kMaxKeys = 1 << 16;
constexpr size_t kMaxWaitKeys = 4096;
constexpr uint32_t kMaxWaitMs = 1000;
constexpr uint64_t kMaxRequestBytes = 3 * kMaxValueBytes; ///< a compareSet of two values
constexpr uint64_t kMaxTableBytes = uint64_t(256) << 20;
constexpr uint64_t kEntryOverhead = 64;           ///< charged per key besides its bytes
constexpr uint32_t kVersion = 1;
constexpr size_t kSecretBytes = 32;

/// A store's keys and values and the answer to each request, as c10d's TCPStore gives them.
class Table {
public:
  /// \p charge(n) charges n bytes (n > 0) or gives them back (n < 0) to whoever pays for the
  /// table; false refuses a charge. Everything still charged is given back at destruction.
  explicit Table(std::function<bool(int64_t)> charge = {});
  ~Table();
  Table(const Table &) = delete;
  Table &operator=(const Table &) = delete;

  /// A wait that the keys it names do not answer yet.
  struct Wait {
    std::vector<std::string> keys;
    uint32_t timeoutMs = 0;
  };
  /// Serves one request frame: its reply frame goes to \p reply, unless it is a wait that must
  /// wait (then \p wait says for what, and reply() answers it later). False for a frame that
  /// is not a request at all, which ends the connection; a refused request (a limit) is
  /// answered with an error and the connection goes on.
  bool serve(const net::Frame &request, std::string &reply, std::optional<Wait> &wait);
  /// Whether every one of \p keys is set.
  bool allSet(const std::vector<std::string> &keys) const;
  /// The reply to a wait: ok once its keys are set, missing at its timeout.
  static std::string waitReply(bool ready);
  /// Counts changes: a wait may be answerable once it moves.
  uint64_t changes() const { return changes_; }
  /// The bytes charged for the table.
  uint64_t bytes() const { return bytes_; }

private:
  /// Sets \p key; fails (setting nothing) past a bound of the store or its session's memory.
  llvm::Error put(const std::string &key, std::string value);
  std::map<std::string, std::string> entries_;
  std::function<bool(int64_t)> charge_;
  uint64_t bytes_ = 0, changes_ = 0;
};

/// What a peer's StoreHello says.
struct Hello {
  std::string nonce, mac;
};
/// Reads a StoreHello frame; nothing if it is not one.
std::optional<Hello> readHello(const net::Frame &frame);

/// A store listening for the servers of one job, each served on the Service's own thread.
class Service {
public:
  /// Listens on \p host (a free port); throws if it cannot. \p charge pays for the table
  /// (Table). Only peers proving they hold \p secret get further than the handshake.
  Service(const std::string &host, std::string secret, std::function<bool(int64_t)> charge);
  /// Closes every connection and the listener; their memory is given back.
  ~Service();
  Service(const Service &) = delete;
  Service &operator=(const Service &) = delete;
  int port() const;

  /// At most this many connections still in their handshake; more are closed on arrival.
  static constexpr int kMaxHandshakes = 16;
  /// The time one may take: then it is closed.
  static constexpr int kHandshakeMs = 5000;
  /// At most this many connections in all (a job's servers hold one each while they join).
  static constexpr int kMaxConnections = 4096;
  /// A proven connection without a request for this long is closed; its client reconnects.
  static constexpr int kIdleMs = 60000;
  /// A peer that leaves this many bytes of replies unread is disconnected.
  static constexpr uint64_t kMaxUnreadBytes = uint64_t(8) << 20;

  struct State; ///< the listener, connections and table, owned by the Service's thread

private:
  std::unique_ptr<State> s_;
};

/// A joining server's connection to a store (blocking; one thread at a time). Every call
/// throws std::runtime_error, naming the store, on a refusal, a dead store, a timeout or a
/// cancellation; a connection the store closed while idle is opened again on the next call.
class Client {
public:
  /// \p cancelled: when it turns true, waits end within kCancelPollMs with an error.
  Client(std::string host, int port, std::string secret, std::chrono::milliseconds timeout,
         std::shared_ptr<std::atomic<bool>> cancelled = {});
  ~Client();

  void set(const std::string &key, const std::string &value);
  std::optional<std::string> get(const std::string &key); ///< none if unset (no wait)
  int64_t add(const std::string &key, int64_t delta);
  bool check(const std::vector<std::string> &keys);
  /// Waits until every key is set; false after \p timeout.
  bool wait(const std::vector<std::string> &keys, std::chrono::milliseconds timeout);
  bool deleteKey(const std::string &key);
  int64_t numKeys();
  std::string compareSet(const std::string &key, const std::string &expected,
                         const std::string &desired);
  void append(const std::string &key, const std::string &value);
  /// Closes the connection (the next call opens one).
  void disconnect();

  const std::string &host() const { return host_; }
  int port() const { return port_; }
  const std::string &secret() const { return secret_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::shared_ptr<std::atomic<bool>> &cancelled() const { return cancelled_; }
  static constexpr int kCancelPollMs = 200;

private:
  struct Reply;
  /// One request and its reply, waited for \p replyTimeoutMs (negative: the store's own
  /// time to answer).
  template <typename Fill> Reply request(Fill fill, int replyTimeoutMs = -1);
  void connect();
  [[noreturn]] void fail(const std::string &why);
  std::string host_, secret_;
  int port_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<std::atomic<bool>> cancelled_;
  std::unique_ptr<net::Socket> socket_;
  std::unique_ptr<net::FrameDecoder> decoder_;
};

/// Gloo (libtorch's) publishes each rank of a group as: u64 n, n bytes of its host name, u64 m,
/// m bytes of its listener's address (a sockaddr_storage, then a sequence number), then 64-bit
/// numbers. Where the record's sockaddr_storage (of an IPv4 or IPv6 address) begins; npos if
/// \p value is no such record.
size_t glooAddressAt(const std::string &value);
/// An IPv4 or IPv6 address uses 16 or 28 of the sockaddr_storage's 128 bytes: the rest is
/// whatever the server's memory held. \p value with those bytes zeroed if it is a Gloo record,
/// else \p value.
std::string zeroAddressPadding(std::string value);

/// "host:port#secret" (the secret in hex), as a HostStore reply gives a store's address.
std::string address(const std::string &host, int port, const std::string &secret);
/// A store's address, as address() writes it.
struct StoreAddress {
  std::string host;
  int port = 0;
  std::string secret;
};
/// Parses an address(); nothing if malformed.
std::optional<StoreAddress> parseAddress(const std::string &text);

} // namespace rgpu::server::rendezvous
