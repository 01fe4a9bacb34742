// Plan execution overhead per node on tiny tensors, against calling the same ATen ops directly.
// The graph is a chain of N cheap elementwise ops on a 4-element tensor, so kernel time is small
// and what remains is dispatch, stack building and value bookkeeping.
#include "Plan.h"

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

using namespace rgpu;

namespace {
constexpr int kNodes = 1000;

ir::TensorMeta vec4() { return ir::TensorMeta::contiguous(ir::dtype::Float, {4}); }

/// x -> relu(x) -> neg -> add(x) -> ... alternating, kNodes nodes.
ir::Graph chain() {
  ir::Graph g;
  g.inputs = {vec4()};
  for (uint32_t i = 0; i < kNodes; ++i) {
    ir::Node n;
    uint32_t prev = i; // value id of the previous node's output (or the input)
    if (i % 3 == 2) {
      n.op = ir::Symbol::get("aten::add.Tensor");
      n.operands = {prev, 0};
      n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0), ir::Arg::ref(ir::Arg::Kind::Tensor, 1),
                ir::Arg::ref(ir::Arg::Kind::Scalar, 0)};
      n.scalars = {uint32_t(g.scalars.size())};
      g.scalars.push_back({ir::dtype::Double, ir::ScalarForm::Scalar});
    } else {
      n.op = ir::Symbol::get(i % 3 == 0 ? "aten::relu" : "aten::neg");
      n.operands = {prev};
      n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0)};
    }
    n.outputs = {vec4()};
    g.nodes.push_back(n);
  }
  g.outputs = {kNodes};
  return g;
}

void BM_PlanExecution(benchmark::State &state) {
  std::string error;
  ir::Graph g = chain();
  std::vector<ir::ScalarValue> scalars(g.scalars.size());
  for (auto &s : scalars)
    s.d = 1.0;
  auto plan = server::Plan::build(std::move(g), error);
  std::vector<server::Entry> in = {{at::randn({4}), nullptr}}, out;
  server::RunContext ctx{at::kCPU, at::globalContext().defaultGenerator(at::kCPU)};
  for (auto _ : state)
    plan->run(in, scalars, ctx, out);
  state.counters["ns_per_node"] =
      benchmark::Counter(double(kNodes) * state.iterations(),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_DirectAten(benchmark::State &state) {
  c10::InferenceMode inference;
  at::Tensor x = at::randn({4});
  for (auto _ : state) {
    at::Tensor v = x;
    for (int i = 0; i < kNodes; ++i)
      v = i % 3 == 0 ? at::relu(v) : i % 3 == 1 ? at::neg(v) : at::add(v, x, 1.0);
    benchmark::DoNotOptimize(v);
  }
  state.counters["ns_per_node"] =
      benchmark::Counter(double(kNodes) * state.iterations(),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

BENCHMARK(BM_PlanExecution)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DirectAten)->Unit(benchmark::kMicrosecond);
} // namespace

BENCHMARK_MAIN();
