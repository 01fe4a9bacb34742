// libFuzzer target: the job's rendezvous store (server/Rendezvous.cpp). Input: a mode byte,
// then bytes. Mode 0 (most inputs): a stream of frames from a peer that proved the secret,
// each served by one store's table, whose memory is charged against a small quota: whatever
// the requests, what the table says it holds is what it charged, and destroying it gives
// every byte back. Mode 1: frames as the store reads a handshake (StoreHello). Mode 2: the
// bytes as a Gloo address record a server publishes. Mode 3: the bytes as a store's address.
#include "FuzzCommon.h"
#include "Rendezvous.h"

#include <cstdlib>
#include <string>

using namespace rgpu;
namespace rendezvous = rgpu::server::rendezvous;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  const uint8_t mode = data[0] % 8;
  ++data;
  --size;
  if (mode == 2) {
    const std::string record(reinterpret_cast<const char *>(data), size);
    const std::string clean = rendezvous::zeroAddressPadding(record);
    if (clean.size() != record.size() ||
        (rendezvous::glooAddressAt(record) == std::string::npos && clean != record))
      std::abort();
    return 0;
  }
  if (mode == 3) {
    const std::string text(reinterpret_cast<const char *>(data), size);
    auto a = rendezvous::parseAddress(text);
    if (a && rendezvous::address(a->host, a->port, a->secret) != text &&
        text.find_first_of("ABCDEF") == text.npos)
      std::abort();
    return 0;
  }
  wire::Limits limits = fuzz::limits();
  limits.maxFrameBytes = rendezvous::kMaxRequestBytes;
  auto frames = fuzz::frames(data, size, limits);
  if (mode == 1) {
    for (const net::Frame &f : frames) {
      rendezvous::readHello(f);
    }
    return 0;
  }
  int64_t charged = 0;
  {
    rendezvous::Table table([&](int64_t n) {
      if (n > 0 && charged + n > (4 << 20))
        return false;
      charged += n;
      return true;
    });
    for (const net::Frame &f : frames) {
      std::string reply;
      std::optional<rendezvous::Table::Wait> wait;
      if (!table.serve(f, reply, wait))
        break;
      if (wait)
        reply = rendezvous::Table::waitReply(table.allSet(wait->keys));
      if (reply.empty() || int64_t(table.bytes()) != charged)
        std::abort();
    }
  }
  if (charged != 0)
    std::abort();
  return 0;
}
