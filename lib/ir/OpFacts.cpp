#include "rgpu/ir/OpFacts.h"

#include <llvm/ADT/SmallString.h>
#include <llvm/ADT/StringMap.h>
#include <llvm/ADT/Twine.h>

#include <algorithm>
#include <array>

namespace rgpu::ir {

//===----------------------------------------------------------------------===//
// Dtypes, layouts and memory formats: how graphs number them
//===----------------------------------------------------------------------===//

namespace {

struct DtypeRow {
  int8_t number;
  const char *shortName, *torchName;
  unsigned itemSize;
};

/// Every dtype a graph may carry: the numeric and bool ScalarTypes. Quantized, bit-packed and
/// sub-byte types are not carried.
constexpr DtypeRow kDtypes[] = {
    {dtype::Byte, "u8", "uint8", 1},
    {dtype::Char, "i8", "int8", 1},
    {dtype::Short, "i16", "int16", 2},
    {dtype::Int, "i32", "int32", 4},
    {dtype::Long, "i64", "int64", 8},
    {dtype::Half, "f16", "float16", 2},
    {dtype::Float, "f32", "float32", 4},
    {dtype::Double, "f64", "float64", 8},
    {dtype::ComplexHalf, "c32", "complex32", 4},
    {dtype::ComplexFloat, "c64", "complex64", 8},
    {dtype::ComplexDouble, "c128", "complex128", 16},
    {dtype::Bool, "b8", "bool", 1},
    {dtype::BFloat16, "bf16", "bfloat16", 2},
    {dtype::Float8_e5m2, "f8e5m2", "float8_e5m2", 1},
    {dtype::Float8_e4m3fn, "f8e4m3fn", "float8_e4m3fn", 1},
    {dtype::Float8_e5m2fnuz, "f8e5m2fnuz", "float8_e5m2fnuz", 1},
    {dtype::Float8_e4m3fnuz, "f8e4m3fnuz", "float8_e4m3fnuz", 1},
    {dtype::UInt16, "u16", "uint16", 2},
    {dtype::UInt32, "u32", "uint32", 4},
    {dtype::UInt64, "u64", "uint64", 8},
    {dtype::Float8_e8m0fnu, "f8e8m0fnu", "float8_e8m0fnu", 1},
};

/// Each dtype number's row in kDtypes (-1: none): itemSize sits on the hot paths of layouts.
constexpr std::array<int8_t, 64> kRowOf = [] {
  std::array<int8_t, 64> at{};
  for (int8_t &a : at)
    a = -1;
  for (size_t r = 0; r < sizeof(kDtypes) / sizeof(kDtypes[0]); ++r)
    at[size_t(kDtypes[r].number)] = int8_t(r);
  return at;
}();

const DtypeRow *dtypeRow(int8_t d) {
  if (d < 0 || size_t(d) >= kRowOf.size() || kRowOf[size_t(d)] < 0)
    return nullptr;
  return &kDtypes[kRowOf[size_t(d)]];
}

} // namespace

namespace dtype {
std::string name(int8_t d) {
  if (d == Undefined)
    return "undefined";
  const DtypeRow *row = dtypeRow(d);
  return row ? row->shortName : "dtype<" + std::to_string(int(d)) + ">";
}
const char *torchName(int8_t d) {
  const DtypeRow *row = dtypeRow(d);
  return row ? row->torchName : nullptr;
}
unsigned itemSize(int8_t d) {
  const DtypeRow *row = dtypeRow(d);
  return row ? row->itemSize : 0;
}
bool isValid(int8_t d) { return dtypeRow(d) != nullptr; }
} // namespace dtype

namespace layout {
const char *torchName(int64_t n) { return n == Strided ? "strided" : nullptr; }
} // namespace layout

namespace memory_format {
const char *torchName(int64_t n) {
  static const char *const names[Count] = {"contiguous_format", "preserve_format",
                                           "channels_last", "channels_last_3d"};
  return n >= 0 && n < Count ? names[n] : nullptr;
}
} // namespace memory_format

//===----------------------------------------------------------------------===//
// Ops
//===----------------------------------------------------------------------===//

namespace {

using F = OpFact;

constexpr uint32_t operator|(F a, F b) { return uint32_t(a) | uint32_t(b); }

/// Facts of ops by name: a base name ("aten::copy") holds for every overload; a full name
/// ("aten::slice_copy.Tensor", "aten::view_copy.default" for the overload without a name) for
/// that overload only.
struct Named {
  const char *name;
  uint32_t facts;
};
const Named kNamed[] = {
    // The tracer: what it cannot trace ahead, or traces specially.
    {"aten::nonzero", uint32_t(F::DataDependent)},
    {"aten::masked_select", uint32_t(F::DataDependent)},
    {"aten::unique_consecutive", uint32_t(F::DataDependent)},
    {"aten::_unique", uint32_t(F::DataDependent)},
    {"aten::_unique2", uint32_t(F::DataDependent)},
    {"aten::unique_dim", uint32_t(F::DataDependent)},
    {"aten::unique_dim_consecutive", uint32_t(F::DataDependent)},
    {"aten::bincount", uint32_t(F::DataDependent)},
    {"aten::repeat_interleave", uint32_t(F::DataDependent)},
    {"aten::_ctc_loss", uint32_t(F::DataDependent)},
    {"aten::index_put", F::MaskAssignment | F::AcceptsCpuTensors},
    {"aten::index_put_", uint32_t(F::MaskAssignment)},
    {"aten::_index_put_impl", F::MaskAssignment | F::AcceptsCpuTensors},
    {"aten::_index_put_impl_", uint32_t(F::MaskAssignment)},
    {"aten::index", uint32_t(F::AcceptsCpuTensors)},
    {"aten::copy", F::AcceptsCpuTensors | F::CrossesDevices},
    {"aten::copy.default", uint32_t(F::CopiesIntoFirst)},
    {"aten::arange", uint32_t(F::ShapeFollowsScalars)},
    {"aten::range", uint32_t(F::ShapeFollowsScalars)},
    {"aten::linspace", uint32_t(F::ShapeFollowsScalars)},
    {"aten::logspace", uint32_t(F::ShapeFollowsScalars)},
    // Recorded whole rather than as their composites' ops.
    {"aten::linear.default", F::RecordedWhole | F::CompositeWithoutGrad},
    {"aten::matmul.default", F::RecordedWhole | F::CompositeWithoutGrad},
    {"aten::layer_norm.default", F::RecordedWhole | F::CompositeWithoutGrad},
    {"aten::group_norm.default", F::RecordedWhole | F::CompositeWithoutGrad},
    {"aten::bilinear.default", F::RecordedWhole | F::CompositeWithoutGrad},
    {"aten::repeat_interleave.self_int", uint32_t(F::CompositeWithoutGrad)},
    // In-place ops CPU eager runs on an expand()ed self.
    {"aten::fill_", uint32_t(F::WritesThroughOverlap)},
    {"aten::zero_", uint32_t(F::WritesThroughOverlap)},
    {"aten::tril_", uint32_t(F::WritesThroughOverlap)},
    {"aten::triu_", uint32_t(F::WritesThroughOverlap)},
    {"aten::conj_physical_", uint32_t(F::WritesThroughOverlap)},
    {"aten::masked_fill_", uint32_t(F::WritesThroughOverlap)},
    {"aten::index_fill_", uint32_t(F::WritesThroughOverlap)},
    // Views and storage.
    {"aten::as_strided", uint32_t(F::StridedView)},
    {"aten::as_strided_copy", uint32_t(F::StridedView)},
    {"aten::as_strided_scatter", uint32_t(F::StridedView)},
    {"aten::_reshape_alias", uint32_t(F::StridedView)},
    {"aten::_reshape_alias_copy", uint32_t(F::StridedView)},
    {"aten::resize", uint32_t(F::GrowsStorage)},
    {"aten::_resize_output", uint32_t(F::GrowsStorage)},
    {"aten::view_copy.default", uint32_t(F::RunsAsReshape)},
    {"aten::detach_copy", uint32_t(F::Alias)},
    {"aten::alias_copy", uint32_t(F::Alias)},
    // Writes that a compiled package may make into its input's own buffer.
    {"aten::slice_scatter.default", uint32_t(F::OverwritesFirst)},
    {"aten::select_scatter.default", uint32_t(F::OverwritesFirst)},
    {"aten::diagonal_scatter.default", uint32_t(F::OverwritesFirst)},
    {"aten::index_copy.default", uint32_t(F::OverwritesFirst)},
    {"aten::slice_copy.Tensor", uint32_t(F::RegionView)},
    {"aten::select_copy.int", uint32_t(F::RegionView)},
    // Randomness and statistics.
    {"aten::_scaled_dot_product_flash_attention_for_cpu", uint32_t(F::NeverDraws)},
    {"aten::native_layer_norm_backward", uint32_t(F::NormBackward)},
    {"aten::native_batch_norm_backward", uint32_t(F::NormBackward)},
    {"aten::batch_norm_backward", uint32_t(F::NormBackward)},
    // torch.distributed's functional collectives.
    {"_c10d_functional::all_reduce", uint32_t(F::Collective)},
    {"_c10d_functional::all_gather_into_tensor", uint32_t(F::Collective)},
    {"_c10d_functional::reduce_scatter_tensor", uint32_t(F::Collective)},
    {"_c10d_functional::broadcast", uint32_t(F::Collective)},
    {"_c10d_functional::wait_tensor", uint32_t(F::Collective)},
};

/// Ops whose known values stay known through them (lib/client/KnownValues.cpp): the result's
/// bytes are moved input bytes, or the op is exact on integers.
const char *const kExactBytes[] = {
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "select", "slice",
    "permute", "t", "transpose", "alias", "view_copy", "unsqueeze_copy", "squeeze_copy",
    "expand_copy", "select_copy", "slice_copy", "permute_copy", "t_copy", "transpose_copy",
    "alias_copy", "clone", "lift_fresh", "lift_fresh_copy", "cat", "stack", "flip", "_to_copy",
    "index_select", "gather", "index", "constant_pad_nd"};
const char *const kExactOnIntegers[] = {
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "any", "all",
    "isin", "add", "sub", "mul", "neg", "abs", "where", "maximum", "minimum", "max", "min",
    "amax", "amin", "sum", "cumsum", "masked_fill", "ones", "zeros", "full", "scalar_tensor",
    "ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full", "arange", "fill",
    "argmax", "argmin", "remainder"};

/// Facts of families of aten ops: every op whose name after "aten::" starts with the prefix
/// (after its leading underscores too, where `pastUnderscores`).
struct Family {
  const char *prefix;
  uint32_t facts;
  bool pastUnderscores = false;
};
const Family kFamilies[] = {
    {"empty", F::Factory | F::Uninitialized},
    {"new_empty", F::Factory | F::Uninitialized},
    {"zeros", uint32_t(F::Factory)},
    {"new_zeros", uint32_t(F::Factory)},
    {"ones", uint32_t(F::Factory)},
    {"new_ones", uint32_t(F::Factory)},
    {"full", uint32_t(F::Factory)},
    {"new_full", uint32_t(F::Factory)},
    {"rand", uint32_t(F::Factory)},
    {"scalar_tensor", uint32_t(F::Factory)},
    {"_unsafe_index", uint32_t(F::UncheckedOnceCompiled)},
    {"_unsafe_masked_index", uint32_t(F::UncheckedOnceCompiled)},
    {"to_sparse", uint32_t(F::OtherLayout), true},
    {"sparse_", uint32_t(F::OtherLayout), true},
    {"to_mkldnn", uint32_t(F::OtherLayout), true},
    {"mkldnn_", uint32_t(F::OtherLayout), true},
    {"quantize_per", uint32_t(F::OtherLayout), true},
    {"nested_", uint32_t(F::OtherLayout), true},
    {"make_per_", uint32_t(F::OtherLayout), true},
    {"coo_", uint32_t(F::OtherLayout), true},
    {"csr_", uint32_t(F::OtherLayout), true},
};

/// Families the server refuses for every peer, with what makes them unsafe to run for one.
const std::pair<const char *, const char *> kRefused[] = {
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

/// The values each string argument may take, by ops (all overloads), argument and values.
struct Strings {
  std::vector<std::string> ops;
  const char *arg;
  std::vector<llvm::StringRef> values;
};
std::vector<Strings> stringRows() {
  std::vector<Strings> rows = {
      {{"aten::div", "aten::divide"}, "rounding_mode", {"trunc", "floor"}},
      {{"aten::gelu", "aten::gelu_backward"}, "approximate", {"none", "tanh"}},
      {{"aten::_convolution_mode", "aten::conv1d", "aten::conv2d", "aten::conv3d"},
       "padding",
       {"same", "valid"}},
      {{"aten::_linalg_eigh", "aten::linalg_eigh", "aten::linalg_eigvalsh"}, "UPLO", {"L", "U"}},
      {{"aten::_linalg_svd", "aten::linalg_svd", "aten::linalg_svdvals"},
       "driver",
       {"gesvd", "gesvdj", "gesvda"}},
      {{"aten::linalg_lstsq"}, "driver", {"gels", "gelsy", "gelsd", "gelss"}},
      {{"aten::segment_reduce", "aten::_segment_reduce_backward"},
       "reduce",
       {"sum", "max", "min", "mean", "prod"}},
      {{"aten::index_reduce"}, "reduce", {"prod", "mean", "amax", "amin"}},
      {{"aten::scatter"}, "reduce", {"add", "multiply"}},
      {{"aten::scatter_reduce"}, "reduce", {"sum", "prod", "mean", "amax", "amin"}},
      {{"aten::linalg_cond"}, "p", {"fro", "nuc"}},
      {{"aten::linalg_matrix_norm", "aten::linalg_norm"}, "ord", {"fro", "nuc"}},
      {{"aten::linalg_qr"}, "mode", {"reduced", "complete", "r"}},
      {{"aten::meshgrid"}, "indexing", {"ij", "xy"}},
      {{"aten::quantile", "aten::nanquantile"},
       "interpolation",
       {"linear", "lower", "higher", "midpoint", "nearest"}},
      {{"aten::pad"}, "mode", {"constant", "reflect", "replicate", "circular"}},
      {{"aten::stft"}, "pad_mode", {"constant", "reflect", "replicate", "circular"}},
      {{"aten::pad_sequence"}, "padding_side", {"left", "right"}},
      {{"aten::searchsorted"}, "side", {"left", "right"}},
      {{"_c10d_functional::all_reduce", "_c10d_functional::reduce_scatter_tensor"},
       "reduce_op",
       {"sum", "avg", "product", "min", "max"}},
  };
  Strings fft{{}, "norm", {"forward", "backward", "ortho"}};
  for (const char *op : {"fft", "fft2", "fftn", "hfft", "hfft2", "hfftn", "ifft", "ifft2",
                         "ifftn", "ihfft", "ihfft2", "ihfftn", "irfft", "irfft2", "irfftn",
                         "rfft", "rfft2", "rfftn"})
    fft.ops.push_back(std::string("aten::fft_") + op);
  rows.push_back(std::move(fft));
  return rows;
}

/// Scalar arguments compiled as constants: decompositions branch on `alpha` and `beta` of any
/// op (`beta == 0`); Inductor lowers a pad's fill value as a Python number.
const std::pair<const char *, const char *> kCompiledAsConstants[] = {
    {"*", "alpha"}, {"*", "beta"}, {"aten::constant_pad_nd", "value"}};

const std::pair<const char *, SpecialOp> kSpecial[] = {
    {"aten::_local_scalar_dense", SpecialOp::ReadScalar},
    {"aten::equal", SpecialOp::Equal},
    {"aten::_to_copy", SpecialOp::ToCopy},
    {"aten::_copy_from", SpecialOp::CopyFrom},
    {"aten::_copy_from_and_resize", SpecialOp::CopyFromAndResize},
    {"aten::copy", SpecialOp::Copy},
};

const llvm::StringMap<uint32_t> &namedFacts() {
  static const llvm::StringMap<uint32_t> map = [] {
    llvm::StringMap<uint32_t> m;
    for (const Named &n : kNamed)
      m[n.name] |= n.facts;
    for (const char *op : kExactBytes)
      m[std::string("aten::") + op] |= uint32_t(F::ExactBytes);
    for (const char *op : kExactOnIntegers)
      m[std::string("aten::") + op] |= uint32_t(F::ExactOnIntegers);
    return m;
  }();
  return map;
}

uint32_t familyFacts(llvm::StringRef base) {
  if (!base.consume_front("aten::"))
    return 0;
  uint32_t facts = 0;
  const llvm::StringRef trimmed = base.ltrim('_');
  for (const Family &f : kFamilies)
    if ((f.pastUnderscores ? trimmed : base).startswith(f.prefix))
      facts |= f.facts;
  return facts;
}

} // namespace

OpFacts opFacts(llvm::StringRef name) {
  const llvm::StringMap<uint32_t> &named = namedFacts();
  auto [base, overload] = name.split('.');
  uint32_t facts = familyFacts(base);
  if (auto it = named.find(base); it != named.end())
    facts |= it->second;
  llvm::SmallString<96> full(base); // no allocation per op for the tracer
  full += '.';
  full += overload.empty() ? llvm::StringRef("default") : overload;
  if (auto it = named.find(full); it != named.end())
    facts |= it->second;
  return OpFacts(facts);
}

SpecialOp specialOp(llvm::StringRef name) {
  for (const auto &[op, special] : kSpecial)
    if (name == op)
      return special;
  return SpecialOp::None;
}

std::vector<std::string> opsWith(OpFact fact) {
  std::vector<std::string> out;
  for (const Named &n : kNamed)
    if (n.facts & uint32_t(fact))
      out.push_back(n.name);
  return out;
}

llvm::StringRef refusal(llvm::StringRef name) {
  if (!name.consume_front("aten::"))
    return {};
  for (const auto &[prefix, why] : kRefused)
    if (name.startswith(prefix))
      return why;
  return {};
}

const std::vector<llvm::StringRef> *allowedStrings(llvm::StringRef name, llvm::StringRef arg) {
  static const llvm::StringMap<std::vector<llvm::StringRef>> table = [] {
    llvm::StringMap<std::vector<llvm::StringRef>> t;
    for (const Strings &row : stringRows())
      for (const std::string &op : row.ops)
        t[op + ":" + row.arg] = row.values;
    return t;
  }();
  auto it = table.find((llvm::Twine(name) + ":" + arg).str());
  return it == table.end() ? nullptr : &it->second;
}

bool compiledAsConstant(llvm::StringRef name, llvm::StringRef arg) {
  return std::any_of(std::begin(kCompiledAsConstants), std::end(kCompiledAsConstants),
                     [&](const auto &row) {
                       return (llvm::StringRef(row.first) == "*" || name == row.first) &&
                              arg == row.second;
                     });
}

} // namespace rgpu::ir
