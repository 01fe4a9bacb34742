//===- server/Plan.h - A verified graph, ready to run on libtorch kernels ---===//
//
// A Plan is built once per graph hash: every node's operator handle is resolved, its schema
// checked against the node's arguments, constant arguments are turned into IValues, and the last
// use of every intermediate is known so it is freed right after. Running a plan is then a loop
// of stack fills and boxed calls.
//
// Building a plan is where the server refuses what it will not run: any op the policy does not
// admit (Policy.h), any argument whose kind disagrees with the schema or whose value is out of
// range, and any strided view that would reach outside its base's storage.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "StandIns.h"

#include "rgpu/bridge/Bridge.h"
#include "rgpu/ir/Error.h"
#include "rgpu/ir/Graph.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/Generator.h>

#include <deque>
#include <llvm/ADT/STLFunctionalExtras.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace rgpu::server {

/// Why a value could not be computed: the failing aten op, its message and the user's line.
struct RemoteError {
  std::string op, message, location;
  ir::Hash256 graph;
  uint32_t node = 0;
  std::string pythonType; ///< wire::Error.pythonType: pythonTypeOf() the exception
  /// The pythonType of a value whose run a Cancel stopped (rgpu.Cancelled).
  static constexpr const char *kCancelled = "Cancelled";
  bool cancelled() const { return pythonType == kCancelled; }
};

/// The Python exception class torch raises for \p e ("IndexError" for a c10::IndexError, ...),
/// or empty for a RuntimeError.
std::string pythonTypeOf(const std::exception &e);
using ErrorPtr = std::shared_ptr<const RemoteError>;

/// A tensor held by a session, or the error that prevented computing it.
struct Entry {
  at::Tensor tensor;
  ErrorPtr error;
};

/// What a run needs besides the plan: the server's devices (rgpu:i runs on devices[i]) and
/// the session's generator for each of them (devices that are the same device share one).
struct RunContext {
  llvm::ArrayRef<at::Device> devices;
  llvm::ArrayRef<at::Generator> generators;
  /// The session's torch.Generator(device="rgpu") objects, by id, for explicit generator=
  /// arguments (a scalar slot of form Generator holds the id); null: none.
  const std::unordered_map<uint64_t, at::Generator> *explicitGenerators = nullptr;
  /// Asked before each kernel: true stops the run there (a Cancel arrived), and run() answers
  /// a Cancelled error (RemoteError::kCancelled) naming the op it did not run, with no outputs.
  llvm::function_ref<bool()> cancelled;
};

/// The sizes of one run of a symbolic plan (Plan::resolve): every value's layout, and the
/// constants of the steps whose integer arguments follow the symbols.
struct Shapes {
  std::vector<const ir::TensorMeta *> metas; ///< Per value.
  std::deque<ir::TensorMeta> owned;          ///< The layouts that differ from the plan's.
  std::vector<std::vector<c10::IValue>> consts; ///< Per step; empty: the step's own.
};

class Plan {
public:
  /// Verifies \p graph against the op schemas and builds its plan; a failure names the node
  /// and op. No value may span more than \p maxValueBytes.
  static llvm::Expected<std::unique_ptr<Plan>> build(ir::Graph graph,
                                                     uint64_t maxValueBytes = uint64_t(1) << 62);

  /// Runs the plan. \p inputs follow the graph's input order; on return \p outputs holds one
  /// entry per graph output. A node that throws poisons its outputs and everything downstream;
  /// the first such error is returned (null if the run succeeded).
  /// Outputs get exactly the layout the graph records unless \p exactLayout is false (the
  /// data-dependent path, where the graph cannot know it).
  /// A symbolic plan (of a graph over size symbols) runs with the sizes that \p shapes holds.
  ErrorPtr run(const std::vector<Entry> &inputs, llvm::ArrayRef<ir::ScalarValue> scalars,
               const RunContext &ctx, std::vector<Entry> &outputs, bool exactLayout = true,
               const Shapes *shapes = nullptr) const;

  bool symbolic() const { return graph_.symbolCount > 0; }
  /// The inputs whose layout holds a symbol.
  llvm::ArrayRef<uint32_t> symbolicInputs() const { return symbolicInputs_; }
  /// The sizes of a run of this symbolic plan with size symbols \p symbols, checked as a static
  /// graph's are at build (value sizes, argument values, views inside their bases). The error,
  /// naming the node's op and line where there is one, if they are not acceptable.
  ErrorPtr resolve(llvm::ArrayRef<int64_t> symbols, Shapes &out) const;

