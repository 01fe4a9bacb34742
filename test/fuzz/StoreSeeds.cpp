// Writes the seed inputs of store_fuzz (test/fuzz/corpus/store): `store_seeds DIR`. Each is a
// mode byte and the frames a joining server sends, built as its Client builds them.
#include "rgpu/net/Auth.h"
#include "rgpu/net/Frame.h"
#include "store.capnp.h"

#include <capnp/message.h>

#include <cstdio>
#include <functional>
#include <string>

using namespace rgpu;

namespace {
capnp::Data::Reader bytes(const std::string &s) {
  return capnp::Data::Reader(reinterpret_cast<const kj::byte *>(s.data()), s.size());
}

std::string request(const std::function<void(wire::StoreRequest::Builder)> &fill) {
  capnp::MallocMessageBuilder b;
  fill(b.initRoot<wire::StoreRequest>());
  return net::encodeFrame(b, true);
}

void write(const std::string &dir, const char *name, const std::string &input) {
  FILE *f = std::fopen((dir + "/" + name).c_str(), "wb");
  if (!f)
    return;
  std::fwrite(input.data(), 1, input.size(), f);
  std::fclose(f);
}
} // namespace

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: store_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  auto set = [](const std::string &k, const std::string &v) {
    return request([&](auto r) {
      auto e = r.initSet();
      e.setKey(bytes(k));
      e.setValue(bytes(v));
    });
  };
  std::string gloo = set("rgpu/job/0/1", std::string(170, '\x02'));
  std::string all(1, '\0');
  all += set("k", "v") + gloo;
  all += request([](auto r) { r.setGet(bytes("k")); });
  all += request([](auto r) {
    auto a = r.initAdd();
    a.setKey(bytes("n"));
    a.setDelta(3);
  });
  all += request([](auto r) { r.initCheck(2).set(0, bytes("k")); });
  all += request([](auto r) {
    auto w = r.initWait();
    w.initKeys(1).set(0, bytes("n"));
    w.setTimeoutMs(100);
  });
  all += request([](auto r) { r.setDeleteKey(bytes("k")); });
  all += request([](auto r) { r.setNumKeys(); });
  all += request([](auto r) {
    auto c = r.initCompareSet();
    c.setKey(bytes("c"));
    c.setDesired(bytes("d"));
  });
  all += request([](auto r) {
    auto e = r.initAppend();
    e.setKey(bytes("l"));
    e.setValue(bytes("ab"));
  });
  write(dir, "requests", all);
  capnp::MallocMessageBuilder hello;
  auto h = hello.initRoot<wire::StoreHello>();
  h.setNonce(bytes(std::string(32, 'n')));
  h.setMac(bytes(std::string(32, 'm')));
  write(dir, "hello", std::string(1, '\1') + net::encodeFrame(hello, true));
  std::string record(1, '\2');
  record += std::string("\2\0\0\0\0\0\0\0vm\x88\0\0\0\0\0\0\0\2\0", 20) + std::string(134, 'x') +
            std::string(16, '\0');
  write(dir, "gloo-record", record);
  write(dir, "address", "\3127.0.0.1:4242#" + std::string(64, 'a'));
  return 0;
}
