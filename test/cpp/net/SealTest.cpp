#include "rgpu/net/Seal.h"

#include <gtest/gtest.h>

#include <random>

using namespace rgpu::net;

namespace {
SessionKeys keys() { return deriveKeys("token", std::string(32, 'c'), std::string(32, 'n')); }

std::string noise(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char &c : s)
    c = char(rng());
  return s;
}

/// Opens \p sealed fed in pieces of \p piece bytes; false if any does not open.
bool openInPieces(const std::string &key, const std::string &sealed, size_t piece,
                  std::string &plain, std::string *why = nullptr) {
  Opener opener(key);
  for (size_t at = 0; at < sealed.size(); at += piece)
    if (!opener.open(sealed.data() + at, std::min(piece, sealed.size() - at), plain)) {
      if (why)
        *why = opener.error();
      return false;
    }
  return true;
}
} // namespace

TEST(Seal, EachHelloGetsItsOwnKeysOnePerDirection) {
  SessionKeys a = keys();
  EXPECT_EQ(a.clientToServer.size(), 32u);
  EXPECT_NE(a.clientToServer, a.serverToClient);
  EXPECT_EQ(a.clientToServer, keys().clientToServer);
  EXPECT_NE(a.clientToServer,
            deriveKeys("token", std::string(32, 'c'), std::string(32, 'm')).clientToServer);
  EXPECT_NE(a.clientToServer,
            deriveKeys("other", std::string(32, 'c'), std::string(32, 'n')).clientToServer);
}

TEST(Seal, AStreamOpensWhateverPiecesItArrivesIn) {
  SessionKeys k = keys();
  Sealer sealer(k.clientToServer);
  std::string sealed, want;
  for (size_t n : {0ul, 1ul, 100ul, Sealer::kRecordBytes + 3, 70000ul}) {
    std::string part = noise(n, unsigned(n));
    sealer.seal(part.data(), part.size(), sealed);
    want += part;
  }
  EXPECT_EQ(sealed.find(want.substr(0, 64)), std::string::npos); // nothing in the clear
  for (size_t piece : {1ul, 7ul, 4096ul, sealed.size()}) {
    std::string plain;
    ASSERT_TRUE(openInPieces(k.clientToServer, sealed, piece, plain)) << piece;
    EXPECT_EQ(plain, want) << piece;
  }
}

TEST(Seal, ATamperedReplayedReorderedOrForeignRecordDoesNotOpen) {
  SessionKeys k = keys();
  Sealer sealer(k.clientToServer);
  const std::string header_and_first = sealer.seal("first frame"); // the header comes first
  const std::string second = sealer.seal("second frame"), third = sealer.seal("third frame");
  const std::string stream = header_and_first + second + third;
  std::string plain, why;
  ASSERT_TRUE(openInPieces(k.clientToServer, stream, 5, plain));
  EXPECT_EQ(plain, "first framesecond framethird frame");

  for (size_t at = 0; at < stream.size(); at += 3) { // every third byte flipped in turn
    std::string bad = stream;
    bad[at] ^= 0x10;
    plain.clear();
    EXPECT_FALSE(openInPieces(k.clientToServer, bad, 64, plain) &&
                 plain == "first framesecond framethird frame")
        << at;
  }
  plain.clear();
  EXPECT_FALSE(openInPieces(k.clientToServer, header_and_first + second + second, 64, plain, &why));
  EXPECT_NE(why.find("does not open"), std::string::npos) << why;
  EXPECT_FALSE(openInPieces(k.clientToServer, header_and_first + third + second, 64, plain));
  EXPECT_FALSE(openInPieces(k.serverToClient, stream, 64, plain)); // the other direction's key
  // A length no sealer makes is refused from its four bytes, before any buffering.
  std::string huge = header_and_first.substr(0, 24) + std::string("\xff\xff\xff\x7f", 4);
  EXPECT_FALSE(openInPieces(k.clientToServer, huge, 64, plain, &why));
  EXPECT_NE(why.find("which no peer seals"), std::string::npos) << why;
  // And an opener that failed stays failed.
  Opener opener(k.clientToServer);
  EXPECT_FALSE(opener.open(huge.data(), huge.size(), plain));
  EXPECT_FALSE(opener.open(stream.data(), stream.size(), plain));
}
