#include "rgpu/wire/Planes.h"

#include <zlib.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace rgpu::wire {
namespace {

enum : uint8_t { Raw = 0, Deflated = 1 };
constexpr size_t kHeader = 5;

/// Both sides split by the element's bytes where they divide \p n, else by single bytes.
unsigned planesOf(size_t n, unsigned width) {
  return width >= 1 && width <= 16 && n % width == 0 ? width : 1;
}

/// Shannon entropy in bits per byte of up to 4096 bytes sampled evenly from \p p.
double sampledEntropy(const uint8_t *p, size_t n) {
  uint32_t counts[256] = {};
  size_t step = n > 4096 ? n / 4096 : 1, taken = 0;
  for (size_t i = 0; i < n; i += step, ++taken)
    ++counts[p[i]];
  double bits = 0;
  for (uint32_t c : counts)
    if (c) {
      double q = double(c) / double(taken);
      bits -= q * std::log2(q);
    }
  return bits;
}

/// Element i's byte k is plane byte k * count + i: with Split, \p from holds the elements and
/// \p to gets the planes; otherwise the reverse. W fixes the width for the compiler (0: \p width).
template <bool Split, unsigned W>
void movePlanesBy(const uint8_t *from, uint8_t *to, size_t count, unsigned width) {
  const unsigned w = W ? W : width;
  for (unsigned k = 0; k < w; ++k)
    for (size_t i = 0; i < count; ++i) {
      const size_t element = i * w + k, plane = k * count + i;
      if constexpr (Split)
        to[plane] = from[element];
      else
        to[element] = from[plane];
    }
}
template <bool Split>
void movePlanes(const uint8_t *from, uint8_t *to, size_t count, unsigned width) {
  switch (width) {
  case 2: return movePlanesBy<Split, 2>(from, to, count, width);
  case 4: return movePlanesBy<Split, 4>(from, to, count, width);
  case 8: return movePlanesBy<Split, 8>(from, to, count, width);
  default: return movePlanesBy<Split, 0>(from, to, count, width);
  }
}

/// Raw deflate (no zlib header, no checksum: frames are checked already) of Huffman codes and
/// runs only (Z_RLE): a plane's bytes repeat in runs (zeros) or not at all, and without the
/// search for other matches deflate takes half the time and, on a float's exponent plane,
/// gives a quarter fewer bytes.
class Deflater {
public:
  Deflater() { ok_ = deflateInit2(&z_, 1, Z_DEFLATED, -15, 8, Z_RLE) == Z_OK; }
  ~Deflater() {
    if (ok_)
      deflateEnd(&z_);
  }
  /// Appends the deflated \p n bytes at \p in to \p out if that saves a sixteenth of them.
  bool deflateInto(const uint8_t *in, size_t n, std::string &out) {
    if (!ok_ || deflateReset(&z_) != Z_OK)
      return false;
    const size_t start = out.size(), room = n - n / 16;
    out.resize(start + room);
    z_.next_in = const_cast<Bytef *>(in);
    z_.avail_in = uInt(n);
    z_.next_out = reinterpret_cast<Bytef *>(&out[start]);
    z_.avail_out = uInt(room);
    const bool fits = deflate(&z_, Z_FINISH) == Z_STREAM_END;
    out.resize(fits ? start + z_.total_out : start);
    return fits;
  }

private:
  z_stream z_{};
  bool ok_ = false;
};

/// Inflates \p in into exactly \p n bytes at \p out; false with \p why otherwise.
bool inflateExactly(const uint8_t *in, size_t size, uint8_t *out, size_t n, std::string &why) {
  z_stream z{};
  if (inflateInit2(&z, -15) != Z_OK) {
    why = "zlib could not start";
    return false;
  }
  z.next_in = const_cast<Bytef *>(in);
  z.avail_in = uInt(size);
  z.next_out = out;
  z.avail_out = uInt(n);
  const int status = inflate(&z, Z_FINISH);
  const size_t got = z.total_out, left = z.avail_in, room = z.avail_out;
  const std::string zlibSays = z.msg ? z.msg : "status " + std::to_string(status);
  inflateEnd(&z);
  if (status == Z_STREAM_END && got == n && left == 0)
    return true;
  if (status == Z_STREAM_END)
    why = got != n ? "inflates to " + std::to_string(got) + " bytes, not " + std::to_string(n)
                   : std::to_string(left) + " bytes follow its deflate stream";
  else
    why = room == 0 ? "inflates past its " + std::to_string(n) + " bytes"
                    : "is not a whole deflate stream (zlib: " + zlibSays + ")";
  return false;
}

} // namespace

