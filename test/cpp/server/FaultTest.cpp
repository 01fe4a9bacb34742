// A real rgpu-opserver process fed bad input over its Unix socket (peers of the test's own uid,
// so authenticated): each bad peer gets an error or a closed connection, the server stays up,
// and a well-behaved session alongside it keeps computing.
#include "Rendezvous.h"

#include "rgpu/ir/Digest.h"
#include "rgpu/net/Frame.h"
#include "rgpu/wire/Planes.h"
#include "rgpu/wire/Wire.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <thread>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace rgpu;

namespace {

struct ServerProcess {
  pid_t pid = -1;
  std::string dir, socket;
  std::string files; ///< its --files-dir (16 MiB a principal)

  ServerProcess() {
    char tmp[] = "/tmp/rgpu-fault-XXXXXX";
    int fds[2];
    if (!mkdtemp(tmp) || pipe(fds) != 0)
      return;
    dir = tmp;
    socket = dir + "/opserver.sock";
    files = dir + "/files";
    const std::string cache = dir + "/cache";
    pid = fork();
    if (pid == 0) {
      dup2(fds[1], 2);
      close(fds[0]);
      int null = open("/dev/null", O_WRONLY);
      dup2(null, 1);
      execl(RGPU_OPSERVER_PATH, RGPU_OPSERVER_PATH, "--device", "cpu", "--socket",
            socket.c_str(), "--max-frame-mib", "1024", "--frame-timeout", "2",
            "--session-memory", "256MiB", "--files-dir", files.c_str(), "--files-quota",
            "16MiB", "--cache-dir", cache.c_str(), "--store-size", "16MiB", nullptr);
      _exit(127);
    }
    close(fds[1]);
    FILE *err = fdopen(fds[0], "r");
    char line[512];
    while (fgets(line, sizeof line, err))
      if (std::strstr(line, "listening on unix:"))
        break;
    // Keep draining the log so the server never blocks on a full pipe (RGPU_TEST_SERVER_LOG=1
    // shows it).
    std::thread([err] {
      char buf[512];
      bool show = std::getenv("RGPU_TEST_SERVER_LOG");
      while (fgets(buf, sizeof buf, err))
        if (show)
          fputs(buf, stderr);
      fclose(err);
    }).detach();
  }
  ~ServerProcess() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }
  bool alive() const { return pid > 0 && waitpid(pid, nullptr, WNOHANG) == 0; }
};

ServerProcess &opserver() {
  static ServerProcess s; // killed when the test binary exits
  return s;
}

ir::TensorMeta vec3() { return ir::TensorMeta::contiguous(ir::dtype::Float, {3}); }

/// x * x on one f32[3] input.
ir::Graph square() {
  ir::Graph g;
  g.inputs = {vec3()};
  ir::Node n;
  n.op = ir::Symbol::get("aten::mul.Tensor");
  n.operands = {0, 0};
  n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0), ir::Arg::ref(ir::Arg::Kind::Tensor, 1)};
  n.outputs = {vec3()};
  g.nodes.push_back(n);
  g.outputs = {1};
  return g;
}

/// Fills \p cmd with a Define of \p g under its own hash.
void defineIn(wire::Command::Builder cmd, const ir::Graph &g) {
  auto def = cmd.initDefine();
  wire::encodeHash(ir::hashGraph(g), def.initHash());
  wire::encodeGraph(g, def.initGraph());
}

