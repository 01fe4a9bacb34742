#include "Rendezvous.h"

#include "rgpu/ir/Error.h"
#include "rgpu/net/Auth.h"
#include "rgpu/net/Seal.h"
#include "store.capnp.h"

#include <capnp/message.h>
#include <kj/exception.h>
#include <uv.h>

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>
#include <thread>

namespace rgpu::server::rendezvous {

namespace {

constexpr const char *kClientLabel = "rgpu store client v1";
constexpr const char *kServerLabel = "rgpu store server v1";
/// The handshake's frames are a few dozen bytes.
constexpr uint64_t kMaxHandshakeBytes = 4096;

std::string text(capnp::Data::Reader d) {
  return std::string(reinterpret_cast<const char *>(d.begin()), d.size());
}

capnp::Data::Reader asData(const std::string &s) {
  return capnp::Data::Reader(reinterpret_cast<const kj::byte *>(s.data()), s.size());
}

/// A request the store refuses (a limit): answered with an error, the connection goes on.
struct Refused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string key(capnp::Data::Reader d) {
  if (d.size() > kMaxKeyBytes)
    throw Refused("a key of " + std::to_string(d.size()) + " bytes (at most " +
                  std::to_string(kMaxKeyBytes) + ")");
  return text(d);
}

std::vector<std::string> keys(capnp::List<capnp::Data>::Reader list) {
  if (list.size() > kMaxWaitKeys)
    throw Refused("a request naming " + std::to_string(list.size()) + " keys (at most " +
                  std::to_string(kMaxWaitKeys) + ")");
  std::vector<std::string> out;
  out.reserve(list.size());
  for (auto k : list)
    out.push_back(key(k));
  return out;
}

wire::Limits requestLimits() {
  wire::Limits limits;
  limits.maxFrameBytes = kMaxRequestBytes;
  return limits;
}

} // namespace

//===----------------------------------------------------------------------===//
// Table
//===----------------------------------------------------------------------===//

Table::Table(std::function<bool(int64_t)> charge) : charge_(std::move(charge)) {}

Table::~Table() {
  if (charge_ && bytes_)
    charge_(-int64_t(bytes_));
}

llvm::Error Table::put(const std::string &k, std::string value) {
  if (value.size() > kMaxValueBytes)
    return failure("a value of " + std::to_string(value.size()) + " bytes (at most " +
                   std::to_string(kMaxValueBytes) + ")");
  auto it = entries_.find(k);
  if (it == entries_.end() && entries_.size() >= kMaxKeys)
    return failure("the store holds " + std::to_string(kMaxKeys) + " keys already");
  const int64_t before = it == entries_.end() ? 0 : int64_t(k.size() + it->second.size() + kEntryOverhead);
  const int64_t delta = int64_t(k.size() + value.size() + kEntryOverhead) - before;
  if (delta > 0 && bytes_ + delta > kMaxTableBytes)
    return failure("the store would hold more than " + std::to_string(kMaxTableBytes >> 20) +
                   " MiB");
  if (delta > 0 && charge_ && !charge_(delta))
    return failure("the session that hosts the store has no memory left for " +
                   std::to_string(delta) + " more bytes of it (--session-memory)");
  if (delta < 0 && charge_)
    charge_(delta);
  bytes_ += delta;
  entries_[k] = std::move(value);
  ++changes_;
  return llvm::Error::success();
}

bool Table::allSet(const std::vector<std::string> &keys) const {
  for (const std::string &k : keys)
    if (!entries_.count(k))
      return false;
  return true;
}

std::string Table::waitReply(bool ready) {
  capnp::MallocMessageBuilder out;
  auto r = out.initRoot<wire::StoreReply>();
  if (ready)
    r.setOk();
  else
    r.setMissing();
  return net::encodeFrame(out, true);
}

bool Table::serve(const net::Frame &frame, std::string &reply, std::optional<Wait> &wait) {
  wait.reset();
  reply.clear();
  capnp::MallocMessageBuilder out;
  auto r = out.initRoot<wire::StoreReply>();
  try {
    auto message = net::openFrame(frame, requestLimits());
    auto request = message->getRoot<wire::StoreRequest>();
    try {
      switch (request.which()) {
      case wire::StoreRequest::SET: {
        auto e = request.getSet();
        if (llvm::Error refused = put(key(e.getKey()), text(e.getValue())))
          throw Refused(rgpu::message(std::move(refused)));
        r.setOk();
        break;
      }
      case wire::StoreRequest::GET: {
        auto it = entries_.find(key(request.getGet()));
        if (it == entries_.end())
          r.setMissing();
        else
          r.setValue(asData(it->second));
        break;
      }
      case wire::StoreRequest::ADD: {
        auto a = request.getAdd();
        std::string k = key(a.getKey());
        int64_t n = 0;
        if (auto it = entries_.find(k); it != entries_.end()) {
          const std::string &v = it->second;
          char *end = nullptr;
          errno = 0;
          n = std::strtoll(v.c_str(), &end, 10);
          if (v.empty() || v.size() > 24 || end != v.c_str() + v.size() || errno)
            throw Refused("add to a key whose value is not a number");
        }
        // Wraps as two's complement would, without the undefined behaviour of overflow.
        n = int64_t(uint64_t(n) + uint64_t(a.getDelta()));
        if (llvm::Error refused = put(k, std::to_string(n)))
          throw Refused(rgpu::message(std::move(refused)));
        r.setNumber(n);
        break;
      }
      case wire::StoreRequest::CHECK:
        r.setFlag(allSet(keys(request.getCheck())));
        break;
      case wire::StoreRequest::WAIT: {
        auto w = request.getWait();
        std::vector<std::string> ks = keys(w.getKeys());
        if (allSet(ks)) {
          r.setOk();
        } else if (w.getTimeoutMs() == 0) {
          r.setMissing();
        } else {
          wait = Wait{std::move(ks), std::min(w.getTimeoutMs(), kMaxWaitMs)};
          return true;
        }
        break;
      }
      case wire::StoreRequest::DELETE_KEY: {
        auto it = entries_.find(key(request.getDeleteKey()));
        r.setFlag(it != entries_.end());
        if (it != entries_.end()) {
          const uint64_t freed = it->first.size() + it->second.size() + kEntryOverhead;
          entries_.erase(it);
          bytes_ -= freed;
          if (charge_)
            charge_(-int64_t(freed));
          ++changes_;
        }
        break;
      }
      case wire::StoreRequest::NUM_KEYS:
        r.setNumber(int64_t(entries_.size()));
        break;
      case wire::StoreRequest::COMPARE_SET: {
        // c10d's TCPStore: an unset key takes the desired value only if nothing was expected,
        // and the answer is the key's value after the request (the expected one if unset).
        auto c = request.getCompareSet();
        std::string k = key(c.getKey());
        std::string expected = text(c.getExpected());
        auto it = entries_.find(k);
        if (it == entries_.end() && !expected.empty()) {
          r.setValue(asData(expected));
        } else if (it == entries_.end() || it->second == expected) {
          std::string desired = text(c.getDesired());
          if (llvm::Error refused = put(k, desired))
            throw Refused(rgpu::message(std::move(refused)));
          r.setValue(asData(desired));
        } else {
          r.setValue(asData(it->second));
        }
        break;
      }
      case wire::StoreRequest::APPEND: {
        auto e = request.getAppend();
        std::string k = key(e.getKey());
        auto it = entries_.find(k);
        std::string value = it == entries_.end() ? std::string() : it->second;
        if (value.size() + e.getValue().size() > kMaxValueBytes)
          throw Refused("an append past " + std::to_string(kMaxValueBytes) + " bytes");
        value += text(e.getValue());
        if (llvm::Error refused = put(k, std::move(value)))
          throw Refused(rgpu::message(std::move(refused)));
        r.setOk();
        break;
      }
      default:
        throw Refused("a request this store does not know (a server of another version?)");
      }
    } catch (const Refused &e) {
      r.setError(e.what());
    }
  } catch (const kj::Exception &) {
    return false;
  }
  reply = net::encodeFrame(out, true);
  return true;
}

//===----------------------------------------------------------------------===//
// Service
//===----------------------------------------------------------------------===//

std::optional<Hello> readHello(const net::Frame &frame) {
  try {
    wire::Limits limits;
    limits.maxFrameBytes = kMaxHandshakeBytes;
    auto message = net::openFrame(frame, limits);
    auto hello = message->getRoot<wire::StoreHello>();
    return Hello{text(hello.getNonce()), text(hello.getMac())};
  } catch (const kj::Exception &) {
    return std::nullopt;
  }
}

namespace {
struct Connection;
} // namespace

struct Service::State {
  explicit State(std::function<bool(int64_t)> charge) : table(std::move(charge)) {}
  uv_loop_t loop;
  uv_tcp_t listener;
  uv_async_t stop;
  std::thread thread;
  std::string secret;
  Table table;
  int port = 0;
  std::set<Connection *> connections;
  int handshakes = 0;
  char readBuffer[64 << 10];
};

namespace {

struct Connection {
  Service::State *service;
  uv_tcp_t tcp;
  uv_timer_t timer;
  int open = 2; ///< handles not yet closed
  bool proven = false, closing = false;
  std::string challenge;
  net::FrameDecoder handshake{kMaxHandshakeBytes};
  net::FrameDecoder requests{kMaxRequestBytes};
  std::unique_ptr<net::Sealer> sealer;
  std::unique_ptr<net::Opener> opener;
  std::optional<Table::Wait> wait;
};

struct Write {
  uv_write_t req;
  std::string bytes;
};

void onClosed(uv_handle_t *h) {
  auto *c = static_cast<Connection *>(h->data);
  if (--c->open == 0)
    delete c;
}

void drop(Connection *c) {
  if (c->closing)
    return;
  c->closing = true;
  if (!c->proven)
    --c->service->handshakes;
  c->service->connections.erase(c);
  uv_close(reinterpret_cast<uv_handle_t *>(&c->tcp), onClosed);
  uv_close(reinterpret_cast<uv_handle_t *>(&c->timer), onClosed);
}

void onTimer(uv_timer_t *t);

void arm(Connection *c, uint64_t ms) { uv_timer_start(&c->timer, onTimer, ms, 0); }

void send(Connection *c, const std::string &frame) {
  auto *w = new Write;
  if (c->sealer)
    c->sealer->seal(frame.data(), frame.size(), w->bytes);
  else
    w->bytes = frame;
  uv_buf_t buf = uv_buf_init(w->bytes.data(), unsigned(w->bytes.size()));
  w->req.data = w;
  auto *stream = reinterpret_cast<uv_stream_t *>(&c->tcp);
  if (uv_write(&w->req, stream, &buf, 1, [](uv_write_t *req, int) {
        delete static_cast<Write *>(req->data);
      }) != 0) {
    delete w;
    drop(c);
    return;
  }
  // A peer that does not read its replies is not given more memory to hold them in.
  if (uv_stream_get_write_queue_size(stream) > Service::kMaxUnreadBytes)
    drop(c);
}

/// Answers the waits that the table's last change completed.
void wake(Service::State *s) {
  std::vector<Connection *> ready;
  for (Connection *c : s->connections)
    if (c->wait && s->table.allSet(c->wait->keys))
      ready.push_back(c);
  for (Connection *c : ready) {
    c->wait.reset();
    arm(c, Service::kIdleMs);
    send(c, Table::waitReply(true));
  }
}

void onTimer(uv_timer_t *t) {
  auto *c = static_cast<Connection *>(t->data);
  if (c->wait) {
    c->wait.reset();
    arm(c, Service::kIdleMs);
    send(c, Table::waitReply(false));
  } else {
    drop(c); // a handshake past its time, or a proven connection idle for kIdleMs
  }
}

/// Checks the peer's StoreHello; on success, answers and seals the connection.
bool prove(Connection *c, const net::Frame &frame) {
  std::optional<Hello> hello = readHello(frame);
  if (!hello)
    return false;
  const std::string &nonce = hello->nonce, &mac = hello->mac;
  const std::string &secret = c->service->secret;
  if (nonce.size() != net::auth::kNonceBytes ||
      !net::auth::sameMac(mac, net::auth::mac(kClientLabel, secret, c->challenge, nonce)))
    return false;
  capnp::MallocMessageBuilder out;
  out.initRoot<wire::StoreWelcome>().setMac(
      asData(net::auth::mac(kServerLabel, secret, c->challenge, nonce)));
  send(c, net::encodeFrame(out, true));
  net::SessionKeys keys = net::deriveKeys(secret, c->challenge, nonce);
  c->sealer = std::make_unique<net::Sealer>(keys.serverToClient);
  c->opener = std::make_unique<net::Opener>(keys.clientToServer);
  c->proven = true;
  --c->service->handshakes;
  arm(c, Service::kIdleMs);
  return true;
}

/// Serves the sealed bytes of a proven connection.
bool serve(Connection *c, const char *bytes, size_t n) {
  std::string plain;
  if (!c->opener->open(bytes, n, plain) || !c->requests.feed(plain.data(), plain.size()))
    return false;
  Service::State *s = c->service;
  net::Frame frame;
  while (c->requests.next(frame)) {
    if (c->wait) // one request at a time: a wait is answered before the next
      return false;
    const uint64_t changes = s->table.changes();
    std::string reply;
    if (!s->table.serve(frame, reply, c->wait))
      return false;
    if (c->wait) {
      arm(c, c->wait->timeoutMs);
    } else {
      arm(c, Service::kIdleMs);
      send(c, reply);
    }
    if (s->table.changes() != changes)
      wake(s);
    if (c->closing)
      return true;
  }
  return true;
}

void onRead(uv_stream_t *stream, ssize_t nread, const uv_buf_t *) {
  auto *c = static_cast<Connection *>(stream->data);
  if (c->closing)
    return;
  if (nread < 0) {
    drop(c);
    return;
  }
  const char *bytes = c->service->readBuffer;
  size_t n = size_t(nread);
  // The handshake is read frame by frame exactly, so that no sealed byte is read as plain.
  while (n > 0 && !c->proven) {
    const size_t take = std::min<uint64_t>(n, c->handshake.bytesToFrameEnd());
    if (!c->handshake.feed(bytes, take)) {
      drop(c);
      return;
    }
    bytes += take;
    n -= take;
    net::Frame frame;
    if (c->handshake.next(frame) && !prove(c, frame)) {
      drop(c);
      return;
    }
  }
  if (n > 0 && !serve(c, bytes, n))
    drop(c);
}

void onConnection(uv_stream_t *listener, int status) {
  // On EMFILE libuv closes the connection it cannot take (its reserve descriptor) and goes on.
  if (status < 0)
    return;
  auto *s = static_cast<Service::State *>(listener->data);
  auto *c = new Connection;
  c->service = s;
  uv_tcp_init(&s->loop, &c->tcp);
  uv_timer_init(&s->loop, &c->timer);
  c->tcp.data = c->timer.data = c;
  ++s->handshakes;
  s->connections.insert(c);
  if (uv_accept(listener, reinterpret_cast<uv_stream_t *>(&c->tcp)) != 0 ||
      s->handshakes > Service::kMaxHandshakes ||
      int(s->connections.size()) > Service::kMaxConnections) {
    drop(c);
    return;
  }
  uv_tcp_nodelay(&c->tcp, 1);
  uv_tcp_keepalive(&c->tcp, 1, 30); // a store whose peer vanished learns it
  c->challenge = net::auth::randomBytes(net::auth::kNonceBytes);
  capnp::MallocMessageBuilder out;
  auto challenge = out.initRoot<wire::StoreChallenge>();
  challenge.setVersion(kVersion);
  challenge.setNonce(asData(c->challenge));
  send(c, net::encodeFrame(out, true));
  arm(c, Service::kHandshakeMs);
  uv_read_start(
      reinterpret_cast<uv_stream_t *>(&c->tcp),
      [](uv_handle_t *h, size_t, uv_buf_t *buf) {
        auto *c = static_cast<Connection *>(h->data);
        *buf = uv_buf_init(c->service->readBuffer, sizeof c->service->readBuffer);
      },
      onRead);
}

} // namespace

Service::Service(const std::string &host, std::string secret,
                 std::function<bool(int64_t)> charge)
    : s_(std::make_unique<State>(std::move(charge))) {
  s_->secret = std::move(secret);
  uv_loop_init(&s_->loop);
  addrinfo hints{}, *found = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  std::string error;
  if (int rc = getaddrinfo(host.c_str(), "0", &hints, &found); rc != 0) {
    error = gai_strerror(rc);
  } else {
    uv_tcp_init(&s_->loop, &s_->listener);
    s_->listener.data = s_.get();
    rc = uv_tcp_bind(&s_->listener, found->ai_addr, 0);
    if (rc == 0)
      rc = uv_listen(reinterpret_cast<uv_stream_t *>(&s_->listener), 128, onConnection);
    freeaddrinfo(found);
    sockaddr_storage bound{};
    int len = sizeof bound;
    if (rc == 0)
      rc = uv_tcp_getsockname(&s_->listener, reinterpret_cast<sockaddr *>(&bound), &len);
    if (rc != 0) {
      error = uv_strerror(rc);
      uv_close(reinterpret_cast<uv_handle_t *>(&s_->listener), nullptr);
    } else {
      s_->port = ntohs(bound.ss_family == AF_INET6
                           ? reinterpret_cast<sockaddr_in6 *>(&bound)->sin6_port
                           : reinterpret_cast<sockaddr_in *>(&bound)->sin_port);
    }
  }
  if (!error.empty()) {
    uv_run(&s_->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s_->loop);
    throw std::runtime_error("cannot listen on " + host + " for the rendezvous store: " + error);
  }
  uv_async_init(&s_->loop, &s_->stop, [](uv_async_t *a) {
    auto *s = static_cast<State *>(a->data);
    uv_close(reinterpret_cast<uv_handle_t *>(&s->listener), nullptr);
    for (Connection *c : std::vector<Connection *>(s->connections.begin(), s->connections.end()))
      drop(c);
    uv_close(reinterpret_cast<uv_handle_t *>(&s->stop), nullptr);
  });
  s_->stop.data = s_.get();
  s_->thread = std::thread([s = s_.get()] { uv_run(&s->loop, UV_RUN_DEFAULT); });
}

Service::~Service() {
  uv_async_send(&s_->stop);
  s_->thread.join();
  uv_loop_close(&s_->loop);
}

int Service::port() const { return s_->port; }

//===----------------------------------------------------------------------===//
// Client
//===----------------------------------------------------------------------===//

struct Client::Reply {
  std::unique_ptr<capnp::MessageReader> message;
  net::Frame frame;
  wire::StoreReply::Reader get() { return message->getRoot<wire::StoreReply>(); }
};

Client::Client(std::string host, int port, std::string secret, std::chrono::milliseconds timeout,
               std::shared_ptr<std::atomic<bool>> cancelled)
    : host_(std::move(host)), secret_(std::move(secret)), port_(port), timeout_(timeout),
      cancelled_(std::move(cancelled)) {}

Client::~Client() = default;

void Client::fail(const std::string &why) {
  disconnect();
  throw std::runtime_error("the rendezvous store at " + host_ + ":" + std::to_string(port_) +
                           ": " + why);
}

void Client::disconnect() {
  socket_.reset();
  decoder_.reset();
}

void Client::connect() {
  disconnect();
  socket_ = std::make_unique<net::Socket>();
  std::string error;
  const int connectMs = int(std::min<int64_t>(timeout_.count(), 30000));
  if (!socket_->connect(host_, port_, error, 30, connectMs))
    fail(error);
  socket_->readFramesExactly();
  net::FrameDecoder handshake(kMaxHandshakeBytes);
  net::Frame frame;
  wire::Limits limits;
  limits.maxFrameBytes = kMaxHandshakeBytes;
  auto receive = [&](const std::string &missing) {
    auto status = socket_->receive(handshake, frame, Service::kHandshakeMs, false);
    if (status != net::Socket::Status::Ok)
      fail(missing + " (" +
           (status == net::Socket::Status::Timeout ? "timed out"
            : socket_->error().empty()             ? "closed"
                                                   : socket_->error()) +
           ")");
    return net::openFrame(frame, limits);
  };
  std::string challenge, nonce = net::auth::randomBytes(net::auth::kNonceBytes);
  try {
    auto message = receive("no challenge: is this a rendezvous store?");
    auto c = message->getRoot<wire::StoreChallenge>();
    if (c.getVersion() != kVersion)
      fail("a store of protocol " + std::to_string(c.getVersion()) + ", this server speaks " +
           std::to_string(kVersion) + " (servers of one job must be of one rgpu version)");
    challenge = text(c.getNonce());
    capnp::MallocMessageBuilder out;
    auto hello = out.initRoot<wire::StoreHello>();
    hello.setNonce(asData(nonce));
    hello.setMac(asData(net::auth::mac(kClientLabel, secret_, challenge, nonce)));
    if (!socket_->sendAll(net::encodeFrame(out, true)))
      fail("closed during the handshake");
    // A store that does not know the secret closes the connection here.
    auto welcome = receive("the handshake was refused: the address's secret is not this "
                           "store's");
    if (!net::auth::sameMac(text(welcome->getRoot<wire::StoreWelcome>().getMac()),
                            net::auth::mac(kServerLabel, secret_, challenge, nonce)))
      fail("it does not hold the job's secret");
  } catch (const kj::Exception &e) {
    fail("a malformed handshake: " + std::string(e.getDescription().cStr()));
  }
  socket_->seal(net::deriveKeys(secret_, challenge, nonce));
  decoder_ = std::make_unique<net::FrameDecoder>(2 * kMaxValueBytes);
}

template <typename Fill> Client::Reply Client::request(Fill fill, int replyTimeoutMs) {
  if (replyTimeoutMs < 0) // the store answers all but waits at once
    replyTimeoutMs = int(std::min<int64_t>(timeout_.count(), 60000)) + Service::kHandshakeMs;
  if (socket_) {
    // The store closes a connection idle for kIdleMs: that shows as an end here, never as a
    // frame (a reply to nothing).
    net::Frame stray;
    auto status = socket_->receive(*decoder_, stray, 0, false);
    if (status == net::Socket::Status::Ok)
      fail("it sent a reply to no request");
    if (status != net::Socket::Status::Timeout)
      disconnect();
  }
  capnp::MallocMessageBuilder out;
  fill(out.initRoot<wire::StoreRequest>());
  const std::string bytes = net::encodeFrame(out, true);
  if (!socket_)
    connect();
  if (!socket_->sendAll(bytes))
    fail("it closed the connection");
  Reply reply;
  auto status = socket_->receive(*decoder_, reply.frame, replyTimeoutMs, false);
  if (status != net::Socket::Status::Ok)
    fail(status == net::Socket::Status::Timeout ? "no reply within " +
                                                      std::to_string(replyTimeoutMs) + " ms"
         : socket_->error().empty()             ? "it closed the connection"
                                                : socket_->error());
  try {
    wire::Limits limits;
    limits.maxFrameBytes = 2 * kMaxValueBytes;
    reply.message = net::openFrame(reply.frame, limits);
    if (reply.get().isError())
      fail(std::string("refused: ") + reply.get().getError().cStr());
  } catch (const kj::Exception &e) {
    fail("a malformed reply: " + std::string(e.getDescription().cStr()));
  }
  return reply;
}

namespace {
void setEntry(wire::StoreEntry::Builder e, const std::string &key, const std::string &value) {
  e.setKey(asData(key));
  e.setValue(asData(value));
}

void setKeys(capnp::List<capnp::Data>::Builder list, const std::vector<std::string> &keys) {
  for (size_t i = 0; i < keys.size(); ++i)
    list.set(i, asData(keys[i]));
}
} // namespace

void Client::set(const std::string &key, const std::string &value) {
  request([&](wire::StoreRequest::Builder r) { setEntry(r.initSet(), key, value); });
}

std::optional<std::string> Client::get(const std::string &key) {
  Reply reply = request([&](wire::StoreRequest::Builder r) { r.setGet(asData(key)); });
  if (!reply.get().isValue())
    return std::nullopt;
  return text(reply.get().getValue());
}

int64_t Client::add(const std::string &key, int64_t delta) {
  Reply reply = request(
      [&](wire::StoreRequest::Builder r) {
        auto a = r.initAdd();
        a.setKey(asData(key));
        a.setDelta(delta);
      });
  if (!reply.get().isNumber())
    fail("a reply to add that is not a number");
  return reply.get().getNumber();
}

bool Client::check(const std::vector<std::string> &keys) {
  Reply reply = request(
      [&](wire::StoreRequest::Builder r) { setKeys(r.initCheck(unsigned(keys.size())), keys); });
  return reply.get().isFlag() && reply.get().getFlag();
}

bool Client::wait(const std::vector<std::string> &keys, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (cancelled_ && *cancelled_)
      fail("the join was cancelled: its client left");
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    const int64_t slice = std::clamp<int64_t>(
        left.count(), 0, cancelled_ ? kCancelPollMs : int64_t(kMaxWaitMs));
    Reply reply = request(
        [&](wire::StoreRequest::Builder r) {
          auto w = r.initWait();
          setKeys(w.initKeys(unsigned(keys.size())), keys);
          w.setTimeoutMs(uint32_t(slice));
        },
        int(slice) + Service::kHandshakeMs);
    if (reply.get().isOk())
      return true;
    if (std::chrono::steady_clock::now() >= deadline)
      return false;
  }
}

