//===- rgpu/bridge/Bridge.h - Where rgpu's IR meets libtorch ----------------===//
//
// The conversions between ir:: types and ATen that the client, the server and the tools all
// need, written once: a tensor's meta, a dtype number's ScalarType, the kind of argument a
// schema type carries, the view a functionalized `*_copy` op stands for, and the torch version.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/jit_type.h>

#include <optional>
#include <string>

namespace rgpu::bridge {

/// The dtype, sizes and strides of \p t; an Undefined meta for an undefined tensor.
ir::TensorMeta metaOf(const at::Tensor &t);
ir::TensorMeta metaOf(const c10::TensorImpl &t);

/// ATen's ScalarType for a graph's dtype number: the numbers are ScalarType's.
inline at::ScalarType scalarType(int8_t dtype) { return static_cast<at::ScalarType>(dtype); }
static_assert(int(at::ScalarType::BFloat16) == ir::dtype::BFloat16 &&
              int(at::ScalarType::Float8_e5m2) == ir::dtype::Float8_e5m2 &&
              int(at::ScalarType::Float8_e4m3fnuz) == ir::dtype::Float8_e4m3fnuz &&
              int(at::ScalarType::UInt16) == ir::dtype::UInt16 &&
              int(at::ScalarType::UInt64) == ir::dtype::UInt64 &&
              int(at::ScalarType::Float8_e8m0fnu) == ir::dtype::Float8_e8m0fnu);

/// The libtorch version this process runs, "2.13.0".
std::string torchVersion();

/// What a schema argument type carries, with Optional peeled off.
enum class ArgType : uint8_t {
  Tensor,
  Number,       ///< a Scalar: lifted out of the graph as a scalar input
  Device,
  Generator,
  List,         ///< see the element type
  Int,
  ScalarType,   ///< an int holding a c10::ScalarType
  Layout,       ///< an int holding a c10::Layout
  MemoryFormat, ///< an int holding a c10::MemoryFormat
  Float,
  Bool,
  String,
  Unsupported,  ///< nothing rgpu can carry (Storage, Stream, Dimname, ...)
};
/// A schema's Argument::type() says `int` where its real_type() says ScalarType, Layout or
/// MemoryFormat: pass real_type() to tell those apart.
ArgType argType(const c10::TypePtr &type);
/// The ir::Arg kind a constant of \p t is encoded as (Int, Double, Bool or Str); None otherwise.
ir::Arg::Kind constantKind(ArgType t);

/// Ops that build a view from explicit sizes, strides and an offset: their result depends on
/// the operand's exact memory layout, and it must stay inside the operand's storage.
bool isStridedView(llvm::StringRef base);

/// Whether \p op draws from a random generator: torch tags such ops nondeterministic_seeded.
/// Ops the op-facts table lists as NeverDraws carry the tag and never draw.
bool drawsRandom(const c10::OperatorHandle &op);

/// The view op that a functionalized `*_copy` op (`transpose_copy.int`) stands for, when one
/// exists with the same arguments; the strided-view constructors never resolve. In a
/// functional graph nothing writes through the alias, so running the view is safe and saves a
/// copy; it also gives the result the strides CPU eager gives the view.
std::optional<c10::OperatorHandle> viewOf(const c10::OperatorName &copyOp);

} // namespace rgpu::bridge
