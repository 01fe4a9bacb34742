#include "rgpu/client/Replay.h"
#include "rgpu/ir/Bytes.h"

#include <llvm/ADT/DenseMap.h>

namespace rgpu::client {

TraceKey readTrace(llvm::ArrayRef<TraceNode *> nodes,
                   llvm::ArrayRef<std::pair<TraceNode *, uint32_t>> outputs) {
  TraceKey key;
  key.positions.reserve(nodes.size() * 8);
  ir::ByteWriter w(key.shape);
  llvm::DenseMap<const TraceNode *, uint32_t> index;
  llvm::DenseMap<const DeviceData *, uint32_t> inputIds;
  index.reserve(nodes.size());
  // Inputs first, by first use, as GraphCutter::buildGraph numbers them; their positions come first.
  for (const TraceNode *n : nodes)
    for (const Value &v : n->inputs)
      if (!v.pending() && inputIds.try_emplace(v.data.get(), uint32_t(key.inputs.size())).second) {
        key.inputs.push_back(v.data.get());
        const ir::TensorMeta &m = v.data->meta;
        w.put(m.dtype);
        w.put(uint32_t(m.sizes.size()));
        w.put(v.data->dynamicDims);
        key.positions.insert(key.positions.end(), m.sizes.begin(), m.sizes.end());
        key.positions.insert(key.positions.end(), m.strides.begin(), m.strides.end());
      }
  w.put(uint32_t(~0u));
  for (uint32_t k = 0; k < nodes.size(); ++k) {
    const TraceNode &n = *nodes[k];
    index[&n] = k;
    w.put(n.node.op.id());
    w.put(uint32_t(n.node.args.size()));
    for (const ir::Arg &a : n.node.args) {
      w.put(a.kind);
      if (a.kind == ir::Arg::Kind::Int)
        key.positions.push_back(a.i);
      else if (a.kind == ir::Arg::Kind::Double)
        w.put(a.d);
      else
        w.put(a.i);
    }
    w.put(uint32_t(n.node.strings.size()));
    for (const std::string &s : n.node.strings)
      w.str(s);
    for (const Value &v : n.inputs) {
      if (v.pending()) {
        auto it = index.find(v.node.get());
        w.put(uint8_t(1));
        // Every operand of a cut's node is in the cut, earlier in trace order.
        w.put(it == index.end() ? ~0u : it->second);
        w.put(v.index);
      } else {
        w.put(uint8_t(0));
        w.put(inputIds.lookup(v.data.get()));
      }
    }
    w.put(uint32_t(n.scalarSlots.size()));
    for (size_t s = 0; s < n.scalarSlots.size(); ++s) {
      w.put(n.scalarSlots[s].dtype);
      w.put(n.scalarSlots[s].form);
      key.scalars.push_back(&n.scalarValues[s]);
    }
    w.put(uint32_t(n.node.outputs.size()));
    for (const ir::TensorMeta &m : n.node.outputs) {
      w.put(m.dtype);
      w.put(uint32_t(m.sizes.size()));
      key.positions.insert(key.positions.end(), m.sizes.begin(), m.sizes.end());
      key.positions.insert(key.positions.end(), m.strides.begin(), m.strides.end());
    }
  }
  w.put(uint32_t(outputs.size()));
  for (auto [node, i] : outputs) {
    w.put(index.lookup(node));
    w.put(i);
  }
  w.finish();
  return key;
}

Replay *ReplayCache::find(const std::string &shape) {
  auto it = map_.find(shape);
  return it == map_.end() ? nullptr : &it->second;
}

Replay &ReplayCache::insert(const std::string &shape) {
  if (map_.size() >= kMaxEntries)
    map_.clear();
  Replay &r = map_[shape];
  r = Replay();
  return r;
}

} // namespace rgpu::client
