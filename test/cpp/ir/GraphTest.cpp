#include "rgpu/ir/Graph.h"

#include <gtest/gtest.h>
#include <llvm/Support/Endian.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Support/xxhash.h>

#include <cstring>

using namespace rgpu::ir;

namespace {
TensorMeta meta(llvm::ArrayRef<int64_t> sizes, int8_t dt = dtype::Float) {
  return TensorMeta::contiguous(dt, sizes);
}

Node binary(const char *op, uint32_t a, uint32_t b, const TensorMeta &out) {
  Node n;
  n.op = Symbol::get(op);
  n.operands = {a, b};
  n.args = {Arg::ref(Arg::Kind::Tensor, 0), Arg::ref(Arg::Kind::Tensor, 1)};
  n.outputs = {out};
  return n;
}

/// x0 * x1 + x0 on two [4,8] inputs.
Graph mulAdd(const TensorMeta &m = meta({4, 8})) {
  Graph g;
  g.inputs = {m, m};
  g.nodes.push_back(binary("aten::mul.Tensor", 0, 1, m));
  g.nodes.push_back(binary("aten::add.Tensor", 2, 0, m));
  g.outputs = {3};
  return g;
}
} // namespace

TEST(Graph, HashIsStableUnderInputRenumbering) {
  Graph a = mulAdd();
  // The same program with its inputs listed the other way round.
  Graph b = mulAdd();
  b.nodes[0].operands = {1, 0};
  b.nodes[1].operands = {2, 1};
  Canonical ca = canonicalize(a), cb = canonicalize(b);
  EXPECT_EQ(ca.hash, cb.hash);
  EXPECT_EQ(ca.inputOrder, (llvm::SmallVector<uint32_t, 8>{0, 1}));
  EXPECT_EQ(cb.inputOrder, (llvm::SmallVector<uint32_t, 8>{1, 0}));
}

TEST(Graph, HashChangesWithShapeDtypeAndOp) {
  Hash256 base = canonicalize(mulAdd()).hash;
  EXPECT_NE(base, canonicalize(mulAdd(meta({4, 9}))).hash);
  EXPECT_NE(base, canonicalize(mulAdd(meta({4, 8}, dtype::BFloat16))).hash);
  Graph op = mulAdd();
  op.nodes[1].op = Symbol::get("aten::sub.Tensor");
  EXPECT_NE(base, canonicalize(op).hash);
  Graph strided = mulAdd();
  strided.inputs[0].strides = {1, 4};
  EXPECT_NE(base, canonicalize(strided).hash);
}

namespace {
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full;

/// XXH64's accumulator of \p lane (seed 0) after the stripes before \p stripe of \p bytes.
uint64_t xxLane(const std::string &bytes, size_t lane, size_t stripe) {
  const uint64_t init[4] = {kP1 + kP2, kP2, 0, 0 - kP1};
  uint64_t acc = init[lane];
  for (size_t s = 0; s < stripe; ++s) {
    uint64_t word = llvm::support::endian::read64le(bytes.data() + 32 * s + 8 * lane);
    acc += word * kP2;
    acc = (acc << 31) | (acc >> 33);
    acc *= kP1;
  }
  return acc;
}

/// What identified a graph before BLAKE2b: two XXH64s of its bytes behind a leading salt word,
/// 0 for one and a constant for the other.
std::pair<uint64_t, uint64_t> xxIdentity(const std::string &bytes) {
  std::string salted(8, '\0');
  salted += bytes;
  uint64_t first = llvm::xxHash64(salted);
  uint64_t salt = 0x9e3779b97f4a7c15ull;
  std::memcpy(&salted[0], &salt, sizeof salt);
  return {first, llvm::xxHash64(salted)};
}
} // namespace

