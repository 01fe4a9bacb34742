//===- rgpu/client/LazyTensor.h - Tensors that live on the server ----------===//
//
// An rgpu tensor seen by the user is a FunctionalTensorWrapper (ATen's functionalization) around
// a LazyTensorImpl. The LazyTensorImpl owns no storage: its Value is either device data (a
// handle on the server, chosen by the client so no round trip is needed) or a pending output of
// a traced node. Functionalization guarantees that only functional ops ever reach the tracer, so
// a traced graph never mutates anything and can be cached and replayed by hash.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <llvm/ADT/IntrusiveRefCntPtr.h>

namespace rgpu::client {

/// A tensor on the server. Releasing the last reference queues a Release for its handle.
struct DeviceData : llvm::ThreadSafeRefCountedBase<DeviceData> {
  DeviceData(uint64_t h, ir::TensorMeta m) : handle(h), meta(std::move(m)) {}
  ~DeviceData();
  const uint64_t handle;
  const ir::TensorMeta meta; ///< The layout the server holds it in.
  /// Bit d: dimension d is declared dynamic (rgpu.mark_dynamic, torch.compile(dynamic=True)),
  /// so the first graph that reads this data already treats that size as a symbol. Guarded by
  /// the session lock.
  uint64_t dynamicDims = 0;
  /// Its bytes on this side, once a reply brought them: small outputs come back with the reply
  /// to their run, rgpu.on_ready asks for others, and a read of at most 256 bytes keeps what it
  /// read. Guarded by the session lock.
  at::Tensor value;
  /// The frame whose reply brings `value`; kValueQueued while its Download waits in the queue,
  /// 0 if none will.
  uint64_t valueSeq = 0;
  static constexpr uint64_t kValueQueued = ~uint64_t(0);
};

struct TraceNode;

/// What a lazy tensor holds: a pending node output or device data, never both.
struct Value {
  llvm::IntrusiveRefCntPtr<TraceNode> node;
  uint32_t index = 0;
  llvm::IntrusiveRefCntPtr<DeviceData> data;

  bool pending() const { return node != nullptr; }
};

/// One traced op. Its ir::Node carries op, args and output metas; operand and scalar ids are
/// filled in only when a cut numbers the graph.
struct TraceNode : llvm::ThreadSafeRefCountedBase<TraceNode> {
  ir::Node node;
  llvm::SmallVector<Value, 4> inputs; ///< Tensor operands, in Arg::Tensor order.
  llvm::SmallVector<ir::ScalarSlot, 2> scalarSlots;
  llvm::SmallVector<ir::ScalarValue, 2> scalarValues;
  uint32_t location = 0; ///< Id in the client's location table.
  uint64_t seq = 0;      ///< Trace order; makes the output order of a cut deterministic.
  /// Its outputs' values, where the client computed them as it traced (KnownValues.h); empty
  /// or undefined where not.
  llvm::SmallVector<at::Tensor, 1> known;
};

class LazyTensorImpl final : public c10::TensorImpl {
public:
  /// A tensor on rgpu:\p device.
  LazyTensorImpl(Value value, const ir::TensorMeta &meta, c10::DeviceIndex device);
  ~LazyTensorImpl() override;

  ir::TensorMeta meta() const;
  /// Makes this an inference tensor (no autograd keys, no version counter) or a normal one, as
  /// a view is when its input is, whether or not torch.inference_mode is on.
  void setInference(bool inference);
  /// The layout a download of this tensor arrives in: its own if it is dense, else contiguous.
  ir::TensorMeta downloadLayout() const;

  Value value;
  /// rgpu.on_ready waits for this pending tensor: the cut that computes it asks for its bytes.
  bool wantValue = false;
  /// The handle of the device data this tensor is a new version of, made by ops that wrote a
  /// tensor holding it (Versions.h); 0 if none. Cleared when a cut computes it.
  uint64_t versionOf = 0;
  /// Made by a view op after functionalization (inside a composite kernel): a copy, which a
  /// write must not take for an alias.
  bool rawView = false;
  /// Intrusive list of live impls, walked at every cut (guarded by the session lock).
  LazyTensorImpl *prev = nullptr, *next = nullptr;

  c10::intrusive_ptr<c10::TensorImpl>
  shallow_copy_and_detach(const c10::VariableVersion &version_counter,
                          bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl>
  shallow_copy_and_detach(c10::VariableVersion &&version_counter,
                          bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl> &impl) override;

private:
  const char *tensorimpl_type_name() const override { return "rgpu::LazyTensorImpl"; }
};

/// Registers the tracing kernel for the ops that must reach rgpu whole (see Tracer.cpp). Called
/// once, after every aten op is registered.
void registerWholeOps();

/// The LazyTensorImpl behind \p t (unwrapping functionalization), or null if \p t is not rgpu.
LazyTensorImpl *lazyImpl(const at::Tensor &t);

/// This thread's current rgpu device (torch.rgpu.set_device), where `device="rgpu"` goes.
c10::DeviceIndex currentDevice();
void setCurrentDevice(c10::DeviceIndex index);

} // namespace rgpu::client