bool Client::deleteKey(const std::string &key) {
  Reply reply = request([&](wire::StoreRequest::Builder r) { r.setDeleteKey(asData(key)); });
  return reply.get().isFlag() && reply.get().getFlag();
}

int64_t Client::numKeys() {
  Reply reply = request([&](wire::StoreRequest::Builder r) { r.setNumKeys(); });
  if (!reply.get().isNumber())
    fail("a reply to numKeys that is not a number");
  return reply.get().getNumber();
}

std::string Client::compareSet(const std::string &key, const std::string &expected,
                               const std::string &desired) {
  Reply reply = request(
      [&](wire::StoreRequest::Builder r) {
        auto c = r.initCompareSet();
        c.setKey(asData(key));
        c.setExpected(asData(expected));
        c.setDesired(asData(desired));
      });
  if (!reply.get().isValue())
    fail("a reply to compareSet that is not a value");
  return text(reply.get().getValue());
}

void Client::append(const std::string &key, const std::string &value) {
  request([&](wire::StoreRequest::Builder r) { setEntry(r.initAppend(), key, value); });
}

//===----------------------------------------------------------------------===//
// Addresses
//===----------------------------------------------------------------------===//

size_t glooAddressAt(const std::string &value) {
  size_t at = 0;
  auto u64 = [&](uint64_t &x) {
    if (value.size() - at < sizeof x)
      return false;
    std::memcpy(&x, value.data() + at, sizeof x);
    at += sizeof x;
    return true;
  };
  uint64_t name = 0, length = 0;
  if (!u64(name) || name > value.size() - at)
    return std::string::npos;
  at += name;
  if (!u64(length) || length != sizeof(sockaddr_storage) + sizeof(int64_t) ||
      length > value.size() - at)
    return std::string::npos;
  const size_t address = at;
  if ((value.size() - at - length) % 8 != 0) // what follows is 64-bit numbers
    return std::string::npos;
  sa_family_t family;
  std::memcpy(&family, value.data() + address, sizeof family);
  return family == AF_INET || family == AF_INET6 ? address : std::string::npos;
}

