// The server's graph verifier, plan executor and compiled-package checks, without the network.
#include "Compiler.h"
#include "Plan.h"
#include "rgpu/ir/Symbolic.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

using namespace rgpu;
using rgpu::ir::Arg;

namespace {
ir::TensorMeta meta(std::vector<int64_t> sizes, int8_t dtype = ir::dtype::Float) {
  return ir::TensorMeta::contiguous(dtype, sizes);
}

ir::Node node(const char *op, std::vector<uint32_t> operands, std::vector<Arg> args,
              std::vector<ir::TensorMeta> outs) {
  ir::Node n;
  n.op = ir::Symbol::get(op);
  n.operands.assign(operands.begin(), operands.end());
  n.args.assign(args.begin(), args.end());
  n.outputs.assign(outs.begin(), outs.end());
  return n;
}

Arg t(int i) { return Arg::ref(Arg::Kind::Tensor, i); }

/// relu(x @ w + b * alpha) summed over dim 1, with alpha a lifted scalar.
ir::Graph mlp() {
  ir::Graph g;
  g.inputs = {meta({4, 3}), meta({3, 5}), meta({5})};
  g.scalars = {{ir::dtype::Double, ir::ScalarForm::Scalar}};
  g.nodes.push_back(node("aten::mm", {0, 1}, {t(0), t(1)}, {meta({4, 5})}));
  ir::Node add = node("aten::add.Tensor", {3, 2}, {t(0), t(1), Arg::ref(Arg::Kind::Scalar, 0)},
                      {meta({4, 5})});
  add.scalars = {0};
  g.nodes.push_back(add);
  g.nodes.push_back(node("aten::relu", {4}, {t(0)}, {meta({4, 5})}));
  g.nodes.push_back(node("aten::sum.dim_IntList", {5},
                         {t(0), Arg::ref(Arg::Kind::List, 1), Arg::integer(1), Arg::boolean(false),
                          Arg::none()},
                         {meta({4})}));
  g.outputs = {6, 5};
  return g;
}

/// Plan::build's plan, or null with its failure in \p error.
std::unique_ptr<server::Plan> build(ir::Graph g, std::string &error) {
  auto plan = server::Plan::build(std::move(g));
  if (!plan) {
    error = message(plan.takeError());
    return nullptr;
  }
  return std::move(*plan);
}

std::string refusal(ir::Graph g) {
  std::string error;
  auto plan = build(std::move(g), error);
  return plan ? "" : error;
}
} // namespace

TEST(Plan, RunsAHandBuiltGraphLikeDirectAtenCalls) {
  std::string error;
  auto plan = build(mlp(), error);
  ASSERT_TRUE(plan) << error;
  at::Tensor x = at::randn({4, 3}), w = at::randn({3, 5}), b = at::randn({5});
  std::vector<server::Entry> in = {{x, nullptr}, {w, nullptr}, {b, nullptr}};
  ir::ScalarValue alpha;
  alpha.d = 0.5;
  std::vector<server::Entry> out;
  auto err = plan->run(in, {alpha}, {at::Device(at::kCPU), at::globalContext().defaultGenerator(at::kCPU)}, out);
  ASSERT_FALSE(err) << err->message;
  at::Tensor relu = at::relu(at::add(at::mm(x, w), b, 0.5));
  EXPECT_TRUE(at::allclose(out[1].tensor, relu));
  EXPECT_TRUE(at::allclose(out[0].tensor, relu.sum(1)));
}

TEST(Plan, AFailingNodePoisonsWhatDependsOnIt) {
  ir::Graph g;
  g.inputs = {meta({4, 3}), meta({2}, ir::dtype::Long)};
  g.nodes.push_back(node("aten::index_select", {0, 1}, {t(0), Arg::integer(0), t(1)}, {meta({2, 3})}));
  g.nodes.push_back(node("aten::neg", {2}, {t(0)}, {meta({2, 3})}));
  g.nodes.push_back(node("aten::neg", {0}, {t(0)}, {meta({4, 3})}));
  g.nodes[0].loc = g.addLocation("train.py:9");
  g.outputs = {3, 4};
  std::string error;
  auto plan = build(g, error);
  ASSERT_TRUE(plan) << error;
  std::vector<server::Entry> in = {{at::randn({4, 3}), nullptr},
                                   {at::tensor({0, 9}, at::kLong), nullptr}};
  std::vector<server::Entry> out;
  auto err = plan->run(in, {}, {at::Device(at::kCPU), at::globalContext().defaultGenerator(at::kCPU)}, out);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->op, "aten::index_select");
  EXPECT_EQ(err->location, "train.py:9");
  EXPECT_EQ(out[0].error, err);
  EXPECT_FALSE(out[1].error);
  EXPECT_TRUE(out[1].tensor.defined());
}

TEST(Plan, VerifierRejectsEachMalformedCase) {
  auto with = [](auto edit) {
    ir::Graph g = mlp();
    edit(g);
    return refusal(g);
  };
  EXPECT_EQ(refusal(mlp()), "");
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[2].op = ir::Symbol::get("aten::no_such_op"); })
                .find("unknown op"),
            std::string::npos);
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[2].op = ir::Symbol::get("mylib::relu"); })
                .find("only aten ops"),
            std::string::npos);
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[2].op = ir::Symbol::get("aten::relu_"); })
                .find("mutates"),
            std::string::npos);
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[2].args.push_back(Arg::integer(1)); })
                .find("too many arguments"),
            std::string::npos);
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[0].args.pop_back(); }).find("too few"),
            std::string::npos);
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[3].args[3] = Arg::integer(2); }).find("expects bool"),
            std::string::npos);
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[1].args[2] = t(0); }).find("expects Scalar"),
            std::string::npos);
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[2].outputs.push_back(meta({1})); }).find("outputs"),
            std::string::npos);
  EXPECT_NE(with([](ir::Graph &g) { g.nodes[2].operands = {9}; }).find("not defined"),
            std::string::npos);
}

