#include "rgpu/net/Frame.h"
#include "rgpu/wire/Wire.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

using namespace rgpu;

namespace {
ir::Graph sample() {
  ir::Graph g;
  ir::TensorMeta m;
  m.sizes = {2, 3};
  m.strides = {3, 1};
  g.inputs = {m};
  g.scalars = {{ir::dtype::Double, ir::ScalarForm::WrappedNumber}};
  ir::Node n;
  n.op = ir::Symbol::get("aten::sum.dim_IntList");
  n.operands = {0};
  n.scalars = {0};
  n.strings = {"rgpu:0", "tanh"};
  n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0), ir::Arg::ref(ir::Arg::Kind::List, 2),
            ir::Arg::integer(0),                     ir::Arg::integer(1),
            ir::Arg::boolean(true),                  ir::Arg::none(),
            ir::Arg::real(0.5),                      ir::Arg::ref(ir::Arg::Kind::Scalar, 0),
            ir::Arg::ref(ir::Arg::Kind::Device, 0),  ir::Arg::ref(ir::Arg::Kind::Str, 1)};
  ir::TensorMeta out;
  n.outputs = {out};
  n.loc = g.addLocation("model.py:7");
  g.nodes.push_back(n);
  g.outputs = {1};
  return g;
}

/// Frames a message and reads it back through the decoder, as a peer would.
template <typename Fill, typename Check>
void roundTrip(bool pack, Fill fill, Check check) {
  capnp::MallocMessageBuilder b;
  fill(b.initRoot<wire::ClientFrame>());
  std::string bytes = net::encodeFrame(b, pack);
  net::FrameDecoder d(1 << 20);
  // Feed byte by byte to exercise reassembly.
  for (char c : bytes)
    ASSERT_TRUE(d.feed(&c, 1));
  net::Frame f;
  ASSERT_TRUE(d.next(f));
  auto reader = net::openFrame(f, wire::Limits());
  check(reader->getRoot<wire::ClientFrame>());
}
} // namespace

TEST(Wire, GraphRoundTripsWithTheSameHash) {
  ir::Graph g = sample();
  capnp::MallocMessageBuilder b;
  wire::encodeGraph(g, b.initRoot<wire::Graph>());
  ir::Graph back;
  ASSERT_EQ(message(wire::decodeGraph(b.getRoot<wire::Graph>().asReader(), {}, back)), "");
  EXPECT_EQ(ir::hashGraph(back), ir::hashGraph(g));
  EXPECT_EQ(back.locations[back.nodes[0].loc], "model.py:7");
  EXPECT_EQ(back.nodes[0].strings[1], "tanh");
}

TEST(Wire, EveryCommandKindRoundTrips) {
  for (bool pack : {false, true}) {
    roundTrip(
        pack,
        [](wire::ClientFrame::Builder f) {
          f.setSeq(42);
          f.setWantReply(true);
          auto cmds = f.initCommands(8);
          auto hello = cmds[0].initHello();
          hello.setProtocol(wire::kProtocolVersion);
          hello.setTorchVersion("2.13.0");
          auto def = cmds[1].initDefine();
          wire::encodeHash({1, 2}, def.initHash());
          wire::encodeGraph(sample(), def.initGraph());
          auto run = cmds[2].initRun();
          wire::encodeHash({1, 2}, run.initHash());
          auto whole = run.initWhole();
          whole.initInputs(1).set(0, 7);
          wire::encodeScalar({ir::ScalarValue::Kind::Double, 0, 0.125, 0},
                             whole.initScalars(1)[0]);
          run.setFirstOutput(100);
          auto up = cmds[3].initUpload();
          up.setHandle(5);
          up.setTotal(4);
          up.setData(kj::heapArray<kj::byte>({1, 2, 3, 4}));
          cmds[4].initDownload().setHandle(5);
          cmds[5].initReleaseRanges(2).set(1, 9);
          cmds[6].setSeed(1234);
          cmds[7].setSync();
        },
        [](wire::ClientFrame::Reader f) {
          EXPECT_EQ(f.getSeq(), 42u);
          EXPECT_TRUE(f.getWantReply());
          auto cmds = f.getCommands();
          ASSERT_EQ(cmds.size(), 8u);
          EXPECT_EQ(cmds[0].getHello().getTorchVersion(), "2.13.0");
          ir::Graph g;
          EXPECT_EQ(message(wire::decodeGraph(cmds[1].getDefine().getGraph(), {}, g)), "");
          EXPECT_EQ(ir::hashGraph(g), ir::hashGraph(sample()));
          EXPECT_EQ(cmds[2].getRun().getWhole().getInputs()[0], 7u);
          EXPECT_EQ(wire::decodeScalar(cmds[2].getRun().getWhole().getScalars()[0]).d, 0.125);
          EXPECT_EQ(cmds[2].getRun().getFirstOutput(), 100u);
          EXPECT_EQ(cmds[3].getUpload().getData().size(), 4u);
          EXPECT_EQ(cmds[4].getDownload().getHandle(), 5u);
          EXPECT_EQ(cmds[5].getReleaseRanges()[1], 9u);
          EXPECT_EQ(cmds[6].getSeed(), 1234u);
          EXPECT_EQ(cmds[7].which(), wire::Command::SYNC);
        });
  }
}

