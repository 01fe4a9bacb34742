#include "OpTables.h"

#include <llvm/ADT/StringSet.h>

namespace rgpu::client {

bool isDataDependent(llvm::StringRef name) {
  static const llvm::StringSet<> ops = {
      "aten::nonzero",           "aten::masked_select",       "aten::unique_consecutive",
      "aten::_unique",           "aten::_unique2",            "aten::unique_dim",
      "aten::unique_dim_consecutive", "aten::bincount",       "aten::repeat_interleave",
      "aten::_ctc_loss",
  };
  return ops.count(name) != 0;
}

bool producesOtherLayouts(llvm::StringRef name) {
  name.consume_front("aten::");
  name = name.ltrim('_');
  return name.startswith("to_sparse") || name.startswith("sparse_") ||
         name.startswith("to_mkldnn") || name.startswith("mkldnn_") ||
         name.startswith("quantize_per") || name.startswith("nested_") ||
         name.startswith("make_per_") || name.startswith("coo_") || name.startswith("csr_");
}

bool crossesDevices(llvm::StringRef name) { return name == "aten::copy"; }

bool acceptsCpuTensors(llvm::StringRef name) {
  return name == "aten::copy" || name == "aten::index" || name == "aten::index_put" ||
         name == "aten::_index_put_impl";
}

bool shapeFollowsScalars(llvm::StringRef name) {
  return name == "aten::arange" || name == "aten::range" || name == "aten::linspace" ||
         name == "aten::logspace";
}

} // namespace rgpu::client
