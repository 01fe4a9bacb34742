//===- lib/client/MetaKernels.cpp - ATen's C++ meta kernels, by op -------===//
//
// The table binds aten overloads to `at::meta::` functions, the C++ meta kernels of
// structured ops. Each binding's C++ signature is checked against the op's schema when the
// table is built, as torch checks a kernel it registers; a mismatch leaves the op to the
// dispatcher. A few ops common in models are written out: `masked_fill`, `arange` and
// `_unsafe_view` as CPU's composite kernels compute them, `native_layer_norm` as torch's meta
// kernel promises it, `_grouped_mm` as its CPU and CUDA kernels accept it, `convolution` in the
// memory format its CPU and CUDA kernels give, and the fused LSTM and GRU cells, which torch's
// recurrent layers run on every device but CPU.
//
//===----------------------------------------------------------------------===//
#include "rgpu/client/MetaKernels.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/MetaFunctions.h>
#include <ATen/core/op_registration/infer_schema.h>
#include <ATen/native/GroupedMMUtils.h>
#include <ATen/native/layer_norm.h>
#include <ATen/ops/empty_like_native.h>

#include <algorithm>
#include <functional>
#include <unordered_map>
#include <utility>

namespace rgpu::client {
namespace {

using T = at::Tensor;
using CT = const at::Tensor &;
using CS = const at::Scalar &;
using OptCT = const std::optional<at::Tensor> &;
using OptDtype = std::optional<at::ScalarType>;
using OptLayout = std::optional<at::Layout>;
using OptDevice = std::optional<at::Device>;
using OptBool = std::optional<bool>;

// The signatures of the bound functions, named by shape.
using Unary = T(CT);
using Binary = T(CT, CT);
using BinaryScalar = T(CT, CT, CS);
using WithScalar = T(CT, CS);
using ScalarFirst = T(CS, CT);
using WithString = T(CT, c10::string_view);
using BinaryString = T(CT, CT, c10::string_view);
using BinaryOptString = T(CT, CT, std::optional<c10::string_view>);
using WithInt = T(CT, int64_t);
using Ternary = T(CT, CT, CT);
using TernaryScalar = T(CT, CT, CT, CS);
using TernaryTwoScalars = T(CT, CT, CT, CS, CS);
using ClampScalars = T(CT, const std::optional<at::Scalar> &, const std::optional<at::Scalar> &);
using ClampTensors = T(CT, OptCT, OptCT);
using DimsReduce = T(CT, at::OptionalIntArrayRef, bool, OptDtype);
using DimsNoDtype = T(CT, at::OptionalIntArrayRef, bool);
using ArrayReduce = T(CT, at::IntArrayRef, bool);
using OptDimReduce = T(CT, std::optional<int64_t>, bool);
using DimReduce = T(CT, int64_t, bool);
using DimPair = std::tuple<T, T>(CT, int64_t, bool);
using Cumulative = T(CT, int64_t, OptDtype);
using Cat = T(const at::ITensorListRef &, int64_t);
using Softmax = T(CT, int64_t, bool);
using SoftmaxBackward = T(CT, CT, int64_t, at::ScalarType);
using Gather = T(CT, int64_t, CT, bool);
using NllForward = std::tuple<T, T>(CT, CT, OptCT, int64_t, int64_t);
using NllBackward = T(CT, CT, CT, OptCT, int64_t, int64_t, CT);
using Loss = T(CT, CT, int64_t);
using TopK = std::tuple<T, T>(CT, int64_t, int64_t, bool, bool);

/// `masked_fill` as CPU's composite kernel computes it: `self` broadcast with `mask`, cloned
/// contiguous; the checks are those of CPU's in-place kernel.
T maskedFill(CT self, CT mask, const std::optional<at::Tensor> &valueTensor) {
  TORCH_CHECK(mask.scalar_type() == at::kBool,
              "masked_fill_ only supports boolean masks, but got mask with dtype ",
              mask.scalar_type());
  TORCH_CHECK(!valueTensor || valueTensor->dim() == 0,
              "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with ",
              valueTensor ? valueTensor->dim() : 0, " dimension(s).");
  c10::MaybeOwned<T> expandedMask, expandedSelf;
  std::tie(expandedMask, expandedSelf) = at::expand_outplace(mask, self);
  return at::empty(expandedSelf->sizes(), expandedSelf->options());
}
T maskedFillScalar(CT self, CT mask, CS) { return maskedFill(self, mask, std::nullopt); }

/// The result of CPU's `slice_scatter` and `select_scatter`: a clone of `self` (laid out as
/// clone's `empty_like` lays it out) whose \p region, a view of that clone, `src` must match.
T scatterInto(CT self, CT src, const std::function<T(CT)> &region) {
  T out = at::native::empty_like(self); // the C++ kernel: `at::empty_like` reaches Python's
  T view = region(out);
  TORCH_CHECK(view.sizes() == src.sizes(),
              "expected src to have a size equal to the slice of self. src size = ", src.sizes(),
              ", slice size = ", view.sizes());
  return out;
}
T sliceScatter(CT self, CT src, int64_t dim, std::optional<c10::SymInt> start,
               std::optional<c10::SymInt> end, c10::SymInt step) {
  return scatterInto(self, src, [&](CT t) { return at::slice_symint(t, dim, start, end, step); });
}
T selectScatter(CT self, CT src, int64_t dim, c10::SymInt index) {
  return scatterInto(self, src, [&](CT t) { return at::select_symint(t, dim, index); });
}
T maskedFillTensor(CT self, CT mask, CT value) { return maskedFill(self, mask, value); }

/// `arange` as CPU's composite kernel computes it: integral inputs and no dtype give int64.
T arange(CS start, CS end, CS step, OptDtype dtype, OptLayout layout, OptDevice device,
         OptBool pinMemory) {
  auto options = at::TensorOptions().dtype(dtype).layout(layout).device(device).pinned_memory(
      pinMemory);
  if (!dtype && start.isIntegral(true) && end.isIntegral(true) && step.isIntegral(true))
    options = options.dtype(at::kLong);
  T result = at::empty({0}, options);
  at::meta::arange_out(result, start, end, step);
  return result;
}
T arangeEnd(CS end, OptDtype dtype, OptLayout layout, OptDevice device, OptBool pinMemory) {
  return arange(0, end, 1, dtype, layout, device, pinMemory);
}
T arangeStart(CS start, CS end, OptDtype dtype, OptLayout layout, OptDevice device,
              OptBool pinMemory) {
  return arange(start, end, 1, dtype, layout, device, pinMemory);
}

/// `native_layer_norm` with CPU's checks, and the outputs torch's meta kernel promises (CUDA
/// computes them so): the result in the input's dtype, contiguous; mean and rstd shaped
/// [*batch, 1, ..., 1] in the computation dtype, float32 for half and bf16 inputs (CPU's kernel
/// keeps those in the input's dtype; the server returns what the meta kernel promised).
std::tuple<T, T, T> nativeLayerNorm(CT input, c10::SymIntArrayRef normalizedShape, OptCT weight,
                                    OptCT bias, double) {
  at::IntArrayRef shape = C10_AS_INTARRAYREF_SLOW(normalizedShape);
  at::native::_check_layer_norm_inputs(input, shape, weight ? *weight : T(), bias ? *bias : T());
  TORCH_CHECK(!input.is_complex(), "native_layer_norm does not support complex inputs");
  std::vector<int64_t> stats(input.sizes().begin(), input.sizes().end());
  std::fill(stats.end() - shape.size(), stats.end(), 1);
  auto statsOptions = input.options();
  if (at::isReducedFloatingType(input.scalar_type()))
    statsOptions = statsOptions.dtype(at::kFloat);
  return {at::empty(input.sizes(), input.options()), at::empty(stats, statsOptions),
          at::empty(stats, statsOptions)};
}

/// `_unsafe_view`: CPU's kernel is `view`'s, whose result it does not mark as an alias.
T unsafeView(CT self, c10::SymIntArrayRef size) { return at::_ops::view::call(self, size); }

/// `_grouped_mm` as its CPU and CUDA kernels check and shape it. torch's meta kernel admits
/// bfloat16 only, the CUDA fast path's dtype; both kernels run float32 and float16 too (a loop
/// of mm), and Hugging Face's mixture-of-experts layers call it so.
T groupedMm(CT a, CT b, OptCT offs, OptCT bias, OptDtype outDtype) {
  at::native::_grouped_mm_validate_inputs(a, b, offs, bias, outDtype);
  return at::native::create_grouped_gemm_output_tensor(
      a, b, offs, at::native::_resolve_grouped_mm_out_dtype(a, b, outDtype));
}

/// `convolution` as torch's meta kernel checks and shapes it, in the memory format CPU's and
/// CUDA's kernels give: channels-last if the input or the weight is (the meta kernel, which
/// cannot know the device, leaves it contiguous). A channels-last model stays channels-last
/// on rgpu, as it does on CUDA, where the server would otherwise copy every result.
T convolution(CT input, CT weight, OptCT bias, c10::SymIntArrayRef stride,
              c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool transposed,
              c10::SymIntArrayRef outputPadding, c10::SymInt groups) {
  // The commonest mistakes, with CPU's messages (the meta kernel's say less).
  const int64_t g = groups.guard_int(__FILE__, __LINE__);
  if (input.dim() == weight.dim() && input.dim() >= 3 && g > 0) {
    const int64_t want = transposed ? weight.size(0) : weight.size(1) * g;
    TORCH_CHECK(input.size(1) == want, "Given ",
                transposed ? "transposed=1" : "groups=" + std::to_string(g), ", weight of size ",
                weight.sizes(), ", expected input", input.sizes(), " to have ", want,
                " channels, but got ", input.size(1), " channels instead");
    const int64_t outChannels = transposed ? weight.size(1) * g : weight.size(0);
    TORCH_CHECK(!bias || !bias->defined() || (bias->dim() == 1 && bias->size(0) == outChannels),
                "Given weight of size ", weight.sizes(), ", expected bias to be 1-dimensional "
                "with ", outChannels, " elements, but got bias of size ", bias->sizes(),
                " instead");
  }
  T out = at::_ops::convolution::redispatch(c10::DispatchKeySet(c10::DispatchKey::Meta), input,
                                            weight, bias, stride, padding, dilation, transposed,
                                            outputPadding, std::move(groups));
  for (auto format : {at::MemoryFormat::ChannelsLast, at::MemoryFormat::ChannelsLast3d})
    if (input.suggest_memory_format() == format || weight.suggest_memory_format() == format)
      return at::empty(out.sizes(), out.options().memory_format(format));
  return out;
}

/// The checks of CUDA's fused LSTM and GRU cells: gates [batch, factor * hidden], biases
/// [factor * hidden] or none, the previous state [batch, hidden].
void checkFusedCell(const char *op, CT inputGates, CT hiddenGates, CT prev, OptCT inputBias,
                    OptCT hiddenBias, int64_t factor) {
  TORCH_CHECK(prev.dim() == 2 && inputGates.dim() == 2 &&
                  inputGates.sizes() == hiddenGates.sizes() &&
                  inputGates.size(0) == prev.size(0) &&
                  inputGates.size(1) == factor * prev.size(1),
              op, ": gates must be [batch, ", factor, " * hidden] for a state [batch, hidden], got ",
              inputGates.sizes(), ", ", hiddenGates.sizes(), " and ", prev.sizes());
  for (OptCT bias : {inputBias, hiddenBias})
    TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == inputGates.size(1)), op,
                ": a bias must be [", factor, " * hidden], got ", bias->sizes());
}

