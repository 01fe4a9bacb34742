#include "FrameCodec.h"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <gtest/gtest.h>

#include <cstring>

using namespace rgpu;
using namespace rgpu::client;

namespace {
ir::Hash256 hashOf(uint64_t k) {
  ir::Hash256 h{};
  h.w[0] = k;
  return h;
}

ir::ScalarValue real(double d) {
  ir::ScalarValue v;
  v.kind = ir::ScalarValue::Kind::Double;
  v.d = d;
  return v;
}

command::Run runOf(const ir::Hash256 &hash, std::vector<uint64_t> inputs,
                   std::vector<ir::ScalarValue> scalars) {
  command::Run run;
  run.hash = hash;
  run.args.inputs = std::move(inputs);
  run.args.scalars = std::move(scalars);
  run.firstOutput = 100;
  run.outputs = 2;
  return run;
}

/// Encodes \p commands (and \p releases) into one frame and hands its reader to \p check.
template <class Check>
void encoded(FrameEncoder &encoder, std::vector<Command> commands, Check check,
             std::vector<uint64_t> releases = {}) {
  capnp::MallocMessageBuilder b;
  auto frame = b.initRoot<wire::ClientFrame>();
  encoder.encode(frame, commands, std::move(releases));
  check(frame.asReader().getCommands());
}
} // namespace

TEST(FrameCodec, AJoinGroupSaysRankSizeAndTimeoutInFieldsOfTheirOwn) {
  FrameEncoder encoder;
  encoded(encoder, {command::JoinGroup{"10.0.0.1:29500", "g0", 3, 4, 30000}}, [](auto cmds) {
    ASSERT_EQ(cmds.size(), 1u);
    auto j = cmds[0].getJoinGroup();
    EXPECT_EQ(j.getStore(), "10.0.0.1:29500");
    EXPECT_EQ(j.getPrefix(), "g0");
    EXPECT_EQ(j.getRank(), 3u);
    EXPECT_EQ(j.getSize(), 4u);
    EXPECT_EQ(j.getTimeoutMs(), 30000u);
  });
}

TEST(FrameCodec, AGraphsSecondRunSaysOnlyWhatChanged) {
  FrameEncoder encoder;
  const ir::Hash256 g = hashOf(7);
  encoded(encoder, {runOf(g, {10, 11, 12}, {real(0.5), real(1.0)})}, [](auto cmds) {
    auto r = cmds[0].getRun();
    ASSERT_TRUE(r.isWhole());
    ASSERT_EQ(r.getWhole().getInputs().size(), 3u);
    EXPECT_EQ(r.getWhole().getInputs()[2], 12u);
    EXPECT_EQ(r.getWhole().getScalars().size(), 2u);
    EXPECT_EQ(r.getFirstOutput(), 100u);
    EXPECT_EQ(r.getNumOutputs(), 2u);
  });
  // The next step: every input three handles on, one scalar changed.
  encoded(encoder, {runOf(g, {13, 14, 15}, {real(0.5), real(2.0)})}, [](auto cmds) {
    ASSERT_TRUE(cmds[0].getRun().isRelative());
    auto r = cmds[0].getRun().getRelative();
    ASSERT_EQ(r.getInputDeltas().size(), 2u); // (delta 3, count 3)
    EXPECT_EQ(r.getInputDeltas()[0], 3);
    EXPECT_EQ(r.getInputDeltas()[1], 3);
    ASSERT_EQ(r.getChangedSlots().size(), 1u);
    EXPECT_EQ(r.getChangedSlots()[0], 1u);
    ASSERT_EQ(r.getValues().size(), 1u);
    EXPECT_EQ(wire::decodeScalar(r.getValues()[0]).d, 2.0);
  });
}

TEST(FrameCodec, AForgottenGraphRunsWholeAgain) {
  FrameEncoder encoder;
  const ir::Hash256 g = hashOf(7);
  encoded(encoder, {runOf(g, {10}, {})}, [](auto) {});
  encoded(encoder, {command::Forget{{g}}, runOf(g, {11}, {})}, [&](auto cmds) {
    ASSERT_EQ(cmds.size(), 2u);
    ASSERT_EQ(cmds[0].getForget().size(), 1u);
    EXPECT_EQ(wire::decodeHash(cmds[0].getForget()[0]), g);
    ASSERT_TRUE(cmds[1].getRun().isWhole());
    EXPECT_EQ(cmds[1].getRun().getWhole().getInputs()[0], 11u);
  });
}

