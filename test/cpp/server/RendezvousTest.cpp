// The job's rendezvous store (server/Rendezvous.h) on a real loopback listener: c10d's store
// semantics, the secret, and every bound, each with a well-behaved client beside the attacker.

#include "Rendezvous.h"

#include "rgpu/net/Auth.h"
#include "store.capnp.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

using namespace rgpu;
using namespace rgpu::server::rendezvous;
using namespace std::chrono_literals;

namespace {

const std::string kSecret(kSecretBytes, 's');

Client client(const Service &service, const std::string &secret = kSecret,
              std::shared_ptr<std::atomic<bool>> cancelled = {}) {
  return Client("127.0.0.1", service.port(), secret, 10s, std::move(cancelled));
}

/// A raw TCP connection to the store; -1 if refused.
int connectTo(const Service &service) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(service.port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

/// Whether the store closed \p fd within \p ms (reading and dropping what it sent).
bool closedWithin(int fd, int ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) == 1) {
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0)
        return true;
    }
  }
  return false;
}

/// A client of the store that must keep getting right answers while an attack goes on.
class Beside {
public:
  /// Its connection is proven before the constructor returns.
  explicit Beside(const Service &service)
      : client_("127.0.0.1", service.port(), kSecret, 10s) {
    client_.set("beside", "ready");
    thread_ = std::thread([this] {
      for (int k = 0; !stop_; ++k) {
        try {
          client_.set("beside", std::to_string(k));
          if (client_.get("beside") == std::to_string(k))
            ++ok_;
          else
            ++wrong_;
        } catch (const std::exception &) {
          ++wrong_;
        }
      }
    });
  }
  bool finish() {
    while (ok_ + wrong_ == 0)
      std::this_thread::sleep_for(5ms);
    stop_ = true;
    thread_.join();
    return ok_ > 0 && wrong_ == 0;
  }

private:
  Client client_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> ok_{0}, wrong_{0};
};

} // namespace

TEST(Rendezvous, AnswersAsC10dsTcpStoreDoes) {
  Service service("127.0.0.1", kSecret, {});
  Client a = client(service), b = client(service);
  a.set("k", "v");
  EXPECT_EQ(b.get("k"), "v");
  EXPECT_EQ(b.get("none"), std::nullopt);
  EXPECT_EQ(a.add("n", 5), 5);
  EXPECT_EQ(b.add("n", -7), -2);
  EXPECT_EQ(a.get("n"), "-2");
  EXPECT_THROW(a.add("k", 1), std::runtime_error); // "v" is no number
  EXPECT_TRUE(a.check({"k", "n"}));
  EXPECT_FALSE(a.check({"k", "none"}));
  // compareSet: an unset key takes the value only if nothing was expected.
  EXPECT_EQ(a.compareSet("c", "x", "y"), "x");
  EXPECT_EQ(a.get("c"), std::nullopt);
  EXPECT_EQ(a.compareSet("c", "", "y"), "y");
  EXPECT_EQ(a.compareSet("c", "z", "w"), "y");
  EXPECT_EQ(a.compareSet("c", "y", "w"), "w");
  a.append("l", "ab");
  a.append("l", "cd");
  EXPECT_EQ(b.get("l"), "abcd");
  EXPECT_EQ(a.numKeys(), 4);
  EXPECT_TRUE(a.deleteKey("l"));
  EXPECT_FALSE(a.deleteKey("l"));
  EXPECT_EQ(a.numKeys(), 3);
  std::string binary("\0\xff\x01", 3);
  a.set(binary, binary);
  EXPECT_EQ(b.get(binary), binary);
}

TEST(Rendezvous, AWaitEndsWhenAnotherSetsItsKeysOrAtItsTimeout) {
  Service service("127.0.0.1", kSecret, {});
  Client a = client(service), b = client(service);
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(a.wait({"late"}, 300ms));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  std::thread setter([&] {
    std::this_thread::sleep_for(1500ms); // longer than one wait request (kMaxWaitMs)
    b.set("late", "1");
  });
  start = std::chrono::steady_clock::now();
  EXPECT_TRUE(a.wait({"late"}, 5s));
  auto waited = std::chrono::steady_clock::now() - start;
  setter.join();
  EXPECT_GE(waited, 1400ms);
  EXPECT_LT(waited, 2500ms);
}

