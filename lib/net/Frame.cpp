#include "rgpu/net/Frame.h"

#include <capnp/serialize-packed.h>
#include <capnp/serialize.h>
#include <kj/io.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <sched.h>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

namespace rgpu::net {

namespace {
void putHeader(std::string &out, uint32_t flags, uint64_t length) {
  char h[kHeaderBytes];
  uint32_t magic = kMagic;
  std::memcpy(h, &magic, 4);
  std::memcpy(h + 4, &flags, 4);
  std::memcpy(h + 8, &length, 8);
  out.append(h, kHeaderBytes);
}
} // namespace

std::string encodeFrame(capnp::MessageBuilder &message, bool pack, uint32_t flags) {
  std::string out;
  if (pack) {
    kj::VectorOutputStream stream;
    capnp::writePackedMessage(stream, message);
    auto bytes = stream.getArray();
    putHeader(out, flags | kFlagPacked, bytes.size());
    out.append(reinterpret_cast<const char *>(bytes.begin()), bytes.size());
    return out;
  }
  auto words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  out.reserve(kHeaderBytes + bytes.size());
  putHeader(out, flags, bytes.size());
  out.append(reinterpret_cast<const char *>(bytes.begin()), bytes.size());
  return out;
}

namespace {
/// Expands Cap'n Proto's packed encoding into at most \p maxWords words; throws on malformed or
/// oversized input. Each word is a tag byte whose bits say which of its bytes follow; tag 0 is
/// followed by a count of further zero words, tag 0xff by a count of words copied verbatim.
kj::Array<capnp::word> unpack(kj::ArrayPtr<const kj::byte> in, uint64_t maxWords) {
  std::vector<kj::byte> out;
  size_t at = 0;
  auto need = [&](size_t n) {
    KJ_REQUIRE(in.size() - at >= n, "packed frame ends inside a word");
  };
  auto grow = [&](uint64_t words) {
    KJ_REQUIRE(out.size() / 8 + words <= maxWords, "packed frame expands past its limit");
  };
  while (at < in.size()) {
    kj::byte tag = in[at++];
    grow(1);
    for (int bit = 0; bit < 8; ++bit) {
      if (tag & (1 << bit)) {
        need(1);
        out.push_back(in[at++]);
      } else {
        out.push_back(0);
      }
    }
    if (tag == 0x00) {
      need(1);
      uint64_t zeros = in[at++];
      grow(zeros);
      out.resize(out.size() + zeros * 8, 0);
    } else if (tag == 0xff) {
      need(1);
      uint64_t raw = in[at++];
      need(raw * 8);
      grow(raw);
      out.insert(out.end(), in.begin() + at, in.begin() + at + raw * 8);
      at += raw * 8;
    }
  }
  auto words = kj::heapArray<capnp::word>(out.size() / 8);
  if (!out.empty())
    std::memcpy(words.begin(), out.data(), out.size());
  return words;
}
} // namespace

std::unique_ptr<capnp::MessageReader> openFrame(const Frame &frame, const wire::Limits &limits) {
  capnp::ReaderOptions options = wire::readerOptions(limits, frame.bytes, frame.flags & kFlagPacked);
  auto bytes = frame.words.asBytes().slice(0, frame.bytes);
  if (frame.flags & kFlagPacked) {
    // Unpacked whole, up to what the traversal limit allows, then read flat: no reader that
    // pulls segments lazily (and can throw from its destructor) ever sees a peer's bytes.
    struct Owning : capnp::FlatArrayMessageReader {
      kj::Array<capnp::word> words;
      Owning(kj::Array<capnp::word> w, const capnp::ReaderOptions &options)
          : capnp::FlatArrayMessageReader(w, options), words(std::move(w)) {}
    };
    return std::make_unique<Owning>(unpack(bytes, options.traversalLimitInWords), options);
  }
  if (frame.bytes % sizeof(capnp::word) != 0)
    KJ_FAIL_REQUIRE("frame length is not a whole number of words");
  return std::make_unique<capnp::FlatArrayMessageReader>(
      frame.words.slice(0, frame.bytes / sizeof(capnp::word)), options);
}

bool FrameDecoder::feed(const char *data, size_t n) {
  if (!error_.empty())
    return false;
  while (n > 0) {
    if (!inFrame_) {
      size_t take = std::min(n, kHeaderBytes - headerFill_);
      std::memcpy(header_ + headerFill_, data, take);
      headerFill_ += take;
      data += take;
      n -= take;
      if (headerFill_ < kHeaderBytes)
        return true;
      headerFill_ = 0;
      uint32_t magic, flags;
      uint64_t length;
      std::memcpy(&magic, header_, 4);
      std::memcpy(&flags, header_ + 4, 4);
      std::memcpy(&length, header_ + 8, 8);
      if (magic != kMagic) {
        error_ = "not an rgpu frame (bad magic)";
        return false;
      }
      if (flags & ~(kFlagPacked | kFlagCancel)) {
        error_ = "unknown frame flags";
        return false;
      }
      if (length > maxFrameBytes_) {
        error_ = "frame of " + std::to_string(length) + " bytes exceeds the limit of " +
                 std::to_string(maxFrameBytes_);
        return false;
      }
      current_ = Frame();
      current_.flags = flags;
      current_.bytes = length;
      // The buffer grows as bytes arrive: a header announcing a gigabyte costs what was sent.
      const uint64_t first = std::min({length, kFirstBufferBytes, budget_});
      if (first < std::min(length, uint64_t(8))) {
        error_ = "a frame of " + std::to_string(length) + " bytes, and no memory left for it";
        return false;
      }
      current_.words = kj::heapArray<capnp::word>((first + 7) / 8);
      filled_ = 0;
      inFrame_ = true;
    }
    size_t take = std::min<uint64_t>(n, current_.bytes - filled_);
    if (filled_ + take > current_.words.size() * sizeof(capnp::word)) {
      if (filled_ + take > budget_) {
        error_ = "a frame of " + std::to_string(current_.bytes) + " bytes, of which " +
                 std::to_string(filled_ + take) + " arrived, past the " +
                 std::to_string(budget_) + " bytes of memory left for it";
        return false;
      }
      uint64_t grown = std::min<uint64_t>(
          std::min(current_.bytes, budget_),
          std::max<uint64_t>(filled_ + take, 4 * current_.words.size() * 8));
      auto words = kj::heapArray<capnp::word>((grown + 7) / 8);
      std::memcpy(words.begin(), current_.words.begin(), filled_);
      current_.words = std::move(words);
    }
    std::memcpy(reinterpret_cast<char *>(current_.words.begin()) + filled_, data, take);
    filled_ += take;
    data += take;
    n -= take;
    if (filled_ == current_.bytes) {
      ready_.push_back(std::move(current_));
      inFrame_ = false;
    }
  }
  return true;
}

bool FrameDecoder::next(Frame &out) {
  if (readyHead_ == ready_.size())
    return false;
  out = std::move(ready_[readyHead_++]);
  if (readyHead_ == ready_.size()) {
    ready_.clear();
    readyHead_ = 0;
  }
  return true;
}

Socket::~Socket() { close(); }

int Socket::defaultSpin() {
  static int us = [] {
    const char *v = std::getenv("RGPU_SPIN_US");
    return v ? std::max(0, std::atoi(v)) : 1000;
  }();
  return us;
}

void Socket::close() {
  if (fd_ >= 0)
    ::close(fd_);
  fd_ = -1;
  sealer_.reset();
  opener_.reset();
  error_.clear();
  exact_ = false;
}

void Socket::seal(const SessionKeys &keys) {
  sealer_ = std::make_unique<Sealer>(keys.clientToServer);
  opener_ = std::make_unique<Opener>(keys.serverToClient);
  exact_ = false;
}

namespace {
/// connect(2) that gives up after \p timeoutMs (negative: the kernel's own timeout).
bool connectWithin(int fd, const sockaddr *addr, socklen_t len, int timeoutMs) {
  if (timeoutMs < 0)
    return ::connect(fd, addr, len) == 0;
  int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  bool ok = ::connect(fd, addr, len) == 0;
  if (!ok && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int ready;
    do
      ready = ::poll(&p, 1, timeoutMs);
    while (ready < 0 && errno == EINTR);
    int err = 0;
    socklen_t errLen = sizeof err;
    if (ready == 0)
      err = ETIMEDOUT;
    else if (ready < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &errLen) != 0)
      err = errno;
    ok = err == 0;
    errno = err;
  }
  fcntl(fd, F_SETFL, flags);
  return ok;
}
} // namespace

