// libFuzzer target: the decoder of an upload chunk compressed by byte plane
// (lib/wire/Planes.cpp), which the server runs on a peer's bytes before trusting any of them.
// Input: the element width (1 byte), the chunk's decoded length (2 bytes, little-endian), then
// the blob. What decodes must also encode and decode back to the same bytes.
#include "rgpu/wire/Planes.h"

#include <cstdlib>
#include <string>
#include <vector>

using namespace rgpu;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 3)
    return 0;
  const unsigned width = data[0] % 17;
  const size_t n = size_t(data[1]) | size_t(data[2]) << 8;
  std::vector<uint8_t> out(n);
  std::string why;
  if (!wire::decodePlanes(data + 3, size - 3, out.data(), n, width, why))
    return 0;
  if (auto again = wire::encodePlanes(out.data(), n, width)) {
    std::vector<uint8_t> back(n);
    if (!wire::decodePlanes(reinterpret_cast<const uint8_t *>(again->data()), again->size(),
                            back.data(), n, width, why) ||
        back != out)
      std::abort();
  }
  return 0;
}
