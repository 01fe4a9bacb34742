//===- rgpu/net/Seal.h - Sealed frames over TCP -----------------------------===//
//
// Over TCP, everything after the Hello travels sealed: both sides derive one key per direction
// from the token and the two nonces of that Hello, and each direction is a libsodium
// secretstream (XChaCha20-Poly1305): a 24-byte header, then records of at most kRecordBytes
// of frame bytes, each `u32 length (little-endian) + ciphertext`. A record that is tampered
// with, replayed, reordered or sealed under another key does not open, and the connection
// ends; a resumed session's new Hello derives new keys. What is sealed is the byte stream, not
// frames: a record may hold part of a frame or several.
//
// The Unix socket stays plaintext: only the server's own uid reaches it.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace rgpu::net {

/// The keys of one TCP session, one per direction.
struct SessionKeys {
  std::string clientToServer, serverToClient;
};

/// Derives \p token's keys for the Hello that answered \p challenge with \p clientNonce: a
/// fresh pair for every Hello, which neither side can choose alone.
SessionKeys deriveKeys(const std::string &token, const std::string &challenge,
                       const std::string &clientNonce);

/// The sending half of a sealed stream.
class Sealer {
public:
  explicit Sealer(const std::string &key);
  ~Sealer();
  /// Appends the sealed form of \p n bytes at \p data to \p out (the stream's header first,
  /// the first time).
  void seal(const char *data, size_t n, std::string &out);
  std::string seal(const std::string &plain) {
    std::string out;
    seal(plain.data(), plain.size(), out);
    return out;
  }
  /// The most frame bytes one record holds.
  static constexpr size_t kRecordBytes = 1 << 20;

private:
  struct State;
  std::unique_ptr<State> s_;
};

/// The receiving half of a sealed stream.
class Opener {
public:
  explicit Opener(const std::string &key);
  ~Opener();
  /// Takes \p n received bytes and appends what they open to \p plain (a record that has not
  /// all arrived waits for the rest). False, for good, on a record that does not open or is
  /// longer than any Sealer makes; error() says which.
  bool open(const char *data, size_t n, std::string &plain);
  const std::string &error() const { return error_; }

private:
  struct State;
  std::unique_ptr<State> s_;
  std::string error_;
};

} // namespace rgpu::net
