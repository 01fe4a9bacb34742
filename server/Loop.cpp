#include "Loop.h"
#include "Context.h"
#include "Device.h"
#include "Log.h"
#include "Pool.h"

#include "rgpu/ir/Error.h"
#include "rgpu/net/Auth.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <uv.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <list>
#include <mutex>
#include <unordered_map>

namespace rgpu::server {

namespace {
constexpr uint64_t kHeartbeatMs = 500;
/// Connections the kernel may hold before they are accepted (it caps this at somaxconn): a burst
/// past it would leave peers whose handshake the server never sees.
constexpr int kListenBacklog = 4096;
} // namespace

using Server = Loop::State;

// Not in an anonymous namespace: Loop::State holds them.
namespace loop {

struct Connection {
  /// The stream: TCP or a Unix-domain socket (both begin with a uv_stream_t).
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } h;
  /// Closes a connection that does not authenticate in time, or whose frame stalls.
  uv_timer_t timer;
  int handlesOpen = 2; ///< the stream and the timer; the connection is freed when both are closed
  uint64_t id = 0;
  uint64_t acceptedMs = 0, lastByteMs = 0;
  Server *server = nullptr;
  net::FrameDecoder decoder;
  std::unique_ptr<net::Opener> opener; ///< once its TCP Hello set the session's keys
  std::string opened;                  ///< what the last read opened
  /// Bytes of frames not yet served (the one arriving, those queued) charged to chargedTo
  /// (null: to the server alone), see chargeFrames.
  uint64_t charged = 0;
  std::shared_ptr<memory::Account> chargedTo;
  std::shared_ptr<Slot> slot;
  std::list<Connection *>::iterator unauthenticated; ///< its place in Server::waiting
  bool waiting = false;                               ///< in Server::waiting
  bool closing = false;
  bool reading = false;
  uint64_t lastWriteMs = 0;
  Connection(uint64_t maxFrame) : decoder(maxFrame) {}
  uv_stream_t *stream() { return reinterpret_cast<uv_stream_t *>(&h); }
  uv_handle_t *handle() { return reinterpret_cast<uv_handle_t *>(&h); }
};


/// One listening socket.
struct Listener {
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } h;
  bool isUnix = false;
  Server *server = nullptr;
  uv_stream_t *stream() { return reinterpret_cast<uv_stream_t *>(&h); }
};

} // namespace loop

using loop::Connection;
using loop::Listener;

struct Loop::State {
  uv_loop_t *loop;
  std::vector<std::unique_ptr<Listener>> listeners;
  std::string socketPath; ///< removed at exit
  /// Who TCP peers may prove to be; empty if there is no TCP listener.
  std::shared_ptr<const std::vector<Principal>> principals;
  uv_async_t wake;
  uv_timer_t ticker; ///< heartbeats, and parked sessions whose grace passed
  uv_timer_t exitTimer; ///< started once the CUDA context is lost
  uv_signal_t sigint, sigterm;
  Context *ctx;
  ConnectionLimits limits;
  Pool pool;
  uint64_t nextId = 1;
  std::unordered_map<uint64_t, Connection *> conns;
  std::list<Connection *> waiting; ///< unauthenticated connections, oldest first
  uint64_t waitingDropped = 0, lastDropLogMs = 0;
  std::mutex outMu;
  std::deque<Outgoing> outbox; ///< under outMu: what pool threads handed the loop

  State(Context &ctx, ConnectionLimits limits, int spinUs)
      : loop(uv_default_loop()), ctx(&ctx), limits(limits),
        pool(ctx, limits.bufferedBytes, spinUs, [this](Outgoing o) { post(std::move(o)); }) {}

  /// Hands \p o to the loop (from any thread).
  void post(Outgoing o) {
    {
      std::lock_guard<std::mutex> lock(outMu);
      outbox.push_back(std::move(o));
    }
    uv_async_send(&wake);
  }
};

