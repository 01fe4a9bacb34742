//===- rgpu/ir/Digest.h - BLAKE2b-256 of bytes --------------------------------===//
//
// The one digest rgpu names things by: a graph by its canonical bytes (hashGraph), an upload
// and a file of the server's files area by their content. libsodium's BLAKE2b, whose fastest
// implementation for the CPU is chosen once.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <cstddef>
#include <cstdint>

namespace rgpu::ir {

/// The BLAKE2b-256 digest of \p size bytes at \p data.
Hash256 digestOf(const void *data, size_t size);

/// The same digest of bytes that arrive in parts.
class Digester {
public:
  Digester();
  void update(const void *data, size_t size);
  Hash256 finish();

private:
  alignas(64) unsigned char state_[384]; ///< crypto_generichash_state
};

} // namespace rgpu::ir
