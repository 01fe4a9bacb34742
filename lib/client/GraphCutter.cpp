#include "GraphCutter.h"
#include "rgpu/wire/RunArgs.h"

#include <llvm/ADT/DenseMap.h>
#include <llvm/ADT/DenseSet.h>
#include <llvm/ADT/StringExtras.h>

#include <algorithm>
#include <optional>

namespace rgpu::client {

GraphCutter::Cut GraphCutter::collect(const LiveTensors &live) {
  // Live tensors with pending work, grouped by the value they hold.
  Cut cut;
  auto &outs = cut.outs;
  llvm::DenseMap<std::pair<TraceNode *, uint32_t>, uint32_t> outIndex;
  live.forEach([&](LazyTensorImpl *impl) {
    if (!impl->value.pending())
      return;
    auto key = std::make_pair(impl->value.node.get(), impl->value.index);
    auto [it, inserted] = outIndex.try_emplace(key, uint32_t(outs.size()));
    if (inserted)
      outs.push_back({key.first, key.second, {}});
    outs[it->second].impls.push_back(impl);
  });
  // A random op runs even if nothing holds its result: its draws advance the generator, as on
  // CPU, so later draws are CPU's. Its first output is a result nobody holds (released at once).
  llvm::DenseSet<TraceNode *> held;
  for (const Cut::Out &o : outs)
    held.insert(o.node);
  for (const auto &node : random_)
    if (held.insert(node.get()).second)
      outs.push_back({node.get(), 0, {}});
  cut.random = std::move(random_);
  random_.clear();
  nodesSinceCut_ = 0;
  if (outs.empty())
    return cut;
  std::sort(outs.begin(), outs.end(), [](const Cut::Out &a, const Cut::Out &b) {
    return a.node->seq != b.node->seq ? a.node->seq < b.node->seq : a.index < b.index;
  });

  // Every node the outputs need, in trace order (which is topological).
  auto &nodes = cut.nodes;
  llvm::DenseSet<TraceNode *> seen;
  std::vector<TraceNode *> work;
  for (const Cut::Out &o : outs)
    if (seen.insert(o.node).second)
      work.push_back(o.node);
  while (!work.empty()) {
    TraceNode *n = work.back();
    work.pop_back();
    nodes.push_back(n);
    for (const Value &v : n->inputs)
      if (v.pending() && seen.insert(v.node.get()).second)
        work.push_back(v.node.get());
  }
  std::sort(nodes.begin(), nodes.end(),
            [](const TraceNode *a, const TraceNode *b) { return a->seq < b->seq; });

  for (const Cut::Out &o : outs)
    cut.outputs.push_back({o.node, o.index});
  // Outputs that are new versions of device data (Versions.h): a cancelled run binds them back.
  // Functionalization keeps a view and its base as an alias of one another (a Parameter is a
  // detach of its data, and its base is regenerated from the value written): an alias of a
  // version is a version of the same data, and so is what a version aliases.
  llvm::DenseMap<std::pair<TraceNode *, uint32_t>, uint64_t> versions;
  for (const Cut::Out &o : outs)
    for (LazyTensorImpl *impl : o.impls)
      if (impl->versionOf) {
        versions[{o.node, o.index}] = impl->versionOf;
        break;
      }
  if (versions.empty())
    return cut;
  // The value \p node's output \p index is an alias of, if it is one (same layout).
  using Output = std::pair<TraceNode *, uint32_t>;
  auto aliased = [](TraceNode *node, uint32_t index) -> std::optional<Output> {
    llvm::StringRef op = node->node.op.str();
    if (!ir::opFacts(op).has(ir::OpFact::Alias) || node->inputs.size() != 1 ||
        !node->inputs[0].pending())
      return std::nullopt;
    const Value &in = node->inputs[0];
    if (!(in.node->node.outputs[in.index] == node->node.outputs[index]))
      return std::nullopt;
    return std::make_pair(in.node.get(), in.index);
  };
  for (const Cut::Out &o : outs)
    if (auto source = aliased(o.node, o.index))
      if (auto it = versions.find({o.node, o.index}); it != versions.end())
        versions.try_emplace(*source, it->second);
  for (size_t k = 0; k < outs.size(); ++k) {
    std::optional<Output> at = Output{outs[k].node, outs[k].index};
    for (int hops = 0; at && hops < 4; ++hops, at = aliased(at->first, at->second))
      if (auto it = versions.find(*at); it != versions.end()) {
        cut.restores.insert(cut.restores.end(), {uint64_t(k), it->second});
        break;
      }
  }
  return cut;
}

GraphCutter::Traced GraphCutter::buildGraph(
    llvm::ArrayRef<TraceNode *> nodes, llvm::ArrayRef<std::pair<TraceNode *, uint32_t>> outputs) {
  // Inputs are numbered by first sight, then node outputs in trace order.
  Traced t;
  ir::Graph &g = t.graph;
  llvm::DenseMap<DeviceData *, uint32_t> inputIds;
  llvm::DenseMap<TraceNode *, uint32_t> firstValue;
  llvm::DenseMap<uint32_t, uint32_t> locIds;
  for (TraceNode *n : nodes)
    for (const Value &v : n->inputs)
      if (!v.pending() && inputIds.try_emplace(v.data.get(), uint32_t(g.inputs.size())).second) {
        t.inputHandles.push_back(v.data->handle);
        t.inputDynamicDims.push_back(v.data->dynamicDims);
        g.inputs.push_back(v.data->meta);
      }
  uint32_t next = g.inputs.size();
  g.nodes.reserve(nodes.size());
  t.clientLocs.push_back(0);
  for (TraceNode *n : nodes) {
    firstValue[n] = next;
    g.nodes.push_back(n->node);
    ir::Node &node = g.nodes.back();
    node.operands.clear();
    for (const Value &v : n->inputs)
      node.operands.push_back(v.pending() ? firstValue.lookup(v.node.get()) + v.index
                                          : inputIds.lookup(v.data.get()));
    node.scalars.clear();
    for (size_t s = 0; s < n->scalarSlots.size(); ++s) {
      node.scalars.push_back(g.scalars.size());
      g.scalars.push_back(n->scalarSlots[s]);
      t.scalarValues.push_back(n->scalarValues[s]);
    }
    auto [it, inserted] = locIds.try_emplace(n->location, 0);
    if (inserted) {
      it->second = g.addLocation(locations_.text(n->location));
      if (it->second == t.clientLocs.size())
        t.clientLocs.push_back(n->location);
    }
    node.loc = it->second;
    next += node.outputs.size();
  }
  for (auto [node, index] : outputs)
    g.outputs.push_back(firstValue.lookup(node) + index);
  return t;
}

GraphCutter::Resolved GraphCutter::resolve(Traced t, bool replyMetas, const TraceKey *key,
                                           uint32_t site) {
  ir::Canonical c = ir::canonicalize(t.graph);
  Resolved r;
  r.hash = c.hash;
  // A member of a family of graphs that differ only in sizes runs as the family's symbolic
  // graph (rgpu/ir/Symbolic.h).
  ir::ShapeFamilies::Fit fit;
  const bool mayFit = dynamic_ && !replyMetas;
  llvm::SmallVector<uint32_t, 4> hinted; // input-size positions declared dynamic
  if (mayFit) {
    uint32_t p = 0;
    for (size_t j = 0; j < c.graph.inputs.size(); ++j) {
      const uint64_t dims = t.inputDynamicDims[c.inputOrder[j]];
      const size_t rank = c.graph.inputs[j].sizes.size();
      for (size_t d = 0; d < rank && d < 64; ++d)
        if (dims >> d & 1)
          hinted.push_back(p + d);
      p += rank + c.graph.inputs[j].strides.size();
    }
  }
  if (mayFit && families_.fit(c.graph, c.hash, fit, hinted)) {
    if (fit.isNew) {
      ++stats_.graphsGeneralized;
      log_(20, "rgpu: " + locations_.text(site) +
                   (fit.fromHints ? " cut a graph whose inputs have sizes declared dynamic"
                                  : " cut a graph that differs from an earlier one only in sizes") +
                   "; it now runs as one graph over " + std::to_string(fit.graph->symbolCount) +
                   " size symbol(s) (" + llvm::join(ir::symbolSources(*fit.graph), ", ") +
                   "), whatever those sizes are. RGPU_DYNAMIC=0 turns this off.");
    }
    r.hash = fit.hash;
    r.graph = fit.graph;
    r.symbolic = true;
    r.symbols = fit.symbols;
  }
  for (uint32_t i : c.inputOrder)
    r.handles.push_back(t.inputHandles[i]);
  for (uint32_t s : c.scalarOrder)
    r.scalars.push_back(t.scalarValues[s]);
  r.outputs = c.graph.outputs.size();
  // Where each canonical node came from in this trace, for error messages.
  for (const ir::Node &node : c.graph.nodes)
    r.locations.push_back(t.clientLocs[node.loc]);

  if (key && !replyMetas && key->positions == ir::positions(t.graph)) {
    // Later cuts of this trace shape skip building, canonicalizing and fitting their graph.
    // Where the canonical graph takes each position from: canonicalize a copy of the trace's
    // graph whose positions are their own indices.
    ir::Graph numbered = t.graph;
    int64_t next = 0;
    ir::forEachPosition(numbered, [&](int64_t &v) { v = next++; });
    Replay &replay = replays_.insert(key->shape);
    for (int64_t k : ir::positions(ir::canonicalize(numbered).graph))
      replay.positionOrder.push_back(uint32_t(k));
    replay.inputOrder.assign(c.inputOrder.begin(), c.inputOrder.end());
    replay.scalarOrder.assign(c.scalarOrder.begin(), c.scalarOrder.end());
    replay.nodeOrder = c.nodeOrder;
    replay.outputs = r.outputs;
    replay.positions = ir::positions(c.graph);
    replay.hash = c.hash;
    if (r.graph) {
      replay.fit = fit;
      replay.fit.isNew = replay.fit.fromHints = false;
    }
    if (dynamic_)
      replay.candidates = families_.candidates(c.graph);
    replay.generation = families_.generation();
  }
  if (!r.graph)
    r.graph = std::make_shared<const ir::Graph>(std::move(c.graph));
  return r;
}

bool GraphCutter::replay(const TraceKey &key, const Cut &cut, const GraphBudget &budget,
                         Resolved &res, uint32_t site) {
  Replay *r = replays_.find(key.shape);
  if (!r || r->generation != families_.generation() ||
      r->positionOrder.size() != key.positions.size())
    return false;
  std::vector<int64_t> concrete(r->positionOrder.size());
  for (size_t k = 0; k < concrete.size(); ++k)
    concrete[k] = key.positions[r->positionOrder[k]];
  if (concrete == r->positions) {
    // The same graph as last time: it runs as it ran then.
    res.hash = r->fit.graph ? r->fit.hash : r->hash;
    res.graph = r->fit.graph;
    res.symbols = r->fit.symbols;
    if (!res.graph && !budget.holds(res.hash))
      return false; // the server forgot it: the full path has the graph to define again
  } else {
    // Other sizes: an instance of one of the family's symbolic graphs, tried as fit tries them.
    auto it = std::find_if(r->candidates.begin(), r->candidates.end(), [&](const auto &c) {
      return ir::matchPositions(*c.graph, c.positions, concrete, res.symbols);
    });
    if (it == r->candidates.end())
      return false;
    res.hash = it->hash;
    res.graph = it->graph;
  }
  res.symbolic = res.graph != nullptr;
  for (uint32_t i : r->inputOrder)
    res.handles.push_back(key.inputs[i]->handle);
  for (uint32_t i : r->scalarOrder)
    res.scalars.push_back(*key.scalars[i]);
  res.outputs = r->outputs;
  for (uint32_t n : r->nodeOrder)
    res.locations.push_back(cut.nodes[n]->location);
  if (checkReplays_) {
    Resolved full = resolve(buildGraph(cut.nodes, cut.outputs), false, &key, site);
    if (full.hash != res.hash || full.symbols != res.symbols || full.handles != res.handles ||
        !std::equal(full.scalars.begin(), full.scalars.end(), res.scalars.begin(),
                    res.scalars.end(), wire::sameBits) ||
        full.outputs != res.outputs || full.locations != res.locations)
      raise(ErrorKind::Remote, "rgpu: a replayed cut differs from its graph (" + full.hash.hex() +
                                   " vs " + res.hash.hex() + ")");
  }
  return true;
}

} // namespace rgpu::client