/// Fills \p cmd with a Run of \p hash on \p inputs, binding \p outputs handles from \p first.
void runIn(wire::Command::Builder cmd, const ir::Hash256 &hash, std::vector<uint64_t> inputs,
           uint64_t first, uint64_t outputs) {
  auto run = cmd.initRun();
  wire::encodeHash(hash, run.initHash());
  auto in = run.initWhole().initInputs(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    in.set(i, inputs[i]);
  run.setFirstOutput(first);
  run.setNumOutputs(outputs);
}

/// The header of an unpacked frame announcing \p length bytes.
std::string frameHeader(uint64_t length) {
  char header[net::kHeaderBytes];
  uint32_t magic = net::kMagic, flags = 0;
  memcpy(header, &magic, 4);
  memcpy(header + 4, &flags, 4);
  memcpy(header + 8, &length, 8);
  return std::string(header, sizeof header);
}

/// The f32[3] a reply's one result holds; empty if it holds something else.
std::vector<float> vec3Of(const net::Frame &reply) {
  auto r = net::openFrame(reply, wire::Limits());
  auto results = r->getRoot<wire::ServerFrame>().getResults();
  if (results.size() != 1 || !results[0].isData() || results[0].getData().size() != 12)
    return {};
  std::vector<float> v(3);
  std::memcpy(v.data(), results[0].getData().begin(), 12);
  return v;
}

/// A client speaking the wire protocol by hand.
class Peer {
public:
  Peer() : decoder_(wire::Limits().maxFrameBytes) {
    std::string error;
    EXPECT_TRUE(socket_.connectUnix(opserver().socket, error)) << error;
  }

  bool sendRaw(const std::string &bytes) { return socket_.sendAll(bytes); }
  /// The next frame is numbered \p seq + 1.
  void setSeq(uint64_t seq) { seq_ = seq; }

  /// Sends one frame built by \p fill; returns the reply if \p wantReply.
  /// With \p wait false, asks for a reply without waiting for it (see receive).
  /// \p flags: header flags besides packing (net::kFlagCancel).
  template <typename Fill>
  std::optional<net::Frame> send(bool wantReply, size_t n, Fill fill, bool pack = true,
                                 bool wait = true, uint32_t flags = 0) {
    capnp::MallocMessageBuilder b;
    auto f = b.initRoot<wire::ClientFrame>();
    f.setSeq(++seq_);
    f.setWantReply(wantReply);
    fill(f.initCommands(n));
    if (!socket_.sendAll(net::encodeFrame(b, pack, flags)))
      return std::nullopt;
    if (!wantReply || !wait)
      return net::Frame();
    return receive();
  }

  /// The next frame from the server that is not a heartbeat, if one comes within 10 s.
  std::optional<net::Frame> receive() {
    for (;;) {
      net::Frame reply;
      if (socket_.receive(decoder_, reply, 10000) != net::Socket::Status::Ok)
        return std::nullopt;
      if (!net::openFrame(reply, wire::Limits())->getRoot<wire::ServerFrame>().getHeartbeat())
        return reply;
    }
  }

  /// True if the server closed this connection (within a few seconds).
  bool closedByServer() {
    net::Frame f;
    for (;;) {
      auto s = socket_.receive(decoder_, f, 5000);
      if (s == net::Socket::Status::Ok)
        continue; // an error frame before the close
      return s == net::Socket::Status::Closed || s == net::Socket::Status::Error;
    }
  }

  void hello() {
    auto reply = send(true, 1, [](auto cmds) {
      auto h = cmds[0].initHello();
      h.setProtocol(wire::kProtocolVersion);
    });
    ASSERT_TRUE(reply);
  }

  /// The error message in a reply, or "" if none.
  static std::string errorOf(const net::Frame &reply) {
    auto r = net::openFrame(reply, wire::Limits());
    auto sf = r->getRoot<wire::ServerFrame>();
    return sf.hasError() ? std::string(sf.getError().getMessage()) : "";
  }

  /// Uploads [1, 2, 3], squares it on the server and reads it back.
  std::vector<float> squareOnServer() {
    uint64_t in = next_++, out = next_++;
    ir::Graph g = square();
    ir::Hash256 hash = ir::hashGraph(g);
    auto reply = send(true, 5, [&](auto cmds) {
      float data[3] = {1, 2, 3};
      auto up = cmds[0].initUpload();
      up.setHandle(in);
      wire::encodeMeta(vec3(), up.initMeta());
      up.setTotal(12);
      up.setData(kj::arrayPtr(reinterpret_cast<const kj::byte *>(data), 12));
      auto def = cmds[1].initDefine();
      wire::encodeHash(hash, def.initHash());
      wire::encodeGraph(g, def.initGraph());
      auto run = cmds[2].initRun();
      wire::encodeHash(hash, run.initHash());
      run.initWhole().initInputs(1).set(0, in);
      run.setFirstOutput(out);
      run.setNumOutputs(1);
      auto down = cmds[3].initDownload();
      down.setHandle(out);
      wire::encodeMeta(vec3(), down.initMeta());
      // Released, so that a client looping on this holds constant memory on the server.
      auto release = cmds[4].initReleaseRanges(4); // (first, count) pairs
      release.set(0, in);
      release.set(1, 1);
      release.set(2, out);
      release.set(3, 1);
    });
    return reply ? vec3Of(*reply) : std::vector<float>();
  }

private:
  net::Socket socket_;
  net::FrameDecoder decoder_;
  uint64_t seq_ = 0;
  uint64_t next_ = 100;
};

/// The well-behaved session that runs alongside every bad one.
Peer &good() {
  static Peer *p = [] {
    auto *peer = new Peer();
    peer->hello();
    return peer;
  }();
  return *p;
}

/// The server's resident memory, in MiB.
double serverRssMiB() {
  FILE *f = fopen(("/proc/" + std::to_string(opserver().pid) + "/status").c_str(), "r");
  if (!f)
    return -1;
  char line[256];
  double kib = -1;
  while (fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmRSS: %lf kB", &kib) == 1)
      break;
  fclose(f);
  return kib / 1024;
}

/// The bound on the server's resident memory after any attack: libtorch and the test's own
/// tensors take about 300 MiB; an attack that made the server keep what it was sent would
/// pass it (the 100 refused Defines once kept 225 MiB, 30 million poisoned outputs 3 GB).
constexpr double kRssBoundMiB = 768;

void expectGoodSessionUnaffected() {
  ASSERT_TRUE(opserver().alive());
  EXPECT_EQ(good().squareOnServer(), (std::vector<float>{1, 4, 9}));
  EXPECT_LT(serverRssMiB(), kRssBoundMiB);
}

/// A well-behaved client computing on its own connection, on a thread of its own, for as long
/// as an attack runs beside it; every result it gets must be right.
class Beside {
public:
  Beside() {
    thread_ = std::thread([this] {
      Peer peer;
      peer.hello();
      while (!stop_) {
        if (peer.squareOnServer() == std::vector<float>{1, 4, 9})
          ++ok_;
        else
          ++wrong_;
      }
    });
  }
  /// Stops the client; true if it computed at least once and never got a wrong answer.
  bool finish() {
    while (ok_ + wrong_ == 0 && opserver().alive())
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    stop_ = true;
    thread_.join();
    return ok_ > 0 && wrong_ == 0;
  }
  ~Beside() {
    if (thread_.joinable())
      finish();
  }

private:
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> ok_{0}, wrong_{0};
};

/// Defines \p g and runs it once on \p inputs, downloading output 0 as \p outMeta; returns the
/// reply.
std::optional<net::Frame> defineRunDownload(Peer &peer, const ir::Graph &g,
                                            std::vector<uint64_t> inputs,
                                            const ir::TensorMeta &outMeta) {
  return peer.send(true, 3, [&](auto cmds) {
    defineIn(cmds[0], g);
    runIn(cmds[1], ir::hashGraph(g), inputs, 7000, g.outputs.size());
    auto down = cmds[2].initDownload();
    down.setHandle(7000);
    wire::encodeMeta(outMeta, down.initMeta());
  });
}

/// The number of data bytes in a reply's results.
size_t dataBytesOf(const net::Frame &reply) {
  auto r = net::openFrame(reply, wire::Limits());
  size_t n = 0;
  for (auto result : r->getRoot<wire::ServerFrame>().getResults())
    n += result.isData() ? result.getData().size() : 0;
  return n;
}

/// Connects to \p addr \p count times, sending 8 bytes and closing each time; returns how many
/// connects were refused (the listen backlog full for a moment). TCP connections close with a
/// reset: so many closes would otherwise leave as many of this machine's ports in TIME_WAIT,
/// slowing every connect.
int connectSendClose(const sockaddr *addr, socklen_t len, int count = 20000) {
  const char eight[8] = {'R', 'G', 'P', 'U', 0, 0, 0, 0};
  int refused = 0;
  for (int k = 0; k < count; ++k) {
    int fd = ::socket(addr->sa_family, SOCK_STREAM, 0);
    if (fd < 0) {
      ADD_FAILURE() << "socket: " << std::strerror(errno);
      return count;
    }
    if (::connect(fd, addr, len) == 0)
      (void)!::send(fd, eight, sizeof eight, MSG_NOSIGNAL);
    else
      ++refused;
    if (addr->sa_family != AF_UNIX) {
      linger reset{1, 0};
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
    }
    ::close(fd);
  }
  return refused;
}

} // namespace

TEST(Faults, GarbageBytesCloseOnlyThatConnection) {
  expectGoodSessionUnaffected();
  Peer bad;
  bad.sendRaw(std::string(4096, '\x5a'));
  EXPECT_TRUE(bad.closedByServer());
  expectGoodSessionUnaffected();
}

TEST(Faults, AnHttpRequestIsRefused) {
  Peer bad;
  bad.sendRaw("GET / HTTP/1.1\r\nHost: localhost\r\n\r\n");
  EXPECT_TRUE(bad.closedByServer());
  expectGoodSessionUnaffected();
}

TEST(Faults, AFrameClaimingTwoToTheSixtyBytesIsRefusedBeforeAllocating) {
  Peer bad;
  bad.sendRaw(frameHeader(uint64_t(1) << 60));
  EXPECT_TRUE(bad.closedByServer());
  expectGoodSessionUnaffected();
}

TEST(Faults, ATruncatedMessageGetsAnErrorAndAClose) {
  Peer bad;
  bad.hello();
  capnp::MallocMessageBuilder b;
  auto f = b.initRoot<wire::ClientFrame>();
  f.setWantReply(true);
  wire::encodeGraph(square(), f.initCommands(1)[0].initDefine().initGraph());
  std::string bytes = net::encodeFrame(b, false);
  uint64_t shorter = 24; // a segment table claiming more words than follow
  memcpy(&bytes[8], &shorter, 8);
  bytes.resize(net::kHeaderBytes + shorter);
  bad.sendRaw(bytes);
  EXPECT_TRUE(bad.closedByServer());
  expectGoodSessionUnaffected();
}

TEST(Faults, APackedFrameWhoseSegmentTablePromisesMoreThanItHoldsIsRefused) {
  // Found by graph_fuzz (test/fuzz/regressions): the packed reader read such a frame lazily and
  // threw from its destructor, which ended the process.
  Beside beside;
  Peer bad;
  bad.hello();
  const unsigned char payload[] = {0x11, 0x01, 0xd6, 0x01, 0x7a, 0x00, 0x00, 0x00, 0xd6, 0x01,
                                   0x00, 0x00, 0x00, 0x00};
  char header[net::kHeaderBytes];
  uint32_t magic = net::kMagic, flags = net::kFlagPacked;
  uint64_t length = sizeof payload;
  memcpy(header, &magic, 4);
  memcpy(header + 4, &flags, 4);
  memcpy(header + 8, &length, 8);
  bad.sendRaw(std::string(header, sizeof header) +
              std::string(reinterpret_cast<const char *>(payload), sizeof payload));
  EXPECT_TRUE(bad.closedByServer());
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, ADefineNamingAnUnknownOpIsAnErrorAndTheSessionGoesOn) {
  Peer bad;
  bad.hello();
  ir::Graph g = square();
  g.nodes[0].op = ir::Symbol::get("aten::definitely_not_an_op");
  ir::Hash256 hash = ir::hashGraph(g);
  auto reply = bad.send(true, 1, [&](auto cmds) {
    auto def = cmds[0].initDefine();
    wire::encodeHash(hash, def.initHash());
    wire::encodeGraph(g, def.initGraph());
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("unknown op"), std::string::npos) << Peer::errorOf(*reply);
  EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
  expectGoodSessionUnaffected();
}

TEST(Faults, ADefineOfFromFileIsRefusedByName) {
  Peer bad;
  bad.hello();
  ir::Graph g;
  ir::Node n;
  n.op = ir::Symbol::get("aten::from_file");
  n.strings = {"/etc/hostname"};
  n.args = {ir::Arg::ref(ir::Arg::Kind::Str, 0), ir::Arg::none(), ir::Arg::integer(4),
            ir::Arg::none(), ir::Arg::none(), ir::Arg::none(), ir::Arg::none()};
  n.outputs = {vec3()};
  g.nodes.push_back(n);
  g.outputs = {0};
  ir::Hash256 hash = ir::hashGraph(g);
  auto reply = bad.send(true, 3, [&](auto cmds) {
    auto def = cmds[0].initDefine();
    wire::encodeHash(hash, def.initHash());
    wire::encodeGraph(g, def.initGraph());
    auto run = cmds[1].initRun();
    wire::encodeHash(hash, run.initHash());
    run.setFirstOutput(7);
    run.setNumOutputs(1);
    cmds[2].initDownload().setHandle(7);
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("aten::from_file"), std::string::npos);
  auto r = net::openFrame(*reply, wire::Limits());
  for (auto result : r->getRoot<wire::ServerFrame>().getResults())
    EXPECT_EQ(result.getData().size(), 0u); // nothing of the file came back
  expectGoodSessionUnaffected();
}

TEST(Faults, RunsNamingUnknownGraphsOrHandlesAreErrors) {
  Peer bad;
  bad.hello();
  auto unknownHash = bad.send(true, 1, [](auto cmds) {
    auto run = cmds[0].initRun();
    wire::encodeHash({1, 2}, run.initHash());
    run.setFirstOutput(5);
    run.setNumOutputs(1);
  });
  ASSERT_TRUE(unknownHash);
  EXPECT_NE(Peer::errorOf(*unknownHash).find("unknown graph"), std::string::npos);

  ir::Graph g = square();
  ir::Hash256 hash = ir::hashGraph(g);
  auto unknownHandle = bad.send(true, 2, [&](auto cmds) {
    defineIn(cmds[0], g);
    runIn(cmds[1], hash, {424242}, 6, 1);
  });
  ASSERT_TRUE(unknownHandle);
  EXPECT_NE(Peer::errorOf(*unknownHandle).find("unknown tensor handle 424242"), std::string::npos);
  // Another session's handles are not reachable either: the good peer's are 100 and up.
  auto foreign = bad.send(true, 1, [](auto cmds) {
    auto down = cmds[0].initDownload();
    down.setHandle(101);
    wire::encodeMeta(vec3(), down.initMeta());
  });
  ASSERT_TRUE(foreign);
  EXPECT_NE(Peer::errorOf(*foreign).find("unknown tensor handle"), std::string::npos);
  expectGoodSessionUnaffected();
}

TEST(Faults, AGraphThatDoesNotMatchItsHashIsRefused) {
  Peer bad;
  bad.hello();
  auto reply = bad.send(true, 1, [](auto cmds) {
    auto def = cmds[0].initDefine();
    wire::encodeHash({3, 4}, def.initHash());
    wire::encodeGraph(square(), def.initGraph());
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("does not match its hash"), std::string::npos);
  expectGoodSessionUnaffected();
}

TEST(Faults, AHelloWithAnotherProtocolVersionIsRefusedClearly) {
  Peer bad;
  auto reply = bad.send(true, 1, [](auto cmds) { cmds[0].initHello().setProtocol(999); });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("version mismatch"), std::string::npos);
  EXPECT_TRUE(bad.closedByServer());
  expectGoodSessionUnaffected();
}

namespace {

/// An upload chunk of \p data for handle \p h of a tensor of meta \p m.
void uploadChunk(wire::Command::Builder cmd, uint64_t h, const ir::TensorMeta &m, uint64_t total,
                 uint64_t offset, kj::ArrayPtr<const kj::byte> data) {
  auto up = cmd.initUpload();
  up.setHandle(h);
  wire::encodeMeta(m, up.initMeta());
  up.setTotal(total);
  up.setOffset(offset);
  up.setData(data);
}

} // namespace

TEST(Faults, UploadChunksThatWrapOrDisagreeAreRefusedWithoutTouchingMemory) {
  Beside beside;
  Peer bad;
  bad.hello();
  const kj::byte bytes[16] = {};
  auto chunk = kj::arrayPtr(bytes, 16);
  ir::TensorMeta small = ir::TensorMeta::contiguous(ir::dtype::Float, {4});     // 16 bytes
  ir::TensorMeta eight = ir::TensorMeta::contiguous(ir::dtype::Float, {8});     // 32 bytes
  ir::TensorMeta big = ir::TensorMeta::contiguous(ir::dtype::Float, {1 << 24}); // 64 MiB
  struct Case {
    const char *why;
    ir::TensorMeta meta;
    uint64_t total, offset;
    bool firstChunkBefore;
  } cases[] = {
      {"ends past the total", small, 16, 64ull << 20, false},              // far past the buffer
      {"ends past the total", small, 16, ~uint64_t(0) - 4, false},         // offset + size wraps
      {"does not follow", big, 64ull << 20, 32, true},                     // a gap of 16 bytes
      {"disagrees with the first chunk", eight, 32, 16, true},             // another meta
      {"came without a first chunk", eight, 32, 16, false},
      {"is not its meta", small, 1ull << 40, 0, false},                    // total is not the meta's
  };
  uint64_t h = 500;
  for (const Case &c : cases) {
    ++h;
    auto reply = bad.send(true, c.firstChunkBefore ? 2 : 1, [&](auto cmds) {
      size_t k = 0;
      if (c.firstChunkBefore)
        uploadChunk(cmds[k++], h, big, 64ull << 20, 0, chunk); // a 64 MiB buffer, 16 bytes in
      uploadChunk(cmds[k], h, c.meta, c.total, c.offset, chunk);
    });
    ASSERT_TRUE(reply) << c.why;
    std::string error = Peer::errorOf(*reply);
    EXPECT_NE(error.find(c.why), std::string::npos) << c.why << ": " << error;
    ASSERT_TRUE(opserver().alive()) << c.why;
  }
  // A shape whose byte span overflows int64 is a malformed meta, not a small buffer.
  ir::TensorMeta huge = ir::TensorMeta::contiguous(ir::dtype::Float, {1ll << 62, 1ll << 4});
  auto reply = bad.send(true, 1, [&](auto cmds) { uploadChunk(cmds[0], ++h, huge, 16, 0, chunk); });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("meta is malformed"), std::string::npos)
      << Peer::errorOf(*reply);
  EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, CompressedUploadsAreCheckedBeforeAByteIsTrusted) {
  Beside beside;
  Peer bad;
  bad.hello();
  // 4096 floats counting up: their exponent plane compresses.
  std::vector<float> values(4096);
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = float(i);
  const auto *raw = reinterpret_cast<const uint8_t *>(values.data());
  std::string packed = *wire::encodePlanes(raw, 4 * values.size(), 4);
  ir::TensorMeta meta = ir::TensorMeta::contiguous(ir::dtype::Float, {int64_t(values.size())});
  ir::TensorMeta big = ir::TensorMeta::contiguous(ir::dtype::Float, {1 << 25}); // 128 MiB
  // A bomb: 1 MiB of zeros deflated to about a kilobyte, declared as 16 KiB.
  std::vector<uint8_t> zeros(1 << 20);
  std::string bomb = *wire::encodePlanes(zeros.data(), zeros.size(), 1);
  struct Case {
    const char *why;
    ir::TensorMeta meta;
    uint8_t encoding;
    uint64_t length;
    std::string data;
  } cases[] = {
      {"encoding 2 is unknown", meta, 2, 16384, packed},
      {"more than a chunk's", big, 1, 128ull << 20, packed},
      {"ends past the total", meta, 1, 16388, packed},
      {"inflates past its 4096 bytes", meta, 1, 16384, bomb},
      {"follow the last byte plane", meta, 1, 16384, packed + "trailing"},
      {"byte plane 0 of 4 is missing", meta, 1, 16384, ""},
      {"byte plane", meta, 1, 16384, packed.substr(0, packed.size() / 2)},
  };
  uint64_t h = 700;
  for (const Case &c : cases) {
    auto reply = bad.send(true, 1, [&](auto cmds) {
      uploadChunk(cmds[0], ++h, c.meta, c.meta.storageBytes(), 0,
                  kj::arrayPtr(reinterpret_cast<const kj::byte *>(c.data.data()), c.data.size()));
      cmds[0].getUpload().setEncoding(wire::Upload::Encoding(c.encoding));
      cmds[0].getUpload().setLength(c.length);
    });
    ASSERT_TRUE(reply) << c.why;
    std::string error = Peer::errorOf(*reply);
    EXPECT_NE(error.find("malformed upload"), std::string::npos) << c.why << ": " << error;
    EXPECT_NE(error.find(c.why), std::string::npos) << c.why << ": " << error;
    ASSERT_TRUE(opserver().alive()) << c.why;
  }
  // A well-formed one arrives as the bytes it was made from.
  auto reply = bad.send(true, 2, [&](auto cmds) {
    uploadChunk(cmds[0], ++h, meta, meta.storageBytes(), 0,
                kj::arrayPtr(reinterpret_cast<const kj::byte *>(packed.data()), packed.size()));
    cmds[0].getUpload().setEncoding(wire::Upload::Encoding::BYTE_PLANES);
    cmds[0].getUpload().setLength(meta.storageBytes());
    auto down = cmds[1].initDownload();
    down.setHandle(h);
    wire::encodeMeta(meta, down.initMeta());
  });
  ASSERT_TRUE(reply);
  auto r = net::openFrame(*reply, wire::Limits());
  auto results = r->getRoot<wire::ServerFrame>().getResults();
  ASSERT_EQ(results.size(), 1u) << Peer::errorOf(*reply);
  ASSERT_TRUE(results[0].isData());
  ASSERT_EQ(results[0].getData().size(), 4 * values.size());
  EXPECT_EQ(std::memcmp(results[0].getData().begin(), raw, 4 * values.size()), 0);
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, DevicesThisServerDoesNotHaveAreRefused) {
  Beside beside;
  Peer bad;
  bad.hello();
  const kj::byte bytes[12] = {};
  // An upload to rgpu:7 of a one-device server: an error for its handle, the session goes on.
  auto reply = bad.send(true, 1, [&](auto cmds) {
    uploadChunk(cmds[0], 900, vec3(), 12, 0, kj::arrayPtr(bytes, 12));
    cmds[0].getUpload().setDevice(7);
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("names rgpu:7"), std::string::npos) << Peer::errorOf(*reply);
  // A graph copying to rgpu:9: refused at its Define.
  ir::Graph g;
  g.inputs = {vec3()};
  ir::Node n;
  n.op = ir::Symbol::get("aten::_to_copy");
  n.operands = {0};
  n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0), ir::Arg::none(), ir::Arg::none(),
            ir::Arg::ref(ir::Arg::Kind::Device, 0), ir::Arg::none(), ir::Arg::boolean(false),
            ir::Arg::none()};
  n.strings = {"rgpu:9"};
  n.outputs = {vec3()};
  g.nodes.push_back(n);
  g.outputs = {1};
  reply = bad.send(true, 1, [&](auto cmds) { defineIn(cmds[0], g); });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("names rgpu:9"), std::string::npos) << Peer::errorOf(*reply);
  EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
  // A memory request for rgpu:3 is malformed: the connection closes.
  reply = bad.send(true, 1, [&](auto cmds) { cmds[0].initMemory().setDevice(3); });
  EXPECT_TRUE(bad.closedByServer());
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, GeneratorRequestsAreBoundedAndTheirErrorsKeepTheSession) {
  Beside beside;
  {
    // More generators than a session may hold, in one frame: an error, and the session goes on.
    Peer bad;
    bad.hello();
    auto reply = bad.send(true, 4097, [&](auto cmds) {
      for (uint32_t k = 0; k < 4097; ++k) {
        auto g = cmds[k].initGenerator();
        g.setId(k + 1);
        g.setCreate(k);
      }
    });
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("4096 generators"), std::string::npos)
        << Peer::errorOf(*reply);
    EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
    // Seeding or reading a generator the session does not have; setting a state of the wrong
    // size: each an error of its own, the session goes on.
    reply = bad.send(true, 1, [&](auto cmds) {
      auto g = cmds[0].initGenerator();
      g.setId(999999);
      g.setSeed(1);
    });
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("generator 999999 does not exist"), std::string::npos)
        << Peer::errorOf(*reply);
    reply = bad.send(true, 1, [&](auto cmds) {
      auto g = cmds[0].initGenerator();
      g.setId(999998);
      g.setRestore();
    });
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("generator 999998 does not exist"), std::string::npos)
        << Peer::errorOf(*reply);
    const kj::byte seven[7] = {};
    reply = bad.send(true, 1, [&](auto cmds) {
      auto r = cmds[0].initRngState();
      r.setGenerator(5);
      r.setSet(true);
      r.setState(kj::arrayPtr(seven, 7));
    });
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("size"), std::string::npos) << Peer::errorOf(*reply);
    EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
  }
  // Malformed requests close the connection: generator 0, a device the server lacks, a state
  // past 64 KiB.
  std::vector<std::function<void(wire::Command::Builder)>> malformed = {
      [](wire::Command::Builder c) { c.initGenerator().setCreate(1); },
      [](wire::Command::Builder c) {
        auto g = c.initGenerator();
        g.setId(1);
        g.setDevice(9);
        g.setCreate(1);
      },
      [](wire::Command::Builder c) { c.initRngState().setDevice(9); },
      [](wire::Command::Builder c) {
        auto r = c.initRngState();
        r.setSet(true);
        r.initState(65 * 1024);
      },
  };
  for (auto &fill : malformed) {
    Peer bad;
    bad.hello();
    bad.send(true, 1, [&](auto cmds) { fill(cmds[0]); });
    EXPECT_TRUE(bad.closedByServer());
  }
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, ARunOfAnUnknownGraphPoisonsABoundedNumberOfOutputs) {
  double before = serverRssMiB();
  Beside beside;
  Peer bad;
  bad.hello();
  auto start = std::chrono::steady_clock::now();
  auto reply = bad.send(true, 1, [](auto cmds) {
    auto run = cmds[0].initRun();
    wire::encodeHash({9, 9}, run.initHash());
    run.setFirstOutput(1);
    run.setNumOutputs(30'000'000);
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("unknown graph"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_LT(serverRssMiB() - before, 64.0); // 65536 poisoned handles, not 30 million
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, PoisonedHandlesAreChargedAndCappedPerSession) {
  // 200 Runs of an unknown graph in one small frame would bind 200 x 65536 poisoned handles;
  // each costs the session 96 bytes of its --session-memory, and it may hold --max-handles
  // (1048576): past that a bind is an error (the Run's outputs are not kept), and the session
  // goes on.
  double before = serverRssMiB();
  Beside beside;
  Peer bad;
  bad.hello();
  auto reply = bad.send(true, 200, [](auto cmds) {
    for (uint32_t k = 0; k < 200; ++k)
      runIn(cmds[k], {9, 9}, {}, 1 + uint64_t(k) * 65536, 65536);
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("unknown graph"), std::string::npos);
  EXPECT_LT(serverRssMiB() - before, 200.0); // not 13 million handles' ~1.2 GB
  auto held = [&] { // (handles, bytes) the session holds
    auto r = bad.send(true, 1, [](auto cmds) { cmds[0].setStats(); });
    auto message = net::openFrame(*r, wire::Limits());
    auto stats = message->getRoot<wire::ServerFrame>().getResults()[0].getStats().getSession();
    return std::make_pair(stats.getTensors(), stats.getMemory());
  };
  EXPECT_EQ(held().first, 1u << 20);
  EXPECT_GE(held().second, (uint64_t(1) << 20) * 96);
  bad.send(false, 1, [](auto cmds) {
    auto ranges = cmds[0].initReleaseRanges(2);
    ranges.set(0, 1);
    ranges.set(1, 1u << 20);
  });
  auto [handles, bytes] = held();
  EXPECT_EQ(handles, 0u);
  EXPECT_LT(bytes, 1024u); // the frame that asks, in flight, counts too
  EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, AHalfReceivedFrameCountsTowardTheSessionsMemory) {
  // A frame's bytes count toward --session-memory (256 MiB here) while it arrives: one that
  // announces 512 MiB and keeps coming ends its connection with an error saying so when it
  // passes the quota, not when the server holds it all (256 such connections once held 1 GiB
  // each).
  double before = serverRssMiB();
  Beside beside;
  Peer greedy;
  greedy.hello();
  ASSERT_TRUE(greedy.sendRaw(frameHeader(uint64_t(512) << 20)));
  const std::string mib(1 << 20, '\0');
  size_t sent = 0;
  while (sent < 400 && greedy.sendRaw(mib))
    ++sent;
  EXPECT_LT(sent, 300u); // the server stopped taking them at its 256 MiB
  EXPECT_TRUE(greedy.closedByServer());
  // And what the frame held goes with its connection.
  for (int k = 0; k < 40 && serverRssMiB() - before > 64; ++k)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_LT(serverRssMiB() - before, 64.0);
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, TwentyThousandConnectionsThatSayAlmostNothingLeaveTheServerServing) {
  // Connect, send 8 bytes, close, 20,000 times: each costs the server a descriptor only until
  // it sees the close (a Gloo listener once kept them all, until accept failed and the process
  // ended).
  Beside beside;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, opserver().socket.c_str(), sizeof addr.sun_path - 1);
  const int refused = connectSendClose(reinterpret_cast<sockaddr *>(&addr), sizeof addr);
  EXPECT_LT(refused, 20000);
  ASSERT_TRUE(opserver().alive());
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, ARunWhoseOutputCountDisagreesWithItsGraphIsAnError) {
  Peer bad;
  bad.hello();
  ir::Graph g = square();
  ir::Hash256 hash = ir::hashGraph(g);
  auto reply = bad.send(true, 2, [&](auto cmds) {
    defineIn(cmds[0], g);
    runIn(cmds[1], hash, {1}, 2, 1000);
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("wrong number of outputs"), std::string::npos)
      << Peer::errorOf(*reply);
  expectGoodSessionUnaffected();
}

TEST(Faults, RelativeRunsThatDisagreeAreErrorsAndForgetWhatTheyWereRelativeTo) {
  Beside beside;
  Peer bad;
  bad.hello();
  ir::Graph g = square();
  ir::Hash256 hash = ir::hashGraph(g);
  const float data[3] = {1, 2, 3};
  auto relative = [&](uint64_t first, std::vector<int64_t> deltas, std::vector<uint32_t> slots,
                      std::vector<uint16_t> values) {
    return [=](wire::Command::Builder cmd) {
      auto run = cmd.initRun();
      wire::encodeHash(hash, run.initHash());
      auto rel = run.initRelative();
      auto d = rel.initInputDeltas(deltas.size());
      for (size_t k = 0; k < deltas.size(); ++k)
        d.set(k, deltas[k]);
      auto s = rel.initChangedSlots(slots.size());
      for (size_t k = 0; k < slots.size(); ++k)
        s.set(k, slots[k]);
      auto v = rel.initChangedValues(values.size());
      for (size_t k = 0; k < values.size(); ++k)
        v.set(k, values[k]);
      run.setFirstOutput(first);
      run.setNumOutputs(1);
    };
  };
  auto error = [&](auto fill) {
    auto reply = bad.send(true, 1, [&](auto cmds) { fill(cmds[0]); });
    return reply ? Peer::errorOf(*reply) : std::string("no reply");
  };
  auto define = bad.send(true, 1, [&](auto cmds) { defineIn(cmds[0], g); });
  ASSERT_TRUE(define);
  EXPECT_NE(error(relative(950, {0, 1}, {}, {})).find("relative to a run this session has not made"),
            std::string::npos);
  // A whole run, then one relative to it (input 900 + 10 = 910, its output): [1, 16, 81].
  auto ran = bad.send(true, 2, [&](auto cmds) {
    uploadChunk(cmds[0], 900, vec3(), 12, 0,
                kj::arrayPtr(reinterpret_cast<const kj::byte *>(data), 12));
    runIn(cmds[1], hash, {900}, 910, 1);
  });
  ASSERT_TRUE(ran);
  EXPECT_EQ(Peer::errorOf(*ran), "");
  auto twice = bad.send(true, 2, [&](auto cmds) {
    relative(920, {10, 1}, {}, {})(cmds[0]);
    auto down = cmds[1].initDownload();
    down.setHandle(920);
    wire::encodeMeta(vec3(), down.initMeta());
  });
  ASSERT_TRUE(twice);
  EXPECT_EQ(Peer::errorOf(*twice), "");
  auto result = net::openFrame(*twice, wire::Limits())->getRoot<wire::ServerFrame>().getResults();
  ASSERT_EQ(result.size(), 1u);
  ASSERT_EQ(result[0].getData().size(), 12u);
  float got[3];
  memcpy(got, result[0].getData().begin(), 12);
  EXPECT_EQ(std::vector<float>(got, got + 3), std::vector<float>({1, 16, 81}));
  // Malformed relative runs: each an error, and each drops what the next would be relative to.
  for (auto [fill, message] : std::vector<std::pair<std::function<void(wire::Command::Builder)>,
                                                    std::string>>{
           {relative(930, {0}, {}, {}), "not (delta, count) pairs"},
           {relative(930, {0, 5}, {}, {}), "more input deltas than inputs"},
           {relative(930, {}, {}, {}), "fewer input deltas than inputs"},
           {relative(930, {0, 1}, {3}, {0}), "a changed scalar out of range"},
           {relative(930, {0, 1}, {0}, {}), "slots and values differ in number"},
           {[&](wire::Command::Builder c) { runIn(c, hash, {900, 900}, 930, 1); },
            "wrong number of inputs or scalars"},
       }) {
    auto whole = bad.send(true, 1, [&](auto cmds) { runIn(cmds[0], hash, {900}, 940, 1); });
    ASSERT_TRUE(whole);
    EXPECT_NE(error(fill).find(message), std::string::npos) << message;
    EXPECT_NE(error(relative(950, {0, 1}, {}, {})).find("has not made"), std::string::npos);
  }
  // A delta that wraps the handle around is only an unknown handle.
  auto whole = bad.send(true, 1, [&](auto cmds) { runIn(cmds[0], hash, {900}, 960, 1); });
  ASSERT_TRUE(whole);
  EXPECT_NE(error(relative(970, {std::numeric_limits<int64_t>::min(), 1}, {}, {}))
                .find("unknown tensor handle"),
            std::string::npos);
  // Release ranges: pairs, and no more handles in all than a Release may name.
  for (std::vector<uint64_t> ranges :
       {std::vector<uint64_t>{1}, {1, uint64_t(1) << 40}, {0, ~uint64_t(0)}}) {
    Peer releaser;
    releaser.hello();
    auto reply = releaser.send(true, 1, [&](auto cmds) {
      auto r = cmds[0].initReleaseRanges(ranges.size());
      for (size_t k = 0; k < ranges.size(); ++k)
        r.set(k, ranges[k]);
    });
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("ranges that are not pairs or name more than"),
              std::string::npos);
  }
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, ADownloadOfBytesOutsideItsTensorIsAnError) {
  Beside beside;
  Peer bad;
  bad.hello();
  const float data[3] = {1, 2, 3};
  for (auto [offset, length] : {std::pair<uint64_t, uint64_t>{8, 8}, {~uint64_t(0) - 2, 4},
                                {0, uint64_t(1) << 40}}) {
    auto reply = bad.send(true, 2, [&](auto cmds) {
      uploadChunk(cmds[0], 900, vec3(), 12, 0,
                  kj::arrayPtr(reinterpret_cast<const kj::byte *>(data), 12));
      auto down = cmds[1].initDownload();
      down.setHandle(900);
      wire::encodeMeta(vec3(), down.initMeta());
      down.setOffset(offset);
      down.setLength(length);
    });
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("outside its 12 bytes"), std::string::npos)
        << Peer::errorOf(*reply);
  }
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

namespace {

/// One node graph: \p op applied to one f32[4] input (if \p withInput) with \p args.
ir::Graph oneNode(const char *op, std::vector<ir::Arg> args, std::vector<std::string> strings,
                  ir::TensorMeta out, bool withInput = true) {
  ir::Graph g;
  ir::Node n;
  n.op = ir::Symbol::get(op);
  if (withInput) {
    g.inputs = {ir::TensorMeta::contiguous(ir::dtype::Float, {4})};
    n.operands = {0};
  }
  n.args.assign(args.begin(), args.end());
  n.strings.assign(strings.begin(), strings.end());
  n.outputs = {out};
  g.nodes.push_back(n);
  g.outputs = {uint32_t(withInput ? 1 : 0)};
  return g;
}

ir::Arg intList(size_t n) { return ir::Arg::ref(ir::Arg::Kind::List, n); }
ir::Arg self() { return ir::Arg::ref(ir::Arg::Kind::Tensor, 0); }

void uploadFour(Peer &peer, uint64_t handle) {
  const float data[4] = {1, 2, 3, 4};
  auto reply = peer.send(true, 1, [&](auto cmds) {
    uploadChunk(cmds[0], handle, ir::TensorMeta::contiguous(ir::dtype::Float, {4}), 16, 0,
                kj::arrayPtr(reinterpret_cast<const kj::byte *>(data), 16));
  });
  ASSERT_TRUE(reply);
}

} // namespace

TEST(Faults, StridedViewsThatReachPastTheirStorageAreRefusedAtDefine) {
  Beside beside;
  Peer bad;
  bad.hello();
  uploadFour(bad, 50);
  ir::TensorMeta f64 = ir::TensorMeta::contiguous(ir::dtype::Float, {64});
  ir::TensorMeta f2m = ir::TensorMeta::contiguous(ir::dtype::Float, {1 << 19});
  struct Case {
    ir::Graph graph;
    ir::TensorMeta out;
  } cases[] = {
      // 64 floats read through a 4-float tensor, and a 2 MiB read.
      {oneNode("aten::_reshape_alias_copy", {self(), intList(1), ir::Arg::integer(64), intList(1),
                                             ir::Arg::integer(1)}, {}, f64), f64},
      {oneNode("aten::_reshape_alias", {self(), intList(1), ir::Arg::integer(1 << 19), intList(1),
                                        ir::Arg::integer(1)}, {}, f2m), f2m},
      {oneNode("aten::as_strided_copy", {self(), intList(1), ir::Arg::integer(64), intList(1),
                                         ir::Arg::integer(1), ir::Arg::none()}, {}, f64), f64},
      // In bounds by size, past the end by its offset.
      {oneNode("aten::as_strided", {self(), intList(1), ir::Arg::integer(4), intList(1),
                                    ir::Arg::integer(1), ir::Arg::integer(1)}, {},
               ir::TensorMeta::contiguous(ir::dtype::Float, {4})),
       ir::TensorMeta::contiguous(ir::dtype::Float, {4})},
  };
  for (const Case &c : cases) {
    auto reply = defineRunDownload(bad, c.graph, {50}, c.out);
    ASSERT_TRUE(reply);
    std::string error = Peer::errorOf(*reply);
    EXPECT_NE(error.find("reaches element"), std::string::npos) << error;
    EXPECT_NE(error.find(c.graph.nodes[0].op.str().str()), std::string::npos) << error;
    EXPECT_EQ(dataBytesOf(*reply), 0u);
  }
  // A view inside its storage still runs: [[1, 2], [3, 4]] transposed is 1, 3, 2, 4.
  ir::TensorMeta two = ir::TensorMeta::contiguous(ir::dtype::Float, {2, 2});
  ir::TensorMeta transposed = two;
  transposed.strides = {1, 2};
  auto reply = defineRunDownload(
      bad,
      oneNode("aten::as_strided_copy", {self(), intList(2), ir::Arg::integer(2),
                                        ir::Arg::integer(2), intList(2), ir::Arg::integer(1),
                                        ir::Arg::integer(2), ir::Arg::none()}, {}, two),
      {50}, two);
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  EXPECT_EQ(dataBytesOf(*reply), 16u);
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, EnumArgumentsOutOfRangeAreRefusedNamingTheArgument) {
  Beside beside;
  Peer bad;
  bad.hello();
  ir::TensorMeta four = ir::TensorMeta::contiguous(ir::dtype::Float, {4});
  // aten::ones(size, dtype, layout, device, pin_memory)
  auto ones = [&](ir::Arg dtype, ir::Arg layout) {
    return oneNode("aten::ones", {intList(1), ir::Arg::integer(4), dtype, layout, ir::Arg::none(),
                                  ir::Arg::none()}, {}, four, false);
  };
  struct Case {
    ir::Graph graph;
    const char *why;
  } cases[] = {
      {ones(ir::Arg::integer(-1), ir::Arg::none()), "argument 'dtype' is dtype number -1"},
      {ones(ir::Arg::integer(1000), ir::Arg::none()), "argument 'dtype' is dtype number 1000"},
      {ones(ir::Arg::integer(13), ir::Arg::none()), "argument 'dtype' is dtype number 13"},
      {ones(ir::Arg::none(), ir::Arg::integer(1)), "argument 'layout' is layout number 1"},
      {ones(ir::Arg::none(), ir::Arg::integer(-7)), "argument 'layout' is layout number -7"},
      // aten::empty_like(self, dtype, layout, device, pin_memory, memory_format)
      {oneNode("aten::empty_like", {self(), ir::Arg::none(), ir::Arg::none(), ir::Arg::none(),
                                    ir::Arg::none(), ir::Arg::integer(99)}, {}, four),
       "argument 'memory_format' is memory format number 99"},
      // aten::empty.memory_format with a negative size
      {oneNode("aten::empty.memory_format", {intList(1), ir::Arg::integer(-4), ir::Arg::none(),
                                             ir::Arg::none(), ir::Arg::none(), ir::Arg::none(),
                                             ir::Arg::none()}, {}, four, false),
       "argument 'size' has a negative size"},
  };
  uploadFour(bad, 60);
  for (const Case &c : cases) {
    auto reply = defineRunDownload(bad, c.graph, c.graph.inputs.empty() ? std::vector<uint64_t>{}
                                                                        : std::vector<uint64_t>{60},
                                   four);
    ASSERT_TRUE(reply);
    std::string error = Peer::errorOf(*reply);
    EXPECT_NE(error.find(c.why), std::string::npos) << c.why << ": " << error;
    EXPECT_NE(error.find("node 0"), std::string::npos) << error;
    EXPECT_EQ(dataBytesOf(*reply), 0u);
  }
  // In range, the same op runs.
  auto reply = defineRunDownload(bad, ones(ir::Arg::integer(ir::dtype::Float), ir::Arg::integer(0)),
                                 {}, four);
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  EXPECT_EQ(dataBytesOf(*reply), 16u);
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, StringArgumentsOutsideTheirOpsTableAreRefused) {
  Beside beside;
  Peer bad;
  bad.hello();
  uploadFour(bad, 70);
  ir::TensorMeta scalar = ir::TensorMeta::contiguous(ir::dtype::Float, {1});
  // aten::segment_reduce(data, reduce, lengths, indices, offsets, axis, unsafe, initial): the
  // reduce string once reached Inductor's generated C++ unescaped.
  auto segment = [&](const std::string &reduce) {
    return oneNode("aten::segment_reduce",
                   {self(), ir::Arg::ref(ir::Arg::Kind::Str, 0), ir::Arg::none(), ir::Arg::none(),
                    ir::Arg::none(), ir::Arg::integer(0), ir::Arg::boolean(false),
                    ir::Arg::none()},
                   {reduce}, scalar);
  };
  auto reply = defineRunDownload(
      bad, segment("sum\"); system(\"touch /tmp/rgpu-owned\"); //"), {70}, scalar);
  ASSERT_TRUE(reply);
  std::string error = Peer::errorOf(*reply);
  EXPECT_NE(error.find("argument 'reduce' is not one of sum, max, min, mean, prod"),
            std::string::npos) << error;
  // A free-form string argument refuses the op itself.
  ir::Graph einsum = oneNode("aten::einsum", {ir::Arg::ref(ir::Arg::Kind::Str, 0), intList(1),
                                              self(), ir::Arg::none()}, {"i->i"}, scalar);
  reply = defineRunDownload(bad, einsum, {70}, scalar);
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("argument 'equation' is a free-form string"),
            std::string::npos) << Peer::errorOf(*reply);
  EXPECT_EQ(access("/tmp/rgpu-owned", F_OK), -1);
  // A string from the op's table runs; any other is refused.
  ir::TensorMeta four = ir::TensorMeta::contiguous(ir::dtype::Float, {4});
  auto gelu = [&](const char *approximate) {
    return oneNode("aten::gelu", {self(), ir::Arg::ref(ir::Arg::Kind::Str, 0)}, {approximate},
                   four);
  };
  reply = defineRunDownload(bad, gelu("tanh"), {70}, four);
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  EXPECT_EQ(dataBytesOf(*reply), 16u);
  reply = defineRunDownload(bad, gelu("tanh'"), {70}, four);
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("argument 'approximate' is not one of none, tanh"),
            std::string::npos) << Peer::errorOf(*reply);
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, RefusedDefinesLeaveNothingBehind) {
  auto refusedGraph = [](int k) {
    ir::Graph g;
    for (int n = 0; n < 20000; ++n) {
      ir::Node node;
      node.op = ir::Symbol::get("aten::not_an_op_" + std::to_string(k) + "_" + std::to_string(n) +
                                std::string(64, 'x'));
      node.outputs = {vec3()};
      g.nodes.push_back(node);
    }
    g.outputs = {0};
    return g;
  };
  auto define = [](Peer &peer, const ir::Graph &g) {
    return peer.send(true, 1, [&](auto cmds) { defineIn(cmds[0], g); });
  };
  double before = 0;
  {
    Beside beside;
    Peer bad;
    bad.hello();
    // One refused Define first, so that what is measured is growth, not this connection's
    // first use of the allocator.
    ASSERT_TRUE(define(bad, refusedGraph(-1)));
    before = serverRssMiB();
    for (int k = 0; k < 100; ++k) { // 100 Defines of 20000 distinct op names, ~2 MiB each
      auto reply = define(bad, refusedGraph(k));
      ASSERT_TRUE(reply);
      ASSERT_NE(Peer::errorOf(*reply).find("unknown op"), std::string::npos);
    }
    EXPECT_TRUE(beside.finish());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300)); // the bad session has ended
  double after = serverRssMiB();
  std::printf("server RSS %.1f MiB before the refused Defines, %.1f MiB after\n", before, after);
  // Keeping the refused graphs would grow it by ~200 MiB. The bound leaves room for the
  // allocator's arenas, which the well-behaved client training beside also grows (20.7 MiB
  // seen once in CI).
  EXPECT_LT(after - before, 48.0) << "RSS grew from " << before << " to " << after << " MiB";
  expectGoodSessionUnaffected();
}

