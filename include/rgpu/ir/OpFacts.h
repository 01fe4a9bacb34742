//===- rgpu/ir/OpFacts.h - Everything rgpu knows about an op, in one table ---===//
//
// rgpu records every aten op with one generic path; what it must know about particular ops is
// listed here and nowhere else: which ops the tracer cannot trace ahead, which the server
// refuses and why, which string arguments may take which values, which compiled code may not
// run, and how graphs number dtypes, layouts and memory formats. The tracer, the server's
// policy and plan, and the compile worker (through rgpu_compile_job) all read this table, so
// "what does rgpu know about op X" is one grep of lib/ir/OpFacts.cpp.
//
// The table is torch-free: facts are keyed by op name ("aten::copy", or "aten::slice_copy.Tensor"
// for one overload) or by a family of names (a prefix of the name after "aten::"). What a
// schema says (mutability, argument types, tags) is read from the schema, not listed here.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <llvm/ADT/ArrayRef.h>
#include <llvm/ADT/StringRef.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace rgpu::ir {

/// c10::ScalarType numbers for the dtypes rgpu names; any valid ScalarType may appear.
namespace dtype {
constexpr int8_t Byte = 0, Char = 1, Short = 2, Int = 3, Long = 4, Half = 5, Float = 6,
                 Double = 7, ComplexHalf = 8, ComplexFloat = 9, ComplexDouble = 10, Bool = 11,
                 BFloat16 = 15, Float8_e5m2 = 23, Float8_e4m3fn = 24, Float8_e5m2fnuz = 25,
                 Float8_e4m3fnuz = 26, UInt16 = 27, UInt32 = 28, UInt64 = 29,
                 Float8_e8m0fnu = 44;
/// The dtype of a node output that is an undefined tensor (e.g. a gradient not asked for).
constexpr int8_t Undefined = -1;
/// Short name used in dumps: "f32", "i64", "bf16"; "dtype<N>" for the rest.
std::string name(int8_t dtype);
/// The name of the dtype in Python's torch module ("float32"); null for one a graph cannot
/// carry.
const char *torchName(int8_t dtype);
/// Bytes per element, or 0 if unknown.
unsigned itemSize(int8_t dtype);
/// True for dtypes a graph may carry (the numeric and bool ScalarTypes).
bool isValid(int8_t dtype);
} // namespace dtype

/// c10::Layout numbers: graphs carry torch.strided tensors only.
namespace layout {
constexpr int64_t Strided = 0;
/// The name of layout \p n in Python's torch module ("strided"); null for one rgpu does not carry.
const char *torchName(int64_t n);
} // namespace layout

/// c10::MemoryFormat numbers.
namespace memory_format {
/// How many memory formats torch has (numbers 0 to count - 1).
constexpr int64_t Count = 4;
/// The name of memory format \p n in Python's torch module ("channels_last"); null if none.
const char *torchName(int64_t n);
} // namespace memory_format

