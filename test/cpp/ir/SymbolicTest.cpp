#include "rgpu/ir/Symbolic.h"

#include <gtest/gtest.h>
#include <llvm/ADT/StringExtras.h>
#include <llvm/Support/raw_ostream.h>

using namespace rgpu::ir;

namespace {
TensorMeta meta(llvm::ArrayRef<int64_t> sizes) { return TensorMeta::contiguous(dtype::Float, sizes); }

/// One decoding step with a KV cache of length n: cat(cache[1,4,n,8], new[1,4,1,8]) along dim 2,
/// then the last n+1-1 = n rows sliced back out (x[:, :, 1:n+1]), viewed as [4*(n), 8].
Graph decode(int64_t n) {
  Graph g;
  g.inputs = {meta({1, 4, n, 8}), meta({1, 4, 1, 8})};
  Node cat;
  cat.op = Symbol::get("aten::cat.default");
  cat.operands = {0, 1};
  cat.args = {Arg::ref(Arg::Kind::List, 2), Arg::ref(Arg::Kind::Tensor, 0),
              Arg::ref(Arg::Kind::Tensor, 1), Arg::integer(2)};
  cat.outputs = {meta({1, 4, n + 1, 8})};
  Node slice;
  slice.op = Symbol::get("aten::slice_copy.Tensor");
  slice.operands = {2};
  slice.args = {Arg::ref(Arg::Kind::Tensor, 0), Arg::integer(2), Arg::integer(1),
                Arg::integer(n + 1), Arg::integer(1)};
  slice.outputs = {meta({1, 4, n, 8})};
  Node view;
  view.op = Symbol::get("aten::view_copy.default");
  view.operands = {3};
  view.args = {Arg::ref(Arg::Kind::Tensor, 0), Arg::ref(Arg::Kind::List, 2),
               Arg::integer(4 * n), Arg::integer(8)};
  view.outputs = {meta({4 * n, 8})};
  g.nodes = {cat, slice, view};
  g.outputs = {2, 4};
  return g;
}

/// x[b,t] + y[b,t] viewed as [b*t].
Graph batch(int64_t b, int64_t t) {
  Graph g;
  g.inputs = {meta({b, t}), meta({b, t})};
  Node add;
  add.op = Symbol::get("aten::add.Tensor");
  add.operands = {0, 1};
  add.args = {Arg::ref(Arg::Kind::Tensor, 0), Arg::ref(Arg::Kind::Tensor, 1)};
  add.outputs = {meta({b, t})};
  Node view;
  view.op = Symbol::get("aten::view_copy.default");
  view.operands = {2};
  view.args = {Arg::ref(Arg::Kind::Tensor, 0), Arg::ref(Arg::Kind::List, 1), Arg::integer(b * t)};
  view.outputs = {meta({b * t})};
  g.nodes = {add, view};
  g.outputs = {3};
  return g;
}

/// Attention scores q[b,t,8] @ k[b,8,t]: [b,t,t], viewed as [b*t*t].
Graph scores(int64_t b, int64_t t) {
  Graph g;
  g.inputs = {meta({b, t, 8}), meta({b, 8, t})};
  Node bmm;
  bmm.op = Symbol::get("aten::bmm.default");
  bmm.operands = {0, 1};
  bmm.args = {Arg::ref(Arg::Kind::Tensor, 0), Arg::ref(Arg::Kind::Tensor, 1)};
  bmm.outputs = {meta({b, t, t})};
  g.nodes = {bmm};
  g.outputs = {2};
  return g;
}

bool fitOf(ShapeFamilies &families, const Graph &g, ShapeFamilies::Fit &out,
           llvm::ArrayRef<uint32_t> hinted = {}) {
  return families.fit(g, hashGraph(g), out, hinted);
}

std::string text(const Graph &g) {
  std::string s;
  llvm::raw_string_ostream os(s);
  printText(g, os);
  return os.str();
}
} // namespace

