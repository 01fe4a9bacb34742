//===- lib/client/Attention.cpp - scaled_dot_product_attention picks the server's kernel ===//
//
// F.scaled_dot_product_attention asks a per-device stub which kernel to run; a device without
// one gets the math kernel, written in smaller ops. rgpu answers for the device its tensors
// live on: on a CPU server, CPU's own choice, so the server runs the kernel CPU eager runs
// (its fused flash kernel for CPU, forward and backward) and the results are CPU's, bit for
// bit, where the math kernel differs by rounding (visibly in bfloat16 gradients). The choice
// reads only sizes, dtypes and torch.backends' flags, never data. A CUDA server's kernels are
// chosen from the device's capabilities, which this client does not know: it keeps the math
// kernel there, as before.
//
//===----------------------------------------------------------------------===//
#include "rgpu/client/Session.h"

#include <ATen/ATen.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>

namespace {

using rgpu::client::Session;

bool onCpuServer(const at::Tensor &query) {
  try {
    const auto devices = Session::get().serverHello().devices;
    const size_t index = std::max<int>(0, query.device().index());
    return index < devices.size() && devices[index] == "cpu";
  } catch (const std::exception &) {
    return false; // unreachable: the next sync says why
  }
}

int64_t sdpChoice(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                  const std::optional<at::Tensor> &mask, double dropout, bool causal,
                  std::optional<double> scale, bool gqa) {
  if (!onCpuServer(query))
    return int64_t(sdp::SDPBackend::math);
  return at::_ops::_fused_sdp_choice::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                 query, key, value, mask, dropout, causal, scale,
                                                 gqa);
}

} // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &sdpChoice)
} // namespace at::native