namespace {

std::string errorFrame(const std::string &message, wire::Error::Kind kind) {
  capnp::MallocMessageBuilder reply;
  auto e = reply.initRoot<wire::ServerFrame>().initError();
  e.setMessage(message);
  e.setKind(kind);
  return net::encodeFrame(reply, true);
}

/// The close callback of a connection's handles; the last one frees the connection.
void onHandleClosed(uv_handle_t *h) {
  auto *conn = static_cast<Connection *>(h->data);
  if (--conn->handlesOpen == 0)
    delete conn;
}

void leaveWaiting(Connection *c) {
  if (c->waiting) {
    c->server->waiting.erase(c->unauthenticated);
    c->waiting = false;
  }
}

void closeConnection(Connection *c) {
  if (c->closing)
    return;
  c->closing = true;
  Server *server = c->server;
  memory::creditFrames(c->chargedTo.get(), c->charged);
  c->charged = 0;
  {
    std::lock_guard<std::mutex> lock(c->slot->mu);
    c->slot->stopped = true;
    c->slot->queue.clear();
  }
  {
    std::lock_guard<std::mutex> lock(c->slot->writeMu); // no pool thread sends past this
    c->slot->fd = -1;
  }
  c->slot->signals.closed = true;
  server->pool.schedule(c->slot); // a pool thread ends the session
  server->conns.erase(c->id);
  --server->ctx->connectionsOpen;
  leaveWaiting(c);
  uv_timer_stop(&c->timer);
  uv_close(reinterpret_cast<uv_handle_t *>(&c->timer), onHandleClosed);
  uv_close(c->handle(), onHandleClosed);
}

void onRead(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf);

void onAlloc(uv_handle_t *, size_t suggested, uv_buf_t *buf) {
  buf->base = static_cast<char *>(malloc(suggested));
  buf->len = buf->base ? suggested : 0;
}

void write(Connection *c, std::shared_ptr<const std::string> bytes, bool close, bool counted);

/// Ends \p c after an error frame saying \p why (sealed if its frames are), logged too.
void endWith(Connection *c, const std::string &why) {
  log(c->slot->peer + ": " + why + "; closing the connection");
  std::shared_ptr<const std::string> bytes;
  c->slot->send(std::make_shared<const std::string>(errorFrame(why, wire::Error::Kind::PROTOCOL)),
                false, false, [&](std::shared_ptr<const std::string> b, bool) { bytes = b; });
  c->slot->outBytes += bytes ? bytes->size() : 0;
  if (bytes)
    write(c, std::move(bytes), true, /*counted=*/true);
  else
    closeConnection(c);
}

/// Charges the bytes \p c holds of frames not yet served (the one arriving and those
/// queued) to its session's memory account once it has one, and to the server's total in any
/// case: half-received frames count toward --session-memory and --memory-limit like tensors.
/// False, the connection ended with an error saying so, past either.
bool chargeFrames(Connection *c) {
  std::shared_ptr<memory::Account> account;
  {
    std::lock_guard<std::mutex> lock(c->slot->mu);
    account = c->slot->account;
  }
  if (account != c->chargedTo) { // the session started, or was resumed: its account from now
    memory::creditFrames(c->chargedTo.get(), c->charged);
    c->charged = 0;
    c->chargedTo = account;
  }
  const uint64_t now = c->decoder.bufferedBytes() + c->slot->queuedBytes.load();
  if (now < c->charged) {
    memory::creditFrames(account.get(), c->charged - now);
  } else if (now > c->charged) {
    try {
      memory::chargeFrames(account.get(), now - c->charged);
    } catch (const c10::Error &e) {
      endWith(c, std::string("its frames in flight: ") + e.what_without_backtrace());
      return false;
    }
  }
  c->charged = now;
  return true;
}

/// What the frame \p c is receiving may still be given, in bytes: what its session's quota
/// and the server's limit leave, besides what they hold (its frames counted as chargeFrames
/// last charged them, so the frame being received counts as room).
uint64_t frameBudget(Connection *c) {
  const uint64_t queued = c->slot->queuedBytes.load(), mine = c->charged;
  auto left = [&](uint64_t cap, uint64_t held) {
    const uint64_t others = held > mine ? held - mine : 0;
    return cap > others + queued ? cap - others - queued : 0;
  };
  uint64_t budget = ~uint64_t(0);
  if (uint64_t limit = memory::limit())
    budget = left(limit, memory::held());
  std::lock_guard<std::mutex> lock(c->slot->mu);
  if (const auto &a = c->slot->account; a && a->quota && a == c->chargedTo)
    budget = std::min(budget, left(a->quota, a->held));
  return budget;
}

/// Reads while the connection has room: fewer frames waiting than its limits, fewer reply bytes
/// unsent. A peer that stops reading its replies is therefore no longer read either.
void updateReading(Connection *c) {
  if (c->closing || !chargeFrames(c))
    return;
  const ConnectionLimits &l = c->server->limits;
  bool full;
  {
    std::lock_guard<std::mutex> lock(c->slot->mu);
    full = c->slot->queue.size() >= l.bufferedFrames;
  }
  full = full || c->slot->queuedBytes >= l.bufferedBytes || c->slot->outBytes >= l.bufferedBytes;
  c->slot->readPaused = full;
  if (full && c->reading) {
    uv_read_stop(c->stream());
    c->reading = false;
  } else if (!full && !c->reading) {
    uv_read_start(c->stream(), onAlloc, onRead);
    c->reading = true;
  }
}

constexpr uint64_t kMaxCancelBytes = 256;

/// A frame flagged net::kFlagCancel, as it arrives: the runs of every earlier frame of the
/// session stop now, not when the pool thread reaches this frame. Anything malformed is left to
/// the pool thread, which serves the frame in its turn.
void noteCancel(Slot &slot, const net::Frame &frame, const wire::Limits &limits) {
  if (frame.bytes > kMaxCancelBytes) // a Cancel is tens of bytes: the loop opens nothing large
    return;
  try {
    auto cf = net::openFrame(frame, limits)->getRoot<wire::ClientFrame>();
    auto commands = cf.getCommands();
    if (cf.getSeq() == 0 || commands.size() != 1 || !commands[0].isCancel())
      return;
    uint64_t through = cf.getSeq() - 1, now = slot.signals.cancelThrough.load();
    while (now < through && !slot.signals.cancelThrough.compare_exchange_weak(now, through)) {
    }
  } catch (const kj::Exception &) {
  }
}

void onRead(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf) {
  auto *c = static_cast<Connection *>(stream->data);
  if (n < 0) {
    if (n != UV_EOF)
      log(c->slot->peer + ": " + uv_strerror(n));
    closeConnection(c);
  } else if (n > 0 && !c->closing) {
    c->lastByteMs = uv_now(c->server->loop);
    bool greeted = c->slot->greeted;
    if (greeted)
      leaveWaiting(c);
    c->decoder.setMaxFrameBytes(greeted ? c->server->ctx->limits().maxFrameBytes
                                        : c->server->limits.helloFrameBytes);
    c->decoder.setBufferBudget(frameBudget(c));
    if (!c->opener) {
      std::lock_guard<std::mutex> lock(c->slot->mu);
      c->opener = std::move(c->slot->pendingOpener);
    }
    const char *bytes = buf->base;
    size_t length = size_t(n);
    if (c->opener) {
      c->opened.clear();
      if (!c->opener->open(buf->base, length, c->opened)) {
        log(c->slot->peer + ": " + c->opener->error() + "; closing the connection");
        closeConnection(c);
        free(buf->base);
        return;
      }
      bytes = c->opened.data();
      length = c->opened.size();
    }
    if (!c->decoder.feed(bytes, length)) {
      const bool memory = c->decoder.error().find("of memory left") != std::string::npos;
      if (greeted)
        endWith(c, c->decoder.error() + (memory ? " (--session-memory, --memory-limit)" : ""));
      else {
        log(c->slot->peer + ": " + c->decoder.error() + " (before its Hello was accepted); "
            "closing the connection");
        closeConnection(c);
      }
    } else {
      net::Frame frame;
      bool any = false;
      {
        std::lock_guard<std::mutex> lock(c->slot->mu);
        while (c->decoder.next(frame)) {
          if (c->slot->stopped) // a refused connection: read and dropped
            continue;
          if ((frame.flags & net::kFlagCancel) && greeted)
            noteCancel(*c->slot, frame, c->server->ctx->limits());
          c->slot->queuedBytes += frame.bytes;
          c->slot->queue.push_back(std::move(frame));
          any = true;
        }
      }
      if (any)
        c->server->pool.schedule(c->slot);
      updateReading(c); // charges what the read added, first
    }
  }
  free(buf->base);
}

/// Writes \p bytes to \p c; closes it afterwards if \p close. \p counted: the write is in the
/// slot's loopWrites already (a pool thread's reply).
void write(Connection *c, std::shared_ptr<const std::string> bytes, bool close,
           bool counted = false) {
  if (!counted) {
    std::lock_guard<std::mutex> lock(c->slot->writeMu);
    ++c->slot->loopWrites;
  }
  struct Write {
    uv_write_t req;
    std::shared_ptr<const std::string> bytes;
    Connection *conn;
    bool close;
  };
  c->lastWriteMs = uv_now(c->server->loop);
  auto *w = new Write{{}, std::move(bytes), c, close};
  uv_buf_t buf = uv_buf_init(const_cast<char *>(w->bytes->data()), w->bytes->size());
  w->req.data = w;
  int rc = uv_write(&w->req, c->stream(), &buf, 1, [](uv_write_t *req, int) {
    auto *w = static_cast<Write *>(req->data);
    Connection *conn = w->conn;
    conn->slot->outBytes -= w->bytes->size();
    {
      std::lock_guard<std::mutex> lock(conn->slot->writeMu);
      --conn->slot->loopWrites;
    }
    if (w->close) {
      closeConnection(conn);
    } else {
      updateReading(conn);
      conn->server->pool.schedule(conn->slot); // a session waiting for its replies to go out
    }
    delete w;
  });
  if (rc != 0) {
    c->slot->outBytes -= w->bytes->size();
    {
      std::lock_guard<std::mutex> lock(c->slot->writeMu);
      --c->slot->loopWrites;
    }
    delete w;
    closeConnection(c);
  }
}

/// Refuses \p c whole: one error frame, then the connection closes; nothing of it remains.
void refuse(Connection *c, const std::string &why, wire::Error::Kind kind) {
  log(c->slot->peer + ": " + why);
  ++c->server->ctx->connectionsRefused;
  {
    std::lock_guard<std::mutex> lock(c->slot->mu);
    c->slot->stopped = true;
  }
  auto frame = std::make_shared<const std::string>(errorFrame(why, kind));
  c->slot->outBytes += frame->size();
  write(c, std::move(frame), true);
}

void onTimer(uv_timer_t *t) {
  auto *c = static_cast<Connection *>(t->data);
  Server *server = c->server;
  uint64_t now = uv_now(server->loop);
  if (c->closing)
    return;
  if (!c->slot->greeted && now - c->acceptedMs >= server->limits.helloTimeoutMs) {
    log(c->slot->peer + ": not authenticated within " +
        std::to_string(server->limits.helloTimeoutMs / 1000.0).substr(0, 4) +
        " s (--hello-timeout); closing the connection");
    closeConnection(c);
  } else if (c->decoder.pendingBytes() > 0 && c->reading &&
             now - c->lastByteMs >= server->limits.frameTimeoutMs) {
    log(c->slot->peer + ": a frame stalled with " + std::to_string(c->decoder.pendingBytes()) +
        " bytes still to come, nothing for " +
        std::to_string(server->limits.frameTimeoutMs / 1000.0).substr(0, 4) +
        " s (--frame-timeout); closing the connection");
    closeConnection(c);
  }
}

void onConnection(uv_stream_t *stream, int status) {
  auto *listener = static_cast<Listener *>(stream->data);
  Server *server = listener->server;
  if (status < 0) {
    log(std::string("accept failed: ") + uv_strerror(status));
    return;
  }
  auto *c = new Connection(server->limits.helloFrameBytes);
  c->server = server;
  c->id = server->nextId++;
  if (listener->isUnix)
    uv_pipe_init(server->loop, &c->h.pipe, 0);
  else
    uv_tcp_init(server->loop, &c->h.tcp);
  c->handle()->data = c;
  uv_timer_init(server->loop, &c->timer);
  c->timer.data = c;
  c->slot = std::make_shared<Slot>();
  c->slot->connId = c->id;
  if (uv_accept(stream, c->stream()) != 0) {
    c->closing = true;
    uv_close(reinterpret_cast<uv_handle_t *>(&c->timer), onHandleClosed);
    uv_close(c->handle(), onHandleClosed);
    return;
  }
  c->acceptedMs = c->lastByteMs = uv_now(server->loop);
  uv_os_fd_t fd = -1;
  if (uv_fileno(c->handle(), &fd) == 0)
    c->slot->fd = fd; // no pool thread serves the slot yet
  server->conns[c->id] = c;
  ++server->ctx->connectionsOpen;
  std::string refusal;
  if (listener->isUnix) {
    ucred cred{};
    socklen_t len = sizeof cred;
    uv_os_fd_t fd = -1;
    bool known = uv_fileno(c->handle(), &fd) == 0 &&
                 getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
    c->slot->peer = "session " + std::to_string(c->id) + " (uid " +
                    (known ? std::to_string(cred.uid) : std::string("?")) + ")";
    if (!known || cred.uid != geteuid())
      refusal = "rgpu-opserver serves only its own user (uid " + std::to_string(geteuid()) +
                "); this connection comes from " +
                (known ? "uid " + std::to_string(cred.uid) : std::string("an unknown user"));
  } else {
    uv_tcp_nodelay(&c->h.tcp, 1);
    sockaddr_storage addr{};
    int len = sizeof addr;
    char host[64] = "?";
    if (uv_tcp_getpeername(&c->h.tcp, reinterpret_cast<sockaddr *>(&addr), &len) == 0) {
      if (addr.ss_family == AF_INET)
        uv_ip4_name(reinterpret_cast<sockaddr_in *>(&addr), host, sizeof host);
      else
        uv_ip6_name(reinterpret_cast<sockaddr_in6 *>(&addr), host, sizeof host);
    }
    c->slot->peer = "session " + std::to_string(c->id) + " (" + host + ")";
    c->slot->admission = {net::auth::randomBytes(net::auth::kNonceBytes), server->principals};
  }
  const uint64_t tickMs = std::clamp<uint64_t>(
      std::min(server->limits.helloTimeoutMs, server->limits.frameTimeoutMs) / 4, 50, 1000);
  uv_timer_start(&c->timer, onTimer, tickMs, tickMs);
  // A refused connection is read too (its slot is stopped, so nothing is kept): closing a
  // socket with unread bytes would reset it before the client reads the error frame.
  c->reading = true;
  uv_read_start(c->stream(), onAlloc, onRead);
  if (!refusal.empty()) {
    refuse(c, refusal, wire::Error::Kind::AUTH);
    return;
  }
  // Unauthenticated connections are bounded: past the limit the oldest one goes, so a flood
  // of idle peers delays a real client by no more than its own handshake.
  if (server->waiting.size() >= server->limits.maxWaiting) {
    Connection *oldest = server->waiting.front();
    ++server->waitingDropped;
    uint64_t now = uv_now(server->loop);
    if (now - server->lastDropLogMs >= 1000) {
      log(std::to_string(server->waitingDropped) + " unauthenticated connection(s) closed to "
          "stay within " + std::to_string(server->limits.maxWaiting) + " (--max-pending)");
      server->lastDropLogMs = now;
      server->waitingDropped = 0;
    }
    closeConnection(oldest);
  }
  c->unauthenticated = server->waiting.insert(server->waiting.end(), c);
  c->waiting = true;
  if (!c->slot->admission.challenge.empty()) {
    capnp::MallocMessageBuilder b;
    const std::string &nonce = c->slot->admission.challenge;
    b.initRoot<wire::ServerFrame>().initChallenge().setNonce(
        kj::arrayPtr(reinterpret_cast<const kj::byte *>(nonce.data()), nonce.size()));
    auto frame = std::make_shared<const std::string>(net::encodeFrame(b, true));
    c->slot->outBytes += frame->size();
    write(c, std::move(frame), false);
  }
}

/// Ends the server the way SIGTERM does: running compiles killed, the socket removed.
[[noreturn]] void shutDown(Server *server, int status) {
  server->ctx->stopCompiles();
  if (!server->socketPath.empty())
    unlink(server->socketPath.c_str());
  std::_Exit(status);
}

void onDeviceLost(uv_timer_t *t) {
  auto *server = static_cast<Server *>(t->data);
  log("exiting with status " + std::to_string(device::kExitDeviceLost) + " for a supervisor to "
      "restart the server: the CUDA context cannot be used after: " +
      server->ctx->deviceLost().value_or(""));
  shutDown(server, device::kExitDeviceLost);
}

void onWake(uv_async_t *handle) {
  auto *server = static_cast<Server *>(handle->data);
  // The CUDA context is lost: the failing session's reply (in this batch) goes out first.
  if (server->ctx->deviceLost() && !uv_is_active(reinterpret_cast<uv_handle_t *>(&server->exitTimer)))
    uv_timer_start(&server->exitTimer, onDeviceLost, 200, 0);
  std::deque<Outgoing> batch;
  {
    std::lock_guard<std::mutex> lock(server->outMu);
    batch.swap(server->outbox);
  }
  for (Outgoing &o : batch) {
    auto it = server->conns.find(o.conn);
    if (it == server->conns.end())
      continue;
    Connection *c = it->second;
    if (c->slot->greeted)
      leaveWaiting(c);
    if (o.bytes)
      write(c, std::move(o.bytes), o.close, true);
    else if (o.close)
      closeConnection(c);
    else
      updateReading(c); // a frame was served: room to read again, perhaps
  }
}

/// Every half second: a heartbeat to each client whose frames are being served and that has
/// heard nothing for that long (so it can tell a busy server from a hung one), and parked
/// sessions whose grace passed are dropped.
void onTick(uv_timer_t *t) {
  auto *server = static_cast<Server *>(t->data);
  static const auto heartbeat = [] {
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::ServerFrame>().setHeartbeat(true);
    return std::make_shared<const std::string>(net::encodeFrame(b, true));
  }();
  uint64_t now = uv_now(server->loop);
  std::vector<Connection *> busy;
  for (auto &[id, c] : server->conns) {
    uint64_t lastWrite = std::max(c->lastWriteMs, c->slot->directWriteMs.load());
    if (c->closing || !c->slot->greeted || now - std::min(now, lastWrite) < kHeartbeatMs)
      continue;
    std::lock_guard<std::mutex> lock(c->slot->mu);
    if (c->slot->scheduled || !c->slot->queue.empty())
      busy.push_back(c);
  }
  for (Connection *c : busy) {
    std::shared_ptr<const std::string> beat = heartbeat;
    {
      std::lock_guard<std::mutex> lock(c->slot->writeMu);
      if (c->slot->loopWrites > 0) // bytes are on their way already
        continue;
      if (c->slot->sealer)
        beat = std::make_shared<const std::string>(c->slot->sealer->seal(*heartbeat));
      ++c->slot->loopWrites;
    }
    c->slot->outBytes += beat->size();
    write(c, std::move(beat), false, /*counted=*/true);
  }
  server->pool.wakeDeferred(); // a resume's deadline may have passed
  if (size_t n = server->ctx->expireParked())
    log(std::to_string(n) + " disconnected session(s) dropped: not resumed within " +
        std::to_string(server->ctx->sessionGraceMs / 1000) + " s (--session-grace)");
}

void onSignal(uv_signal_t *handle, int signum) {
  log(std::string("received ") + (signum == SIGINT ? "SIGINT" : "SIGTERM") + ", shutting down");
  auto *server = static_cast<Server *>(handle->data);
  // Sessions hold only in-memory state. Compiles in flight are killed and their temporary files
  // removed, so the cache holds only whole artifacts.
  shutDown(server, 0);
}

} // namespace