TEST(Symbolic, OnlyPositionsAreOutsideTheSkeleton) {
  EXPECT_EQ(skeletonHash(decode(5)), skeletonHash(decode(9)));
  EXPECT_NE(hashGraph(decode(5)), hashGraph(decode(9)));
  Graph other = decode(5);
  other.nodes[0].op = Symbol::get("aten::stack.default");
  EXPECT_NE(skeletonHash(other), skeletonHash(decode(5)));
  Graph bf16 = decode(5);
  bf16.inputs[1].dtype = dtype::BFloat16;
  EXPECT_NE(skeletonHash(bf16), skeletonHash(decode(5)));
}

TEST(Symbolic, AGenerationStepGeneralizesToOneSymbol) {
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  EXPECT_FALSE(fitOf(families, decode(5), fit)); // the first of its family runs as itself
  EXPECT_FALSE(fitOf(families, decode(5), fit)); // and so does the same graph again
  ASSERT_TRUE(fitOf(families, decode(6), fit));
  EXPECT_TRUE(fit.isNew);
  EXPECT_EQ(fit.graph->symbolCount, 1u);
  EXPECT_EQ(rgpu::message(verifyStructure(*fit.graph)), "");
  EXPECT_EQ(fit.symbols, (llvm::SmallVector<int64_t, 4>{6}));
  Hash256 symbolic = fit.hash;
  for (int64_t n : {7, 50, 1, 5}) {
    ASSERT_TRUE(fitOf(families, decode(n), fit)) << n;
    EXPECT_FALSE(fit.isNew);
    EXPECT_EQ(fit.hash, symbolic);
    EXPECT_EQ(fit.symbols[0], n);
    // What the server runs is exactly the graph the client traced.
    Graph back = *fit.graph;
    ASSERT_TRUE(instantiate(back, fit.symbols));
    EXPECT_TRUE(sameStructure(back, decode(n))) << n;
  }
  std::string t = text(*fit.graph);
  EXPECT_NE(t.find("input 0 : f32[1,4,s0,8]"), std::string::npos) << t;
  EXPECT_NE(t.find("aten::slice_copy.Tensor(%2, 2, 1, s0+1, 1) : f32[1,4,s0,8]"),
            std::string::npos) << t;
  EXPECT_NE(t.find("[4*s0, 8]) : f32[4*s0,8]"), std::string::npos) << t;
  bool shapesOnly = false;
  auto lines = diffGraphs(decode(5), *fit.graph, &shapesOnly);
  EXPECT_TRUE(shapesOnly);
  EXPECT_NE(std::find(lines.begin(), lines.end(), "input 0: f32[1,4,5,8] vs f32[1,4,s0,8]"),
            lines.end()) << llvm::join(lines, "\n");
  // An empty cache has other strides (torch counts a size 0 as 1 in them): whatever it runs
  // as, that is the graph traced.
  if (fitOf(families, decode(0), fit)) {
    Graph back = *fit.graph;
    ASSERT_TRUE(instantiate(back, fit.symbols));
    EXPECT_TRUE(sameStructure(back, decode(0)));
  }
}

TEST(Symbolic, AGuessFromTooFewShapesIsRefinedNotTrusted) {
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  EXPECT_FALSE(fitOf(families, batch(32, 64), fit));
  ASSERT_TRUE(fitOf(families, batch(32, 128), fit)); // only t varied: b stays 32
  Hash256 first = fit.hash;
  EXPECT_EQ(fit.graph->symbolCount, 1u);
  ASSERT_TRUE(fitOf(families, batch(32, 96), fit));
  EXPECT_EQ(fit.hash, first);
  // b changes: the graph that fixed b = 32 does not match, and a second one is made.
  ASSERT_TRUE(fitOf(families, batch(17, 96), fit));
  EXPECT_TRUE(fit.isNew);
  EXPECT_NE(fit.hash, first);
  EXPECT_EQ(fit.graph->symbolCount, 2u);
  Hash256 second = fit.hash;
  for (auto [b, t] : {std::pair<int64_t, int64_t>{8, 7}, {32, 64}, {3, 3}}) {
    ASSERT_TRUE(fitOf(families, batch(b, t), fit));
    Graph back = *fit.graph;
    ASSERT_TRUE(instantiate(back, fit.symbols));
    EXPECT_TRUE(sameStructure(back, batch(b, t))) << b << "x" << t;
  }
  EXPECT_EQ(fit.hash, second); // b == t shares nothing it should not: [3,3] needs both
  EXPECT_NE(text(*fit.graph).find("[s0*s1]) : f32[s0*s1]"), std::string::npos) << text(*fit.graph);
}