TEST(Graph, AGraphForgedToCollideUnderXxHashGetsItsOwnDigest) {
  // The attack that a 128-bit xxHash identity allowed: an XXH64 lane step is invertible, so a
  // free double in the same lane as a changed input size cancels the change, in both passes
  // at once (they differ only in lane 0). Graph B's input is 8 wide, A's 64, and B would run
  // A's compiled code. The digest now tells them apart.
  auto make = [](int64_t width, double c, int strings) {
    Graph g;
    TensorMeta in;
    in.dtype = dtype::Float;
    in.sizes = {4, width};
    in.strides = {1, 4}; // a transposed input: only the size changes with the width
    g.inputs = {in};
    Node n;
    n.op = Symbol::get("aten::forged_op0"); // 16 bytes: the words after it stay aligned
    n.operands = {0};
    n.args = {Arg::ref(Arg::Kind::Tensor, 0)};
    for (int k = 0; k < strings; ++k) { // shifts the doubles by 8 bytes
      n.strings.push_back("12345678");
      n.args.push_back(Arg::ref(Arg::Kind::Str, k));
    }
    for (int k = 0; k < 4; ++k)
      n.args.push_back(Arg::real(k == 0 ? c : 1.0));
    TensorMeta out = in;
    out.sizes = {4, 64};
    n.outputs = {out};
    g.nodes.push_back(n);
    g.outputs = {1};
    return g;
  };
  const double seedValue = 0.5;
  uint64_t seedBits;
  std::memcpy(&seedBits, &seedValue, sizeof seedBits);
  bool forged = false;
  for (int strings = 0; strings < 2 && !forged; ++strings) {
    Graph a = make(64, seedValue, strings), b = make(8, seedValue, strings);
    std::string bytesA = canonicalBytes(a), bytesB = canonicalBytes(b);
    ASSERT_EQ(bytesA.size(), bytesB.size());
    // Offsets in the salted buffer (8 bytes longer) of the changed word and of the double.
    size_t changed = 8 + size_t(std::mismatch(bytesA.begin(), bytesA.end(), bytesB.begin()).first -
                                bytesA.begin());
    size_t changedWord = changed / 8 * 8;
    size_t fix = 8 + bytesA.find(std::string(reinterpret_cast<const char *>(&seedBits), 8));
    size_t lane = fix % 32 / 8, full = (bytesA.size() + 8) / 32 * 32;
    if (lane == 0 || changedWord % 32 / 8 != lane || fix / 32 <= changedWord / 32 || fix + 8 > full)
      continue;
    std::string salted = std::string(8, '\0');
    uint64_t accA = xxLane(salted + bytesA, lane, fix / 32);
    uint64_t accB = xxLane(salted + bytesB, lane, fix / 32);
    uint64_t inverse = kP2; // of kP2 modulo 2^64, by Newton's iteration
    for (int k = 0; k < 6; ++k)
      inverse *= 2 - kP2 * inverse;
    uint64_t forgedBits = seedBits + (accA - accB) * inverse;
    double forgedValue;
    std::memcpy(&forgedValue, &forgedBits, sizeof forgedValue);
    b = make(8, forgedValue, strings);
    EXPECT_EQ(xxIdentity(canonicalBytes(a)), xxIdentity(canonicalBytes(b)));
    EXPECT_FALSE(sameStructure(a, b));
    EXPECT_NE(hashGraph(a), hashGraph(b));
    forged = true;
  }
  EXPECT_TRUE(forged);
}

TEST(Graph, HashIsBlake2b256OfTheCanonicalBytesAndPrintsAs64HexDigits) {
  Hash256 h = hashGraph(mulAdd());
  EXPECT_EQ(h.hex().size(), 64u);
  Hash256 parsed;
  ASSERT_TRUE(Hash256::parse(h.hex(), parsed));
  EXPECT_EQ(parsed, h);
  EXPECT_FALSE(Hash256::parse(h.hex().substr(0, 32), parsed));
  EXPECT_NE(hashGraph(mulAdd()), hashGraph(mulAdd(meta({4, 9}))));
}

TEST(Graph, SameStructureComparesEverythingTheHashCovers) {
  Graph base = mulAdd();
  Graph located = mulAdd();
  located.nodes[1].loc = located.addLocation("train.py:7"); // locations are not hashed
  EXPECT_TRUE(sameStructure(base, located));
  std::vector<Graph> changed(7, mulAdd());
  changed[0].nodes[1].op = Symbol::get("aten::sub.Tensor");
  changed[1].nodes[0].operands = {1, 0};
  changed[2].inputs[1] = meta({4, 8}, dtype::Half);
  changed[3].nodes[1].outputs[0].strides = {1, 4};
  changed[4].outputs = {2};
  changed[5].nodes[1].args.push_back(Arg::integer(2));
  changed[6].nodes[1].strings.push_back("tanh");
  for (size_t i = 0; i < changed.size(); ++i)
    EXPECT_FALSE(sameStructure(base, changed[i])) << i;
}

