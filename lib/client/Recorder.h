//===- lib/client/Recorder.h - One op, recorded as a trace node ------------===//
//
// The recorder turns an op's boxed arguments into a TraceNode (tensors become operands, Python
// numbers and CPU scalars become scalar slots, so that their values are not hashed) and learns
// its outputs' sizes, strides and dtype by running the op on meta twins of its operands. Many
// meta kernels are Python functions (~100 us a call), and a training loop repeats the same
// calls every step: the results are cached by everything they depend on.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Tracing.h"

#include "rgpu/bridge/Bridge.h"

#include <memory>

namespace rgpu::client {

/// What a meta call tells: output metas, flattened, and for each return of the op the length of
/// its list (-1 for a single tensor).
struct OpMetas {
  std::vector<ir::TensorMeta> outputs;
  std::vector<uint8_t> bits; ///< Each output's mathBits.
  std::vector<int32_t> listSizes;
};

/// What the tracer asks of an operator, worked out once per operator: its interned name, the
/// tables above, and how to read each argument (its schema type, without casting types per op).
struct OpInfo {
  struct ArgInfo {
    bridge::ArgType type;
    bool optional;
    bridge::ArgType elem; ///< A list's element type.
    bool elemOptional;
  };
  c10::OperatorName name; ///< An operator registered after another was removed may reuse its
                          ///< schema's address: the name is compared too.
  ir::Symbol symbol;
  /// What the op-facts table (rgpu/ir/OpFacts.h) says of it, read once per operator.
  bool mutableSchema, otherLayouts, dataDependent, maskAssignment, followsScalars, acceptsCpu,
      crossesDevices, viewOp;
  /// A view op, or the *_copy op functionalization runs for one.
  bool anyView;
  /// Draws random numbers (see ir::Node::random).
  bool random;
  /// The tracer's own handling of it, if any.
  ir::SpecialOp special;
  /// Its results may be computed here (KnownValues.h).
  bool knowable;
  std::vector<ArgInfo> args;

  explicit OpInfo(const c10::OperatorHandle &op);
  static const OpInfo &of(const c10::OperatorHandle &op);
};

/// What recording an op gives the tracing kernel.
struct Recording {
  llvm::IntrusiveRefCntPtr<TraceNode> node;
  /// Its outputs' metas (valid until the next op is recorded), or null if they depend on data
  /// (or the op has no meta kernel): the op then runs on the server at once.
  const OpMetas *metas = nullptr;
  /// The rgpu device of its outputs: the one its device argument names, else its first rgpu
  /// operand's, else the current device.
  c10::DeviceIndex device = 0;
};

/// Records \p op (described by \p info) called with \p args. Shape errors raise here, with
/// PyTorch's own message.
Recording record(const c10::OperatorHandle &op, const OpInfo &info,
                 c10::ArrayRef<c10::IValue> args);

} // namespace rgpu::client