/// `_thnn_fused_lstm_cell`: (hy, cy, workspace) as CUDA's kernel makes them. torch's meta
/// kernel fails on a cell without biases.
std::tuple<T, T, T> fusedLstmCell(CT inputGates, CT hiddenGates, CT cx, OptCT inputBias,
                                  OptCT hiddenBias) {
  checkFusedCell("_thnn_fused_lstm_cell", inputGates, hiddenGates, cx, inputBias, hiddenBias, 4);
  return {at::empty(cx.sizes(), inputGates.options()), at::empty(cx.sizes(), inputGates.options()),
          at::empty(inputGates.sizes(), inputGates.options())};
}

/// `_thnn_fused_gru_cell`: (hy, workspace) as CUDA's kernel makes them; torch has no meta
/// kernel for it. The workspace holds five [batch, hidden] blocks for the backward.
std::tuple<T, T> fusedGruCell(CT inputGates, CT hiddenGates, CT hx, OptCT inputBias,
                              OptCT hiddenBias) {
  checkFusedCell("_thnn_fused_gru_cell", inputGates, hiddenGates, hx, inputBias, hiddenBias, 3);
  return {at::empty(hx.sizes(), inputGates.options()),
          at::empty({hx.size(0), 5 * hx.size(1)}, inputGates.options())};
}