TEST(Rendezvous, ACancelledWaitEndsWithinAPoll) {
  Service service("127.0.0.1", kSecret, {});
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  Client a = client(service, kSecret, cancelled);
  std::thread canceller([&] {
    std::this_thread::sleep_for(300ms);
    *cancelled = true;
  });
  auto start = std::chrono::steady_clock::now();
  try {
    a.wait({"never"}, 60s);
    ADD_FAILURE() << "a cancelled wait returned";
  } catch (const std::runtime_error &e) {
    EXPECT_NE(std::string(e.what()).find("cancelled"), std::string::npos) << e.what();
  }
  canceller.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 300ms + 3 * Client::kCancelPollMs * 1ms);
}

TEST(Rendezvous, OnlyPeersHoldingTheSecretGetPastTheHandshake) {
  Service service("127.0.0.1", kSecret, {});
  Beside beside(service);
  std::string other(kSecretBytes, 't');
  Client wrong = client(service, other);
  try {
    wrong.set("k", "forged");
    ADD_FAILURE() << "a client without the secret was served";
  } catch (const std::runtime_error &e) {
    EXPECT_NE(std::string(e.what()).find("secret"), std::string::npos) << e.what();
  }
  // A peer that answers the challenge with garbage, or a valid frame of the wrong MAC, is
  // closed at once.
  int fd = connectTo(service);
  ASSERT_GE(fd, 0);
  (void)!::send(fd, "GET / HTTP/1.1\r\n\r\n", 18, MSG_NOSIGNAL);
  EXPECT_TRUE(closedWithin(fd, 2000));
  ::close(fd);
  EXPECT_EQ(client(service).get("k"), std::nullopt);
  EXPECT_TRUE(beside.finish());
}

TEST(Rendezvous, AHandshakeThatStallsIsClosedAndCountsTowardABound) {
  Service service("127.0.0.1", kSecret, {});
  Beside beside(service);
  // Service::kMaxHandshakes silent connections: one more is closed on arrival, and once the
  // silent ones are closed at kHandshakeMs, the store takes new ones again.
  std::vector<int> silent;
  for (int k = 0; k < Service::kMaxHandshakes; ++k)
    silent.push_back(connectTo(service));
  std::this_thread::sleep_for(200ms);
  int extra = connectTo(service);
  EXPECT_TRUE(closedWithin(extra, 2000));
  ::close(extra);
  for (int fd : silent)
    EXPECT_TRUE(closedWithin(fd, Service::kHandshakeMs + 2000));
  for (int fd : silent)
    ::close(fd);
  EXPECT_TRUE(beside.finish()); // its connection was proven before: never counted
  Client late = client(service);
  late.set("after", "1");
  EXPECT_EQ(late.get("after"), "1");
}

TEST(Rendezvous, ThePeerThatDoesNotReadItsRepliesIsDisconnected) {
  Service service("127.0.0.1", kSecret, {});
  Client setup = client(service);
  setup.set("big", std::string(kMaxValueBytes, 'x'));
  Beside beside(service);
  // A proven connection that pipelines gets of a 1 MiB value and reads nothing: the store
  // disconnects it past kMaxUnreadBytes, instead of holding every reply.
  net::Socket raw;
  std::string error;
  ASSERT_TRUE(raw.connect("127.0.0.1", service.port(), error)) << error;
  raw.readFramesExactly();
  net::FrameDecoder decoder(4096);
  net::Frame frame;
  ASSERT_EQ(raw.receive(decoder, frame, 5000, false), net::Socket::Status::Ok);
  std::string challenge;
  {
    auto m = net::openFrame(frame, wire::Limits());
    auto c = m->getRoot<wire::StoreChallenge>().getNonce();
    challenge.assign(reinterpret_cast<const char *>(c.begin()), c.size());
  }
  std::string nonce = net::auth::randomBytes(32);
  capnp::MallocMessageBuilder hello;
  auto h = hello.initRoot<wire::StoreHello>();
  auto bytes = [](const std::string &s) {
    return capnp::Data::Reader(reinterpret_cast<const kj::byte *>(s.data()), s.size());
  };
  h.setNonce(bytes(nonce));
  h.setMac(bytes(net::auth::mac("rgpu store client v1", kSecret, challenge, nonce)));
  ASSERT_TRUE(raw.sendAll(net::encodeFrame(hello, true)));
  ASSERT_EQ(raw.receive(decoder, frame, 5000, false), net::Socket::Status::Ok);
  raw.seal(net::deriveKeys(kSecret, challenge, nonce));
  capnp::MallocMessageBuilder get;
  get.initRoot<wire::StoreRequest>().setGet(bytes("big"));
  const std::string one = net::encodeFrame(get, true);
  bool cut = false;
  for (int k = 0; k < 200 && !cut; ++k)
    cut = !raw.sendAll(one);
  std::this_thread::sleep_for(1s); // the store serves the pile while nothing is read
  net::FrameDecoder big(4 * kMaxValueBytes);
  for (int k = 0; k < 200 && !cut; ++k) {
    auto s = raw.receive(big, frame, 1000, false);
    cut = s == net::Socket::Status::Closed || s == net::Socket::Status::Error;
  }
  EXPECT_TRUE(cut);
  EXPECT_TRUE(beside.finish());
}