TEST(Faults, FramesAskingForTooMuchAreRefusedByTheirNamedLimits) {
  Beside beside;
  {
    Peer bad;
    bad.hello();
    // More commands than wire::Limits::maxCommands: refused whole, the connection closed.
    auto reply = bad.send(
        true, wire::Limits().maxCommands + 1,
        [](auto cmds) {
          for (auto c : cmds)
            c.setSync();
        },
        /*pack=*/false);
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("commands, more than the limit"), std::string::npos)
        << Peer::errorOf(*reply);
    EXPECT_TRUE(bad.closedByServer());
  }
  {
    Peer bad;
    bad.hello();
    auto reply = bad.send(
        true, 1,
        [](auto cmds) {
          auto ranges = cmds[0].initReleaseRanges(2);
          ranges.set(0, 1);
          ranges.set(1, wire::Limits().maxReleaseHandles + 1);
        },
        /*pack=*/false);
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("name more than"), std::string::npos)
        << Peer::errorOf(*reply);
  }
  {
    // Downloads whose bytes together exceed one reply's limit: the ones past it are errors, and
    // the reply stays within it.
    Peer bad;
    bad.hello();
    ir::TensorMeta big = ir::TensorMeta::contiguous(ir::dtype::Float, {1 << 23}); // 32 MiB
    std::vector<kj::byte> zeros(32u << 20);
    auto up = bad.send(
        true, 1,
        [&](auto cmds) {
          uploadChunk(cmds[0], 40, big, 32u << 20, 0, kj::arrayPtr(zeros.data(), zeros.size()));
        },
        /*pack=*/false);
    ASSERT_TRUE(up);
    auto reply = bad.send(true, 10, [&](auto cmds) {
      for (auto c : cmds) {
        auto down = c.initDownload();
        down.setHandle(40);
        wire::encodeMeta(big, down.initMeta());
      }
    });
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply).find("would take this reply past 256 MiB"), std::string::npos)
        << Peer::errorOf(*reply);
    EXPECT_LE(dataBytesOf(*reply), size_t(256) << 20);
  }
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, ARunCannotNameOrDetectAnotherSessionsGraph) {
  // The good session has defined square(); another session's Run of its hash is the same
  // error as a Run of a hash nobody defined.
  expectGoodSessionUnaffected();
  Peer bad;
  bad.hello();
  auto runOf = [&](const ir::Hash256 &hash) {
    auto reply = bad.send(true, 1, [&](auto cmds) { runIn(cmds[0], hash, {100}, 9000, 1); });
    return reply ? Peer::errorOf(*reply) : std::string("no reply");
  };
  ir::Hash256 known = ir::hashGraph(square()), never = {0x1234, 0x5678};
  EXPECT_EQ(runOf(known), "unknown graph " + known.hex());
  EXPECT_EQ(runOf(never), "unknown graph " + never.hex());
  // Defining it itself, the session gets the shared plan (a graph is compared in full before
  // its plan is shared) and runs it on its own tensors.
  EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
  expectGoodSessionUnaffected();
}

