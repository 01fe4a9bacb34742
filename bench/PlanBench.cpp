// Plan execution overhead per node on tiny tensors, against calling the same ATen ops directly.
// The graph is a chain of N cheap elementwise ops on a 4-element tensor, so kernel time is small
// and what remains is dispatch, stack building and value bookkeeping.
#include "Memory.h"
#include "Plan.h"

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <c10/util/Flags.h>

C10_DECLARE_bool(caffe2_cpu_allocator_do_zero_fill);

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
  ir::Graph g = chain();
  std::vector<ir::ScalarValue> scalars(g.scalars.size());
  for (auto &s : scalars)
    s.d = 1.0;
  auto plan = llvm::cantFail(server::Plan::build(std::move(g)));
  std::vector<server::Entry> in = {{at::randn({4}), nullptr}}, out;
  const at::Device cpu(at::kCPU);
  const at::Generator generator = at::globalContext().defaultGenerator(at::kCPU);
  server::RunContext ctx{cpu, generator};
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

/// What zeroing every CPU allocation costs (rgpu-opserver does it so that no session reads bytes
/// another left behind): a chain of 30 elementwise ops on 1M floats, the worst case (memory
/// bound, every op allocates 4 MiB), and a 512x512 matmul chain, the common case. Arg 0 is the
/// allocator as torch ships it, 1 with zeroing.
void BM_AllocatorZeroing(benchmark::State &state) {
  bool elementwise = state.range(0) == 0;
  FLAGS_caffe2_cpu_allocator_do_zero_fill = state.range(1) != 0;
  c10::InferenceMode inference;
  at::Tensor x = elementwise ? at::randn({1 << 20}) : at::randn({512, 512}) / 32;
  for (auto _ : state) {
    at::Tensor v = x;
    for (int i = 0; i < 30; ++i)
      v = elementwise ? at::add(at::relu(v), x) : at::mm(v, x);
    benchmark::DoNotOptimize(v);
  }
  FLAGS_caffe2_cpu_allocator_do_zero_fill = false;
  state.SetLabel(std::string(elementwise ? "elementwise" : "matmul") +
                 (state.range(1) ? ", zeroed" : ", as shipped"));
}

/// What the accounting allocator (server/Memory.h) costs where allocations dominate: a chain of
/// 1000 additions on 4-element tensors, each allocating its output, charged to a session. Arg 1
/// installs it, for the rest of the process: it is registered last.
void BM_AccountedAllocations(benchmark::State &state) {
  if (state.range(0))
    server::memory::install(0);
  auto account = std::make_shared<server::memory::Account>();
  server::memory::Charge charge(account);
  c10::InferenceMode inference;
  at::Tensor x = at::ones({4});
  for (auto _ : state) {
    at::Tensor v = x;
    for (int i = 0; i < 1000; ++i)
      v = at::add(v, x);
    benchmark::DoNotOptimize(v);
  }
  state.SetLabel(state.range(0) ? "accounted" : "as shipped");
}

BENCHMARK(BM_PlanExecution)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AllocatorZeroing)->Args({0, 0})->Args({0, 1})->Args({1, 0})->Args({1, 1})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DirectAten)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AccountedAllocations)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
} // namespace

BENCHMARK_MAIN();
