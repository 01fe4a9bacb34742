#include "Transport.h"

#include "rgpu/bridge/Bridge.h"
#include "rgpu/client/Errors.h"
#include "rgpu/ir/Error.h"
#include "rgpu/net/Auth.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <pthread.h>
#include <thread>
#include <unistd.h>

namespace rgpu::client {

namespace {

/// Forks of this process, counted in the child: a connection opened before the last fork
/// belongs to the parent.
std::atomic<uint64_t> gForks{0};
const bool forkCounted = [] {
  pthread_atfork(nullptr, nullptr, [] { gForks.fetch_add(1, std::memory_order_relaxed); });
  return true;
}();

using Clock = std::chrono::steady_clock;

std::string bytesOf(capnp::Data::Reader d) {
  return std::string(reinterpret_cast<const char *>(d.begin()), d.size());
}

kj::ArrayPtr<const kj::byte> dataOf(const std::string &s) {
  return kj::arrayPtr(reinterpret_cast<const kj::byte *>(s.data()), s.size());
}

/// "2.13.0" -> "2.13": op schemas are stable within a minor release.
std::string minorOf(const std::string &v) { return v.substr(0, v.find('.', v.find('.') + 1)); }

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

/// A token for a TCP server, and where it came from.
struct Token {
  std::string value, source;
};

/// The token for a TCP server: RGPU_TOKEN, else the file named by RGPU_TOKEN_FILE, else the
/// default token file. A failure says what was looked at (or why the file is unusable).
llvm::Expected<Token> findToken(const ConnectionOptions &options) {
  if (!options.token.empty())
    return Token{options.token, "RGPU_TOKEN"};
  const bool named = !options.tokenFile.empty();
  const std::string path = named ? options.tokenFile : net::auth::defaultTokenPath();
  Token token;
  token.source = (named ? "RGPU_TOKEN_FILE=" : "the token file ") + path;
  if (!named && ::access(path.c_str(), F_OK) != 0)
    return failure("RGPU_TOKEN and RGPU_TOKEN_FILE are unset, and " + path + " does not exist");
  auto value = net::auth::readToken(path);
  if (!value)
    return value.takeError();
  token.value = std::move(*value);
  return token;
}

const char *kTokenHelp =
    "rgpu-opserver prints where its token is when it starts (by default ~/.config/rgpu/token "
    "on its host); copy that file here (mode 0600) or set RGPU_TOKEN to its contents, or use "
    "`rgpu-run --host`, which reaches the server's own socket over ssh and needs no token";

/// A server that answered the Hello and will not resume the session: retrying cannot help.
class NotResumed : public llvm::ErrorInfo<NotResumed> {
public:
  static char ID;
  explicit NotResumed(std::string why) : why_(std::move(why)) {}
  void log(llvm::raw_ostream &os) const override { os << why_; }
  std::error_code convertToErrorCode() const override { return llvm::inconvertibleErrorCode(); }

private:
  std::string why_;
};
char NotResumed::ID;

} // namespace

Transport::Transport(std::function<void(int, const std::string &)> log) : log_(std::move(log)) {}

std::string Transport::address() const {
  if (!wanted_.empty())
    return wanted_;
  std::string server = ConnectionOptions::fromEnvironment().server;
  return !server.empty() ? server : "unix:" + net::auth::defaultSocketPath();
}

std::string Transport::connectionFailure() const {
  const std::string &why = socket_.error();
  return why.empty() ? "the connection failed" : "the connection failed: " + why;
}

void Transport::lose(const std::string &why) {
  // Before a first Hello was accepted there was no session, and nothing on the server to lose.
  lostReason_ = "rgpu session lost: " + why +
                (instance_.empty() ? std::string(".")
                                   : ". Tensors on the server are gone; call rgpu.reset() to "
                                     "start a new session (or restart the program).");
  socket_.close();
  kept_.clear();
  keptBytes_ = 0;
  raise(ErrorKind::SessionLost, lostReason_);
}

bool Transport::inherited() const {
  return forksAtOpen_ != gForks.load(std::memory_order_relaxed) && socket_.connected();
}

void Transport::leaveInherited() {
  if (!inherited())
    return;
  socket_.close(); // this process's descriptor: the parent's connection stays open
  kept_.clear();
  keptBytes_ = 0;
  if (lostReason_.empty())
    lostReason_ = "rgpu session lost: this process was forked (fork(), or multiprocessing's "
                  "'fork' start method) from the process whose rgpu session it is, and that "
                  "session's connection is not this process's to use. Create rgpu tensors "
                  "after the fork, in processes started with the 'spawn' method (as with "
                  "CUDA), or call rgpu.reset() here to start this process's own session";
}

llvm::Error Transport::open(int timeoutMs) {
  forksAtOpen_ = gForks.load(std::memory_order_relaxed);
  decoder_ = std::make_unique<net::FrameDecoder>(limits_.maxFrameBytes);
  std::string error;
  if (!tcp_)
    return socket_.connectUnix(endpoint_.path, error) ? llvm::Error::success() : failure(error);
  if (!socket_.connect(endpoint_.host, endpoint_.port, error, options_.reconnectSeconds,
                       timeoutMs))
    return failure(error);
  socket_.readFramesExactly(); // until the Hello's keys seal the rest
  return llvm::Error::success();
}

void Transport::connect() {
  leaveInherited();
  if (lost())
    raise(ErrorKind::SessionLost, lostReason_);
  options_ = ConnectionOptions::fromEnvironment();
  address_ = !wanted_.empty()          ? wanted_
             : !options_.server.empty() ? options_.server
                                        : "unix:" + net::auth::defaultSocketPath();
  if (!net::parseEndpoint(address_, endpoint_))
    raise(ErrorKind::SessionLost,
          "RGPU_OPSERVER='" + address_ + "' is neither host:port (e.g. 127.0.0.1:9720) nor "
          "unix:PATH (e.g. unix:" + net::auth::defaultSocketPath() + ")");
  tcp_ = !endpoint_.isUnix();
  if (llvm::Error error = open(options_.reconnectSeconds * 1000))
    raise(ErrorKind::SessionLost,
          "cannot reach rgpu-opserver at " + address_ + " (" + message(std::move(error)) + "). " +
              (tcp_ ? "Start one with `rgpu-opserver --port " + std::to_string(endpoint_.port) +
                          "` on the GPU host, or"
                    : std::string("Start `rgpu-opserver` on this machine, or")) +
              " point RGPU_OPSERVER at one (see `rgpu-run --help`).");
  if (llvm::Error error = handshake(false, 60000))
    lose(message(std::move(error)));
}

net::Frame Transport::receiveHandshake(int timeoutMs, bool &ok) {
  net::Frame frame;
  for (;;) {
    auto status = socket_.receive(*decoder_, frame, timeoutMs);
    ok = status == net::Socket::Status::Ok;
    if (!ok)
      return frame;
    auto reader = net::openFrame(frame, limits_);
    if (!reader->getRoot<wire::ServerFrame>().getHeartbeat())
      return frame;
  }
}

llvm::Error Transport::handshake(bool resume, int timeoutMs) {
  // Over TCP the server speaks first: a challenge, which the Hello answers with a MAC under
  // the token (the token itself never travels). Over the Unix socket the server knows the
  // peer's uid and sends nothing first.
  std::string challenge;
  Token token;
  bool ok = true;
  auto noAnswer = [&](const std::string &what) {
    socket_.close();
    return failure("rgpu-opserver at " + address_ + (ok ? " " : " sent no ") + what +
                   (ok ? "" : " within " + seconds(timeoutMs / 1000.0)));
  };
  if (tcp_) {
    net::Frame first = receiveHandshake(timeoutMs, ok);
    if (!ok)
      return noAnswer("challenge");
    auto reader = net::openFrame(first, limits_);
    auto sf = reader->getRoot<wire::ServerFrame>();
    if (sf.hasError())
      lose("rgpu-opserver at " + address_ + " refused the connection: " +
           std::string(sf.getError().getMessage()));
    if (!sf.hasChallenge() || sf.getChallenge().getNonce().size() != net::auth::kNonceBytes)
      lose("rgpu-opserver at " + address_ + " did not start with a challenge: it is not an "
           "rgpu-opserver of this version");
    challenge = bytesOf(sf.getChallenge().getNonce());
    llvm::Expected<Token> found = findToken(options_);
    if (!found) {
      socket_.close();
      lostReason_ = "rgpu-opserver at " + address_ + " needs a token over TCP, and this client "
                    "has none (" + message(found.takeError()) + "). " + kTokenHelp + ".";
      raise(ErrorKind::Auth, lostReason_);
    }
    token = std::move(*found);
  }
  if (!resume)
    sessionId_ = net::auth::randomBytes(16);
  std::string nonce = net::auth::randomBytes(net::auth::kNonceBytes);
  capnp::MallocMessageBuilder b;
  auto frame = b.initRoot<wire::ClientFrame>();
  frame.setSeq(0); // a Hello is never replayed
  frame.setWantReply(true);
  auto h = frame.initCommands(1)[0].initHello();
  h.setProtocol(wire::kProtocolVersion);
  h.setTorchVersion(bridge::torchVersion());
  h.setSessionId(dataOf(sessionId_));
  h.setResumeFrom(resume ? acked_ + 1 : 0);
  h.setClientNonce(dataOf(nonce));
  if (tcp_)
    h.setAuthMac(dataOf(net::auth::clientMac(token.value, challenge, nonce)));
  const auto sent = Clock::now();
  if (!socket_.sendAll(net::encodeFrame(b, true)))
    return noAnswer("closed the connection before the Hello");
  net::Frame reply = receiveHandshake(timeoutMs, ok);
  if (!ok)
    return noAnswer("reply to the Hello");
  roundTrip_ = std::min(roundTrip_, Clock::now() - sent);
  auto reader = net::openFrame(reply, limits_);
  auto sf = reader->getRoot<wire::ServerFrame>();
  if (sf.hasError()) {
    auto e = sf.getError();
    std::string message = e.getMessage();
    if (e.getKind() == wire::Error::Kind::AUTH) {
      socket_.close();
      raise(ErrorKind::Auth,
            lostReason_ = "rgpu-opserver at " + address_ + " refused this client: " + message +
                (tcp_ ? " (the client used " + token.source + ", fingerprint " +
                            net::auth::fingerprint(token.value) + "; the server logs its own token's "
                            "fingerprint when it starts). " + kTokenHelp + "."
                      : std::string(".")));
    }
    lose(message);
  }
  if (sf.getResults().size() != 1 || sf.getResults()[0].which() != wire::Result::HELLO)
    lose("rgpu-opserver at " + address_ + " answered the Hello with something else");
  auto hr = sf.getResults()[0].getHello();
  if (tcp_ && !net::auth::sameMac(bytesOf(hr.getServerMac()),
                                  net::auth::serverMac(token.value, challenge, nonce))) {
    socket_.close();
    raise(ErrorKind::Auth, lostReason_ = "the server at " + address_ + " did not prove that it "
                           "holds the token from " + token.source + ": it is not the rgpu-opserver "
                           "you meant, or it has another token");
  }
  if (tcp_) // everything after the Hello travels sealed, under keys of this Hello
    socket_.seal(net::deriveKeys(token.value, challenge, nonce));
  std::string theirs = hr.getTorchVersion();
  if (minorOf(theirs) != minorOf(bridge::torchVersion()))
    lose("version mismatch: this client runs torch " + bridge::torchVersion() +
         ", rgpu-opserver at " + address_ + " runs torch " + theirs +
         "; install the same torch minor release on both sides");
  if (hr.getProtocol() != wire::kProtocolVersion)
    lose("version mismatch: rgpu protocol " + std::to_string(wire::kProtocolVersion) +
         " here, " + std::to_string(hr.getProtocol()) + " on the server");
  std::string instance = bytesOf(hr.getInstance());
  if (resume) {
    if (!hr.getResumed()) {
      socket_.close();
      return llvm::make_error<NotResumed>(
          instance != instance_
              ? "rgpu-opserver at " + address_ + " restarted: it is a new server process, "
                "and the session's tensors went with the old one"
              : "rgpu-opserver at " + address_ + " no longer holds this session: it was not "
                "resumed within the server's --session-grace of " +
                std::to_string(graceSeconds_) + " s");
    }
    acknowledge(hr.getLastSeq());
  } else {
    instance_ = instance;
    graceSeconds_ = hr.getSessionGrace();
    graphBudget_ = hr.getGraphBudget();
    if (uint64_t chunk = hr.getUploadChunk(); chunk > 0)
      limits_.uploadChunkBytes = std::min(limits_.uploadChunkBytes, chunk);
    serverHello_ = {hr.getProtocol(), theirs, hr.getDevice(), hr.getCompiler(), {}};
    for (capnp::Text::Reader d : hr.getDevices())
      serverHello_.devices.push_back(d);
    if (serverHello_.devices.empty())
      serverHello_.devices.push_back(serverHello_.device);
  }
  return llvm::Error::success();
}

void Transport::acknowledge(uint64_t seq) {
  acked_ = std::max(acked_, seq);
  while (!kept_.empty() && kept_.front().first <= acked_) {
    keptBytes_ -= kept_.front().second.size();
    kept_.pop_front();
  }
}

void Transport::send(uint64_t seq, std::string bytes) {
  leaveInherited();
  if (lost())
    raise(ErrorKind::SessionLost, lostReason_);
  keptBytes_ += bytes.size();
  kept_.emplace_back(seq, std::move(bytes));
  lastSent_ = seq;
  lastSentAt_ = Clock::now();
  if (!socket_.connected() || !socket_.sendAll(kept_.back().second))
    recover("the connection closed while a frame was sent", Clock::now());
}

bool Transport::poll(net::Frame &out) {
  leaveInherited();
  if (lost())
    raise(ErrorKind::SessionLost, lostReason_);
  for (;;) {
    auto status = socket_.connected() ? socket_.receive(*decoder_, out, 0, /*spin=*/false)
                                      : net::Socket::Status::Closed;
    if (status == net::Socket::Status::Timeout)
      return false;
    if (status != net::Socket::Status::Ok) {
      recover(status == net::Socket::Status::Closed ? "the connection closed"
                                                     : connectionFailure(),
              Clock::now());
      continue;
    }
    try {
      auto sf = net::openFrame(out, limits_)->getRoot<wire::ServerFrame>();
      if (sf.getHeartbeat())
        continue;
      acknowledge(sf.getAckSeq());
    } catch (const kj::Exception &) {
      // Malformed: the session reports it.
    }
    return true;
  }
}

net::Frame Transport::receive(uint64_t seq,
                              const std::function<void(const net::Frame &)> &earlier, bool spin) {
  leaveInherited();
  if (lost())
    raise(ErrorKind::SessionLost, lostReason_);
  // A server serving this client's frames sends a heartbeat every half second: this long a
  // silence means a hung server or a dead link.
  const int silenceMs = std::clamp(options_.reconnectSeconds * 500, 1500, 10000);
  auto heard = Clock::now();
  // Waited for in slices while an interrupt may come (see setInterruptCheck).
  bool cancelled = false, first = true;
  for (;;) {
    if (interrupted_ && !cancelled && interrupted_())
      cancelled = cancel() > 0;
    const bool sliced = interrupted_ && !cancelled;
    net::Frame frame;
    auto status = socket_.connected()
                      ? socket_.receive(*decoder_, frame,
                                        sliced ? std::min(silenceMs, kInterruptPollMs) : silenceMs,
                                        spin && first)
                      : net::Socket::Status::Closed;
    first = false;
    if (status == net::Socket::Status::Timeout && sliced &&
        Clock::now() - heard < std::chrono::milliseconds(silenceMs))
      continue;
    if (status == net::Socket::Status::Ok) {
      heard = Clock::now();
      uint64_t ack = seq;
      bool fatal = false;
      try {
        auto reader = net::openFrame(frame, limits_);
        auto sf = reader->getRoot<wire::ServerFrame>();
        if (sf.getHeartbeat())
          continue;
        acknowledge(sf.getAckSeq());
        ack = sf.getAckSeq();
        fatal = sf.hasError() && sf.getError().getKind() != wire::Error::Kind::REMOTE;
      } catch (const kj::Exception &) {
        // Malformed: the session reports it.
      }
      if (ack >= seq || fatal) {
        if (seq == lastSent_)
          fastestReply_ = std::min(fastestReply_, heard - lastSentAt_);
        return frame;
      }
      earlier(frame);
      continue;
    }
    bool silent = status == net::Socket::Status::Timeout;
    recover(silent ? "no answer for " + seconds(silenceMs / 1000.0)
            : status == net::Socket::Status::Closed ? std::string("the connection closed")
                                                   : connectionFailure(),
            silent ? heard : Clock::now());
    heard = Clock::now();
  }
}

void Transport::recover(const std::string &why, Clock::time_point since) {
  socket_.close();
  if (sessionId_.empty())
    lose(why);
  auto start = Clock::now();
  auto deadline = since + std::chrono::seconds(options_.reconnectSeconds);
  log_(30, "rgpu: lost the connection to rgpu-opserver at " + address_ + " (" + why +
               "); resuming the session, for up to " + std::to_string(options_.reconnectSeconds) +
               " s (RGPU_RECONNECT_SECONDS)");
  std::string last = why;
  auto backoff = std::chrono::milliseconds(50);
  while (Clock::now() < deadline) {
    const int left = int(std::max<int64_t>(
        100, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now())
                 .count()));
    if (llvm::Error error = open(left)) {
      last = message(std::move(error));
    } else if (llvm::Error hello = handshake(true, left)) {
      if (hello.isA<NotResumed>())
        lose(message(std::move(hello)));
      last = message(std::move(hello));
    } else {
      // Counted as soon as the server has taken the session back: a connection lost again
      // while the kept frames go out is one more resume, not part of this one.
      ++reconnects_;
      log_(30, "rgpu: resumed the session on rgpu-opserver at " + address_ + " after " +
                   seconds(std::chrono::duration<double>(Clock::now() - start).count()) +
                   " without a connection; sending " + std::to_string(kept_.size()) +
                   " frame(s) again");
      keepAnchor();
      bool sent = true;
      for (const auto &kept : kept_)
        if (!(sent = socket_.sendAll(kept.second)))
          break;
      if (sent)
        return;
      socket_.close();
      last = "the connection closed again while frames were sent again";
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(
        backoff, std::max<Clock::duration>(deadline - Clock::now(), Clock::duration::zero())));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
  lose("rgpu-opserver at " + address_ + " could not be reached again within " +
       std::to_string(options_.reconnectSeconds) + " s (RGPU_RECONNECT_SECONDS; " + last + ")");
}

namespace {
enum class Control { Sync, Bye, Cancel };
/// A frame numbered \p seq of one command: a Sync or a Bye, which ask for a reply, or a Cancel,
/// flagged for the server's I/O loop.
std::string controlFrame(uint64_t seq, Control kind) {
  capnp::MallocMessageBuilder b;
  auto frame = b.initRoot<wire::ClientFrame>();
  frame.setSeq(seq);
  frame.setWantReply(kind != Control::Cancel);
  auto cmd = frame.initCommands(1)[0];
  switch (kind) {
  case Control::Sync: cmd.setSync(); break;
  case Control::Bye: cmd.setBye(); break;
  case Control::Cancel: cmd.setCancel(); break;
  }
  return net::encodeFrame(b, true, kind == Control::Cancel ? net::kFlagCancel : 0);
}
} // namespace

uint64_t Transport::cancel() {
  if (lost() || sessionId_.empty() || lastSent_ == 0)
    return 0;
  cancelledThrough_ = lastSent_;
  const uint64_t seq = nextSeq();
  send(seq, controlFrame(seq, Control::Cancel));
  return cancelledThrough_;
}

void Transport::keepAnchor() {
  const uint64_t seq = nextSeq();
  std::string bytes = controlFrame(seq, Control::Sync);
  keptBytes_ += bytes.size();
  kept_.emplace_back(seq, std::move(bytes));
  lastSent_ = seq;
  lastSentAt_ = Clock::now();
}

void Transport::close() {
  leaveInherited();
  if (socket_.connected() && !lost() && !sessionId_.empty()) {
    // The Bye waits (briefly) for its reply: a server that sees the connection end before it
    // has read the Bye would keep the session for a resume. Best effort: a lost Bye costs the
    // server the grace period, never this client more than a second.
    const uint64_t seq = nextSeq();
    if (socket_.sendAll(controlFrame(seq, Control::Bye))) {
      auto until = Clock::now() + std::chrono::seconds(1);
      for (net::Frame reply; Clock::now() < until;) {
        int ms = int(std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now())
                         .count());
        if (socket_.receive(*decoder_, reply, std::max(ms, 1)) != net::Socket::Status::Ok)
          break;
        try {
          if (net::openFrame(reply, limits_)->getRoot<wire::ServerFrame>().getAckSeq() == seq)
            break;
        } catch (const kj::Exception &) {
          break;
        }
      }
    }
  }
  socket_.close();
}

void Transport::reset() {
  close();
  lostReason_.clear();
  sessionId_.clear();
  seq_ = acked_ = 0;
  kept_.clear();
  keptBytes_ = 0;
  roundTrip_ = fastestReply_ = Clock::duration::max(); // the next session may be elsewhere
}

} // namespace rgpu::client
