//===- server/StandIns.h - Kernels CUDA has and CPU lacks ------------------===//
//
// A client sees a device that is not CPU, so model code and torch's own composites take their
// GPU paths: transformers counts tokens per expert with `histc` of integers, and torch's LSTM
// and GRU run fused cells (`_thnn_fused_*`) on every device but CPU. CUDA has those kernels
// and CPU does not. And the meta kernels promise what CUDA's kernels return, which CPU's do
// not always (`_embedding_bag`'s auxiliary outputs). A CPU server runs these stand-ins in
// their place, computing what the CUDA kernels compute, with the outputs their meta kernels
// promise. A CUDA server runs the real kernels.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <llvm/ADT/StringRef.h>

namespace rgpu::server {

/// Runs in place of \p op's kernel on a CPU device: takes its arguments from the stack and
/// leaves its results there, as a boxed call does.
using StandIn = void (*)(const c10::OperatorHandle &op, torch::jit::Stack &stack);

/// The stand-in for the op \p fullName ("aten::histc"), or null if it needs none.
StandIn cpuStandIn(llvm::StringRef fullName);

} // namespace rgpu::server
