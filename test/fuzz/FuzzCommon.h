//===- test/fuzz/FuzzCommon.h - What the fuzz targets share -----------------===//
//
// Inputs are what a peer can send: a byte stream of frames (header and message), exactly as it
// arrives on the socket. The stream is fed to the frame decoder in chunks whose sizes come from
// the input itself, so partial headers and split frames are exercised too.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/net/Frame.h"
#include "rgpu/wire/RunArgs.h"
#include "rgpu/wire/Wire.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace rgpu::fuzz {

/// Limits small enough that no input can make a target allocate gigabytes legitimately.
inline wire::Limits limits() {
  wire::Limits l;
  l.maxFrameBytes = 8u << 20;
  l.maxNodes = 4096;
  l.maxDownloadBytes = 1u << 20;
  l.maxTensorBytes = 64u << 20;
  return l;
}

/// Splits \p data into frames as a server's reader would. Stops at the first protocol error.
inline std::vector<net::Frame> frames(const uint8_t *data, size_t size, const wire::Limits &l) {
  net::FrameDecoder decoder(l.maxFrameBytes);
  std::vector<net::Frame> out;
  size_t at = 0;
  while (at < size) {
    // Chunk sizes from the stream's own bytes: 1..4096, so headers split at every offset.
    size_t chunk = 1 + (size_t(data[at]) * 16 + at) % 4096;
    chunk = std::min(chunk, size - at);
    if (!decoder.feed(reinterpret_cast<const char *>(data + at), chunk))
      break;
    at += chunk;
    net::Frame f;
    while (decoder.next(f))
      out.push_back(std::move(f));
  }
  return out;
}

} // namespace rgpu::fuzz