/// `_thnn_fused_gru_cell_backward`: gradients of the input and hidden gates, of hx, and of the
/// biases if there are biases.
std::tuple<T, T, T, T, T> fusedGruCellBackward(CT gradHy, CT workspace, bool hasBias) {
  TORCH_CHECK(workspace.dim() == 2 && workspace.size(1) % 5 == 0 && gradHy.dim() == 2 &&
                  gradHy.size(0) == workspace.size(0) &&
                  gradHy.size(1) == workspace.size(1) / 5,
              "_thnn_fused_gru_cell_backward: a workspace of ", workspace.sizes(),
              " does not fit grad_hy of ", gradHy.sizes());
  const int64_t batch = workspace.size(0), gates = workspace.size(1) / 5 * 3;
  auto options = workspace.options();
  T bias = hasBias ? at::empty({gates}, options) : T();
  return {at::empty({batch, gates}, options), at::empty({batch, gates}, options),
          at::empty(gradHy.sizes(), options), bias, hasBias ? at::empty({gates}, options) : T()};
}

class Table {
public:
  Table();

  const c10::KernelFunction *find(const c10::OperatorName &name) const {
    auto it = kernels_.find(name);
    return it == kernels_.end() ? nullptr : &it->second;
  }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto &[name, kernel] : kernels_)
      out.push_back(c10::toString(name));
    std::sort(out.begin(), out.end());
    return out;
  }

