//===- lib/client/Transport.h - The client's connection, which survives drops -===//
//
// The transport owns everything between a frame the session has encoded and the server's
// reply to it: connecting (Unix socket or TCP), authentication, the Hello, sending, receiving,
// acknowledgements, and resuming after a drop.
//
// Every frame has a sequence number and is kept until the server acknowledges it (each reply
// carries the last frame the server executed). When the connection drops (a closed socket, or
// a server silent for too long while the client waits: a busy server sends heartbeats), the
// transport reconnects with backoff for up to RGPU_RECONNECT_SECONDS (default 60), asks the
// server to resume its session, and sends again every frame the server had not executed; the
// server never runs a frame twice and keeps its last reply for a client that missed it. A
// server that cannot resume (restarted, or the session's grace passed) makes the session lost,
// at once, with a message that says which.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Options.h"

#include "rgpu/client/Replies.h"
#include "rgpu/net/Frame.h"
#include "rgpu/wire/Wire.h"

#include <llvm/Support/Error.h>

#include <capnp/message.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

namespace rgpu::client {

class Transport {
public:
  /// \p log receives (level, message) records; it is called with the session lock held, so it
  /// must not block (the session queues them).
  explicit Transport(std::function<void(int, const std::string &)> log);

  /// The address ("unix:PATH" or "host:port") used at the next new session; until set,
  /// RGPU_OPSERVER as it is when connecting, else the default Unix socket.
  void setAddress(std::string address) { wanted_ = std::move(address); }
  std::string address() const;
  /// "the connection failed", with what the bytes said when they said why (a sealed record
  /// that does not open, a frame the decoder refused).
  std::string connectionFailure() const;

  bool connected() const { return socket_.connected(); }
  /// Whether a session was ever started on a server (a Hello sent), lost since or not.
  bool started() const { return !sessionId_.empty(); }
  /// After SessionLost, every call raises it again with this reason, until reset().
  bool lost() const { return !lostReason_.empty(); }
  const std::string &lostReason() const { return lostReason_; }

  /// Connects and starts a new session on the server, reading how (ConnectionOptions) from the
  /// environment as it is now. Raises SessionLost or Auth.
  void connect();
  /// What the server's Hello reply said.
  uint64_t graphBudget() const { return graphBudget_; }
  const ServerHello &serverHello() const { return serverHello_; }
  uint64_t reconnects() const { return reconnects_; }
  const wire::Limits &limits() const { return limits_; }
  /// The fastest Hello round trip seen: the link's own latency, without queues behind it.
  std::chrono::steady_clock::duration roundTrip() const { return roundTrip_; }
  /// The fastest exchange seen, a Hello or a frame awaited until its reply (the server's work
  /// included): at least the link's latency, and close to it once one exchange was quick. A
  /// Hello on a busy machine can take milliseconds over loopback; a value read cannot take
  /// less than the link's round trip.
  std::chrono::steady_clock::duration fastestExchange() const {
    return std::min(roundTrip_, fastestReply_);
  }

  /// The sequence number for the next frame.
  uint64_t nextSeq() { return ++seq_; }
  /// Sends the frame numbered \p seq (encoded with that number) and keeps it until the server
  /// has executed it. A drop is survived by resuming; raises SessionLost if it cannot be.
  void send(uint64_t seq, std::string bytes);
  /// Waits for the server's reply to frame \p seq (or an error that ends the session). Replies
  /// to earlier frames that arrive first (frames whose replies nobody waited for) go to
  /// \p earlier, in order. After a resume the server may no longer have had that reply: then
  /// the next later reply is returned instead. Without \p spin, it sleeps at once (a wait that
  /// is not for a value: the CPU is better left to the server).
  net::Frame receive(uint64_t seq, const std::function<void(const net::Frame &)> &earlier,
                     bool spin = true);
  /// While receive() waits, \p check is asked every kInterruptPollMs; the first time it says
  /// yes, a Cancel goes out (cancel()) and the wait goes on for its reply, which comes soon.
  void setInterruptCheck(std::function<bool()> check) { interrupted_ = std::move(check); }
  static constexpr int kInterruptPollMs = 40;
  /// Sends a Cancel: the server stops the runs of every frame sent before it, at the plan's
  /// next kernel. Returns the last frame it covers (cancelledThrough()).
  uint64_t cancel();
  /// The last frame a Cancel covered; 0 if none did.
  uint64_t cancelledThrough() const { return cancelledThrough_; }
  /// The last frame sent.
  uint64_t lastSent() const { return lastSent_; }
  /// The next reply that has arrived, without waiting; false if none has. A dropped connection
  /// is resumed here as in receive().
  bool poll(net::Frame &out);
  /// Bytes of frames sent and not yet acknowledged.
  uint64_t unacknowledged() const { return keptBytes_; }

