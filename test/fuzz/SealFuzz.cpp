// libFuzzer target: the opener of sealed TCP streams (lib/net/Seal.cpp), which the server runs
// on every byte a TCP peer sends after its Hello. Input: a mode byte, then bytes. Even modes
// open the bytes as they are, fed in pieces of a size the mode picks: that must never crash.
// Odd modes seal the bytes, change one byte of the sealed stream where the next two bytes say
// (or none), and open it again: unchanged, it must give the bytes back; changed, it must never
// give them back whole.
#include "rgpu/net/Seal.h"

#include <cstdlib>
#include <string>

using namespace rgpu;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 3)
    return 0;
  static const net::SessionKeys keys =
      net::deriveKeys("fuzz token", std::string(32, 'c'), std::string(32, 'n'));
  const uint8_t mode = data[0];
  const size_t piece = 1 + mode / 2;
  if (mode % 2 == 0) {
    std::string plain;
    net::Opener opener(keys.clientToServer);
    for (size_t at = 1; at < size; at += piece)
      if (!opener.open(reinterpret_cast<const char *>(data) + at, std::min(piece, size - at),
                       plain))
        break;
    return 0;
  }
  const size_t where = size_t(data[1]) | size_t(data[2]) << 8;
  const std::string message(reinterpret_cast<const char *>(data) + 3, size - 3);
  net::Sealer sealer(keys.clientToServer);
  std::string sealed = sealer.seal(message);
  sealed += sealer.seal(message);
  const bool changed = where < sealed.size();
  if (changed)
    sealed[where] ^= 0x5a;
  net::Opener opener(keys.clientToServer);
  std::string plain;
  bool ok = true;
  for (size_t at = 0; ok && at < sealed.size(); at += piece)
    ok = opener.open(sealed.data() + at, std::min(piece, sealed.size() - at), plain);
  if (!changed && (!ok || plain != message + message))
    std::abort();
  // (An empty message seals to the stream's header alone, which no record vouches for.)
  if (changed && ok && !message.empty() && plain == message + message)
    std::abort();
  return 0;
}
