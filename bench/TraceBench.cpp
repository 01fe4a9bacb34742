// Tracing cost per op in C++, without Python: an elementwise chain on rgpu tensors, recorded
// into the lazy graph (dispatch, functionalization, meta inference, node creation). The ops
// have C++ meta kernels (relu, say, has only a Python one, which needs the Python runtime). Each
// iteration drops its tensors, so the trace never grows and no server is needed.
#include "rgpu/client/LazyTensor.h"

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

namespace {
constexpr int kOps = 300;

void BM_TraceElementwiseOp(benchmark::State &state) {
  static bool installed = (rgpu::client::registerWholeOps(), true);
  (void)installed;
  at::Tensor x = at::empty({64, 64}, at::TensorOptions().device(c10::DeviceType::PrivateUse1));
  for (auto _ : state) {
    at::Tensor y = x;
    for (int i = 0; i < kOps / 3; ++i) {
      y = y.mul(1.0001);
      y = y.add(0.5);
      y = y.tanh();
    }
    benchmark::DoNotOptimize(y.unsafeGetTensorImpl());
  }
  state.SetItemsProcessed(state.iterations() * kOps);
}
} // namespace

BENCHMARK(BM_TraceElementwiseOp)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