TEST(FrameCodec, ReleasesGoLastAsRanges) {
  FrameEncoder encoder;
  encoded(
      encoder, {command::Sync{}},
      [](auto cmds) {
        ASSERT_EQ(cmds.size(), 2u);
        EXPECT_EQ(cmds[0].which(), wire::Command::SYNC);
        auto ranges = cmds[1].getReleaseRanges();
        ASSERT_EQ(ranges.size(), 4u); // (5, 3) and (9, 1)
        EXPECT_EQ(ranges[0], 5u);
        EXPECT_EQ(ranges[1], 3u);
        EXPECT_EQ(ranges[2], 9u);
        EXPECT_EQ(ranges[3], 1u);
      },
      {7, 5, 9, 6, 5});
}

TEST(FrameCodec, AnUploadChunkCarriesItsSliceOfTheBytes) {
  FrameEncoder encoder;
  auto bytes = std::make_shared<std::vector<uint8_t>>(std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7, 8});
  command::Upload up;
  up.handle = 9;
  up.device = 1;
  up.meta = ir::TensorMeta::contiguous(ir::dtype::Float, {2});
  up.bytes = std::shared_ptr<const uint8_t>(bytes, bytes->data());
  up.offset = 4;
  up.length = 4;
  encoded(encoder, {up}, [](auto cmds) {
    auto u = cmds[0].getUpload();
    EXPECT_EQ(u.getHandle(), 9u);
    EXPECT_EQ(u.getDevice(), 1u);
    EXPECT_EQ(u.getOffset(), 4u);
    EXPECT_EQ(u.getTotal(), 8u);
    EXPECT_EQ(u.getEncoding(), wire::Upload::Encoding::RAW);
    ASSERT_EQ(u.getData().size(), 4u);
    EXPECT_EQ(u.getData()[0], 5);
  });
}

TEST(FrameCodec, AReplyDecodesIntoValuesPerKind) {
  capnp::MallocMessageBuilder b;
  auto f = b.initRoot<wire::ServerFrame>();
  f.setAckSeq(12);
  auto results = f.initResults(3);
  results[0].setData(kj::heapArray<kj::byte>({1, 2}));
  results[1].setText("127.0.0.1:29500");
  auto st = results[2].initStats();
  st.setGraphRuns(5);
  st.setCompiler("plan");
  f.initNotes(1).set(0, "compiled");
  auto e = f.initError();
  e.setOp("aten::index_select");
  e.setMessage("index out of range");
  e.setPythonType("IndexError");
  e.setNode(2);
  Reply r = decodeReply(f.asReader());
  EXPECT_EQ(r.ackSeq, 12u);
  ASSERT_EQ(r.data.size(), 1u);
  EXPECT_EQ(r.data[0], std::string("\x01\x02", 2));
  ASSERT_EQ(r.texts.size(), 1u);
  EXPECT_EQ(r.texts[0], "127.0.0.1:29500");
  ASSERT_EQ(r.stats.size(), 1u);
  // The counters come as a message of their own, read back field by field.
  auto words = kj::heapArray<capnp::word>(r.stats[0].message.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), r.stats[0].message.data(), words.asBytes().size());
  capnp::FlatArrayMessageReader copy(words);
  EXPECT_EQ(copy.getRoot<wire::ServerStats>().getGraphRuns(), 5u);
  EXPECT_EQ(std::string(copy.getRoot<wire::ServerStats>().getCompiler().cStr()), "plan");
  ASSERT_EQ(r.notes.size(), 1u);
  ASSERT_TRUE(r.error.has_value());
  EXPECT_FALSE(r.error->fatal);
  EXPECT_EQ(r.error->op, "aten::index_select");
  EXPECT_EQ(r.error->pythonType, "IndexError");
  EXPECT_EQ(r.error->node, 2u);
}
