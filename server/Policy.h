//===- server/Policy.h - What rgpu-opserver agrees to run -------------------===//
//
// An allow-list built from the op registry, not a deny-list: an op is admitted when it is an
// aten op whose schema is functional (no argument is written), whose results are tensors, whose
// every argument is of a kind rgpu carries, whose string arguments each have a table of the
// values they may take, and which does not belong to a refused family (sparse, nested,
// quantized and packed-weight tensors, unchecked indexing, test ops, ops that reach files,
// host memory or process state). Admission is decided on the op's name alone, before anything
// of a graph is interned or kept; the per-argument checks run when its plan is built.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/bridge/Bridge.h"
#include "rgpu/ir/Error.h"

#include <string>
#include <utility>
#include <vector>

namespace rgpu::server::policy {

/// Success if \p fullName ("aten::add.Tensor") may appear in a graph, else why not. Thread-safe.
llvm::Error admit(llvm::StringRef fullName);

/// Whether \p fullName is one of torch.distributed's functional collectives that graphs may hold
/// ("_c10d_functional::all_reduce", ...); they run on the plan executor only.
bool isCollective(llvm::StringRef fullName);

/// False for admitted ops that must not be compiled (the graphs holding them stay on the plan
/// executor): `_unsafe_index` and friends, whose eager kernels check their indices and whose
/// compiled code, by their contract, does not.
bool compilable(llvm::StringRef base);
/// True for the ops that grow their result's storage past the bytes of their input
/// (`resize`, `_resize_output`): the allocator leaves the grown bytes as it found them (CUDA's
/// caching allocator holds other sessions' data), so the plan zeroes them.
bool growsStorage(llvm::StringRef base);

/// Checks the value of a constant argument \p a of type \p type: ScalarType, Layout and
/// MemoryFormat in range, strings from the op's table, strides non-negative. \p str is the
/// argument's text for a string.
llvm::Error checkConstant(llvm::StringRef base, const c10::Argument &arg, bridge::ArgType type,
                          const ir::Arg &a, llvm::StringRef str);

/// Checks one element of an int list argument (sizes of factories, strides).
llvm::Error checkListElement(llvm::StringRef base, const c10::Argument &arg, int64_t value);

/// For the strided-view constructors (as_strided, _reshape_alias and their _copy and scatter
/// forms): success if the view that \p sizes, \p strides and \p offset describe lies inside
/// the storage of an operand laid out as \p base, else why not. Overflow-checked.
llvm::Error checkStridedView(const ir::TensorMeta &base, llvm::ArrayRef<int64_t> sizes,
                             llvm::ArrayRef<int64_t> strides, int64_t offset);

/// Every registered aten op the policy refuses, with the reason; sorted by name.
std::vector<std::pair<std::string, std::string>> refusedOps();

} // namespace rgpu::server::policy
