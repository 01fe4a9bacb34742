#include "Policy.h"

#include <llvm/ADT/StringMap.h>

#include <algorithm>
#include <mutex>

namespace rgpu::server::policy {

namespace {

std::string tableKey(llvm::StringRef op, llvm::StringRef arg) { return op.str() + ":" + arg.str(); }

/// The values each string argument may take, keyed "aten::op:argument" (all overloads share
/// an entry). A string argument with no entry makes its op refused: free-form strings
/// (einsum's equation, assertion messages, file names) never reach a kernel or code generator.
const llvm::StringMap<std::vector<llvm::StringRef>> &stringTables() {
  static const llvm::StringMap<std::vector<llvm::StringRef>> tables = [] {
    llvm::StringMap<std::vector<llvm::StringRef>> t;
    auto add = [&](std::initializer_list<std::string> ops, llvm::StringRef arg,
                   std::vector<llvm::StringRef> values) {
      for (const std::string &op : ops)
        t[tableKey(op, arg)] = values;
    };
    add({"aten::div", "aten::divide"}, "rounding_mode", {"trunc", "floor"});
    add({"aten::gelu", "aten::gelu_backward"}, "approximate", {"none", "tanh"});
    add({"aten::_convolution_mode", "aten::conv1d", "aten::conv2d", "aten::conv3d"}, "padding",
        {"same", "valid"});
    add({"aten::_linalg_eigh", "aten::linalg_eigh", "aten::linalg_eigvalsh"}, "UPLO", {"L", "U"});
    add({"aten::_linalg_svd", "aten::linalg_svd", "aten::linalg_svdvals"}, "driver",
        {"gesvd", "gesvdj", "gesvda"});
    add({"aten::linalg_lstsq"}, "driver", {"gels", "gelsy", "gelsd", "gelss"});
    add({"aten::segment_reduce", "aten::_segment_reduce_backward"}, "reduce",
        {"sum", "max", "min", "mean", "prod"});
    add({"aten::index_reduce"}, "reduce", {"prod", "mean", "amax", "amin"});
    add({"aten::scatter"}, "reduce", {"add", "multiply"});
    add({"aten::scatter_reduce"}, "reduce", {"sum", "prod", "mean", "amax", "amin"});
    for (llvm::StringRef fft : {"fft", "fft2", "fftn", "hfft", "hfft2", "hfftn", "ifft", "ifft2",
                                "ifftn", "ihfft", "ihfft2", "ihfftn", "irfft", "irfft2",
                                "irfftn", "rfft", "rfft2", "rfftn"})
      add({"aten::fft_" + fft.str()}, "norm", {"forward", "backward", "ortho"});
    add({"aten::linalg_cond"}, "p", {"fro", "nuc"});
    add({"aten::linalg_matrix_norm", "aten::linalg_norm"}, "ord", {"fro", "nuc"});
    add({"aten::linalg_qr"}, "mode", {"reduced", "complete", "r"});
    add({"aten::meshgrid"}, "indexing", {"ij", "xy"});
    add({"aten::quantile", "aten::nanquantile"}, "interpolation",
        {"linear", "lower", "higher", "midpoint", "nearest"});
    add({"aten::pad"}, "mode", {"constant", "reflect", "replicate", "circular"});
    add({"aten::stft"}, "pad_mode", {"constant", "reflect", "replicate", "circular"});
    add({"aten::pad_sequence"}, "padding_side", {"left", "right"});
    add({"aten::searchsorted"}, "side", {"left", "right"});
    add({"_c10d_functional::all_reduce", "_c10d_functional::reduce_scatter_tensor"},
        "reduce_op", {"sum", "avg", "product", "min", "max"});
    return t;
  }();
  return tables;
}

/// Families refused by name, with the reason: what makes them unsafe to run for a peer.
const std::vector<std::pair<llvm::StringRef, llvm::StringRef>> &refusedFamilies() {
  static const std::vector<std::pair<llvm::StringRef, llvm::StringRef>> families = {
      {"from_file", "reads a file on the server"},
      {"_print", "writes to the server's output"},
      {"_async_error", "raises asynchronously on the device"},
      {"_cufft_", "changes process-wide state"},
      {"_pin_memory", "allocates pinned host memory"},
      {"pin_memory", "allocates pinned host memory"},
      {"_copy_from", "writes into an argument its schema does not mark as written"},
      {"_test_", "is a test op"},
      {"_functional_assert", "carries a free-form message"},
      {"_functional_sym_constrain", "constrains symbolic shapes, which graphs do not have"},
      {"_sparse", "builds sparse tensors; rgpu supports strided tensors only"},
      {"sparse_", "builds sparse tensors; rgpu supports strided tensors only"},
      {"to_sparse", "builds sparse tensors; rgpu supports strided tensors only"},
      {"_to_sparse", "builds sparse tensors; rgpu supports strided tensors only"},
      {"_nested", "builds nested tensors from raw buffers; rgpu supports strided tensors only"},
      {"nested_", "builds nested tensors; rgpu supports strided tensors only"},
      {"to_padded_tensor", "reads nested tensors; rgpu supports strided tensors only"},
      {"_mkldnn", "builds mkldnn tensors; rgpu supports strided tensors only"},
      {"mkldnn_", "builds mkldnn tensors; rgpu supports strided tensors only"},
      {"to_mkldnn", "builds mkldnn tensors; rgpu supports strided tensors only"},
      {"quantize", "builds quantized tensors; rgpu supports float, int, bool and complex dtypes"},
      {"_make_per_", "builds quantized tensors from raw values"},
      {"q_", "reads quantized tensors"},
      {"int_repr", "reads quantized tensors"},
      {"_empty_affine_quantized", "builds quantized tensors"},
      {"_empty_per_channel_affine_quantized", "builds quantized tensors"},
      {"fbgemm_", "reads packed weights whose layout no check covers"},
      {"_fbgemm", "reads packed weights whose layout no check covers"},
      {"_weight_int", "reads packed weights whose layout no check covers"},
      {"_convert_weight_to_int4pack", "builds packed weights"},
      {"_dyn_quant", "reads packed weights whose layout no check covers"},
      {"_cslt", "reads packed sparse weights"},
      {"_mixed_dtypes_linear", "reads packed weights whose layout no check covers"},
  };
  return families;
}

bool listElementCarried(const c10::TypePtr &list) {
  c10::TypePtr elem = list->containedType(0);
  if (auto o = elem->cast<c10::OptionalType>())
    return o->getElementType()->kind() == c10::TypeKind::TensorType;
  switch (bridge::argType(elem)) {
  case bridge::ArgType::Tensor:
  case bridge::ArgType::Number:
  case bridge::ArgType::Int:
  case bridge::ArgType::Float:
  case bridge::ArgType::Bool: return true;
  default: return false;
  }
}

std::string verdict(const c10::FunctionSchema &schema) {
  llvm::StringRef base(schema.name());
  llvm::StringRef bare = base.drop_front(6); // after "aten::"
  for (const auto &[prefix, why] : refusedFamilies())
    if (bare.startswith(prefix))
      return "refused: " + why.str();
  if (schema.is_mutable())
    return "refused: the op mutates its inputs; graphs are functional";
  if (schema.returns().empty())
    return "refused: returns no tensor";
  for (const auto &ret : schema.returns()) {
    auto k = ret.type()->kind();
    bool tensorList = k == c10::TypeKind::ListType &&
                      ret.type()->containedType(0)->kind() == c10::TypeKind::TensorType;
    if (k != c10::TypeKind::TensorType && !tensorList)
      return "refused: returns a non-tensor value";
  }
  for (const c10::Argument &a : schema.arguments()) {
    c10::TypePtr type = a.type();
    if (auto opt = type->cast<c10::OptionalType>())
      type = opt->getElementType();
    bridge::ArgType t = bridge::argType(type);
    if (t == bridge::ArgType::Unsupported ||
        (t == bridge::ArgType::List && !listElementCarried(type)))
      return "refused: argument '" + a.name() + "' has type " + a.type()->str() +
             ", which rgpu does not carry";
    if (t == bridge::ArgType::String && !stringTables().count(tableKey(base, a.name())))
      return "refused: argument '" + a.name() + "' is a free-form string";
  }
  return "";
}

/// The verdict on every registered aten op, keyed by full name; built on first use.
const llvm::StringMap<std::string> &verdicts() {
  static const llvm::StringMap<std::string> all = [] {
    llvm::StringMap<std::string> v;
    for (const c10::OperatorName &name : c10::Dispatcher::singleton().getAllOpNames()) {
      if (!llvm::StringRef(name.name).startswith("aten::"))
        continue;
      auto handle = c10::Dispatcher::singleton().findSchema(name);
      if (!handle)
        continue;
      std::string full = name.overload_name.empty() ? name.name
                                                    : name.name + "." + name.overload_name;
      v[full] = verdict(handle->schema());
    }
    return v;
  }();
  return all;
}

/// Ops that are safe on the plan executor but not once compiled: their eager kernels clamp or
/// check indices, and Inductor, as these ops allow, generates loads without bounds checks.
bool uncheckedOnceCompiled(llvm::StringRef bare) {
  return bare.startswith("_unsafe_index") || bare.startswith("_unsafe_masked_index");
}

bool isFactory(llvm::StringRef bare) {
  for (llvm::StringRef p : {"empty", "new_empty", "zeros", "new_zeros", "ones", "new_ones",
                            "full", "new_full", "rand", "scalar_tensor"})
    if (bare.startswith(p))
      return true;
  return bridge::isStridedView("aten::" + bare.str());
}

} // namespace

/// torch.distributed's functional collectives, which graphs of a session that joined a process
/// group may hold (their group must be the session's own: server/Groups.cpp checks).
bool isCollective(llvm::StringRef fullName) {
  static const llvm::StringRef ops[] = {
      "_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor",
      "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::broadcast",
      "_c10d_functional::wait_tensor"};
  return std::find(std::begin(ops), std::end(ops), fullName) != std::end(ops);
}

std::string admit(llvm::StringRef fullName) {
  if (isCollective(fullName))
    return "";
  if (!fullName.startswith("aten::"))
    return "only aten ops and torch.distributed's functional collectives are accepted";
  auto it = verdicts().find(fullName);
  if (it == verdicts().end())
    return "unknown op";
  return it->second;
}

bool growsStorage(llvm::StringRef base) {
  return base == "aten::resize" || base == "aten::_resize_output";
}

bool compilable(llvm::StringRef base) {
  // A collective waits on the other servers of its group: it runs on the plan. A resize's
  // grown part is zeroed by the plan (growsStorage), which compiled code would not do.
  return base.startswith("aten::") && !uncheckedOnceCompiled(base.drop_front(6)) &&
         !growsStorage(base);
}

std::string checkConstant(llvm::StringRef base, const c10::Argument &arg, bridge::ArgType type,
                          const ir::Arg &a, llvm::StringRef str) {
  std::string where = "argument '" + arg.name() + "'";
  switch (type) {
  case bridge::ArgType::ScalarType:
    if (!ir::dtype::isValid(int8_t(a.i)) || a.i != int8_t(a.i))
      return where + " is dtype number " + std::to_string(a.i) + ", not one rgpu knows";
    return "";
  case bridge::ArgType::Layout:
    if (a.i != int64_t(c10::Layout::Strided))
      return where + " is layout number " + std::to_string(a.i) +
             "; rgpu supports torch.strided only";
    return "";
  case bridge::ArgType::MemoryFormat:
    if (a.i < 0 || a.i >= int64_t(c10::MemoryFormat::NumOptions))
      return where + " is memory format number " + std::to_string(a.i) + ", not one torch has";
    return "";
  case bridge::ArgType::String: {
    if (isCollective(base) && arg.name() == "group_name")
      return ""; // the session's own group: Groups::check
    auto table = stringTables().find(tableKey(base, arg.name()));
    if (table == stringTables().end())
      return where + " is a free-form string";
    if (std::find(table->second.begin(), table->second.end(), str) == table->second.end()) {
      std::string allowed;
      for (llvm::StringRef v : table->second)
        allowed += (allowed.empty() ? "" : ", ") + v.str();
      return where + " is not one of " + allowed;
    }
    return "";
  }
  default: return "";
  }
}

std::string checkListElement(llvm::StringRef base, const c10::Argument &arg, int64_t value) {
  if (value >= 0)
    return "";
  if (arg.name() == "stride")
    return "argument 'stride' has a negative stride";
  if (arg.name() == "size" && isFactory(base.drop_front(6)))
    return "argument 'size' has a negative size";
  return "";
}

std::string checkStridedView(const ir::TensorMeta &base, llvm::ArrayRef<int64_t> sizes,
                             llvm::ArrayRef<int64_t> strides, int64_t offset) {
  if (sizes.size() != strides.size())
    return "sizes and strides differ in rank";
  if (offset < 0)
    return "negative storage offset";
  // The last element the view reaches, in elements from the storage's start.
  int64_t last = offset;
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || strides[i] < 0)
      return "negative size or stride";
    if (sizes[i] == 0)
      empty = true;
    int64_t step;
    if (sizes[i] > 0 && (__builtin_mul_overflow(sizes[i] - 1, strides[i], &step) ||
                         __builtin_add_overflow(last, step, &last)))
      return "the view's extent overflows";
  }
  if (empty)
    return "";
  int64_t bytes = base.storageBytes();
  unsigned item = ir::dtype::itemSize(base.dtype);
  int64_t elements = item ? bytes / item : 0;
  if (bytes < 0 || last >= elements)
    return "the view reaches element " + std::to_string(last) + " of a storage of " +
           std::to_string(elements) + " elements";
  return "";
}

std::vector<std::pair<std::string, std::string>> refusedOps() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto &entry : verdicts())
    if (!entry.second.empty())
      out.emplace_back(entry.first().str(), entry.second);
  std::sort(out.begin(), out.end());
  return out;
}

} // namespace rgpu::server::policy