TEST(Graph, LiftedScalarValuesAreNotHashedButConstantsAre) {
  auto withAlpha = [](Arg alpha) {
    Graph g = mulAdd();
    g.nodes[1].args.push_back(alpha);
    if (alpha.kind == Arg::Kind::Scalar) {
      g.scalars.push_back({dtype::Double, ScalarForm::Scalar});
      g.nodes[1].scalars = {0};
    }
    return canonicalize(g).hash;
  };
  // A lifted scalar is a slot: its value travels with each run, so any lr gives one graph.
  Hash256 lifted = withAlpha(Arg::ref(Arg::Kind::Scalar, 0));
  EXPECT_EQ(lifted, withAlpha(Arg::ref(Arg::Kind::Scalar, 0)));
  // A semantic constant (a dim, an eps) is part of the structure.
  EXPECT_NE(withAlpha(Arg::real(0.5)), withAlpha(Arg::real(0.25)));
  EXPECT_NE(lifted, withAlpha(Arg::real(0.5)));
}

TEST(Graph, UnusedTemporariesAreRemoved) {
  Graph g = mulAdd();
  auto m = meta({4, 8});
  g.nodes.insert(g.nodes.begin(), binary("aten::div.Tensor", 0, 1, m)); // nobody uses %2
  for (Node &n : g.nodes)
    for (uint32_t &v : n.operands)
      if (v >= 2 && &n != &g.nodes[0])
        ++v;
  g.outputs = {4};
  Canonical c = canonicalize(g);
  ASSERT_EQ(c.graph.nodes.size(), 2u);
  EXPECT_EQ(c.hash, canonicalize(mulAdd()).hash);
}

TEST(Graph, RandomNodesKeepTheirTraceOrder) {
  // Two dropouts of one input, consumed by the outputs in the other order: a walk from the
  // outputs alone would draw the second mask first, unlike eager (and unlike a recomputation
  // that consumes them in order).
  auto m = meta({2});
  auto dropout = [&](uint32_t x) {
    Node n;
    n.op = Symbol::get("aten::native_dropout");
    n.operands = {x};
    n.args = {Arg::ref(Arg::Kind::Tensor, 0), Arg::real(0.5), Arg::boolean(true)};
    n.outputs = {m, meta({2}, dtype::Bool)};
    n.random = true;
    return n;
  };
  Graph g;
  g.inputs = {m};
  g.nodes.push_back(dropout(0));                          // %1 %2
  g.nodes.push_back(dropout(0));                          // %3 %4
  g.nodes.push_back(binary("aten::mul.Tensor", 3, 3, m)); // %5 uses the second mask's output
  g.nodes.push_back(binary("aten::mul.Tensor", 1, 1, m)); // %6 uses the first's
  g.outputs = {5, 6};
  Canonical c = canonicalize(g);
  ASSERT_EQ(c.nodeOrder.size(), 4u);
  EXPECT_EQ(c.nodeOrder, (std::vector<uint32_t>{0, 1, 2, 3}));
  // Without the flag, the walk from the outputs puts the second dropout first.
  g.nodes[0].random = g.nodes[1].random = false;
  EXPECT_EQ(canonicalize(g).nodeOrder, (std::vector<uint32_t>{1, 2, 0, 3}));
}

TEST(Graph, CanonicalOrderIsPostOrderFromOutputs) {
  // Two independent chains traced interleaved; canonical form groups each chain.
  auto m = meta({2});
  Graph g;
  g.inputs = {m, m};
  g.nodes.push_back(binary("aten::mul.Tensor", 0, 0, m)); // %2 chain A
  g.nodes.push_back(binary("aten::mul.Tensor", 1, 1, m)); // %3 chain B
  g.nodes.push_back(binary("aten::add.Tensor", 2, 2, m)); // %4 chain A
  g.nodes.push_back(binary("aten::add.Tensor", 3, 3, m)); // %5 chain B
  g.outputs = {4, 5};
  Canonical c = canonicalize(g);
  ASSERT_EQ(c.graph.nodes.size(), 4u);
  EXPECT_EQ(c.graph.nodes[0].operands[0], 0u);
  EXPECT_EQ(c.graph.nodes[1].operands[0], 2u); // add consumes the mul just before it
  EXPECT_EQ(c.graph.nodes[2].operands[0], 1u);
  EXPECT_EQ(c.graph.outputs, (llvm::SmallVector<uint32_t, 8>{3, 5}));
  // The interleaving does not matter.
  Graph h = g;
  std::swap(h.nodes[1], h.nodes[2]);
  h.nodes[1].operands = {2, 2};
  h.nodes[2].operands = {1, 1};
  h.nodes[3].operands = {4, 4};
  h.outputs = {3, 5};
  EXPECT_EQ(canonicalize(h).hash, c.hash);
}

TEST(Graph, DeepChainsDoNotOverflowTheStack) {
  auto m = meta({1});
  Graph g;
  g.inputs = {m};
  for (uint32_t i = 0; i < 200000; ++i)
    g.nodes.push_back(binary("aten::add.Tensor", i, i, m));
  g.outputs = {200000};
  EXPECT_EQ(canonicalize(g).graph.nodes.size(), 200000u);
}