TEST(Faults, HandlesAreAny64BitValue) {
  // Found by session_fuzz (test/fuzz/regressions): the handle table was an llvm::DenseMap, whose
  // two reserved keys a Run could bind, corrupting it.
  Beside beside;
  Peer bad;
  bad.hello();
  const uint64_t in = ~uint64_t(0), out = ~uint64_t(0) - 1;
  const float data[3] = {1, 2, 3};
  ir::Graph g = square();
  auto reply = bad.send(true, 4, [&](auto cmds) {
    uploadChunk(cmds[0], in, vec3(), 12, 0,
                kj::arrayPtr(reinterpret_cast<const kj::byte *>(data), 12));
    defineIn(cmds[1], g);
    runIn(cmds[2], ir::hashGraph(g), {in}, out, 1);
    auto down = cmds[3].initDownload();
    down.setHandle(out);
    wire::encodeMeta(vec3(), down.initMeta());
  });
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  EXPECT_EQ(vec3Of(*reply), (std::vector<float>{1, 4, 9}));
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, AFrameThatStallsAfterAuthenticationIsClosedByTheFrameTimeout) {
  Beside beside;
  Peer bad;
  bad.hello();
  // The header of a 1 GiB frame (the server takes frames up to 1 GiB) and 100 of its bytes,
  // then nothing: the buffer grows only with what arrives, and --frame-timeout 2 closes it.
  double before = serverRssMiB();
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(bad.sendRaw(frameHeader(uint64_t(1) << 30) + std::string(100, '\0')));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LT(serverRssMiB() - before, 16);
  EXPECT_TRUE(bad.closedByServer());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, AClientThatNeverReadsItsRepliesIsThrottledAndLosesNothing) {
  Beside beside;
  Peer lazy;
  lazy.hello();
  ir::TensorMeta big = ir::TensorMeta::contiguous(ir::dtype::Int, {1 << 23}); // 32 MiB
  std::vector<int32_t> values(1 << 23);
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = int32_t(i * 7);
  ASSERT_TRUE(lazy.send(true, 1, [&](auto cmds) {
    uploadChunk(cmds[0], 41, big, 32u << 20, 0,
                kj::arrayPtr(reinterpret_cast<const kj::byte *>(values.data()), 32u << 20));
  }, /*pack=*/false));
  // 40 downloads of it, 1.25 GiB of replies, and none read for a while: the server holds at
  // most --max-buffered-mib (64) of them and stops reading this client meanwhile.
  constexpr int kFrames = 40;
  for (int k = 0; k < kFrames; ++k)
    ASSERT_TRUE(lazy.send(true, 1, [&](auto cmds) {
      auto down = cmds[0].initDownload();
      down.setHandle(41);
      wire::encodeMeta(big, down.initMeta());
    }, /*pack=*/true, /*wait=*/false));
  std::this_thread::sleep_for(std::chrono::seconds(3));
  EXPECT_LT(serverRssMiB(), kRssBoundMiB);
  EXPECT_TRUE(opserver().alive());
  // Every reply then arrives, whole and right.
  for (int k = 0; k < kFrames; ++k) {
    auto reply = lazy.receive();
    ASSERT_TRUE(reply) << "reply " << k;
    auto r = net::openFrame(*reply, wire::Limits());
    auto results = r->getRoot<wire::ServerFrame>().getResults();
    ASSERT_EQ(results.size(), 1u);
    ASSERT_EQ(results[0].getData().size(), size_t(32) << 20);
    EXPECT_EQ(std::memcmp(results[0].getData().begin(), values.data(), 32u << 20), 0);
  }
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, ASessionPastItsMemoryQuotaGetsAnErrorAndGoesOn) {
  Beside beside;
  Peer greedy;
  greedy.hello();
  // The server runs with --session-memory 256MiB: the first chunk of a 512 MiB upload is where
  // its buffer would be allocated.
  ir::TensorMeta huge = ir::TensorMeta::contiguous(ir::dtype::Float, {int64_t(1) << 27});
  const kj::byte chunk[16] = {};
  auto reply = greedy.send(true, 1, [&](auto cmds) {
    uploadChunk(cmds[0], 50, huge, uint64_t(512) << 20, 0, kj::arrayPtr(chunk, 16));
  });
  ASSERT_TRUE(reply);
  std::string error = Peer::errorOf(*reply);
  EXPECT_NE(error.find("past its memory quota of 256 MiB (--session-memory"), std::string::npos)
      << error;
  EXPECT_NE(error.find("allocating 512 MiB"), std::string::npos) << error;
  // Its handle holds that error; the session computes on.
  EXPECT_EQ(greedy.squareOnServer(), (std::vector<float>{1, 4, 9}));
  EXPECT_LT(serverRssMiB(), kRssBoundMiB);
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

/// The server's user and system CPU time so far, in seconds.
double serverCpuSeconds() {
  FILE *f = fopen(("/proc/" + std::to_string(opserver().pid) + "/stat").c_str(), "r");
  if (!f)
    return -1;
  char buf[2048];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  // Fields 14 and 15 (utime, stime) follow the command name, which ends at the last ')'.
  const char *p = std::strrchr(buf, ')');
  unsigned long long utime = 0, stime = 0;
  if (!p || std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime,
                        &stime) != 2)
    return -1;
  return double(utime + stime) / double(sysconf(_SC_CLK_TCK));
}