TEST(Symbolic, AMismatchAnywhereRunsTheGraphAsItself) {
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  fitOf(families, decode(5), fit);
  ASSERT_TRUE(fitOf(families, decode(6), fit));
  Hash256 symbolic = fit.hash;
  // The same skeleton, but a slice end that does not follow the cache length (x[:, :, 1:3]).
  Graph odd = decode(9);
  odd.nodes[1].args[3] = Arg::integer(3);
  odd.nodes[1].outputs = {meta({1, 4, 2, 8})};
  llvm::SmallVector<int64_t, 4> symbols;
  std::vector<int64_t> mine = positions(*fit.graph);
  EXPECT_FALSE(matchPositions(*fit.graph, mine, positions(odd), symbols));
  // It is generalized again (from three shapes), never run as the other graph.
  ASSERT_TRUE(fitOf(families, odd, fit));
  EXPECT_NE(fit.hash, symbolic);
  Graph back = *fit.graph;
  ASSERT_TRUE(instantiate(back, fit.symbols));
  EXPECT_TRUE(sameStructure(back, odd));
}

TEST(Symbolic, AFamilyStopsGeneralizingAfterItsLimit) {
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  // Every graph has its own unrelated constant pattern: [n, n*n + k] with a fresh k.
  auto weird = [](int64_t n) { return batch(n, n * n + 3 * n % 7); };
  size_t made = 0;
  for (int64_t n = 2; n < 40; ++n)
    if (fitOf(families, weird(n), fit) && fit.isNew)
      ++made;
  EXPECT_LE(made, ShapeFamilies::kMaxGraphs);
}

TEST(Symbolic, VerifyRefusesMalformedSymbols) {
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  fitOf(families, decode(5), fit);
  ASSERT_TRUE(fitOf(families, decode(6), fit));
  Graph g = *fit.graph;
  EXPECT_EQ(rgpu::message(verifyStructure(g)), "");
  Graph bad = g;
  bad.symbolic[0].expr.factors = {7};
  EXPECT_NE(rgpu::message(verifyStructure(bad)), "");
  bad = g;
  bad.symbolic.back().position = 1u << 20;
  EXPECT_NE(rgpu::message(verifyStructure(bad)), "");
  bad = g;
  bad.inputs[0].sizes[2] = 5; // a symbolic position holding a value
  EXPECT_NE(rgpu::message(verifyStructure(bad)), "");
  bad = g;
  bad.symbolCount = 0;
  EXPECT_NE(rgpu::message(verifyStructure(bad)), "");
  // Expressions overflow into an error, never a wrapped size.
  bad = g;
  bad.symbolic[1].expr.coef = int64_t(1) << 62;
  EXPECT_FALSE(instantiate(bad, {int64_t(1) << 40}));
}

TEST(Symbolic, ADiffPastANodeWithMoreOutputsNamesEachGraphsOwnValues) {
  // b's first node has one more output, so its later value ids are one ahead of a's.
  Graph a = batch(2, 3), b = batch(2, 3);
  b.nodes[0].outputs.push_back(meta({7}));
  b.nodes[1].operands = {2};
  b.nodes[1].outputs = {meta({5})};
  b.outputs = {4};
  auto lines = diffGraphs(a, b);
  EXPECT_NE(std::find(lines.begin(), lines.end(),
                      "node 1 (aten::view_copy.default): f32[6] vs f32[5]"),
            lines.end()) << llvm::join(lines, "\n");
  // The other way round a's ids would run past the end of b's values.
  lines = diffGraphs(b, a);
  EXPECT_NE(std::find(lines.begin(), lines.end(),
                      "node 1 (aten::view_copy.default): f32[5] vs f32[6]"),
            lines.end()) << llvm::join(lines, "\n");
}