TEST(Graph, VerifierRejectsMalformedGraphs) {
  EXPECT_EQ(rgpu::message(verifyStructure(mulAdd())), "");
  Graph forward = mulAdd();
  forward.nodes[0].operands = {0, 3}; // uses a later value
  EXPECT_NE(rgpu::message(verifyStructure(forward)), "");
  Graph badArg = mulAdd();
  badArg.nodes[0].args.push_back(Arg::ref(Arg::Kind::Tensor, 7));
  EXPECT_NE(rgpu::message(verifyStructure(badArg)), "");
  Graph badList = mulAdd();
  badList.nodes[0].args.push_back(Arg::ref(Arg::Kind::List, 3));
  EXPECT_NE(rgpu::message(verifyStructure(badList)), "");
  Graph badDtype = mulAdd();
  badDtype.inputs[0].dtype = 99;
  EXPECT_NE(rgpu::message(verifyStructure(badDtype)), "");
  Graph badOut = mulAdd();
  badOut.outputs = {17};
  EXPECT_NE(rgpu::message(verifyStructure(badOut)), "");
}

TEST(Graph, PrintsOneNodePerLine) {
  Graph g = mulAdd();
  g.nodes[1].loc = g.addLocation("train.py:12");
  std::string text;
  llvm::raw_string_ostream os(text);
  printText(g, os);
  EXPECT_NE(text.find("%3 = aten::add.Tensor(%2, %0) : f32[4,8]  # train.py:12"),
            std::string::npos)
      << text;
}

TEST(Graph, DiffNamesAShapeChange) {
  bool shapesOnly = false;
  auto lines = diffGraphs(mulAdd(meta({8, 16})), mulAdd(meta({12, 16})), &shapesOnly);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0], "input 0: f32[8,16] vs f32[12,16]");
  EXPECT_TRUE(shapesOnly);
  EXPECT_TRUE(diffGraphs(mulAdd(), mulAdd()).empty());
}

TEST(Graph, AnotherDtypeIsNotAShapeChange) {
  // x.to(uint16) then x.to(int16): the same ops and sizes, other kernels.
  bool shapesOnly = true;
  auto lines = diffGraphs(mulAdd(meta({8, 16}, 27)), mulAdd(meta({8, 16}, dtype::Short)),
                          &shapesOnly);
  EXPECT_FALSE(shapesOnly);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0], "input 0: u16[8,16] vs i16[8,16]");
}

TEST(Graph, IntegersThatChangeWithTheShapesAreShapeOnly) {
  // x[:, :n] of an input whose second size is n: the slice end follows the size.
  auto slice = [](int64_t n) {
    Graph g;
    g.inputs = {meta({4, n})};
    Node s;
    s.op = Symbol::get("aten::slice_copy.Tensor");
    s.operands = {0};
    s.args = {Arg::ref(Arg::Kind::Tensor, 0), Arg::integer(1), Arg::integer(0), Arg::integer(n),
              Arg::integer(1)};
    s.outputs = {meta({4, n})};
    g.nodes.push_back(s);
    g.outputs = {1};
    return g;
  };
  bool shapesOnly = false;
  auto lines = diffGraphs(slice(8), slice(9), &shapesOnly);
  EXPECT_TRUE(shapesOnly);
  EXPECT_NE(std::find(lines.begin(), lines.end(),
                      "node 0 (aten::slice_copy.Tensor): integer arguments 8 vs 9"),
            lines.end());
  // The same integer change with no change of shape is another constant, not another shape.
  Graph other = slice(8);
  other.nodes[0].args[3] = Arg::integer(7);
  diffGraphs(slice(8), other, &shapesOnly);
  EXPECT_FALSE(shapesOnly);
}

TEST(Graph, DiffNamesAddedAndRemovedOps) {
  Graph other = mulAdd();
  other.nodes[1].op = Symbol::get("aten::sub.Tensor");
  bool shapesOnly = true;
  auto lines = diffGraphs(mulAdd(), other, &shapesOnly);
  EXPECT_FALSE(shapesOnly);
  EXPECT_EQ(lines[0], "first difference at node 1: aten::add.Tensor vs aten::sub.Tensor");
  EXPECT_NE(std::find(lines.begin(), lines.end(), "+ aten::sub.Tensor"), lines.end());
  EXPECT_NE(std::find(lines.begin(), lines.end(), "- aten::add.Tensor"), lines.end());
}