Loop::Loop(Context &ctx, ConnectionLimits limits, int spinUs)
    : s_(std::make_unique<State>(ctx, limits, spinUs)) {
  State &s = *s_;
  ctx.closeConnection = [&s](uint64_t connId) { s.post({connId, nullptr, true}); };
  ctx.wakeDeferred = [&s] { s.pool.wakeDeferred(); };
  uv_async_init(s.loop, &s.wake, onWake);
  s.wake.data = &s;
  uv_timer_init(s.loop, &s.exitTimer);
  s.exitTimer.data = &s;
  uv_timer_init(s.loop, &s.ticker);
  s.ticker.data = &s;
  uv_timer_start(&s.ticker, onTick, kHeartbeatMs, kHeartbeatMs);
  uv_signal_init(s.loop, &s.sigint);
  uv_signal_start(&s.sigint, onSignal, SIGINT);
  uv_signal_init(s.loop, &s.sigterm);
  s.sigint.data = s.sigterm.data = &s;
  uv_signal_start(&s.sigterm, onSignal, SIGTERM);
}

Loop::~Loop() = default;

llvm::Error Loop::listenUnix(const std::string &path) {
  std::string dir = path.substr(0, path.rfind('/'));
  if (!dir.empty())
    if (llvm::Error e = net::auth::ensurePrivateDir(dir))
      return failure("cannot listen on " + path + ": " + message(std::move(e)));
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    net::Socket probe;
    std::string ignored;
    if (!S_ISSOCK(st.st_mode))
      return failure("cannot listen on " + path + ": it exists and is not a socket");
    if (probe.connectUnix(path, ignored))
      return failure("another rgpu-opserver is listening on " + path);
    unlink(path.c_str());
  }
  auto l = std::make_unique<Listener>();
  l->isUnix = true;
  l->server = s_.get();
  uv_pipe_init(s_->loop, &l->h.pipe, 0);
  l->h.pipe.data = l.get();
  int rc = uv_pipe_bind(&l->h.pipe, path.c_str());
  if (rc == 0) {
    chmod(path.c_str(), 0600);
    rc = uv_listen(l->stream(), kListenBacklog, onConnection);
  }
  if (rc != 0)
    return failure("cannot listen on " + path + ": " + uv_strerror(rc));
  s_->socketPath = path;
  s_->listeners.push_back(std::move(l));
  return llvm::Error::success();
}

