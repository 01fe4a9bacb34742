#include "rgpu/net/Seal.h"

#include <sodium.h>

#include <cstring>
#include <stdexcept>

namespace rgpu::net {

namespace {
using Stream = crypto_secretstream_xchacha20poly1305_state;
constexpr size_t kHeaderBytes = crypto_secretstream_xchacha20poly1305_HEADERBYTES;
constexpr size_t kTagBytes = crypto_secretstream_xchacha20poly1305_ABYTES;
constexpr size_t kLengthBytes = 4;

void ensureSodium() {
  static const bool ready = sodium_init() >= 0;
  if (!ready)
    throw std::runtime_error("libsodium cannot start");
}

const unsigned char *bytes(const std::string &s) {
  return reinterpret_cast<const unsigned char *>(s.data());
}
} // namespace

SessionKeys deriveKeys(const std::string &token, const std::string &challenge,
                       const std::string &clientNonce) {
  ensureSodium();
  // The token, of any length, keys a BLAKE2b of both nonces: the session's master key.
  unsigned char tokenKey[crypto_generichash_KEYBYTES];
  crypto_generichash(tokenKey, sizeof tokenKey, bytes(token), token.size(), nullptr, 0);
  const std::string label = "rgpu sealed frames 1";
  crypto_generichash_state h;
  crypto_generichash_init(&h, tokenKey, sizeof tokenKey, crypto_kdf_KEYBYTES);
  crypto_generichash_update(&h, bytes(label), label.size() + 1);
  crypto_generichash_update(&h, bytes(challenge), challenge.size());
  crypto_generichash_update(&h, bytes(clientNonce), clientNonce.size());
  unsigned char master[crypto_kdf_KEYBYTES];
  crypto_generichash_final(&h, master, sizeof master);
  SessionKeys keys;
  for (uint64_t id : {1, 2}) {
    unsigned char key[crypto_secretstream_xchacha20poly1305_KEYBYTES];
    crypto_kdf_derive_from_key(key, sizeof key, id, "rgpuseal", master);
    (id == 1 ? keys.clientToServer : keys.serverToClient).assign(reinterpret_cast<char *>(key),
                                                                  sizeof key);
    sodium_memzero(key, sizeof key);
  }
  sodium_memzero(master, sizeof master);
  sodium_memzero(tokenKey, sizeof tokenKey);
  return keys;
}

struct Sealer::State {
  std::string key;
  Stream stream;
  bool started = false;
};

Sealer::Sealer(const std::string &key) : s_(std::make_unique<State>()) {
  ensureSodium();
  if (key.size() != crypto_secretstream_xchacha20poly1305_KEYBYTES)
    throw std::invalid_argument("a sealing key of the wrong length");
  s_->key = key;
}

Sealer::~Sealer() {
  sodium_memzero(s_->key.data(), s_->key.size());
  sodium_memzero(&s_->stream, sizeof s_->stream);
}

void Sealer::seal(const char *data, size_t n, std::string &out) {
  if (!s_->started) {
    unsigned char header[kHeaderBytes];
    crypto_secretstream_xchacha20poly1305_init_push(&s_->stream, header, bytes(s_->key));
    out.append(reinterpret_cast<char *>(header), sizeof header);
    s_->started = true;
  }
  for (size_t at = 0; at < n;) {
    const size_t chunk = std::min(n - at, kRecordBytes);
    const uint32_t length = uint32_t(chunk + kTagBytes);
    const size_t start = out.size();
    out.resize(start + kLengthBytes + length);
    unsigned char *record = reinterpret_cast<unsigned char *>(&out[start]);
    for (size_t k = 0; k < kLengthBytes; ++k)
      record[k] = uint8_t(length >> (8 * k));
    crypto_secretstream_xchacha20poly1305_push(
        &s_->stream, record + kLengthBytes, nullptr,
        reinterpret_cast<const unsigned char *>(data + at), chunk, nullptr, 0,
        crypto_secretstream_xchacha20poly1305_TAG_MESSAGE);
    at += chunk;
  }
}

struct Opener::State {
  std::string key;
  Stream stream;
  bool started = false;
  std::string pending; ///< Bytes of the header or of a record still arriving.
};

Opener::Opener(const std::string &key) : s_(std::make_unique<State>()) {
  ensureSodium();
  if (key.size() != crypto_secretstream_xchacha20poly1305_KEYBYTES)
    throw std::invalid_argument("an opening key of the wrong length");
  s_->key = key;
}

Opener::~Opener() {
  sodium_memzero(s_->key.data(), s_->key.size());
  sodium_memzero(&s_->stream, sizeof s_->stream);
}

bool Opener::open(const char *data, size_t n, std::string &plain) {
  if (!error_.empty())
    return false;
  std::string &pending = s_->pending;
  pending.append(data, n);
  size_t at = 0;
  for (;;) {
    const size_t left = pending.size() - at;
    const unsigned char *p = reinterpret_cast<const unsigned char *>(pending.data()) + at;
    if (!s_->started) {
      if (left < kHeaderBytes)
        break;
      if (crypto_secretstream_xchacha20poly1305_init_pull(&s_->stream, p, bytes(s_->key)) != 0) {
        error_ = "a sealed stream's header is malformed";
        return false;
      }
      s_->started = true;
      at += kHeaderBytes;
      continue;
    }
    if (left < kLengthBytes)
      break;
    uint32_t length = 0;
    for (size_t k = 0; k < kLengthBytes; ++k)
      length |= uint32_t(p[k]) << (8 * k);
    if (length < kTagBytes || length > Sealer::kRecordBytes + kTagBytes) {
      error_ = "a sealed record of " + std::to_string(length) + " bytes, which no peer seals";
      return false;
    }
    if (left < kLengthBytes + length)
      break;
    const size_t start = plain.size();
    plain.resize(start + length - kTagBytes);
    unsigned char tag = 0;
    if (crypto_secretstream_xchacha20poly1305_pull(
            &s_->stream, reinterpret_cast<unsigned char *>(&plain[start]), nullptr, &tag,
            p + kLengthBytes, length, nullptr, 0) != 0 ||
        tag != crypto_secretstream_xchacha20poly1305_TAG_MESSAGE) {
      plain.resize(start);
      error_ = "a sealed record does not open: it was tampered with, replayed, reordered or "
               "sealed under another key";
      return false;
    }
    at += kLengthBytes + length;
  }
  pending.erase(0, at);
  return true;
}

} // namespace rgpu::net
