#include "rgpu/wire/Planes.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

using namespace rgpu;

namespace {

/// Normal floats, as a batch of features is: sign and exponent bytes repeat, mantissas do not.
std::vector<uint8_t> normalFloats(size_t count) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<uint8_t> bytes(count * 4);
  for (size_t i = 0; i < count; ++i) {
    float v = normal(rng);
    std::memcpy(&bytes[i * 4], &v, 4);
  }
  return bytes;
}

std::vector<uint8_t> decode(const std::string &blob, size_t n, unsigned width, std::string &why) {
  std::vector<uint8_t> out(n);
  if (!wire::decodePlanes(reinterpret_cast<const uint8_t *>(blob.data()), blob.size(), out.data(),
                          n, width, why))
    out.clear();
  return out;
}

} // namespace

TEST(Planes, RoundTripsWhatItCompresses) {
  std::string why;
  // Token ids as int64: six of eight planes are zeros.
  std::vector<uint8_t> tokens(4096 * 8);
  for (size_t i = 0; i < 4096; ++i) {
    int64_t id = int64_t((i * 7919) % 50257);
    std::memcpy(&tokens[i * 8], &id, 8);
  }
  auto packed = wire::encodePlanes(tokens.data(), tokens.size(), 8);
  ASSERT_TRUE(packed);
  EXPECT_LT(packed->size(), tokens.size() / 3);
  EXPECT_EQ(decode(*packed, tokens.size(), 8, why), tokens) << why;

  // float32 noise: only the sign and exponent plane shrinks, by enough to send it packed.
  auto floats = normalFloats(16384);
  packed = wire::encodePlanes(floats.data(), floats.size(), 4);
  ASSERT_TRUE(packed);
  EXPECT_LT(packed->size(), floats.size() * 15 / 16);
  EXPECT_EQ(decode(*packed, floats.size(), 4, why), floats) << why;

  // A length the width does not divide goes by single bytes.
  std::vector<uint8_t> odd(10001, 3);
  packed = wire::encodePlanes(odd.data(), odd.size(), 4);
  ASSERT_TRUE(packed);
  EXPECT_EQ(decode(*packed, odd.size(), 4, why), odd) << why;
}

TEST(Planes, LeavesNoiseAlone) {
  std::mt19937 rng(1);
  std::vector<uint8_t> noise(1 << 16);
  for (auto &b : noise)
    b = uint8_t(rng());
  EXPECT_FALSE(wire::encodePlanes(noise.data(), noise.size(), 1));
  EXPECT_FALSE(wire::encodePlanes(noise.data(), 16, 1)); // too small to bother
}

TEST(Planes, RefusesMalformedBlobs) {
  std::vector<uint8_t> zeros(4096 * 4, 0);
  auto packed = *wire::encodePlanes(zeros.data(), zeros.size(), 4);
  std::string why;
  auto refused = [&](const std::string &blob, size_t n = 4096 * 4) {
    why.clear();
    return decode(blob, n, 4, why).empty() && !why.empty();
  };
  EXPECT_TRUE(refused(""));
  EXPECT_TRUE(refused(packed.substr(0, packed.size() - 1))); // truncated
  EXPECT_TRUE(refused(packed + "x"));                        // trailing bytes
  EXPECT_TRUE(refused(packed, 4096 * 4 + 4));                 // inflates short
  EXPECT_TRUE(refused(packed, 4096 * 4 - 4));                 // inflates long
  std::string mode = packed;
  mode[0] = 9;
  EXPECT_TRUE(refused(mode));
  EXPECT_NE(why.find("unknown mode"), std::string::npos) << why;
  std::string length = packed;
  length[4] = char(0x7f); // plane 0 claims far more bytes than follow
  EXPECT_TRUE(refused(length));
  std::string corrupt = packed;
  corrupt[6] ^= 0x55; // inside the first deflate stream
  EXPECT_TRUE(refused(corrupt));
  // A raw plane must be exactly the plane's length.
  std::string raw(1, '\0');
  raw += std::string("\x03\0\0\0", 4) + "abc";
  EXPECT_TRUE(refused(raw, 4));
  EXPECT_NE(why.find("raw byte plane"), std::string::npos) << why;
}