std::string zeroAddressPadding(std::string value) {
  const size_t address = glooAddressAt(value);
  if (address == std::string::npos)
    return value;
  sa_family_t family;
  std::memcpy(&family, value.data() + address, sizeof family);
  const size_t used = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  std::memset(value.data() + address + used, 0, sizeof(sockaddr_storage) - used);
  return value;
}

std::string address(const std::string &host, int port, const std::string &secret) {
  static const char hex[] = "0123456789abcdef";
  std::string out = host + ":" + std::to_string(port) + "#";
  for (unsigned char b : secret) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

std::optional<StoreAddress> parseAddress(const std::string &text) {
  const size_t hash = text.rfind('#');
  if (hash == std::string::npos || text.size() - hash - 1 != 2 * kSecretBytes)
    return std::nullopt;
  const size_t colon = text.rfind(':', hash);
  if (colon == std::string::npos || colon == 0)
    return std::nullopt;
  const std::string digits = text.substr(colon + 1, hash - colon - 1);
  if (digits.empty() || digits.size() > 5 ||
      !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
    return std::nullopt;
  StoreAddress a;
  a.port = std::stoi(digits);
  if (a.port <= 0 || a.port > 65535)
    return std::nullopt;
  auto nibble = [](char ch) {
    return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
  };
  for (size_t i = hash + 1; i < text.size(); i += 2) {
    int hi = nibble(text[i]), lo = nibble(text[i + 1]);
    if (hi < 0 || lo < 0)
      return std::nullopt;
    a.secret += char(hi << 4 | lo);
  }
  a.host = text.substr(0, colon);
  return a;
}

} // namespace rgpu::server::rendezvous