  /// Ends the session on the server (nothing is kept for a resume) and closes the connection.
  /// In a process forked from the one that opened it, only closes this process's descriptor.
  void close();
  /// Whether this process was forked from the one that opened the connection it holds: the
  /// socket is then shared with that process, whose session it is.
  bool inherited() const;
  /// Forgets the session: the next connect() starts a new one.
  void reset();
  /// Ends the session for good with \p why, and raises SessionLost.
  [[noreturn]] void lose(const std::string &why);

private:
  /// Says Hello on the connected socket: a new session, or with \p resume this one. Raises on
  /// authentication and version errors. Fails with NotResumed if the server answered and
  /// will not resume the session (retrying cannot help), with another error if the
  /// connection failed during the Hello.
  llvm::Error handshake(bool resume, int timeoutMs);
  /// Connects the socket to endpoint_ (parsed by connect()), giving up after \p timeoutMs.
  llvm::Error open(int timeoutMs);
  /// The next frame that is not a heartbeat; \p ok false if none came within \p timeoutMs.
  net::Frame receiveHandshake(int timeoutMs, bool &ok);
  /// Reconnects and resumes, for up to the reconnect budget counted from \p since; raises
  /// SessionLost if that fails.
  void recover(const std::string &why, std::chrono::steady_clock::time_point since);
  void acknowledge(uint64_t seq);
  /// In a process forked since the connection opened (see inherited()), marks the session lost
  /// without a word on the socket, which still carries the parent's session: a frame or a read
  /// here would end that session or take its replies.
  void leaveInherited();
  /// Keeps a Sync frame that asks for a reply (sent after a resume, so that a reply later than
  /// every frame sent before the drop arrives: replies the server no longer had are then known
  /// to be lost, not late).
  void keepAnchor();

  std::function<void(int, const std::string &)> log_;
  std::function<bool()> interrupted_;
  ConnectionOptions options_; ///< As read when the session started.
  uint64_t cancelledThrough_ = 0;
  std::string wanted_, address_;
  net::Endpoint endpoint_;
  bool tcp_ = false;
  net::Socket socket_;
  std::unique_ptr<net::FrameDecoder> decoder_;
  wire::Limits limits_;
  std::string lostReason_;
  uint64_t forksAtOpen_ = 0; ///< The process's fork count (see Transport.cpp) when the socket opened.
  ServerHello serverHello_;
  std::string sessionId_, instance_;
  uint64_t graphBudget_ = 0, graceSeconds_ = 0;
  uint64_t seq_ = 0, acked_ = 0;
  std::atomic<uint64_t> reconnects_{0}; ///< read by rgpu.stats() without the session lock
  /// Frames sent and not acknowledged, oldest first.
  std::deque<std::pair<uint64_t, std::string>> kept_;
  uint64_t keptBytes_ = 0;
  std::chrono::steady_clock::duration roundTrip_ = std::chrono::steady_clock::duration::max();
  std::chrono::steady_clock::duration fastestReply_ = std::chrono::steady_clock::duration::max();
  uint64_t lastSent_ = 0; ///< The latest frame sent, and when.
  std::chrono::steady_clock::time_point lastSentAt_;
};

} // namespace rgpu::client