/// One fact about an op; an op has a set of them (OpFacts).
enum class OpFact : uint32_t {
  /// Output shapes depend on tensor data: the tracer cuts the graph and the op runs at once.
  DataDependent = 1u << 0,
  /// A boolean-mask assignment the tracer may trace when its value needs no count of the mask.
  MaskAssignment = 1u << 1,
  /// Output shape follows the values of the op's Scalar arguments.
  ShapeFollowsScalars = 1u << 2,
  /// Accepts CPU tensors beside an rgpu self, as with CUDA (they are uploaded).
  AcceptsCpuTensors = 1u << 3,
  /// Its tensors may be on different rgpu devices (the server copies between them).
  CrossesDevices = 1u << 4,
  /// Produces a layout other than strided (sparse, mkldnn, quantized, nested): refused at the
  /// call, because the server holds strided tensors only.
  OtherLayout = 1u << 5,
  /// Builds a tensor of its `size` argument, which must not be negative.
  Factory = 1u << 6,
  /// Returns uninitialized memory: the server zeroes it, so no session reads another's data.
  Uninitialized = 1u << 7,
  /// A view from explicit sizes, strides and offset: must stay inside its operand's storage.
  StridedView = 1u << 8,
  /// Grows its operand's storage: the plan zeroes the grown part, compiled code would not.
  GrowsStorage = 1u << 9,
  /// Safe on the plan, not once compiled: eager clamps or checks indices, Inductor does not.
  UncheckedOnceCompiled = 1u << 10,
  /// A torch.distributed functional collective: waits on the group's other servers.
  Collective = 1u << 11,
  /// Its result is its first argument with a region replaced by values that do not depend on
  /// what the region held (run again on its own result, it gives the same result).
  OverwritesFirst = 1u << 12,
  /// A view of the region such a write replaces, read by functionalization for its layout only.
  RegionView = 1u << 13,
  /// Its result is its input, same values and layout (detach, alias).
  Alias = 1u << 14,
  /// A functionalized view the plan runs as reshape (view fails on layouts reshape copies).
  RunsAsReshape = 1u << 15,
  /// Tagged nondeterministic_seeded but never draws (CPU's fused attention refuses dropout).
  NeverDraws = 1u << 16,
  /// A normalization backward reading saved statistics, which the plan keeps in fp32.
  NormBackward = 1u << 17,
  /// The result's bytes are its inputs' bytes, moved (known values stay known through it).
  ExactBytes = 1u << 18,
  /// Exact on integer inputs (known integer values stay known through it).
  ExactOnIntegers = 1u << 19,
  /// CPU eager writes through an expand()ed self; rgpu refuses it with its own message.
  WritesThroughOverlap = 1u << 20,
  /// Recorded as one node instead of its composite (its autograd formula is still torch's).
  RecordedWhole = 1u << 21,
  /// Its composite runs below functionalization, with autograd's formula above it.
  CompositeWithoutGrad = 1u << 22,
  /// Its result is its second argument's values in its first argument's layout (copy).
  CopiesIntoFirst = 1u << 23,
};

/// The set of facts rgpu knows about one op.
class OpFacts {
public:
  constexpr OpFacts() = default;
  constexpr explicit OpFacts(uint32_t bits) : bits_(bits) {}
  bool has(OpFact f) const { return bits_ & uint32_t(f); }
  bool empty() const { return bits_ == 0; }
  uint32_t bits() const { return bits_; }

private:
  uint32_t bits_ = 0;
};

/// What rgpu knows about \p name: a full name ("aten::slice_copy.Tensor") gets the facts of the
/// overload and of its base; a base name ("aten::copy") gets the base's. Thread-safe.
OpFacts opFacts(llvm::StringRef name);

/// Ops the tracer handles itself instead of recording them, by what it does with them.
enum class SpecialOp : uint8_t {
  None,
  ReadScalar,        ///< `_local_scalar_dense`: `.item()`, a sync
  Equal,             ///< `equal`: a Python bool, a sync
  ToCopy,            ///< `_to_copy`: may move between devices
  CopyFrom,          ///< `_copy_from`: the copy between devices
  CopyFromAndResize, ///< `_copy_from_and_resize`: the same, into a resized destination
  Copy,              ///< `copy`: may take a CPU source
};
/// The special handling of base name \p name, if any.
SpecialOp specialOp(llvm::StringRef name);

/// Ops of \p fact listed by name (full names: "aten::repeat_interleave.self_int"), for
/// registrations that walk them.
std::vector<std::string> opsWith(OpFact fact);

/// Why ops of \p name's family are refused for every peer ("reads a file on the server"), or
/// empty. \p name is a base name ("aten::from_file").
llvm::StringRef refusal(llvm::StringRef name);

/// The values string argument \p arg of op \p name (a base name) may take; null if the argument
/// is free-form, which makes its op refused (free-form strings never reach a kernel or a code
/// generator).
const std::vector<llvm::StringRef> *allowedStrings(llvm::StringRef name, llvm::StringRef arg);

/// Whether Scalar argument \p arg of \p name (a base name) must be compiled as a constant:
/// decompositions branch on it, or Inductor lowers it as a Python number.
bool compiledAsConstant(llvm::StringRef name, llvm::StringRef arg);

} // namespace rgpu::ir