/// Seconds of 1024x1024 matmuls: \p peer defines the graph and uploads its input (handle 60).
ir::Graph matmulsIn(Peer &peer) {
  ir::TensorMeta m = ir::TensorMeta::contiguous(ir::dtype::Float, {1024, 1024});
  ir::Graph g;
  g.inputs = {m};
  ir::Node n;
  n.op = ir::Symbol::get("aten::mm");
  n.operands = {0, 0};
  n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0), ir::Arg::ref(ir::Arg::Kind::Tensor, 1)};
  n.outputs = {m};
  g.nodes.push_back(n);
  g.outputs = {1};
  std::vector<kj::byte> zeros(4u << 20);
  EXPECT_TRUE(peer.send(true, 2, [&](auto cmds) {
    uploadChunk(cmds[0], 60, m, 4u << 20, 0, kj::arrayPtr(zeros.data(), zeros.size()));
    defineIn(cmds[1], g);
  }, /*pack=*/false));
  return g;
}

TEST(Faults, AClosedSessionsQueuedRunsAreDropped) {
  {
    Peer gone;
    gone.hello();
    ir::Graph g = matmulsIn(gone);
    // Seconds of 1024x1024 matmuls in one frame, then the client is gone.
    ASSERT_TRUE(gone.send(false, 2000, [&](auto cmds) {
      for (auto c : cmds)
        runIn(c, ir::hashGraph(g), {60}, 61, 1);
    }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  double before = serverCpuSeconds();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  double used = serverCpuSeconds() - before;
  EXPECT_LT(used, 0.3) << "the server went on running a closed session's frame";
  expectGoodSessionUnaffected();
}

TEST(Faults, ACancelStopsOnlyItsOwnSessionsEarlierFrames) {
  Peer a, b;
  a.hello();
  b.hello();
  ir::Graph g = matmulsIn(a);
  ir::Graph h = matmulsIn(b);
  auto runs = [](const ir::Graph &graph) {
    return [&graph](auto cmds) {
      for (auto c : cmds)
        runIn(c, ir::hashGraph(graph), {60}, 61, 1);
    };
  };
  auto cancel = [](auto cmds) { cmds[0].setCancel(); };
  // Both queue seconds of work (b's would take half a minute); b's Cancel is its own: a's
  // runs go on.
  ASSERT_TRUE(a.send(false, 20, runs(g)));
  ASSERT_TRUE(b.send(false, 400, runs(h)));
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(b.send(false, 1, cancel, true, true, net::kFlagCancel));
  auto bReply = b.send(true, 1, [](auto cmds) { cmds[0].setStats(); });
  ASSERT_TRUE(bReply);
  const double bSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(bSeconds, 2.0) << "a Cancel did not stop its session's queued runs";
  auto stats = net::openFrame(*bReply, wire::Limits())->getRoot<wire::ServerFrame>();
  ASSERT_EQ(stats.getResults().size(), 1u);
  auto bStats = stats.getResults()[0].getStats().getSession();
  EXPECT_GE(bStats.getRunsCancelled(), 398u);
  EXPECT_EQ(bStats.getRunsCancelled() + bStats.getGraphRuns(), 400u);
  // A later frame of b runs: the Cancel covers only the frames before it.
  ASSERT_TRUE(b.send(false, 1, runs(h)));
  auto later = b.send(true, 1, [](auto cmds) { cmds[0].setStats(); });
  ASSERT_TRUE(later);
  EXPECT_EQ(net::openFrame(*later, wire::Limits())
                ->getRoot<wire::ServerFrame>()
                .getResults()[0]
                .getStats().getSession()
                .getGraphRuns(),
            bStats.getGraphRuns() + 1);
  // a's runs all ran.
  auto aReply = a.send(true, 1, [](auto cmds) { cmds[0].setStats(); });
  ASSERT_TRUE(aReply);
  auto aStats =
      net::openFrame(*aReply, wire::Limits())->getRoot<wire::ServerFrame>().getResults()[0].getStats().getSession();
  EXPECT_EQ(aStats.getGraphRuns(), 20u);
  EXPECT_EQ(aStats.getRunsCancelled(), 0u);
  expectGoodSessionUnaffected();
}

TEST(Faults, ACancelFlagBeforeTheHelloOrOnALargeFrameIsNoCancel) {
  // Before the Hello the loop opens nothing: the frame is the session's first, not a Hello.
  Peer early;
  ASSERT_TRUE(early.send(false, 1, [](auto cmds) { cmds[0].setCancel(); }, true, true,
                         net::kFlagCancel));
  EXPECT_TRUE(early.closedByServer());
  // A flagged frame past 256 bytes is not opened by the loop; the pool serves it in its turn
  // (its Cancel then stops nothing that is still running).
  Peer big;
  big.hello();
  ir::Graph g = matmulsIn(big);
  ASSERT_TRUE(big.send(false, 20, [&](auto cmds) {
    for (auto c : cmds)
      runIn(c, ir::hashGraph(g), {60}, 61, 1);
  }));
  ASSERT_TRUE(big.send(false, 2, [](auto cmds) {
    cmds[0].setCancel();
    cmds[1].initReleaseRanges(64); // 512 bytes of empty ranges
  }, /*pack=*/false, true, net::kFlagCancel));
  auto reply = big.send(true, 1, [](auto cmds) { cmds[0].setStats(); });
  ASSERT_TRUE(reply);
  auto st = net::openFrame(*reply, wire::Limits())->getRoot<wire::ServerFrame>().getResults()[0].getStats().getSession();
  EXPECT_EQ(st.getGraphRuns(), 20u);
  EXPECT_EQ(st.getRunsCancelled(), 0u);
  expectGoodSessionUnaffected();
}

/// Says Hello with session id \p id, asking to resume it from frame \p resumeFrom (0: a new
/// session); returns the reply's HelloReply fields that matter here.
struct HelloAnswer {
  bool ok = false, resumed = false;
  uint64_t lastSeq = 0;
};
HelloAnswer helloWithId(Peer &peer, const std::string &id, uint64_t resumeFrom) {
  peer.setSeq(~uint64_t(0)); // the Hello goes as frame 0
  auto reply = peer.send(true, 1, [&](auto cmds) {
    auto h = cmds[0].initHello();
    h.setProtocol(wire::kProtocolVersion);
    h.setSessionId(kj::arrayPtr(reinterpret_cast<const kj::byte *>(id.data()), id.size()));
    h.setResumeFrom(resumeFrom);
  });
  HelloAnswer a;
  if (!reply)
    return a;
  auto r = net::openFrame(*reply, wire::Limits());
  auto results = r->getRoot<wire::ServerFrame>().getResults();
  if (results.size() != 1 || !results[0].isHello())
    return a;
  a.ok = true;
  a.resumed = results[0].getHello().getResumed();
  a.lastSeq = results[0].getHello().getLastSeq();
  return a;
}

TEST(Faults, ResumeTakeoversWaitOffTheWorkerPool) {
  // A resume Hello for a session still attached closes that session's connection and waits
  // for it to be parked, which only a pool thread does: four such Hellos once held all four
  // workers for 30 s, and every other session with them. Now they wait off the pool.
  Beside beside;
  std::vector<std::unique_ptr<Peer>> owners, takers;
  auto idOf = [](int k) { return std::string("takeover-id-000") + char('0' + k); };
  for (int k = 0; k < 4; ++k) {
    owners.push_back(std::make_unique<Peer>());
    ASSERT_TRUE(helloWithId(*owners.back(), idOf(k), 0).ok);
  }
  for (int k = 0; k < 4; ++k) {
    takers.push_back(std::make_unique<Peer>());
    takers.back()->setSeq(~uint64_t(0));
    std::string id = idOf(k);
    ASSERT_TRUE(takers.back()->send(true, 1, [&](auto cmds) {
      auto h = cmds[0].initHello();
      h.setProtocol(wire::kProtocolVersion);
      h.setSessionId(kj::arrayPtr(reinterpret_cast<const kj::byte *>(id.data()), id.size()));
      h.setResumeFrom(1);
    }, true, /*wait=*/false));
  }
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(good().squareOnServer(), (std::vector<float>{1, 4, 9}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  for (int k = 0; k < 4; ++k) {
    auto reply = takers[k]->receive();
    ASSERT_TRUE(reply);
    auto r = net::openFrame(*reply, wire::Limits());
    auto results = r->getRoot<wire::ServerFrame>().getResults();
    ASSERT_EQ(results.size(), 1u);
    EXPECT_TRUE(results[0].getHello().getResumed()) << k;
    EXPECT_TRUE(owners[k]->closedByServer()) << k;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, AResumedSessionNeverRunsAFrameTwiceAndNeedsItsId) {
  Beside beside;
  const std::string id = "0123456789abcdef";
  ir::Graph g = square();
  const ir::Hash256 hash = ir::hashGraph(g);
  const float data[3] = {1, 2, 3};
  auto squareInPlace = [&](auto cmds) { runIn(cmds[0], hash, {70}, 70, 1); };
  {
    Peer first;
    ASSERT_TRUE(helloWithId(first, id, 0).ok);
    first.setSeq(0);
    ASSERT_TRUE(first.send(true, 2, [&](auto cmds) { // frame 1
      uploadChunk(cmds[0], 70, vec3(), 12, 0,
                  kj::arrayPtr(reinterpret_cast<const kj::byte *>(data), 12));
      defineIn(cmds[1], g);
    }));
    ASSERT_TRUE(first.send(false, 1, squareInPlace)); // frame 2: handle 70 is now 1, 4, 9
    std::this_thread::sleep_for(std::chrono::milliseconds(200)); // executed, by now
    // The connection drops here, frame 2 unacknowledged.
  }
  {
    Peer stranger; // another id: nothing to resume, and nothing said about this one
    HelloAnswer a = helloWithId(stranger, "fedcba9876543210", 2);
    EXPECT_TRUE(a.ok);
    EXPECT_FALSE(a.resumed);
  }
  Peer second;
  HelloAnswer a = helloWithId(second, id, 2);
  ASSERT_TRUE(a.resumed);
  EXPECT_EQ(a.lastSeq, 2u);
  // A client that did not know frame 2 ran sends it again: it is skipped, not run twice.
  second.setSeq(1);
  ASSERT_TRUE(second.send(false, 1, squareInPlace));
  auto reply = second.send(true, 1, [&](auto cmds) { // frame 3
    auto down = cmds[0].initDownload();
    down.setHandle(70);
    wire::encodeMeta(vec3(), down.initMeta());
  });
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  EXPECT_EQ(vec3Of(*reply), (std::vector<float>{1, 4, 9}));
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

namespace {
/// The text of a reply's one result ("" if it has none).
std::string textOf(const net::Frame &reply) {
  auto r = net::openFrame(reply, wire::Limits());
  auto results = r->getRoot<wire::ServerFrame>().getResults();
  return results.size() == 1 && results[0].isText() ? std::string(results[0].getText()) : "";
}

/// The bytes the server says \p peer's session holds (a CPU server's allocated figure).
uint64_t allocatedBy(Peer &peer) {
  auto reply = peer.send(true, 1, [](auto cmds) { cmds[0].initMemory().setDevice(0); });
  auto r = net::openFrame(*reply, wire::Limits());
  return r->getRoot<wire::ServerFrame>().getResults()[0].getMemory().getAllocated();
}
} // namespace

TEST(Faults, TheRendezvousStoreServesOnlyTheJobsSecretAndChargesItsSession) {
  // A session hosts its job's store; the store's port is as open as any server port.
  Peer host;
  host.hello();
  auto reply = host.send(true, 1, [](auto cmds) { cmds[0].setHostStore(); });
  ASSERT_TRUE(reply);
  auto at = rgpu::server::rendezvous::parseAddress(textOf(*reply));
  ASSERT_TRUE(at) << textOf(*reply) << Peer::errorOf(*reply);
  const std::string storeHost = at->host, secret = at->secret;
  const int port = at->port;
  Beside beside;
  // Without the secret: refused at the handshake.
  rgpu::server::rendezvous::Client forger(storeHost, port, std::string(secret.size(), 'x'),
                                    std::chrono::seconds(10));
  EXPECT_THROW(forger.set("rgpu/job/0/0", "forged"), std::runtime_error);
  // 20,000 connections that connect, send 8 bytes and close leave the store (and the server)
  // serving.
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  inet_pton(AF_INET, storeHost.c_str(), &addr.sin_addr);
  const int refused = connectSendClose(reinterpret_cast<sockaddr *>(&addr), sizeof addr);
  EXPECT_LT(refused, 2000) << "the store's listen backlog refused most connections";
  ASSERT_TRUE(opserver().alive());
  EXPECT_TRUE(beside.finish());
  // With it: served, and what the store holds is the hosting session's memory.
  rgpu::server::rendezvous::Client job(storeHost, port, secret, std::chrono::seconds(10));
  EXPECT_EQ(job.get("rgpu/job/0/0"), std::nullopt);
  const uint64_t before = allocatedBy(host);
  for (int k = 0; k < 8; ++k)
    job.set("value" + std::to_string(k), std::string(1 << 20, char('a' + k)));
  EXPECT_GE(allocatedBy(host), before + (8u << 20));
  EXPECT_EQ(job.get("value3"), std::string(1 << 20, 'd'));
  for (int k = 0; k < 8; ++k)
    EXPECT_TRUE(job.deleteKey("value" + std::to_string(k)));
  EXPECT_LT(allocatedBy(host), before + (1u << 20));
  expectGoodSessionUnaffected();
}

TEST(Faults, EachSessionHostsOneStoreAndTheServerABoundedNumber) {
  auto hostStore = [](Peer &peer) {
    auto reply = peer.send(true, 1, [](auto cmds) { cmds[0].setHostStore(); });
    return reply ? textOf(*reply) + Peer::errorOf(*reply) : std::string("no reply");
  };
  auto first = std::make_unique<Peer>();
  first->hello();
  const std::string address = hostStore(*first);
  EXPECT_EQ(hostStore(*first), address); // one store serves every group of the job
  std::vector<std::unique_ptr<Peer>> hosts;
  std::string refusal;
  for (int k = 0; k < 100 && refusal.empty(); ++k) {
    hosts.push_back(std::make_unique<Peer>());
    hosts.back()->hello();
    std::string answer = hostStore(*hosts.back());
    if (answer.find('#') == std::string::npos)
      refusal = answer;
  }
  EXPECT_NE(refusal.find("rendezvous stores already"), std::string::npos) << refusal;
  EXPECT_LE(hosts.size(), 64u);
  // A session that ends gives its store back.
  first->send(false, 1, [](auto cmds) { cmds[0].setBye(); });
  first.reset();
  std::string again;
  for (int k = 0; k < 50 && again.find('#') == std::string::npos; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    again = hostStore(*hosts.back());
  }
  EXPECT_NE(again.find('#'), std::string::npos) << again;
  for (auto &peer : hosts)
    peer->send(false, 1, [](auto cmds) { cmds[0].setBye(); });
  expectGoodSessionUnaffected();
}

namespace {
/// The error of a reply, and the Python exception it names.
std::pair<std::string, std::string> errorAndType(const net::Frame &reply) {
  auto r = net::openFrame(reply, wire::Limits());
  auto sf = r->getRoot<wire::ServerFrame>();
  if (!sf.hasError())
    return {"", ""};
  return {sf.getError().getMessage(), sf.getError().getPythonType()};
}

/// HasContent's answer in a reply.
std::vector<bool> presentOf(const net::Frame &reply) {
  auto r = net::openFrame(reply, wire::Limits());
  std::vector<bool> out;
  for (auto result : r->getRoot<wire::ServerFrame>().getResults())
    if (result.isPresent())
      for (bool p : result.getPresent())
        out.push_back(p);
  return out;
}

/// A request of the files area for \p path, filled by \p fill.
template <typename Fill>
std::optional<net::Frame> fileRequest(Peer &peer, const std::string &path, Fill fill) {
  return peer.send(true, 1, [&](auto cmds) {
    auto f = cmds[0].initFile();
    f.setPath(path);
    fill(f);
  });
}
} // namespace

TEST(Faults, UploadsNamedByTheirDigestAreCheckedBeforeAnythingIsStored) {
  Beside beside;
  Peer bad;
  bad.hello();
  std::vector<float> values(1 << 18); // 1 MiB
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = float(i % 977);
  const uint64_t size = values.size() * sizeof(float);
  auto bytes = kj::arrayPtr(reinterpret_cast<const kj::byte *>(values.data()), size);
  const ir::TensorMeta meta = ir::TensorMeta::contiguous(ir::dtype::Float, {int64_t(values.size())});
  const ir::Hash256 real = ir::digestOf(values.data(), size);
  ir::Hash256 forged = real;
  forged.w[0] ^= 1;
  auto upload = [&](uint64_t handle, const ir::Hash256 &digest, bool stored) {
    return bad.send(true, 1, [&](auto cmds) {
      uploadChunk(cmds[0], handle, meta, size, 0, stored ? kj::ArrayPtr<const kj::byte>() : bytes);
      auto up = cmds[0].getUpload();
      wire::encodeHash(digest, up.initDigest());
      up.setStored(stored);
    });
  };
  auto ask = [&](std::vector<ir::Hash256> digests) {
    auto reply = bad.send(true, 1, [&](auto cmds) {
      auto list = cmds[0].initHasContent(digests.size());
      for (size_t k = 0; k < digests.size(); ++k)
        wire::encodeHash(digests[k], list[k]);
    });
    return reply ? presentOf(*reply) : std::vector<bool>();
  };
  // Bytes under a digest that is not theirs: refused, and nothing is stored under either.
  auto reply = upload(900, forged, false);
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("do not match the digest"), std::string::npos)
      << Peer::errorOf(*reply);
  EXPECT_EQ(ask({forged, real}), (std::vector<bool>{false, false}));
  // Naming a digest the store does not hold binds nothing but an error.
  reply = upload(901, real, true);
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("holds no"), std::string::npos) << Peer::errorOf(*reply);
  // The bytes under their own digest are stored, and a stored upload binds those very bytes.
  reply = upload(902, real, false);
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  EXPECT_EQ(ask({real, forged}), (std::vector<bool>{true, false}));
  reply = upload(903, real, true);
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  reply = bad.send(true, 1, [&](auto cmds) {
    auto down = cmds[0].initDownload();
    down.setHandle(903);
    wire::encodeMeta(meta, down.initMeta());
  });
  ASSERT_TRUE(reply);
  EXPECT_EQ(dataBytesOf(*reply), size);
  {
    auto r = net::openFrame(*reply, wire::Limits());
    auto data = r->getRoot<wire::ServerFrame>().getResults()[0].getData();
    EXPECT_EQ(std::memcmp(data.begin(), values.data(), size), 0);
  }
  // A stored upload that carries bytes, or comes in a later chunk, is malformed.
  reply = bad.send(true, 1, [&](auto cmds) {
    uploadChunk(cmds[0], 904, meta, size, 0, bytes.slice(0, 16));
    wire::encodeHash(real, cmds[0].getUpload().initDigest());
    cmds[0].getUpload().setStored(true);
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("a stored upload is one chunk"), std::string::npos)
      << Peer::errorOf(*reply);
  // A question of more digests than the limit is an error, and the session goes on.
  EXPECT_EQ(ask(std::vector<ir::Hash256>(5000, real)), std::vector<bool>());
  EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}

TEST(Faults, FilesAreaRequestsThatLeaveItOrPassItsLimitsAreRefusedByName) {
  Beside beside;
  Peer bad;
  bad.hello();
  // What an operator (or another process) may have left in the area: a link out of it, a
  // link to a file outside it, a FIFO.
  const std::string area = opserver().files + "/uid";
  std::filesystem::create_directories(area);
  {
    FILE *secret = fopen((opserver().dir + "/secret").c_str(), "w");
    fputs("not yours", secret);
    fclose(secret);
  }
  ASSERT_EQ(symlink("/etc", (area + "/etc").c_str()), 0);
  ASSERT_EQ(symlink((opserver().dir + "/secret").c_str(), (area + "/secret").c_str()), 0);
  ASSERT_EQ(mkfifo((area + "/fifo").c_str(), 0600), 0);
  struct Case {
    std::string path;
    const char *why, *type;
  } cases[] = {
      {"../secret", "'..'", "PermissionError"},
      {"a/../../secret", "'..'", "PermissionError"},
      {"/etc/passwd", "absolute", "PermissionError"},
      {"a//b", "no empty", "PermissionError"},
      {"./secret", "'.'", "PermissionError"},
      {"etc/passwd", "symbolic link", "PermissionError"},
      {"secret", "symbolic link", "PermissionError"},
      {"fifo", "not a regular file", "PermissionError"},
      {std::string(2000, 'a'), "more than 1024", "ValueError"},
      {"nothing/here", "does not exist", "FileNotFoundError"},
  };
  for (const Case &c : cases) {
    auto reply = fileRequest(bad, c.path, [](auto f) {
      auto r = f.initRead();
      r.setLength(100);
    });
    ASSERT_TRUE(reply) << c.why;
    auto [error, type] = errorAndType(*reply);
    EXPECT_NE(error.find(c.why), std::string::npos) << c.path.substr(0, 40) << ": " << error;
    EXPECT_EQ(type, c.type) << c.why;
    if (std::string(c.type) == "FileNotFoundError")
      continue;
    // A write through the same path is refused too, and leaves nothing.
    reply = fileRequest(bad, c.path + "/x", [](auto f) {
      auto w = f.initWrite();
      w.initParts(1)[0].setData(kj::StringPtr("leak").asBytes());
      w.setCommit(true);
    });
    ASSERT_TRUE(reply);
    EXPECT_NE(Peer::errorOf(*reply), "") << c.why;
  }
  EXPECT_FALSE(std::filesystem::exists(opserver().dir + "/x"));
  EXPECT_FALSE(std::filesystem::exists("/etc/x"));
  // The quota: 16 MiB a principal. A write past it keeps nothing.
  std::vector<kj::byte> mib(1 << 20, 7);
  auto write = [&](const std::string &path, int mibs) {
    return fileRequest(bad, path, [&](auto f) {
      auto w = f.initWrite();
      auto parts = w.initParts(mibs);
      for (int k = 0; k < mibs; ++k)
        parts[k].setData(kj::arrayPtr(mib.data(), mib.size()));
      w.setCommit(true);
    });
  };
  auto reply = write("ten", 10);
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  reply = write("ten-more", 10);
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("quota"), std::string::npos) << Peer::errorOf(*reply);
  EXPECT_FALSE(std::filesystem::exists(area + "/ten-more"));
  EXPECT_FALSE(std::filesystem::exists(area + "/ten-more.partial"));
  // A tensor past the file's end, rows picked past the rows, an archive that is not one.
  reply = fileRequest(bad, "ten", [](auto f) {
    auto t = f.initTensor();
    t.setHandle(950);
    t.setOffset(9 << 20);
    wire::encodeMeta(ir::TensorMeta::contiguous(ir::dtype::Float, {1 << 20}), t.initMeta());
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("has 10485760 bytes"), std::string::npos)
      << Peer::errorOf(*reply);
  // Rows 0..3 of "ten" picked by the 16 bytes of \p picks, an index tensor of \p meta.
  auto gather = [&](uint64_t handle, const ir::TensorMeta &meta, const void *picks) {
    return bad.send(true, 2, [&](auto cmds) {
      uploadChunk(cmds[0], handle, meta, meta.storageBytes(), 0,
                  kj::arrayPtr(static_cast<const kj::byte *>(picks), meta.storageBytes()));
      auto g = cmds[1].initFile();
      g.setPath("ten");
      auto r = g.initGather();
      r.setHandle(handle + 1);
      r.setIndex(handle);
      r.setDtype(ir::dtype::Float);
      r.setRows(4);
    });
  };
  const float floats[4] = {0, 0, 0, 0};
  reply = gather(951, ir::TensorMeta::contiguous(ir::dtype::Float, {4}), floats);
  ASSERT_TRUE(reply);
  EXPECT_NE(errorAndType(*reply).first.find("integer tensor"), std::string::npos)
      << errorAndType(*reply).first;
  const int64_t past[2] = {1, 4};
  reply = gather(953, ir::TensorMeta::contiguous(ir::dtype::Long, {2}), past);
  ASSERT_TRUE(reply);
  EXPECT_EQ(errorAndType(*reply).second, "IndexError") << errorAndType(*reply).first;
  reply = fileRequest(bad, "ten", [](auto f) {
    auto g = f.initGather();
    g.setRows(uint64_t(1) << 40);
    g.setDtype(ir::dtype::Float);
    g.initRowSizes(1).set(0, 1 << 20);
  });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("has 10485760 bytes"), std::string::npos)
      << Peer::errorOf(*reply);
  reply = fileRequest(bad, "ten", [](auto f) { f.initLoadArchive().setFirstHandle(960); });
  ASSERT_TRUE(reply);
  EXPECT_NE(Peer::errorOf(*reply).find("not a torch.save archive"), std::string::npos)
      << Peer::errorOf(*reply);
  reply = fileRequest(bad, "ten", [](auto f) { f.setRemove(); });
  ASSERT_TRUE(reply);
  EXPECT_EQ(Peer::errorOf(*reply), "");
  EXPECT_EQ(bad.squareOnServer(), (std::vector<float>{1, 4, 9}));
  EXPECT_TRUE(beside.finish());
  expectGoodSessionUnaffected();
}