std::optional<std::string> encodePlanes(const uint8_t *data, size_t n, unsigned width) {
  const unsigned planes = planesOf(n, width);
  const size_t plane = n / planes;
  // A plane's length travels as a u32; larger chunks go raw (uploads are chunked far below).
  if (n < 64 || plane > UINT32_MAX)
    return std::nullopt;
  std::vector<uint8_t> split;
  if (planes > 1) {
    split.resize(n);
    movePlanes<true>(data, split.data(), plane, planes);
  }
  Deflater deflater;
  std::string out;
  out.reserve(n);
  for (unsigned k = 0; k < planes; ++k) {
    const uint8_t *bytes = planes == 1 ? data : split.data() + k * plane;
    const size_t header = out.size();
    out.append(kHeader, '\0');
    // Above 7 bits a byte, Huffman codes save under an eighth of the plane: not worth its time.
    const bool deflated =
        sampledEntropy(bytes, plane) < 7.0 && deflater.deflateInto(bytes, plane, out);
    if (!deflated)
      out.append(reinterpret_cast<const char *>(bytes), plane);
    out[header] = char(deflated ? Deflated : Raw);
    const uint32_t length = uint32_t(out.size() - header - kHeader);
    for (int i = 0; i < 4; ++i)
      out[header + 1 + i] = char((length >> (8 * i)) & 0xff);
  }
  if (out.size() >= n - n / 16)
    return std::nullopt;
  return out;
}

bool decodePlanes(const uint8_t *blob, size_t size, uint8_t *out, size_t n, unsigned width,
                  std::string &why) {
  const unsigned planes = planesOf(n, width);
  const size_t plane = n / planes;
  std::vector<uint8_t> scratch(planes == 1 ? 0 : n);
  size_t at = 0;
  for (unsigned k = 0; k < planes; ++k) {
    if (size - at < kHeader) {
      why = "byte plane " + std::to_string(k) + " of " + std::to_string(planes) + " is missing";
      return false;
    }
    const uint8_t mode = blob[at];
    uint32_t length = 0;
    for (int i = 0; i < 4; ++i)
      length |= uint32_t(blob[at + 1 + i]) << (8 * i);
    at += kHeader;
    if (length > size - at) {
      why = "byte plane " + std::to_string(k) + " says " + std::to_string(length) +
            " bytes, and " + std::to_string(size - at) + " follow";
      return false;
    }
    uint8_t *dest = planes == 1 ? out : scratch.data() + k * plane;
    if (mode == Raw) {
      if (length != plane) {
        why = "raw byte plane " + std::to_string(k) + " has " + std::to_string(length) +
              " bytes, not " + std::to_string(plane);
        return false;
      }
      if (plane)
        std::memcpy(dest, blob + at, plane);
    } else if (mode == Deflated) {
      if (!inflateExactly(blob + at, length, dest, plane, why)) {
        why = "byte plane " + std::to_string(k) + " " + why;
        return false;
      }
    } else {
      why = "byte plane " + std::to_string(k) + " has unknown mode " + std::to_string(mode);
      return false;
    }
    at += length;
  }
  if (at != size) {
    why = std::to_string(size - at) + " bytes follow the last byte plane";
    return false;
  }
  if (planes > 1)
    movePlanes<false>(scratch.data(), out, plane, planes);
  return true;
}

} // namespace rgpu::wire
