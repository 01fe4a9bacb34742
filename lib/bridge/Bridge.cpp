#include "rgpu/bridge/Bridge.h"

#include <torch/headeronly/version.h>

namespace rgpu::bridge {

ir::TensorMeta metaOf(const at::Tensor &t) {
  ir::TensorMeta m;
  if (!t.defined()) {
    m.dtype = ir::dtype::Undefined;
    return m;
  }
  return metaOf(*t.unsafeGetTensorImpl());
}

ir::TensorMeta metaOf(const c10::TensorImpl &t) {
  ir::TensorMeta m;
  m.dtype = static_cast<int8_t>(t.dtype().toScalarType());
  m.sizes.assign(t.sizes().begin(), t.sizes().end());
  m.strides.assign(t.strides().begin(), t.strides().end());
  return m;
}

std::string torchVersion() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

ArgType argType(const c10::TypePtr &type) {
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>())
    t = opt->getElementType();
  switch (t->kind()) {
  case c10::TypeKind::TensorType: return ArgType::Tensor;
  case c10::TypeKind::NumberType: return ArgType::Number;
  case c10::TypeKind::DeviceObjType: return ArgType::Device;
  case c10::TypeKind::GeneratorType: return ArgType::Generator;
  case c10::TypeKind::ListType: return ArgType::List;
  case c10::TypeKind::IntType:
  case c10::TypeKind::SymIntType: return ArgType::Int;
  case c10::TypeKind::ScalarTypeType: return ArgType::ScalarType;
  case c10::TypeKind::LayoutType: return ArgType::Layout;
  case c10::TypeKind::MemoryFormatType: return ArgType::MemoryFormat;
  case c10::TypeKind::FloatType: return ArgType::Float;
  case c10::TypeKind::BoolType:
  case c10::TypeKind::SymBoolType: return ArgType::Bool;
  case c10::TypeKind::StringType:
  // `Any` is carried as a string only: the process group name of _c10d_functional's ops.
  case c10::TypeKind::AnyType: return ArgType::String;
  default: return ArgType::Unsupported;
  }
}

ir::Arg::Kind constantKind(ArgType t) {
  switch (t) {
  case ArgType::Int:
  case ArgType::ScalarType:
  case ArgType::Layout:
  case ArgType::MemoryFormat: return ir::Arg::Kind::Int;
  case ArgType::Float: return ir::Arg::Kind::Double;
  case ArgType::Bool: return ir::Arg::Kind::Bool;
  case ArgType::String: return ir::Arg::Kind::Str;
  default: return ir::Arg::Kind::None;
  }
}

bool isStridedView(llvm::StringRef base) {
  return ir::opFacts(base).has(ir::OpFact::StridedView);
}

bool drawsRandom(const c10::OperatorHandle &op) {
  return op.hasTag(at::Tag::nondeterministic_seeded) &&
         !ir::opFacts(op.operator_name().name).has(ir::OpFact::NeverDraws);
}

std::optional<c10::OperatorHandle> viewOf(const c10::OperatorName &copyOp) {
  llvm::StringRef base(copyOp.name);
  if (!base.endswith("_copy") || isStridedView(base))
    return std::nullopt;
  auto &dispatcher = c10::Dispatcher::singleton();
  auto view = dispatcher.findSchema({base.drop_back(5).str(), copyOp.overload_name});
  auto copy = dispatcher.findSchema(copyOp);
  if (!view || !copy ||
      view->schema().arguments().size() != copy->schema().arguments().size() ||
      view->schema().is_mutable())
    return std::nullopt;
  return view;
}

} // namespace rgpu::bridge