  const ir::Graph &graph() const { return graph_; }
  /// The op node \p n runs ("aten::transpose.int" for a functionalized `transpose_copy.int`).
  std::string runOp(uint32_t n) const;
  /// True if node \p n is of the `empty` family, whose outputs are zero-filled.
  bool zeroFills(uint32_t n) const { return steps_[n].zeroFill; }
  /// True if some node draws random numbers (from the session's generator).
  bool drawsRandom() const { return random_; }
  /// False if some node's op must not be compiled (policy::compilable).
  bool compilable() const { return compilable_; }
  /// True if some node runs a stand-in on a CPU device, which compiled code would not call.
  bool hasCpuStandIns() const { return cpuStandIns_; }
  ir::Hash256 hash;
  uint64_t buildNs = 0; ///< Time spent verifying the graph and building this plan.
  uint64_t bytes = 0;   ///< ir::graphBytes of its graph: what holding it costs a session.
  /// False for the plan of a graph whose hash another graph already held: it belongs to the
  /// session that defined it and is never compiled.
  bool shared = true;
  /// The highest rgpu device index a Device argument of the graph names (0 without one).
  uint32_t maxDevice = 0;

private:
  /// How to produce one stack slot.
  struct Slot {
    enum Kind : uint8_t {
      Const, Tensor, TensorList, OptTensorList, Scalar, ScalarList,
      Generator,         ///< The session's generator of the step's device.
      ExplicitGenerator, ///< The session's explicit generator whose id scalar slot a holds.
      Device
    };
    Kind kind;
    uint32_t a = 0, b = 0; // Const: index; Tensor: value id; lists: [a, a+b) in listItems_;
                           // Device: the rgpu device index
  };
  struct Step {
    std::optional<c10::OperatorHandle> op;
    std::optional<c10::OperatorHandle> schema; ///< The node's own op, whose schema it matches.
    /// Per const: the node argument it comes from (a list's is the List arg) and the schema
    /// argument it is.
    std::vector<std::pair<uint32_t, uint32_t>> constSources;
    /// A strided view's size, stride and storage_offset consts; -1 if absent.
    int32_t viewSize = -1, viewStride = -1, viewOffset = -1;
    uint32_t node;
    std::vector<Slot> slots;
    std::vector<c10::IValue> consts;
    uint32_t firstOutput, numOutputs;
    bool restrideOperands = false;
    /// A random op with no generator argument: it draws from the process default generator,
    /// which is swapped for the session's around it.
    bool seeded = false;
    /// The rgpu device its Device argument names, or -1 without one.
    int32_t device = -1;
    /// An op of the `empty` family: its outputs are zero-filled, so no session ever reads
    /// bytes that it did not write (memory is reused across sessions).
    bool zeroFill = false;
    bool zeroGrown = false; ///< policy::growsStorage: see callZeroingGrowth.
    /// Norm backward ops whose CPU kernels take their saved statistics in the input's dtype:
    /// the slots of those statistics, and of the input whose dtype they get (see Plan.cpp).
    std::vector<uint32_t> statSlots;
    uint32_t statDtypeSlot = 0;
    /// The norm's parameters and running statistics: float32 ones keep them float32.
    std::vector<uint32_t> paramSlots;
    /// Runs in place of the op on a CPU device, where CUDA has a kernel CPU lacks
    /// (StandIns.h); null for most ops.
    StandIn cpuStandIn = nullptr;
    std::vector<uint32_t> release; // values whose last use is this step
  };

  Plan() = default;
  llvm::Error addStep(uint32_t nodeIndex, uint32_t firstOutput);
  /// Refuses a strided view whose constants \p consts reach outside its base \p base.
  llvm::Error checkView(const Step &step, const std::vector<c10::IValue> &consts,
                        const ir::TensorMeta &base) const;
  /// Where a symbolic graph's integers are: in a value's layout (index into sizes then strides)
  /// or a node's arguments; k indexes graph().symbolic.
  struct MetaPatch {
    uint32_t value;
    std::vector<std::pair<uint32_t, uint32_t>> at; // (index, k)
  };
  struct ArgPatch {
    uint32_t step;
    std::vector<std::pair<uint32_t, uint32_t>> at; // (argument index, k)
  };
  void locateSymbolic();
  std::vector<MetaPatch> metaPatches_;
  std::vector<ArgPatch> argPatches_;
  std::vector<uint32_t> symbolicInputs_;
  uint64_t maxValueBytes_ = 0;
  c10::IValue scalarValue(uint32_t slot, llvm::ArrayRef<ir::ScalarValue> scalars) const;

  ir::Graph graph_;
  std::vector<const ir::TensorMeta *> metas_;
  std::vector<uint32_t> producer_; ///< The node producing each value (0 for inputs).
  std::vector<Step> steps_;
  std::vector<uint32_t> listItems_; // value ids or scalar slots; ~0u is None
  bool random_ = false;
  bool compilable_ = true;
  bool cpuStandIns_ = false;
};

/// Makes \p t have exactly the layout \p meta describes, copying only if it does not already.
at::Tensor restride(const at::Tensor &t, const ir::TensorMeta &meta);

/// The value of a lifted scalar.
c10::Scalar toScalar(const ir::ScalarValue &v);

} // namespace rgpu::server
