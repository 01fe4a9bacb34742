//===- rgpu/client/KnownValues.h - Small values the client can compute itself ----===//
//
// Code often asks about tensors it built itself: Hugging Face's generate checks the token ids
// it was given (`(eos < 0).any()`, `torch.isin(eos, pad).any()`, `(mask == 1).all()`) before
// it starts. Each such read would be a round trip. But the client holds the bytes of what it
// uploaded, and for small integer and boolean values it can compute what the server will,
// bit for bit: a node all of whose operands are known, of an op whose result is the same on
// any device, gets its outputs computed here, on the CPU, as it is traced. The node still
// runs on the server as ever (the graphs do not change); a read of a known output is answered
// from here once the cut that computes it is queued, without waiting.
//
// Known: the bytes of small uploads, and outputs of small nodes of such ops whose operands are
// known. Exact on any device: comparisons, logic, integer arithmetic and reductions, factories
// of integer values, and ops that only move bytes (views, copies, casts, concatenation).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/client/LazyTensor.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <llvm/ADT/StringRef.h>

namespace rgpu::client {

/// The most elements a known value has.
constexpr int64_t kKnownElements = 4096;

/// Whether computeKnown may compute an op of this name (aten::eq, ...).
bool knowable(llvm::StringRef name);

/// Computes \p node's outputs here when its op and operands allow (see above), into
/// TraceNode::known; \p args are the op's arguments as traced (rgpu tensors).
void computeKnown(const c10::OperatorHandle &op, c10::ArrayRef<c10::IValue> args,
                  TraceNode &node);

} // namespace rgpu::client