TEST(Rendezvous, WhatTheStoreHoldsIsChargedAndBoundedAndGivenBack) {
  std::atomic<int64_t> charged{0};
  const int64_t quota = 3 << 20;
  {
    Service service("127.0.0.1", kSecret, [&](int64_t n) {
      if (n > 0 && charged + n > quota)
        return false;
      charged += n;
      return true;
    });
    Client c = client(service);
    c.set("a", std::string(1 << 20, 'a'));
    c.set("b", std::string(1 << 20, 'b'));
    EXPECT_GE(charged.load(), 2 << 20);
    try {
      c.set("c", std::string(1 << 20, 'c'));
      c.set("d", std::string(1 << 20, 'd'));
      ADD_FAILURE() << "the store took more than its session's quota";
    } catch (const std::runtime_error &e) {
      EXPECT_NE(std::string(e.what()).find("--session-memory"), std::string::npos) << e.what();
    }
    // The refusal left the connection and the table as they were.
    EXPECT_EQ(c.get("a")->size(), size_t(1) << 20);
    EXPECT_THROW(c.set("big", std::string(kMaxValueBytes + 1, 'x')), std::runtime_error);
    EXPECT_THROW(c.set(std::string(kMaxKeyBytes + 1, 'k'), "v"), std::runtime_error);
    EXPECT_TRUE(c.deleteKey("a"));
    EXPECT_LT(charged.load(), 3 << 20);
    c.set("e", std::string(1 << 20, 'e'));
  }
  EXPECT_EQ(charged.load(), 0); // the store ended with its session
}

TEST(Rendezvous, AnIdleConnectionTheStoreClosedIsOpenedAgain) {
  Service service("127.0.0.1", kSecret, {});
  Client c = client(service);
  c.set("k", "1");
  c.disconnect();
  EXPECT_EQ(c.get("k"), "1");
}

TEST(Rendezvous, GlooRecordsLeaveWithoutTheServersStrayBytes) {
  // A rank's record of a two-rank group as a server once published it: the host name "vm",
  // then its listener's sockaddr_storage, 127.0.0.1 in its first 16 bytes and stale memory in
  // the other 112, then the sequence number -1 and two more numbers.
  const std::string hex =
      "0200000000000000766d8800000000000000020095cd7f0000010000000000000000000000000000"
      "0000000000000000000000000000000000000000000000000000692390c3805d969661e1effd9856"
      "975b000000000000000000000000000000005aea77889b3f3a250000000000000000000000000000"
      "00000000000000000000692390c3805d969661e1effd9856975bffffffffffffffff000000000000"
      "00000100000000000000";
  std::string record;
  for (size_t i = 0; i < hex.size(); i += 2)
    record += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  ASSERT_EQ(record.size(), 170u);
  const std::string clean = zeroAddressPadding(record);
  const size_t address = 8 + 2 + 8, used = sizeof(sockaddr_in);
  EXPECT_EQ(clean.substr(0, address + used), record.substr(0, address + used));
  EXPECT_NE(record.substr(address + used, 112), std::string(112, '\0'));
  EXPECT_EQ(clean.substr(address + used, 112), std::string(112, '\0'));
  EXPECT_EQ(clean.substr(address + 128), record.substr(address + 128));
  // Anything else is left as it is.
  for (const std::string &other : {std::string("1"), std::string(170, 'x'), record.substr(0, 169),
                                   record + "1234"})
    EXPECT_EQ(zeroAddressPadding(other), other);
}

TEST(Rendezvous, AddressesCarryTheSecret) {
  const std::string text = address("127.0.0.1", 4242, kSecret);
  auto a = parseAddress(text);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 4242);
  EXPECT_EQ(a->secret, kSecret);
  auto six = parseAddress(address("::1", 1, kSecret));
  ASSERT_TRUE(six);
  EXPECT_EQ(six->host, "::1");
  for (const char *bad : {"127.0.0.1:4242", "127.0.0.1:99999#", ":1#00", "h:0#",
                          "h:x#0000000000000000000000000000000000000000000000000000000000000000"})
    EXPECT_FALSE(parseAddress(bad)) << bad;
  EXPECT_FALSE(parseAddress("h:1#" + std::string(64, 'g')));
}
