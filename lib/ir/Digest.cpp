#include "rgpu/ir/Digest.h"

#include <llvm/Support/Endian.h>
#include <llvm/Support/ErrorHandling.h>

#include <sodium.h>

namespace rgpu::ir {

namespace {
static_assert(crypto_generichash_BYTES == 32, "BLAKE2b-256");

void start() {
  static const bool ready = sodium_init() >= 0; // picks the CPU's fastest BLAKE2b once
  if (!ready)
    llvm::report_fatal_error("libsodium cannot start");
}

Hash256 hashOf(const unsigned char *digest) {
  Hash256 h;
  for (size_t k = 0; k < 4; ++k)
    h.w[k] = llvm::support::endian::read64le(digest + 8 * k);
  return h;
}

crypto_generichash_state *stateOf(unsigned char *bytes) {
  static_assert(sizeof(crypto_generichash_state) <= 384, "Digester::state_ is too small");
  return reinterpret_cast<crypto_generichash_state *>(bytes);
}
} // namespace

Hash256 digestOf(const void *data, size_t size) {
  start();
  unsigned char digest[32];
  crypto_generichash(digest, sizeof digest, static_cast<const unsigned char *>(data), size,
                     nullptr, 0);
  return hashOf(digest);
}

Digester::Digester() {
  start();
  crypto_generichash_init(stateOf(state_), nullptr, 0, 32);
}

void Digester::update(const void *data, size_t size) {
  crypto_generichash_update(stateOf(state_), static_cast<const unsigned char *>(data), size);
}

Hash256 Digester::finish() {
  unsigned char digest[32];
  crypto_generichash_final(stateOf(state_), digest, sizeof digest);
  return hashOf(digest);
}

} // namespace rgpu::ir