private:
  /// Binds `aten::name.overload` to \p Fn if the op exists and \p Fn's signature is its
  /// schema's.
  template <class Sig, Sig *Fn> void bind(const char *name, const char *overload) {
    auto op = c10::Dispatcher::singleton().findSchema({std::string("aten::") + name, overload});
    if (!op)
      return;
    if (c10::findSchemaDifferences(c10::inferFunctionSchemaFlattenedReturns<Sig>(),
                                   op->schema()))
      return;
    kernels_.emplace(op->operator_name(),
                     c10::KernelFunction::makeFromUnboxedFunction(
                         c10::CompileTimeFunctionPointer<Sig, Fn>()));
  }

  std::unordered_map<c10::OperatorName, c10::KernelFunction> kernels_;
};

#define RGPU_META(sig, fn, overload) bind<sig, &at::meta::fn>(#fn, overload)
#define RGPU_UNARY(fn) RGPU_META(Unary, fn, "")

Table::Table() {
  RGPU_UNARY(neg);
  RGPU_UNARY(exp);
  RGPU_UNARY(expm1);
  RGPU_UNARY(log);
  RGPU_UNARY(log1p);
  RGPU_UNARY(log2);
  RGPU_UNARY(sqrt);
  RGPU_UNARY(rsqrt);
  RGPU_UNARY(sin);
  RGPU_UNARY(cos);
  RGPU_UNARY(tanh);
  RGPU_UNARY(sigmoid);
  RGPU_UNARY(erf);
  RGPU_UNARY(floor);
  RGPU_UNARY(ceil);
  RGPU_UNARY(round);
  RGPU_UNARY(trunc);
  RGPU_UNARY(reciprocal);
  RGPU_UNARY(sign);
  RGPU_UNARY(silu);
  RGPU_UNARY(hardsigmoid);
  RGPU_UNARY(bitwise_not);
  RGPU_META(WithString, gelu, "");
  RGPU_META(WithScalar, leaky_relu, "");

  RGPU_META(BinaryScalar, add, "Tensor");
  RGPU_META(BinaryScalar, sub, "Tensor");
  RGPU_META(Binary, mul, "Tensor");
  RGPU_META(Binary, div, "Tensor");
  RGPU_META(BinaryOptString, div, "Tensor_mode");
  RGPU_META(Binary, pow, "Tensor_Tensor");
  RGPU_META(WithScalar, pow, "Tensor_Scalar");
  RGPU_META(ScalarFirst, pow, "Scalar");
  RGPU_META(Binary, maximum, "");
  RGPU_META(Binary, minimum, "");
  RGPU_META(Binary, remainder, "Tensor");
  RGPU_META(Binary, fmod, "Tensor");
  RGPU_META(Binary, atan2, "");
  RGPU_META(Binary, bitwise_and, "Tensor");
  RGPU_META(Binary, bitwise_or, "Tensor");
  RGPU_META(Binary, bitwise_xor, "Tensor");
  RGPU_META(BinaryScalar, lerp, "Scalar");
  RGPU_META(Ternary, lerp, "Tensor");
  RGPU_META(TernaryScalar, addcmul, "");
  RGPU_META(TernaryScalar, addcdiv, "");
  RGPU_META(ClampScalars, clamp, "");
  RGPU_META(ClampTensors, clamp, "Tensor");
  RGPU_META(WithScalar, clamp_min, "");
  RGPU_META(Binary, clamp_min, "Tensor");
  RGPU_META(WithScalar, clamp_max, "");
  RGPU_META(Binary, clamp_max, "Tensor");
#define RGPU_COMPARISON(fn)                                                                        \
  RGPU_META(Binary, fn, "Tensor");                                                                 \
  RGPU_META(WithScalar, fn, "Scalar")
  RGPU_COMPARISON(eq);
  RGPU_COMPARISON(ne);
  RGPU_COMPARISON(lt);
  RGPU_COMPARISON(le);
  RGPU_COMPARISON(gt);
  RGPU_COMPARISON(ge);
#undef RGPU_COMPARISON

  RGPU_META(DimsReduce, sum, "dim_IntList");
  RGPU_META(DimsReduce, mean, "dim");
  RGPU_META(ArrayReduce, amax, "");
  RGPU_META(ArrayReduce, amin, "");
  RGPU_META(OptDimReduce, argmax, "");
  RGPU_META(OptDimReduce, argmin, "");
  RGPU_META(DimReduce, any, "dim");
  RGPU_META(DimsNoDtype, any, "dims");
  RGPU_META(Unary, any, "");
  RGPU_META(DimReduce, all, "dim");
  RGPU_META(DimsNoDtype, all, "dims");
  RGPU_META(Unary, all, "");
  RGPU_META(DimPair, max, "dim");
  RGPU_META(DimPair, min, "dim");
  RGPU_META(Cumulative, cumsum, "");
  RGPU_META(TopK, topk, "");
  RGPU_META(WithInt, tril, "");
  RGPU_META(WithInt, triu, "");

  RGPU_META(Cat, cat, "");
  RGPU_META(Binary, mm, "");
  RGPU_META(Binary, bmm, "");
  RGPU_META(TernaryTwoScalars, addmm, "");
  RGPU_META(TernaryTwoScalars, baddbmm, "");
  RGPU_META(Softmax, _softmax, "");
  RGPU_META(Softmax, _log_softmax, "");
  RGPU_META(Gather, gather, "");

  RGPU_META(SoftmaxBackward, _softmax_backward_data, "");
  RGPU_META(SoftmaxBackward, _log_softmax_backward_data, "");
  RGPU_META(BinaryString, gelu_backward, "");
  RGPU_META(Binary, silu_backward, "");
  RGPU_META(BinaryScalar, threshold_backward, "");
  RGPU_META(Binary, sigmoid_backward, "");
  RGPU_META(Binary, tanh_backward, "");
  RGPU_META(NllForward, nll_loss_forward, "");
  RGPU_META(NllBackward, nll_loss_backward, "");
  RGPU_META(Loss, mse_loss, "");

  bind<T(CT, c10::SymIntArrayRef), &unsafeView>("_unsafe_view", "");
  bind<std::tuple<T, T, T>(CT, c10::SymIntArrayRef, OptCT, OptCT, double), &nativeLayerNorm>(
      "native_layer_norm", "");
  bind<T(CT, CT, OptCT, OptCT, OptDtype), &groupedMm>("_grouped_mm", "");
  bind<std::tuple<T, T, T>(CT, CT, CT, OptCT, OptCT), &fusedLstmCell>("_thnn_fused_lstm_cell",
                                                                    "");
  bind<std::tuple<T, T>(CT, CT, CT, OptCT, OptCT), &fusedGruCell>("_thnn_fused_gru_cell", "");
  bind<std::tuple<T, T, T, T, T>(CT, CT, bool), &fusedGruCellBackward>(
      "_thnn_fused_gru_cell_backward", "");
  bind<T(CT, CT, OptCT, c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymIntArrayRef, bool,
         c10::SymIntArrayRef, c10::SymInt),
       &convolution>("convolution", "");
  bind<T(CT, CT, int64_t, std::optional<c10::SymInt>, std::optional<c10::SymInt>, c10::SymInt),
       &sliceScatter>("slice_scatter", "");
  bind<T(CT, CT, int64_t, c10::SymInt), &selectScatter>("select_scatter", "");
  bind<T(CT, CT, CS), &maskedFillScalar>("masked_fill", "Scalar");
  bind<T(CT, CT, CT), &maskedFillTensor>("masked_fill", "Tensor");
  bind<T(CS, OptDtype, OptLayout, OptDevice, OptBool), &arangeEnd>("arange", "");
  bind<T(CS, CS, OptDtype, OptLayout, OptDevice, OptBool), &arangeStart>("arange", "start");
  bind<T(CS, CS, CS, OptDtype, OptLayout, OptDevice, OptBool), &arange>("arange", "start_step");
}

#undef RGPU_UNARY
#undef RGPU_META

const Table &table() {
  static const Table t;
  return t;
}

bool checkingCppMetas = false; // the check mode's state, used under the session lock
std::vector<std::string> disagreements;

} // namespace

bool callCppMeta(const c10::OperatorHandle &op, torch::jit::Stack &stack) {
  const c10::KernelFunction *kernel = table().find(op.operator_name());
  if (!kernel)
    return false;
  kernel->callBoxed(op, c10::DispatchKeySet(c10::DispatchKey::Meta), &stack);
  return true;
}

std::vector<std::string> cppMetaOps() { return table().names(); }

void setCheckCppMetas(bool on) { checkingCppMetas = on; }
bool checkCppMetas() { return checkingCppMetas; }

void noteCppMetaDisagreement(std::string what) {
  if (disagreements.size() < 1000)
    disagreements.push_back(std::move(what));
}

std::vector<std::string> takeCppMetaDisagreements() { return std::exchange(disagreements, {}); }

} // namespace rgpu::client
