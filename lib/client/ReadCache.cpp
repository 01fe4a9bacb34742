#include "ReadCache.h"

#include "rgpu/client/Replay.h"
#include "rgpu/ir/Bytes.h"

#include <llvm/ADT/STLExtras.h>

namespace rgpu::client {

const at::Tensor *ReadCache::find(const std::string &key) {
  auto it = index_.find(key);
  if (it == index_.end())
    return nullptr;
  entries_.splice(entries_.end(), entries_, it->second);
  return &it->second->second;
}

void ReadCache::remember(std::string key, at::Tensor value) {
  if (entries_.size() >= kMaxEntries) {
    index_.erase(entries_.front().first);
    entries_.pop_front();
  }
  entries_.emplace_back(key, std::move(value));
  index_.emplace(std::move(key), std::prev(entries_.end()));
}

std::optional<std::string> readKey(const Value &v, const ir::TensorMeta &want,
                                   uint64_t firstHandle) {
  const int64_t bytes = want.storageBytes();
  if (bytes < 0 || bytes > ReadCache::kMaxBytes)
    return std::nullopt;
  // The nodes that compute v. Random draws differ from run to run; ops outside aten
  // (collectives) read other ranks.
  constexpr size_t kMaxNodes = 8;
  llvm::SmallVector<TraceNode *, kMaxNodes> nodes;
  llvm::SmallVector<const Value *, 16> work{&v};
  while (!work.empty()) {
    const Value &x = *work.pop_back_val();
    if (!x.pending()) {
      if (!x.data || x.data->handle < firstHandle)
        return std::nullopt;
      continue;
    }
    TraceNode *t = x.node.get();
    if (llvm::is_contained(nodes, t))
      continue;
    if (nodes.size() == kMaxNodes || t->node.random || !t->node.op.str().startswith("aten::"))
      return std::nullopt;
    nodes.push_back(t);
    for (const Value &input : t->inputs)
      work.push_back(&input);
  }
  llvm::sort(nodes, [](const TraceNode *a, const TraceNode *b) { return a->seq < b->seq; });
  // What a replay of this trace would key on, and what it leaves out: the positions, the
  // handles read and the scalars' values.
  TraceKey trace = readTrace(nodes, {{v.node.get(), v.index}});
  std::string key = std::move(trace.shape);
  ir::ByteWriter w(key);
  w.write(trace.positions.data(), trace.positions.size() * sizeof(int64_t));
  for (const DeviceData *d : trace.inputs)
    w.put(d->handle);
  for (const ir::ScalarValue *s : trace.scalars) {
    w.put(s->kind);
    w.put(s->i);
    w.put(s->d);
    w.put(s->imag);
  }
  w.put(want.dtype);
  w.write(want.strides.data(), want.strides.size() * sizeof(int64_t));
  w.finish();
  return key;
}

} // namespace rgpu::client
