#include "Policy.h"

#include "rgpu/ir/OpFacts.h"

#include <llvm/ADT/StringMap.h>

#include <algorithm>
#include <mutex>

namespace rgpu::server::policy {

namespace {

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

/// Why rgpu refuses the op of \p schema ("refused: ..."), "" if it admits it: a value kept per
/// op (verdicts()), which admit() turns into a failure.
std::string verdict(const c10::FunctionSchema &schema) {
  llvm::StringRef base(schema.name());
  if (llvm::StringRef why = ir::refusal(base); !why.empty())
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
    if (t == bridge::ArgType::String && !ir::allowedStrings(base, a.name()))
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

} // namespace

bool isCollective(llvm::StringRef fullName) {
  return !fullName.contains('.') && ir::opFacts(fullName).has(ir::OpFact::Collective);
}

llvm::Error admit(llvm::StringRef fullName) {
  if (isCollective(fullName))
    return llvm::Error::success();
  if (!fullName.startswith("aten::"))
    return failure("only aten ops and torch.distributed's functional collectives are accepted");
  auto it = verdicts().find(fullName);
  if (it == verdicts().end())
    return failure("unknown op");
  return it->second.empty() ? llvm::Error::success() : failure(it->second);
}

bool growsStorage(llvm::StringRef base) { return ir::opFacts(base).has(ir::OpFact::GrowsStorage); }

bool compilable(llvm::StringRef base) {
  // A collective waits on the other servers of its group: it runs on the plan. A resize's
  // grown part is zeroed by the plan (growsStorage), which compiled code would not do.
  const ir::OpFacts facts = ir::opFacts(base);
  return base.startswith("aten::") && !facts.has(ir::OpFact::UncheckedOnceCompiled) &&
         !facts.has(ir::OpFact::GrowsStorage);
}

llvm::Error checkConstant(llvm::StringRef base, const c10::Argument &arg, bridge::ArgType type,
                          const ir::Arg &a, llvm::StringRef str) {
  std::string where = "argument '" + arg.name() + "'";
  switch (type) {
  case bridge::ArgType::ScalarType:
    if (!ir::dtype::isValid(int8_t(a.i)) || a.i != int8_t(a.i))
      return failure(where + " is dtype number " + std::to_string(a.i) + ", not one rgpu knows");
    return llvm::Error::success();
  case bridge::ArgType::Layout:
    if (a.i != ir::layout::Strided)
      return failure(where + " is layout number " + std::to_string(a.i) +
                     "; rgpu supports torch.strided only");
    return llvm::Error::success();
  case bridge::ArgType::MemoryFormat:
    if (!ir::memory_format::torchName(a.i))
      return failure(where + " is memory format number " + std::to_string(a.i) +
                     ", not one torch has");
    return llvm::Error::success();
  case bridge::ArgType::String: {
    if (isCollective(base) && arg.name() == "group_name")
      return llvm::Error::success(); // the session's own group: Groups::check
    const std::vector<llvm::StringRef> *table = ir::allowedStrings(base, arg.name());
    if (!table)
      return failure(where + " is a free-form string");
    if (std::find(table->begin(), table->end(), str) == table->end()) {
      std::string allowed;
      for (llvm::StringRef v : *table)
        allowed += (allowed.empty() ? "" : ", ") + v.str();
      return failure(where + " is not one of " + allowed);
    }
    return llvm::Error::success();
  }
  default: return llvm::Error::success();
  }
}

llvm::Error checkListElement(llvm::StringRef base, const c10::Argument &arg, int64_t value) {
  if (value >= 0)
    return llvm::Error::success();
  if (arg.name() == "stride")
    return failure("argument 'stride' has a negative stride");
  const ir::OpFacts facts = ir::opFacts(base);
  const bool sized = facts.has(ir::OpFact::Factory) || facts.has(ir::OpFact::StridedView);
  if (arg.name() == "size" && sized)
    return failure("argument 'size' has a negative size");
  return llvm::Error::success();
}

llvm::Error checkStridedView(const ir::TensorMeta &base, llvm::ArrayRef<int64_t> sizes,
                             llvm::ArrayRef<int64_t> strides, int64_t offset) {
  if (sizes.size() != strides.size())
    return failure("sizes and strides differ in rank");
  if (offset < 0)
    return failure("negative storage offset");
  // The last element the view reaches, in elements from the storage's start.
  int64_t last = offset;
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || strides[i] < 0)
      return failure("negative size or stride");
    if (sizes[i] == 0)
      empty = true;
    int64_t step;
    if (sizes[i] > 0 && (__builtin_mul_overflow(sizes[i] - 1, strides[i], &step) ||
                         __builtin_add_overflow(last, step, &last)))
      return failure("the view's extent overflows");
  }
  if (empty)
    return llvm::Error::success();
  int64_t bytes = base.storageBytes();
  unsigned item = ir::dtype::itemSize(base.dtype);
  int64_t elements = item ? bytes / item : 0;
  if (bytes < 0 || last >= elements)
    return failure("the view reaches element " + std::to_string(last) + " of a storage of " +
           std::to_string(elements) + " elements");
  return llvm::Error::success();
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