llvm::Expected<int> Loop::listenTcp(const std::string &bind, int port,
                                    std::shared_ptr<const std::vector<Principal>> principals) {
  sockaddr_storage addr{};
  if (uv_ip4_addr(bind.c_str(), port, reinterpret_cast<sockaddr_in *>(&addr)) != 0 &&
      uv_ip6_addr(bind.c_str(), port, reinterpret_cast<sockaddr_in6 *>(&addr)) != 0)
    return failure("--bind " + bind + ": not an IP address");
  s_->principals = std::move(principals);
  auto l = std::make_unique<Listener>();
  l->server = s_.get();
  uv_tcp_init(s_->loop, &l->h.tcp);
  l->h.tcp.data = l.get();
  int rc = uv_tcp_bind(&l->h.tcp, reinterpret_cast<sockaddr *>(&addr), 0);
  if (rc == 0)
    rc = uv_listen(l->stream(), kListenBacklog, onConnection);
  if (rc != 0)
    return failure("cannot listen on " + bind + ":" + std::to_string(port) + ": " +
                   uv_strerror(rc));
  int len = sizeof addr;
  uv_tcp_getsockname(&l->h.tcp, reinterpret_cast<sockaddr *>(&addr), &len);
  s_->listeners.push_back(std::move(l));
  return int(ntohs(reinterpret_cast<sockaddr_in *>(&addr)->sin_port));
}

llvm::Error Loop::startWorkers(size_t workers) { return s_->pool.start(workers); }

int Loop::run() { return uv_run(s_->loop, UV_RUN_DEFAULT); }

} // namespace rgpu::server