bool Socket::connect(const std::string &host, int port, std::string &error, int deadPeerSeconds,
                     int connectTimeoutMs) {
  close();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo *res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    error = std::string("cannot resolve ") + host + ": " + gai_strerror(rc);
    return false;
  }
  error = "no address";
  for (addrinfo *a = res; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0)
      continue;
    if (connectWithin(fd, a->ai_addr, a->ai_addrlen, connectTimeoutMs)) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      int secs = std::max(deadPeerSeconds, 3);
      int idle = secs / 3, interval = std::max(1, secs / 6), count = 3;
      unsigned userTimeoutMs = unsigned(secs) * 1000;
      setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
      setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &userTimeoutMs, sizeof userTimeoutMs);
      fd_ = fd;
      break;
    }
    error = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  return fd_ >= 0;
}

bool Socket::connectUnix(const std::string &path, std::string &error) {
  close();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    error = "the socket path " + path + " is longer than " +
            std::to_string(sizeof addr.sun_path - 1) + " bytes";
    return false;
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0) {
    error = std::strerror(errno);
    if (fd >= 0)
      ::close(fd);
    return false;
  }
  fd_ = fd;
  return true;
}

bool Socket::sendAll(const std::string &plain) {
  std::string sealed;
  if (sealer_)
    sealer_->seal(plain.data(), plain.size(), sealed);
  const std::string &data = sealer_ ? sealed : plain;
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return false;
    off += n;
  }
  return true;
}

