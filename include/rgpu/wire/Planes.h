//===- rgpu/wire/Planes.h - Tensor bytes, compressed by byte plane ----------===//
//
// An upload over a slow link may travel compressed (Upload.encoding 1). The bytes of a tensor
// are split into byte planes, one per byte of an element (plane k holds byte k of every
// element), because the planes differ: a float's sign and exponent bytes repeat a few values
// where its low mantissa bytes are noise, and the high bytes of integer token ids are zeros.
// Each plane is deflated (zlib) where that pays and sent as it is otherwise:
//
//   per plane, in order: u8 mode (0 raw, 1 deflated), u32 little-endian length, the bytes
//
// A raw plane's length is the plane's; a deflated one inflates to exactly the plane's length.
// The decoder trusts nothing: every length is checked against the plane, an inflate that does
// not give exactly the plane's bytes is an error, and trailing bytes are too.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace rgpu::wire {

/// Bytes of \p n at \p data (elements of \p width bytes), encoded by plane; nothing if the
/// encoding would save less than a sixteenth of them.
std::optional<std::string> encodePlanes(const uint8_t *data, size_t n, unsigned width);

/// Decodes \p blob of \p size bytes into exactly \p n bytes at \p out (elements of \p width
/// bytes, as encodePlanes was given). False, with \p why, if the blob is malformed.
bool decodePlanes(const uint8_t *blob, size_t size, uint8_t *out, size_t n, unsigned width,
                  std::string &why);

} // namespace rgpu::wire
