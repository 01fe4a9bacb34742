// The Run-arguments and release-range codec (rgpu/wire/RunArgs.h): what the client writes, the
// server reads back exactly, whole or relative, and a Run that does not fit its graph fails.
#include "rgpu/wire/RunArgs.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

using namespace rgpu;

namespace {
ir::ScalarValue real(double d) {
  ir::ScalarValue v;
  v.kind = ir::ScalarValue::Kind::Double;
  v.d = d;
  return v;
}

ir::ScalarValue integer(int64_t i) {
  ir::ScalarValue v;
  v.kind = ir::ScalarValue::Kind::Int;
  v.i = i;
  return v;
}

ir::Hash256 graph(uint64_t k) { return {{k, 0, 0, 0}}; }

bool same(const wire::RunArgs &a, const wire::RunArgs &b) {
  return a.inputs == b.inputs && a.restores == b.restores &&
         std::equal(a.scalars.begin(), a.scalars.end(), b.scalars.begin(), b.scalars.end(),
                    wire::sameBits);
}

/// One Run message: written by \p writer, read back by \p reader.
struct Trip {
  capnp::MallocMessageBuilder msg;
  wire::Run::Builder run;
  bool relative;
  llvm::Expected<wire::RunArgs> read;

  Trip(wire::RunArgsWriter &writer, wire::RunArgsReader &reader, const ir::Hash256 &g,
       const wire::RunArgs &args, const wire::RunShape &shape)
      : run(msg.initRoot<wire::Run>()),
        relative((writer.write(g, args, run), run.asReader().isRelative())),
        read(reader.read(g, run.asReader(), shape)) {}
};

wire::RunShape shapeOf(const wire::RunArgs &a, size_t outputs) {
  return {a.inputs.size(), a.scalars.size(), outputs};
}
} // namespace

TEST(RunArgs, AStepsRunsReadBackExactlyWholeThenRelative) {
  wire::RunArgsWriter writer;
  wire::RunArgsReader reader;
  std::mt19937_64 rng(7);
  wire::RunArgs args;
  for (uint64_t k = 0; k < 12; ++k)
    args.inputs.push_back(100 + k);
  for (int k = 0; k < 9; ++k)
    args.scalars.push_back(k % 3 ? real(0.5 * k) : integer(k));
  args.scalars[4] = real(std::numeric_limits<double>::quiet_NaN());
  args.restores = {0, 3, 1, 4};
  const wire::RunShape shape = shapeOf(args, 5);
  for (int step = 0; step < 50; ++step) {
    Trip t(writer, reader, graph(1), args, shape);
    EXPECT_EQ(t.relative, step > 0) << "step " << step;
    ASSERT_TRUE(bool(t.read)) << message(t.read.takeError());
    EXPECT_TRUE(same(*t.read, args)) << "step " << step;
    // The next step: outputs a fixed number of handles on, save a few inputs that stay (data
    // batches) or jump; some scalars change (bias corrections), sometimes the restores.
    for (size_t k = 0; k < args.inputs.size(); ++k)
      args.inputs[k] += k < 8 ? 12 : k == 8 ? 0 : rng() % 1000;
    args.scalars[1] = real(1.0 / (step + 2));
    args.scalars[2] = args.scalars[1];
    args.scalars[5] = integer(int64_t(rng() % 3));
    if (step % 7 == 3)
      args.restores = step % 2 ? std::vector<uint32_t>{} : std::vector<uint32_t>{2, 0};
  }
}

TEST(RunArgs, ARelativeRunSaysOnlyWhatChanged) {
  wire::RunArgsWriter writer;
  wire::RunArgsReader reader;
  wire::RunArgs args{{10, 11, 12}, {real(0.5), real(1.0), real(1.0)}, {}};
  Trip first(writer, reader, graph(1), args, shapeOf(args, 1));
  ASSERT_TRUE(bool(first.read));
  args.inputs = {13, 14, 15};
  args.scalars = {real(0.5), real(2.0), real(2.0)};
  Trip second(writer, reader, graph(1), args, shapeOf(args, 1));
  ASSERT_TRUE(second.relative);
  auto rel = second.run.asReader().getRelative();
  ASSERT_EQ(rel.getInputDeltas().size(), 2u); // (delta 3, count 3)
  EXPECT_EQ(rel.getInputDeltas()[0], 3);
  EXPECT_EQ(rel.getInputDeltas()[1], 3);
  EXPECT_EQ(rel.getChangedSlots().size(), 2u);
  EXPECT_EQ(rel.getValues().size(), 1u); // one distinct new value
  EXPECT_FALSE(rel.hasRestores());       // unchanged: absent
  ASSERT_TRUE(bool(second.read));
  EXPECT_TRUE(same(*second.read, args));
}

TEST(RunArgs, GraphsAreRememberedApartAndAForgetMakesTheNextRunWhole) {
  wire::RunArgsWriter writer;
  wire::RunArgsReader reader;
  wire::RunArgs a{{1, 2}, {real(1)}, {}}, b{{7}, {}, {}};
  for (int k = 0; k < 2; ++k) {
    Trip ta(writer, reader, graph(1), a, shapeOf(a, 1));
    Trip tb(writer, reader, graph(2), b, shapeOf(b, 1));
    EXPECT_EQ(ta.relative, k == 1);
    EXPECT_EQ(tb.relative, k == 1);
    ASSERT_TRUE(ta.read && tb.read);
    EXPECT_TRUE(same(*ta.read, a));
    EXPECT_TRUE(same(*tb.read, b));
  }
  writer.forget(graph(1));
  reader.forget(graph(1));
  Trip again(writer, reader, graph(1), a, shapeOf(a, 1));
  EXPECT_FALSE(again.relative);
  ASSERT_TRUE(bool(again.read));
}

