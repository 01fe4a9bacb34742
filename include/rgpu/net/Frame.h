//===- rgpu/net/Frame.h - Framing of Cap'n Proto messages over a stream ----===//
//
// Every message travels as one frame: a 16-byte header (magic "RGPU", flags, payload length)
// followed by a Cap'n Proto message, packed when small. The header lets a reader refuse garbage,
// an HTTP request or an absurd length after reading 16 bytes, before allocating anything.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/net/Seal.h"
#include "rgpu/wire/Wire.h"

#include <capnp/message.h>
#include <kj/array.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace rgpu::net {

constexpr uint32_t kMagic = 0x55504752; // "RGPU" in little-endian byte order
constexpr size_t kHeaderBytes = 16;
constexpr uint32_t kFlagPacked = 1;
/// A client frame whose one command is a Cancel: the server's I/O loop reads it as it arrives
/// (wire::Command's cancel).
constexpr uint32_t kFlagCancel = 2;

/// One received frame's payload, word-aligned for Cap'n Proto.
struct Frame {
  uint32_t flags = 0;
  uint64_t bytes = 0;
  kj::Array<capnp::word> words;
};

/// Serialises \p message into a frame. Packs it when \p pack (small control frames, where
/// packing roughly halves the size); data-heavy frames are sent flat.
std::string encodeFrame(capnp::MessageBuilder &message, bool pack, uint32_t flags = 0);

/// Opens a reader over a received frame, with reader limits derived from \p limits and the
/// frame's size. Throws kj::Exception on a malformed message.
std::unique_ptr<capnp::MessageReader> openFrame(const Frame &frame, const wire::Limits &limits);

/// Incremental parser: bytes in, whole frames out. Refuses a wrong magic, unknown flags or a
/// length over the limit, and stays in the error state after that.
class FrameDecoder {
public:
  explicit FrameDecoder(uint64_t maxFrameBytes) : maxFrameBytes_(maxFrameBytes) {}
  /// The limit for frames whose header is still to come.
  void setMaxFrameBytes(uint64_t n) { maxFrameBytes_ = n; }
  /// The most bytes the frame being assembled may be given (its memory budget): feed() fails,
  /// before allocating, where a frame would need more.
  void setBufferBudget(uint64_t n) { budget_ = n; }
  /// Consumes \p n bytes; complete frames queue up for next(). False on a protocol error.
  bool feed(const char *data, size_t n);
  /// Moves the oldest complete frame into \p out; false if none is complete.
  bool next(Frame &out);
  const std::string &error() const { return error_; }
  /// Bytes of the frame being assembled still to come (0 between frames).
  uint64_t pendingBytes() const { return inFrame_ ? current_.bytes - filled_ : 0; }
  /// Bytes still to come before the frame being read (its header first) is complete.
  uint64_t bytesToFrameEnd() const {
    return inFrame_ ? current_.bytes - filled_ : kHeaderBytes - headerFill_;
  }
  /// Bytes allocated for the frame being assembled: what has arrived, give or take a factor
  /// of 4, never the length its header announced.
  uint64_t bufferedBytes() const { return inFrame_ ? current_.words.size() * 8 : 0; }
  /// The buffer a frame starts with; it grows fourfold as bytes arrive.
  static constexpr uint64_t kFirstBufferBytes = 1u << 20;

private:
  uint64_t maxFrameBytes_;
  uint64_t budget_ = ~uint64_t(0);
  std::string error_;
  char header_[kHeaderBytes];
  size_t headerFill_ = 0;
  bool inFrame_ = false;
  Frame current_;
  uint64_t filled_ = 0;
  std::vector<Frame> ready_;
  size_t readyHead_ = 0;
};

/// A blocking TCP connection used by the client. All calls report a dead peer by return value,
/// never by a signal (SIGPIPE is suppressed).
class Socket {
public:
  enum class Status { Ok, Closed, Timeout, Error };

  Socket() = default;
  ~Socket();
  Socket(const Socket &) = delete;
  Socket &operator=(const Socket &) = delete;

  /// Connects to host:port; on failure returns false and sets \p error to the reason.
  /// A peer that stops answering at the TCP level (a dead host, a cut network) is declared gone
  /// after about \p deadPeerSeconds: keepalive probes while waiting, a send timeout while sending.
  /// A live server busy with a long graph still answers the probes, so it is never cut off.
  /// The connection itself is given up after \p connectTimeoutMs (negative: the kernel's).
  bool connect(const std::string &host, int port, std::string &error, int deadPeerSeconds = 30,
               int connectTimeoutMs = -1);
  /// Connects to the Unix-domain socket at \p path.
  bool connectUnix(const std::string &path, std::string &error);
  bool connected() const { return fd_ >= 0; }
  /// Closes the connection; a new one starts unsealed.
  void close();
  /// Until seal(), receive() reads no byte past the frame it completes: the server's sealed
  /// bytes may follow its answer to the Hello at once, and must not be read as plaintext.
  void readFramesExactly() { exact_ = true; }
  /// From now on, everything sent is sealed under \p keys.clientToServer and everything
  /// received opened under \p keys.serverToClient (rgpu/net/Seal.h).
  void seal(const SessionKeys &keys);
  /// Sends all of \p data; false if the peer is gone.
  bool sendAll(const std::string &data);
  /// Receives one frame, waiting at most \p timeoutMs (negative: forever). Without \p spin,
  /// it does not poll RGPU_SPIN_US first: timeout 0 then only takes what has arrived.
  Status receive(FrameDecoder &decoder, Frame &out, int timeoutMs, bool spin = true);
  /// Why the last receive() failed with Error, when the bytes said so (a record that does not
  /// open, a frame the decoder refused); empty for a failure of the connection itself.
  const std::string &error() const { return error_; }

private:
  int fd_ = -1;
  std::unique_ptr<Sealer> sealer_;
  std::unique_ptr<Opener> opener_;
  std::string opened_, error_;
  bool exact_ = false;
  /// How long receive() polls without sleeping before it blocks: RGPU_SPIN_US, else 1000.
  int spinMicros_ = defaultSpin();
  static int defaultSpin();
};

/// Splits "host:port"; false if malformed.
bool parseHostPort(const std::string &text, std::string &host, int &port);

/// Where a server listens: a Unix-domain socket ("unix:PATH" or an absolute path) or TCP
/// ("host:port").
struct Endpoint {
  std::string path; ///< the socket's path; empty for TCP
  std::string host;
  int port = 0;
  bool isUnix() const { return !path.empty(); }
};
/// Parses \p text into \p out; false if it is neither form.
bool parseEndpoint(const std::string &text, Endpoint &out);

} // namespace rgpu::net
