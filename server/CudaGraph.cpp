#include "CudaGraph.h"

#include <ATen/ATen.h>

#include <stdexcept>

#ifdef RGPU_CUDA_GRAPHS // c10's CUDA headers and the runtime's, not ATen's CUDA context (cuBLAS...)
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace rgpu::server {

#ifdef RGPU_CUDA_GRAPHS

namespace {
/// A CUDA event without timing, created at its first record.
class Event {
public:
  Event() = default;
  Event(const Event &) = delete;
  Event &operator=(const Event &) = delete;
  ~Event() {
    if (event_)
      cudaEventDestroy(event_);
  }
  void record(const c10::cuda::CUDAStream &stream) {
    if (!event_)
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream()));
  }
  /// Work queued on \p stream after this waits for the last record (none: no wait).
  void block(const c10::cuda::CUDAStream &stream) const {
    if (event_)
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), event_, 0));
  }

private:
  cudaEvent_t event_ = nullptr;
};
} // namespace

struct CudaGraph::Impl {
  explicit Impl(const at::Device &device) : device(device) {}
  at::Device device;
  at::cuda::CUDAGraph graph;
  std::vector<at::Tensor> inputs;  ///< Static copies of the device tensors; the rest as given.
  std::vector<bool> copied;        ///< Which inputs are static copies.
  std::vector<at::Tensor> outputs; ///< In the graph's memory pool.
  /// Recorded after each replay's last use of the static buffers: a replay from another stream
  /// waits for it before it overwrites them.
  Event done;
};

std::string CudaGraph::unavailable(const at::Device &device) {
  return device.is_cuda() ? "" : "CUDA graphs need a CUDA device";
}

CudaGraph::CudaGraph(const at::Device &device, const std::vector<at::Tensor> &args,
                     const Run &run)
    : impl_(std::make_unique<Impl>(device)) {
  Impl &g = *impl_;
  c10::cuda::CUDAGuard deviceGuard(device);
  c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  for (const at::Tensor &a : args) {
    const bool onDevice = a.defined() && a.device() == device;
    g.copied.push_back(onDevice);
    g.inputs.push_back(onDevice ? at::empty_strided(a.sizes(), a.strides(), a.options()).copy_(a)
                                : a);
  }
  // CUDA captures nothing on the default stream: the capture gets a stream of its own, which
  // first waits for what the current one has queued (the copies above). Thread-local mode: the
  // other sessions' threads may allocate and synchronize while this one captures.
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
  Event queued;
  queued.record(current);
  queued.block(side);
  {
    c10::cuda::CUDAStreamGuard streamGuard(side);
    g.graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      g.outputs = run(g.inputs);
    } catch (...) {
      try {
        g.graph.capture_end(); // releases the stream and the allocator's capture state
      } catch (...) {
      }
      throw;
    }
    g.graph.capture_end();
  }
  Event captured;
  captured.record(side);
  captured.block(current);
}

std::vector<at::Tensor> CudaGraph::replay(std::vector<at::Tensor> &args,
                                          llvm::ArrayRef<uint32_t> written) {
  Impl &g = *impl_;
  if (args.size() != g.inputs.size())
    throw std::runtime_error("the CUDA graph takes " + std::to_string(g.inputs.size()) +
                             " inputs, the run gives " + std::to_string(args.size()));
  c10::cuda::CUDAGuard deviceGuard(g.device);
  c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(g.device.index());
  g.done.block(current); // nothing before the first replay
  for (size_t k = 0; k < args.size(); ++k)
    if (g.copied[k])
      g.inputs[k].copy_(args[k], /*non_blocking=*/true);
  g.graph.replay();
  for (uint32_t k : written)
    args[k].copy_(g.inputs[k], /*non_blocking=*/true);
  std::vector<at::Tensor> out;
  out.reserve(g.outputs.size());
  for (const at::Tensor &t : g.outputs)
    out.push_back(t.defined() ? t.clone(at::MemoryFormat::Preserve) : t);
  g.done.record(current);
  return out;
}

#else // built without CUDA's runtime headers

struct CudaGraph::Impl {};

std::string CudaGraph::unavailable(const at::Device &device) {
  return device.is_cuda() ? "this rgpu-opserver was built without CUDA's runtime headers"
                          : "CUDA graphs need a CUDA device";
}

CudaGraph::CudaGraph(const at::Device &device, const std::vector<at::Tensor> &,
                     const Run &) {
  throw std::runtime_error(unavailable(device));
}

std::vector<at::Tensor> CudaGraph::replay(std::vector<at::Tensor> &, llvm::ArrayRef<uint32_t>) {
  throw std::runtime_error("no CUDA graph was captured");
}

#endif

CudaGraph::~CudaGraph() = default;

} // namespace rgpu::server