Socket::Status Socket::receive(FrameDecoder &decoder, Frame &out, int timeoutMs, bool spin) {
  char buf[1 << 16];
  using Clock = std::chrono::steady_clock;
  const Clock::time_point spinUntil = Clock::now() + std::chrono::microseconds(spinMicros_);
  while (!decoder.next(out)) {
    pollfd p{fd_, POLLIN, 0};
    int rc = 0;
    // A reply due soon is polled for first: a thread that sleeps in poll(2) is woken by the
    // kernel, which costs a virtual machine's idle CPU 100 us and more.
    while (spin && spinMicros_ > 0 && rc == 0 && Clock::now() < spinUntil) {
      rc = ::poll(&p, 1, 0);
      if (rc == 0)
        sched_yield();
    }
    if (rc == 0)
      rc = ::poll(&p, 1, timeoutMs);
    if (rc < 0 && errno == EINTR)
      continue;
    if (rc == 0)
      return Status::Timeout;
    if (rc < 0)
      return Status::Error;
    const size_t want = exact_ ? std::min<uint64_t>(sizeof buf, decoder.bytesToFrameEnd())
                               : sizeof buf;
    ssize_t n = ::recv(fd_, buf, want, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n == 0)
      return Status::Closed;
    if (n < 0)
      return Status::Error;
    if (opener_) {
      opened_.clear();
      if (!opener_->open(buf, size_t(n), opened_)) {
        error_ = opener_->error();
        return Status::Error;
      }
    }
    if (!(opener_ ? decoder.feed(opened_.data(), opened_.size()) : decoder.feed(buf, n))) {
      error_ = decoder.error();
      return Status::Error;
    }
  }
  return Status::Ok;
}

bool parseHostPort(const std::string &text, std::string &host, int &port) {
  size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0)
    return false;
  host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  try {
    size_t used = 0;
    port = std::stoi(text.substr(colon + 1), &used);
    return used == text.size() - colon - 1 && port > 0 && port < 65536;
  } catch (...) {
    return false;
  }
}

bool parseEndpoint(const std::string &text, Endpoint &out) {
  out = Endpoint();
  if (text.rfind("unix:", 0) == 0)
    out.path = text.substr(5);
  else if (!text.empty() && text[0] == '/')
    out.path = text;
  else
    return parseHostPort(text, out.host, out.port);
  return !out.path.empty();
}

} // namespace rgpu::net