TEST(Plan, DenylistedOpsAreRefused) {
  ir::Graph g;
  ir::Node n = node("aten::from_file",
                    {}, {Arg::ref(Arg::Kind::Str, 0), Arg::none(), Arg::integer(4), Arg::none(),
                         Arg::none(), Arg::none(), Arg::none()},
                    {meta({4})});
  n.strings = {"/etc/passwd"};
  g.nodes.push_back(n);
  g.outputs = {0};
  EXPECT_NE(refusal(g).find("aten::from_file"), std::string::npos) << refusal(g);
}

TEST(Compiler, APackageRunsOnlyWhereItsRangesAndTiesHold) {
  // relu(x[s0]), relu(m[s1]), exported with m one longer than x (s1 == s0 + 1).
  ir::Graph g;
  g.inputs = {meta({5}), meta({6})};
  g.nodes.push_back(node("aten::relu", {0}, {t(0)}, {meta({5})}));
  g.nodes.push_back(node("aten::relu", {1}, {t(0)}, {meta({6})}));
  g.outputs = {2, 3};
  auto sym = [](uint32_t k) { return ir::SymExpr{1, 0, {uint16_t(k)}}; };
  // Positions: x size 0, stride 1; m size 2, stride 3; the outputs' sizes 4 and 6.
  ir::Graph symbolic =
      ir::makeSymbolic(g, 2, {{0, sym(0)}, {2, sym(1)}, {4, sym(0)}, {6, sym(1)}});
  std::string error;
  std::shared_ptr<const server::Plan> plan = build(std::move(symbolic), error);
  ASSERT_TRUE(plan) << error;
  server::Specialization spec;
  spec.ranges = {{0, 2, 100}, {1, 0, -1}};
  spec.relations = {{1, 0, 1, 1}};
  server::CompiledGraph compiled(nullptr, spec, ir::canonicalBytes(plan->graph()), plan,
                                 at::kCPU);
  auto inputs = [](int64_t a, int64_t b) {
    return std::vector<server::Entry>{{at::zeros({a}), nullptr}, {at::zeros({b}), nullptr}};
  };
  EXPECT_TRUE(compiled.accepts(*plan, {}, {5, 6}, inputs(5, 6)));
  EXPECT_TRUE(compiled.accepts(*plan, {}, {40, 41}, inputs(40, 41)));
  EXPECT_FALSE(compiled.accepts(*plan, {}, {5, 7}, inputs(5, 7)));     // the tie
  EXPECT_FALSE(compiled.accepts(*plan, {}, {101, 102}, inputs(101, 102))); // the range
  EXPECT_FALSE(compiled.accepts(*plan, {}, {5}, inputs(5, 6)));        // a symbol short
  std::vector<server::Entry> strided = {{at::zeros({10}).slice(0, 0, 10, 2), nullptr},
                                        {at::zeros({6}), nullptr}};
  EXPECT_FALSE(compiled.accepts(*plan, {}, {5, 6}, strided)); // not the layout it was built for
}

TEST(Compiler, APackageRunsOnlyForTheGraphItRecordsAndInputsOfItsMetas) {
  // A package is found by its graph's digest; what it runs for is the graph it records.
  auto relu = [](int64_t n) {
    ir::Graph g;
    g.inputs = {meta({n})};
    g.nodes.push_back(node("aten::relu", {0}, {t(0)}, {meta({n})}));
    g.outputs = {1};
    return g;
  };
  std::string error;
  std::shared_ptr<const server::Plan> plan = build(relu(64), error);
  ASSERT_TRUE(plan) << error;
  server::CompiledGraph compiled(nullptr, {}, ir::canonicalBytes(plan->graph()), plan, at::kCPU);
  EXPECT_TRUE(compiled.compiledFrom(plan));
  std::shared_ptr<const server::Plan> again = build(relu(64), error);
  EXPECT_TRUE(compiled.compiledFrom(again)); // the same graph, planned again
  std::shared_ptr<const server::Plan> smaller = build(relu(8), error);
  EXPECT_FALSE(compiled.compiledFrom(smaller));
  EXPECT_TRUE(compiled.compiledFrom(plan));
  // Inputs of other metas, or on another device, never reach the package (its loader is
  // never called here): the package has no checks of its own.
  std::vector<server::Entry> outputs;
  for (at::Tensor wrong : {at::zeros({8}), at::zeros({64}, at::kDouble),
                           at::zeros({128}).slice(0, 0, 128, 2), at::zeros({64}, at::kMeta)}) {
    try {
      compiled.run(*plan, {{wrong, nullptr}}, {}, outputs);
      ADD_FAILURE() << "ran on " << wrong.sizes() << " " << wrong.strides();
    } catch (const std::runtime_error &e) {
      EXPECT_NE(std::string(e.what()).find("is not the compiled graph's f32[64]"),
                std::string::npos)
          << e.what();
    }
  }
}
