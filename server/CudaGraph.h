//===- server/CudaGraph.h - compiled runs replayed as CUDA graphs -------------===//
//
// With --compile-mode reduce-overhead (or a graph defined with that mode), a compiled graph's
// run on a CUDA device is captured once as a CUDA graph and then replayed: one launch instead
// of one per kernel. The capture runs the package on static copies of the run's device inputs;
// a replay copies the run's inputs into them, replays, and hands out copies of the static
// outputs, so what a run returns never changes under the next replay.
//
// This file names no CUDA type: CudaGraph.cpp is compiled with CUDA's runtime headers where the
// build found them next to a CUDA torch, and otherwise every capture fails with the reason.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <ATen/core/Tensor.h>
#include <llvm/ADT/ArrayRef.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace rgpu::server {

class CudaGraph {
public:
  /// Runs a compiled graph on \p args (on the current stream), returning its outputs.
  using Run = std::function<std::vector<at::Tensor>(std::vector<at::Tensor> &args)>;

  /// Why runs on \p device cannot be captured by this server; empty if they can.
  static std::string unavailable(const at::Device &device);

  /// Captures \p run on static copies of \p args' tensors on \p device (tensors elsewhere, the
  /// CPU scalars, are passed as they are and so are read at capture: the caller replays only
  /// for the same values). Capturing runs nothing. Throws, with the capture ended, on failure.
  CudaGraph(const at::Device &device, const std::vector<at::Tensor> &args, const Run &run);
  ~CudaGraph();
  CudaGraph(const CudaGraph &) = delete;
  CudaGraph &operator=(const CudaGraph &) = delete;

  /// Runs the graph for \p args: copies them into the static inputs, replays, copies the
  /// static inputs at \p written (the ones the graph writes) back into \p args, and returns
  /// copies of the outputs. Not for two threads at once.
  std::vector<at::Tensor> replay(std::vector<at::Tensor> &args, llvm::ArrayRef<uint32_t> written);

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace rgpu::server
