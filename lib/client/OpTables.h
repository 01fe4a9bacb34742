//===- lib/client/OpTables.h - What the tracer knows about ops by name -----===//
//
// The op-name predicates the tracer reads (through OpInfo, once per operator), kept together
// in one place: they are facts about ops, not about tracing, and are meant to join the shared
// table of op facts in lib/bridge.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <llvm/ADT/StringRef.h>

namespace rgpu::client {

/// Ops whose output shapes depend on tensor data. They cannot be traced ahead: the graph is cut
/// and the op runs on the server at once, which answers with the output shapes.
bool isDataDependent(llvm::StringRef name);

/// Ops that produce layouts other than strided (sparse, mkldnn, quantized, nested). The server
/// holds strided tensors only, so they are refused at the call.
bool producesOtherLayouts(llvm::StringRef name);

/// Ops whose tensors may be on different rgpu devices: copies between them, which the server
/// runs (the result is on the destination's device).
bool crossesDevices(llvm::StringRef name);

/// Ops that accept CPU tensors with an rgpu self, as they do with CUDA: the CPU tensors are
/// uploaded (copy's source, the index tensors of indexing).
bool acceptsCpuTensors(llvm::StringRef name);

/// Ops whose output shape follows the values of their Scalar arguments.
bool shapeFollowsScalars(llvm::StringRef name);

} // namespace rgpu::client