TEST(Symbolic, TwoShapesOfASquareAreASquareNotALine) {
  // 128*128 and 96*96 also fit 224*t - 12288, which a third length would refute.
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  EXPECT_FALSE(fitOf(families, scores(4, 128), fit));
  ASSERT_TRUE(fitOf(families, scores(4, 96), fit));
  Hash256 first = fit.hash;
  EXPECT_NE(text(*fit.graph).find("f32[4,s0,s0]"), std::string::npos) << text(*fit.graph);
  ASSERT_TRUE(fitOf(families, scores(4, 64), fit));
  EXPECT_FALSE(fit.isNew);
  EXPECT_EQ(fit.hash, first);
}

TEST(Symbolic, DeclaredDynamicSizesMakeTheFirstGraphSymbolic) {
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  // Both sizes of both inputs declared dynamic (positions: input 0 sizes 0, 1; input 1 sizes 4, 5).
  const uint32_t hinted[] = {0, 1, 4, 5};
  ASSERT_TRUE(fitOf(families, batch(32, 64), fit, hinted));
  EXPECT_TRUE(fit.isNew);
  EXPECT_TRUE(fit.fromHints);
  EXPECT_EQ(fit.graph->symbolCount, 2u);
  EXPECT_NE(text(*fit.graph).find("[s0*s1]) : f32[s0*s1]"), std::string::npos) << text(*fit.graph);
  const Hash256 symbolic = fit.hash;
  for (auto [b, t] : {std::pair<int64_t, int64_t>{17, 96}, {8, 7}, {32, 64}}) {
    ASSERT_TRUE(fitOf(families, batch(b, t), fit)) << b << "x" << t;
    EXPECT_FALSE(fit.isNew);
    EXPECT_EQ(fit.hash, symbolic);
  }
}

TEST(Symbolic, AWrongDeclarationCostsAGraphNotAResult) {
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  // b declared dynamic at b = 8: q's stride 8 (its feature size) is taken for b as well, which
  // the next batch size refutes.
  const uint32_t hinted[] = {0};
  ASSERT_TRUE(fitOf(families, scores(8, 5), fit, hinted));
  EXPECT_TRUE(fit.fromHints);
  const Hash256 guessed = fit.hash;
  ASSERT_TRUE(fitOf(families, scores(4, 5), fit, hinted));
  EXPECT_TRUE(fit.isNew);
  EXPECT_FALSE(fit.fromHints); // generalized from the two shapes seen
  EXPECT_NE(fit.hash, guessed);
  for (int64_t b : {4, 8, 3}) {
    ASSERT_TRUE(fitOf(families, scores(b, 5), fit)) << b;
    Graph back = *fit.graph;
    ASSERT_TRUE(instantiate(back, fit.symbols));
    EXPECT_TRUE(sameStructure(back, scores(b, 5))) << b;
  }
}

TEST(Symbolic, DeclaringOnlySizesOfZeroOrOneDeclaresNothing) {
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  const uint32_t hinted[] = {0};
  EXPECT_FALSE(fitOf(families, batch(1, 64), fit, hinted));
}

TEST(Symbolic, APermutedInputIsAnotherFamilyThanAContiguousOne) {
  // Generation's first step reads the prompt's keys as a permuted view of a projection; later
  // steps read a contiguous cache. Mixed, their strides would fit no expression of n.
  Graph view = decode(8);
  view.inputs[0].strides = {768, 8, 96, 1};
  EXPECT_NE(skeletonHash(view), skeletonHash(decode(9)));
  EXPECT_EQ(skeletonHash(decode(9)), skeletonHash(decode(10)));
  ShapeFamilies families;
  ShapeFamilies::Fit fit;
  EXPECT_FALSE(fitOf(families, view, fit));
  EXPECT_FALSE(fitOf(families, decode(9), fit)); // the first of its own family
  ASSERT_TRUE(fitOf(families, decode(10), fit));
  EXPECT_EQ(fit.graph->symbolCount, 1u);
  EXPECT_NE(text(*fit.graph).find("input 0 : f32[1,4,s0,8]\n"), std::string::npos) // contiguous
      << text(*fit.graph);
}
