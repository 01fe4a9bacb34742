#include "StandIns.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

namespace rgpu::server {
namespace {

using at::Tensor;

std::optional<Tensor> optionalTensor(const c10::IValue &v) {
  return v.isNone() ? std::nullopt : std::optional<Tensor>(v.toTensor());
}

/// `histc` of an integer tensor, counted as CUDA counts it: bounds truncated to integers, the
/// data's own when they are equal (widened by one each way if those are equal too), values
/// outside them left out, and value x in bin (x - min) * bins / (max - min) in integer
/// arithmetic, max in the last; the result in the input's dtype. Other dtypes run CPU's kernel.
void histc(const c10::OperatorHandle &op, torch::jit::Stack &stack) {
  const Tensor self = stack[0].toTensor();
  if (!at::isIntegralType(self.scalar_type(), /*includeBool=*/false)) {
    op.callBoxed(stack);
    return;
  }
  const int64_t bins = stack[1].toInt();
  int64_t lo = stack[2].toScalar().to<int64_t>(), hi = stack[3].toScalar().to<int64_t>();
  TORCH_CHECK(bins > 0, "bins must be > 0");
  Tensor x = self.flatten().to(at::kLong);
  if (lo == hi && x.numel() > 0) {
    lo = x.min().item<int64_t>();
    hi = x.max().item<int64_t>();
  }
  if (lo == hi) {
    --lo;
    ++hi;
  }
  TORCH_CHECK(lo < hi, "max must be larger than min");
  x = x.masked_select(x.ge(lo).logical_and(x.le(hi)));
  Tensor bin = x.sub(lo).mul(bins).div(hi - lo, "floor").clamp_max(bins - 1);
  stack.clear();
  stack.emplace_back(at::bincount(bin, {}, bins).to(self.scalar_type()));
}

/// The fused cells compute in float32 for half and bfloat16 inputs, as CUDA's do.
Tensor opmath(const Tensor &t) { return t.to(at::toOpMathType(t.scalar_type())); }

/// `_thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias?, hidden_bias?)`:
/// (hy, cy, workspace), the workspace holding the activated gates i, f, g, o for the backward.
void lstmCell(const c10::OperatorHandle &, torch::jit::Stack &stack) {
  const Tensor inputGates = stack[0].toTensor(), cx = stack[2].toTensor();
  Tensor gates = opmath(inputGates) + opmath(stack[1].toTensor());
  for (int k : {3, 4})
    if (auto bias = optionalTensor(stack[k]))
      gates = gates + opmath(*bias);
  auto chunks = gates.chunk(4, 1);
  Tensor i = chunks[0].sigmoid(), f = chunks[1].sigmoid(), g = chunks[2].tanh(),
         o = chunks[3].sigmoid();
  Tensor cy = f * opmath(cx) + i * g;
  Tensor hy = o * cy.tanh();
  const auto dtype = inputGates.scalar_type();
  stack.clear();
  stack.emplace_back(hy.to(dtype));
  stack.emplace_back(cy.to(dtype));
  stack.emplace_back(at::cat({i, f, g, o}, 1).to(dtype));
}

/// `_thnn_fused_lstm_cell_backward_impl(grad_hy?, grad_cy?, cx, cy, workspace, has_bias)`:
/// (grad_gates, grad_cx, grad_bias), none of them if neither gradient is given.
void lstmCellBackward(const c10::OperatorHandle &, torch::jit::Stack &stack) {
  auto gradHy = optionalTensor(stack[0]), gradCy = optionalTensor(stack[1]);
  const Tensor cx = opmath(stack[2].toTensor()), cy = opmath(stack[3].toTensor());
  const Tensor workspace = stack[4].toTensor();
  const bool hasBias = stack[5].toBool();
  stack.clear();
  if (!gradHy && !gradCy) {
    stack.resize(3, Tensor()); // undefined, as kernels return a missing tensor
    return;
  }
  auto gates = opmath(workspace).chunk(4, 1);
  const Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  Tensor gh = gradHy ? opmath(*gradHy) : at::zeros_like(cy);
  Tensor tanhCy = cy.tanh();
  Tensor gc = gh * o * (1 - tanhCy * tanhCy);
  if (gradCy)
    gc = gc + opmath(*gradCy);
  Tensor gradGates = at::cat({gc * g * i * (1 - i), gc * cx * f * (1 - f), gc * i * (1 - g * g),
                              gh * tanhCy * o * (1 - o)},
                             1);
  const auto dtype = workspace.scalar_type();
  stack.emplace_back(gradGates.to(dtype));
  stack.emplace_back((gc * f).to(dtype));
  stack.emplace_back(hasBias ? gradGates.sum(0).to(dtype) : Tensor());
}

/// `_thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias?, hidden_bias?)`:
/// (hy, workspace), the workspace holding r, z, n, hx and the hidden gates' n part.
void gruCell(const c10::OperatorHandle &, torch::jit::Stack &stack) {
  const Tensor inputGates = stack[0].toTensor(), hx = opmath(stack[2].toTensor());
  Tensor in = opmath(inputGates), hidden = opmath(stack[1].toTensor());
  if (auto bias = optionalTensor(stack[3]))
    in = in + opmath(*bias);
  if (auto bias = optionalTensor(stack[4]))
    hidden = hidden + opmath(*bias);
  auto x = in.chunk(3, 1), h = hidden.chunk(3, 1);
  Tensor r = (x[0] + h[0]).sigmoid(), z = (x[1] + h[1]).sigmoid();
  Tensor n = (x[2] + r * h[2]).tanh();
  Tensor hy = n + z * (hx - n);
  const auto dtype = inputGates.scalar_type();
  stack.clear();
  stack.emplace_back(hy.to(dtype));
  stack.emplace_back(at::cat({r, z, n, hx, h[2]}, 1).to(dtype));
}

/// `_thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias)`: (grad_input_gates,
/// grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias).
void gruCellBackward(const c10::OperatorHandle &, torch::jit::Stack &stack) {
  const Tensor gh = opmath(stack[0].toTensor()), workspace = stack[1].toTensor();
  const bool hasBias = stack[2].toBool();
  auto w = opmath(workspace).chunk(5, 1);
  const Tensor &r = w[0], &z = w[1], &n = w[2], &hx = w[3], &hn = w[4];
  Tensor gz = gh * (hx - n) * z * (1 - z);
  Tensor gn = gh * (1 - z) * (1 - n * n);
  Tensor gr = gn * hn * r * (1 - r);
  Tensor gradInput = at::cat({gr, gz, gn}, 1), gradHidden = at::cat({gr, gz, gn * r}, 1);
  const auto dtype = workspace.scalar_type();
  stack.clear();
  stack.emplace_back(gradInput.to(dtype));
  stack.emplace_back(gradHidden.to(dtype));
  stack.emplace_back((gh * z).to(dtype));
  stack.emplace_back(hasBias ? gradInput.sum(0).to(dtype) : Tensor());
  stack.emplace_back(hasBias ? gradHidden.sum(0).to(dtype) : Tensor());
}

/// `_embedding_bag` and `_embedding_bag_forward_only`: CPU's kernel, with its auxiliary outputs
/// made what CUDA's are and the meta kernels promise. CPU leaves offset2bag empty on its fast
/// sum path, where CUDA gives each index its bag (the backward reads it); bag_size is sized as
/// the offsets are (one more with include_last_offset, whose last entry CUDA leaves unwritten:
/// zero here); max_indices is empty unless the mode is max.
void embeddingBag(const c10::OperatorHandle &op, torch::jit::Stack &stack) {
  const Tensor indices = stack[1].toTensor(), offsets = stack[2].toTensor();
  const int64_t mode = stack[4].toInt();
  const bool includeLastOffset = stack[7].toBool();
  op.callBoxed(stack);
  Tensor offset2bag = stack[1].toTensor(), bagSize = stack[2].toTensor();
  if (offset2bag.numel() != indices.numel()) {
    Tensor starts = includeLastOffset ? offsets.narrow(0, 0, offsets.numel() - 1) : offsets;
    stack[1] = (at::searchsorted(starts.contiguous(),
                                 at::arange(indices.numel(), indices.options().dtype(starts.dtype())),
                                 /*out_int32=*/false, /*right=*/true) -
                1)
                   .clamp_min(0)
                   .to(indices.scalar_type());
  }
  if (bagSize.numel() != offsets.numel())
    stack[2] = at::cat({bagSize, at::zeros({offsets.numel() - bagSize.numel()}, bagSize.options())});
  if (mode != 2) // max
    stack[3] = at::empty({0}, indices.options());
}

} // namespace

StandIn cpuStandIn(llvm::StringRef fullName) {
  if (fullName == "aten::histc")
    return &histc;
  if (fullName == "aten::_thnn_fused_lstm_cell")
    return &lstmCell;
  if (fullName == "aten::_thnn_fused_lstm_cell_backward_impl")
    return &lstmCellBackward;
  if (fullName == "aten::_thnn_fused_gru_cell")
    return &gruCell;
  if (fullName == "aten::_thnn_fused_gru_cell_backward")
    return &gruCellBackward;
  if (fullName == "aten::_embedding_bag" || fullName == "aten::_embedding_bag_forward_only")
    return &embeddingBag;
  return nullptr;
}

} // namespace rgpu::server
