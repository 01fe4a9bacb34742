//===- rgpu/client/MetaKernels.h - ATen's C++ meta kernels, called directly -===//
//
// `import torch` registers Python meta kernels (torch's decompositions) over the C++ ones of
// many ops, for symbolic tracing. Called on concrete meta tensors they cost 100 us to 2 ms
// each; the C++ kernels they hide, 2 to 10 us. The C++ kernels are the ones CPU eager runs
// before it computes (a structured op's meta function is shared with its CPU kernel), so they
// also give CPU's own sizes, strides and dtypes. The tracer calls them directly where they
// exist; torch's dispatcher is left as it is for everyone else in the process.
//
//===----------------------------------------------------------------------===//
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace rgpu::client {

/// Runs \p op on the meta tensors of \p stack with ATen's C++ meta kernel, as
/// `op.callBoxed(stack)` would run it, and throws as it would where the op is invalid. Returns
/// false, with \p stack untouched, if no C++ kernel is bound for \p op.
bool callCppMeta(const c10::OperatorHandle &op, torch::jit::Stack &stack);

/// The ops bound, "aten::add.Tensor", sorted.
std::vector<std::string> cppMetaOps();

/// A test mode: every op with a C++ kernel is also run by the dispatcher, and where the two
/// disagree (on an output's sizes, strides, dtype or math bits, or the dispatcher's raises), the
/// tracer notes it. torch's Python meta kernels do not always give CPU's strides (`div` with a
/// rounding mode gives a transposed operand's result contiguous strides, CPU the operand's);
/// tests compare a noted op's results with CPU eager.
void setCheckCppMetas(bool on);
bool checkCppMetas();
void noteCppMetaDisagreement(std::string what);
/// The disagreements noted since the last call.
std::vector<std::string> takeCppMetaDisagreements();

} // namespace rgpu::client