TEST(RunArgs, TooManyDistinctNewScalarsGoWhole) {
  wire::RunArgsWriter writer;
  wire::RunArgsReader reader;
  wire::RunArgs args;
  for (int k = 0; k < 70000; ++k)
    args.scalars.push_back(real(k));
  Trip first(writer, reader, graph(1), args, shapeOf(args, 0));
  for (auto &s : args.scalars)
    s.d += 0.5;
  Trip second(writer, reader, graph(1), args, shapeOf(args, 0));
  EXPECT_FALSE(second.relative);
  ASSERT_TRUE(bool(second.read));
  EXPECT_TRUE(same(*second.read, args));
}

TEST(RunArgs, AReadThatDoesNotFitItsGraphFailsAndForgetsThePreviousRun) {
  wire::RunArgsWriter writer;
  wire::RunArgsReader reader;
  wire::RunArgs args{{1, 2}, {real(1)}, {0, 1}};
  const wire::RunShape shape = shapeOf(args, 1);
  auto failsWith = [](llvm::Expected<wire::RunArgs> &r) {
    return r ? std::string("no failure") : message(r.takeError());
  };
  {
    Trip t(writer, reader, graph(1), args, {3, 1, 1});
    EXPECT_NE(failsWith(t.read).find("wrong number of inputs"), std::string::npos);
  }
  {
    // The writer remembers a run the reader refused: its relative Run has nothing to be
    // relative to on the reader's side.
    Trip t(writer, reader, graph(1), args, shape);
    EXPECT_TRUE(t.relative);
    EXPECT_NE(failsWith(t.read).find("has not made"), std::string::npos);
  }
  auto relativeRead = [&](auto fill, const wire::RunShape &s) {
    capnp::MallocMessageBuilder m;
    auto run = m.initRoot<wire::Run>();
    fill(run.initRelative());
    auto r = reader.read(graph(1), run.asReader(), s);
    return failsWith(r);
  };
  auto prime = [&] {
    capnp::MallocMessageBuilder m;
    auto run = m.initRoot<wire::Run>();
    wire::RunArgsWriter fresh;
    fresh.write(graph(1), args, run);
    ASSERT_TRUE(bool(reader.read(graph(1), run.asReader(), shape)));
  };
  prime();
  EXPECT_NE(relativeRead([](auto r) { r.initInputDeltas(3); }, shape).find("pairs"),
            std::string::npos);
  // The failure forgot the previous run: even a good relative Run fails now.
  EXPECT_NE(relativeRead([](auto r) { r.initInputDeltas(2).set(1, 2); }, shape).find("not made"),
            std::string::npos);
  prime();
  EXPECT_NE(relativeRead([](auto r) { r.initInputDeltas(2).set(1, 3); }, shape).find("more input"),
            std::string::npos);
  prime();
  EXPECT_NE(relativeRead([](auto r) { r.initInputDeltas(2).set(1, 1); }, shape).find("fewer"),
            std::string::npos);
  prime();
  EXPECT_NE(relativeRead([](auto r) { r.initInputDeltas(2).set(1, 2); }, {2, 2, 1})
                .find("another shape"),
            std::string::npos);
  prime();
  EXPECT_NE(relativeRead(
                [](auto r) {
                  r.initInputDeltas(2).set(1, 2);
                  r.initChangedSlots(1).set(0, 1); // slot 1 of a graph with one scalar
                  r.initChangedValues(1);
                  r.initValues(1);
                },
                shape)
                .find("out of range"),
            std::string::npos);
  prime();
  EXPECT_NE(relativeRead(
                [](auto r) {
                  r.initInputDeltas(2).set(1, 2);
                  r.initRestores(2).set(1, 5); // input 5 of two
                },
                shape)
                .find("restore out of range"),
            std::string::npos);
}

TEST(RunArgs, ReleasesAreAscendingRangesAndTheirCheckBoundsTheHandlesNamed) {
  EXPECT_EQ(wire::releaseRanges({7, 5, 9, 6, 5}), (std::vector<uint64_t>{5, 3, 9, 1}));
  EXPECT_TRUE(wire::releaseRanges({}).empty());
  capnp::MallocMessageBuilder m;
  auto list = m.initRoot<wire::ClientFrame>().initCommands(1)[0].initReleaseRanges(4);
  list.set(0, 5);
  list.set(1, 3);
  list.set(2, 9);
  list.set(3, 1);
  EXPECT_EQ(message(wire::checkReleaseRanges(list.asReader(), 4)), "");
  EXPECT_NE(message(wire::checkReleaseRanges(list.asReader(), 3)).find("name more than 3"),
            std::string::npos);
  list.set(1, ~uint64_t(0)); // a count that would wrap a sum is taken as 2^32
  EXPECT_EQ(message(wire::checkReleaseRanges(list.asReader(), uint64_t(1) << 40)), "");
  EXPECT_NE(message(wire::checkReleaseRanges(list.asReader(), 1000)), "");
  auto odd = m.initRoot<wire::ClientFrame>().initCommands(1)[0].initReleaseRanges(3);
  EXPECT_NE(message(wire::checkReleaseRanges(odd.asReader(), 1000)).find("not pairs"),
            std::string::npos);
}