TEST(Wire, ServerFrameCarriesResultsAndError) {
  capnp::MallocMessageBuilder b;
  auto f = b.initRoot<wire::ServerFrame>();
  f.setAckSeq(3);
  auto results = f.initResults(2);
  results[0].initHello().setDevice("cpu");
  results[1].setData(kj::heapArray<kj::byte>({9}));
  auto e = f.initError();
  e.setOp("aten::index_select");
  e.setLocation("test.py:3");
  std::string bytes = net::encodeFrame(b, true);
  net::FrameDecoder d(1 << 20);
  ASSERT_TRUE(d.feed(bytes.data(), bytes.size()));
  net::Frame frame;
  ASSERT_TRUE(d.next(frame));
  auto reader = net::openFrame(frame, wire::Limits());
  auto r = reader->getRoot<wire::ServerFrame>();
  EXPECT_EQ(r.getAckSeq(), 3u);
  EXPECT_EQ(r.getResults()[0].getHello().getDevice(), "cpu");
  EXPECT_TRUE(r.hasError());
  EXPECT_EQ(r.getError().getOp(), "aten::index_select");
}

TEST(Wire, DecoderRefusesGarbageHttpAndHugeFrames) {
  net::FrameDecoder garbage(1 << 20);
  std::string junk(64, '\x17');
  EXPECT_FALSE(garbage.feed(junk.data(), junk.size()));
  net::FrameDecoder http(1 << 20);
  std::string get = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  EXPECT_FALSE(http.feed(get.data(), get.size()));
  net::FrameDecoder huge(1 << 20);
  char header[16];
  uint32_t magic = net::kMagic, flags = 0;
  uint64_t len = uint64_t(1) << 60;
  memcpy(header, &magic, 4);
  memcpy(header + 4, &flags, 4);
  memcpy(header + 8, &len, 8);
  EXPECT_FALSE(huge.feed(header, 16));
  EXPECT_NE(huge.error().find("exceeds"), std::string::npos);
}

TEST(Wire, DecoderBuffersWhatArrivedNotWhatTheHeaderAnnounced) {
  net::FrameDecoder d(uint64_t(1) << 30);
  // A frame of 12 MiB + 3 bytes, announced by its header, arriving in pieces.
  const uint64_t length = (12u << 20) + 3;
  std::string payload(length, '\0');
  for (uint64_t i = 0; i < length; ++i)
    payload[i] = char(i * 7);
  char header[16];
  uint32_t magic = net::kMagic, flags = 0;
  memcpy(header, &magic, 4);
  memcpy(header + 4, &flags, 4);
  memcpy(header + 8, &length, 8);
  ASSERT_TRUE(d.feed(header, 16));
  EXPECT_LE(d.bufferedBytes(), net::FrameDecoder::kFirstBufferBytes);
  uint64_t at = 0;
  for (uint64_t piece : {uint64_t(1000), uint64_t(3u << 20), uint64_t(5u << 20)}) {
    ASSERT_TRUE(d.feed(payload.data() + at, piece));
    at += piece;
    EXPECT_LE(d.bufferedBytes(), std::max<uint64_t>(4 * at, net::FrameDecoder::kFirstBufferBytes));
    EXPECT_GE(d.bufferedBytes(), at);
  }
  ASSERT_TRUE(d.feed(payload.data() + at, length - at));
  net::Frame frame;
  ASSERT_TRUE(d.next(frame));
  ASSERT_EQ(frame.bytes, length);
  EXPECT_EQ(memcmp(frame.words.begin(), payload.data(), length), 0);
}

TEST(Wire, TruncatedMessageThrowsInsteadOfCrashing) {
  capnp::MallocMessageBuilder b;
  wire::encodeGraph(sample(), b.initRoot<wire::ClientFrame>().initCommands(1)[0].initDefine().initGraph());
  std::string bytes = net::encodeFrame(b, false);
  // Rewrite the header to claim a shorter payload and cut the message.
  uint64_t shorter = (bytes.size() - net::kHeaderBytes) / 2 & ~uint64_t(7);
  memcpy(&bytes[8], &shorter, 8);
  bytes.resize(net::kHeaderBytes + shorter);
  net::FrameDecoder d(1 << 20);
  ASSERT_TRUE(d.feed(bytes.data(), bytes.size()));
  net::Frame f;
  ASSERT_TRUE(d.next(f));
  EXPECT_ANY_THROW({
    auto r = net::openFrame(f, wire::Limits());
    auto cmds = r->getRoot<wire::ClientFrame>().getCommands();
    ir::Graph g;
    llvm::consumeError(wire::decodeGraph(cmds[0].getDefine().getGraph(), {}, g));
  });
}

TEST(Net, AConnectThatIsNeverAnsweredGivesUpInTime) {
  // A listener that never accepts, its backlog full: the kernel drops further SYNs, as a
  // network that lost its route would.
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr *>(&addr), len), 0);
  ASSERT_EQ(::listen(listener, 0), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr *>(&addr), &len), 0);
  int port = ntohs(addr.sin_port);
  std::vector<std::unique_ptr<net::Socket>> fill;
  std::string error;
  for (int i = 0; i < 4; ++i) {
    fill.push_back(std::make_unique<net::Socket>());
    fill.back()->connect("127.0.0.1", port, error, 30, 200);
  }
  net::Socket socket;
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(socket.connect("127.0.0.1", port, error, 30, 300));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2)) << error;
  EXPECT_NE(error.find("timed out"), std::string::npos) << error;
  ::close(listener);
}
