#include "rgpu/client/Session.h"
#include "rgpu/client/Interrupts.h"
#include "rgpu/client/KnownValues.h"
#include "rgpu/net/Auth.h"

#include "rgpu/bridge/Bridge.h"
#include "rgpu/ir/Bytes.h"
#include "rgpu/wire/Cache.h"
#include "rgpu/wire/Planes.h"

#include <ATen/ATen.h>
#include <llvm/ADT/StringExtras.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstring>
#include <optional>
#include <random>
#include <unistd.h>

namespace rgpu::client {

namespace {
ErrorRaiser gRaiser = nullptr;
LocationProvider gLocation = nullptr;

/// Frames below this size are packed; larger ones carry tensor bytes, which do not pack.
constexpr uint64_t kPackBelow = 64 << 10;
/// Uploads up to this size wait for the next frame; larger ones are sent at once.
constexpr uint64_t kSmallUpload = 64 << 10;
/// Upload chunks smaller than this always go as they are.
constexpr uint64_t kCompressedUpload = 4 << 10;
/// RGPU_COMPRESS=auto compresses uploads on a link with at least this round trip.
constexpr auto kCompressRoundTrip = std::chrono::milliseconds(2);
/// Bytes of frames sent without a reply after which the next frame waits for one.
constexpr uint64_t kMaxUnacknowledged = uint64_t(256) << 20;
/// A trace that never syncs is cut (without waiting) after this many nodes.
constexpr uint64_t kNodeCap = 20000;
/// An output this small comes back with the reply to its run, up to kValueBudget per cut: a
/// loss, an accuracy, a gradient norm, GradScaler's found_inf.
constexpr uint64_t kValueBytes = 16;
constexpr uint64_t kValueBudget = 256;
/// Frames whose replies are outstanding, whatever RGPU_MAX_INFLIGHT allows.
constexpr size_t kMaxInFlightFrames = 64;

} // namespace

void setErrorRaiser(ErrorRaiser raiser) { gRaiser = raiser; }
void setLocationProvider(LocationProvider provider) { gLocation = provider; }

void raise(ErrorKind kind, const std::string &message, const std::string &pythonType) {
  if (gRaiser)
    gRaiser(kind, message, pythonType);
  throw std::runtime_error(message);
}

/// A command waiting for the next frame.
struct Session::Command {
  wire::Command::Which kind;
  ir::Hash256 hash;
  std::shared_ptr<const ir::Graph> graph;
  std::vector<uint64_t> handles;
  std::vector<ir::ScalarValue> scalars;
  uint64_t handle = 0;
  uint32_t count = 0;
  bool replyMetas = false;
  bool resetPeak = false, emptyCache = false; ///< A MemoryRequest's.
  uint8_t device = 0;                          ///< An Upload's or a MemoryRequest's.
  std::string store, prefix;                  ///< A JoinGroup's (rank: handle, size: count).
  std::optional<std::string> rngState;        ///< A RngStateRequest's state to set.
  uint64_t generator = 0;                     ///< A RngStateRequest's or GeneratorRequest's.
  wire::GeneratorRequest::Which generatorOp = wire::GeneratorRequest::CREATE;
  uint64_t generatorArg = 0; ///< The seed (CREATE, SEED) or the generator cloned (CLONE_OF).
  ir::TensorMeta meta;
  at::Tensor data; ///< A private CPU copy of an upload's bytes.
  uint64_t offset = 0, length = 0;
  std::string encoded; ///< An upload chunk compressed by byte plane (rgpu/wire/Planes.h).
  std::string executor; ///< A Define's executor hint.
  std::vector<ir::Hash256> hashes; ///< A Forget's graphs.
  llvm::SmallVector<int64_t, 4> symbols; ///< A Run's symbol values (of a symbolic graph).
  llvm::IntrusiveRefCntPtr<DeviceData> valueOf; ///< A Download that brings this data's value.
  std::vector<uint32_t> restores; ///< A Run's wire::Run.restores.
};

Session &Session::get() {
  static Session *session = new Session(); // outlives every tensor, even at exit
  return *session;
}

Session::Session()
    : transport_([this](int level, const std::string &message) { log(level, message); }),
      diagnostics_([this](int level, const std::string &message) { log(level, message); }) {
  transport_.setInterruptCheck([] { return interrupts::take(); });
  if (const char *n = std::getenv("RGPU_MAX_INFLIGHT"))
    maxInflight_ = size_t(std::clamp(std::atoi(n), 1, int(kMaxInFlightFrames)));
  if (const char *d = std::getenv("RGPU_DYNAMIC"))
    dynamic_ = std::string(d) != "0";
  if (const char *z = std::getenv("RGPU_COMPRESS"); z && *z) {
    std::string v = z;
    compress_ = v == "0" || v == "off" ? Compress::Never
                : v == "1" || v == "on" ? Compress::Always
                                        : Compress::Auto;
  }
}

std::string Session::server() const { return transport_.address(); }

Session::Lock::Lock(Session &session) : session_(session) {
  session_.mu_.lock();
  ++session_.depth_;
}

Session::Lock::~Lock() {
  std::vector<std::pair<int, std::string>> logs;
  LogSink sink = session_.logSink_;
  if (--session_.depth_ == 0)
    logs.swap(session_.pendingLogs_);
  session_.mu_.unlock();
  for (const auto &[level, message] : logs) {
    try {
      sink(level, message);
    } catch (...) {
      // A logging handler that fails loses its record, never the operation (which may be
      // unwinding with an error of its own).
    }
  }
}

void Session::log(int level, const std::string &message) {
  if (logSink_ && (level > 10 || logDebug_))
    pendingLogs_.emplace_back(level, message); // under the session lock; see Lock
}

void Session::track(LazyTensorImpl *impl) {
  Lock lock(*this);
  impl->next = head_;
  if (head_)
    head_->prev = impl;
  head_ = impl;
  ++live_;
}

void Session::untrack(LazyTensorImpl *impl) {
  Lock lock(*this);
  if (impl->prev)
    impl->prev->next = impl->next;
  else
    head_ = impl->next;
  if (impl->next)
    impl->next->prev = impl->prev;
  --live_;
}

uint64_t Session::nextSeq() {
  ++nodesSinceCut_;
  ++stats.opsTraced;
  return ++nodeSeq_;
}

uint32_t Session::internLocation(const std::string &loc) {
  std::lock_guard<std::mutex> lock(locationsMu_);
  auto [it, inserted] = locationIds_.try_emplace(loc, uint32_t(locations_.size()));
  if (inserted)
    locations_.push_back(loc);
  return it->second;
}

uint32_t Session::currentLocation() { return gLocation ? gLocation() : 0; }

std::string Session::locationText(uint32_t id) {
  std::lock_guard<std::mutex> lock(locationsMu_);
  return id < locations_.size() ? locations_[id] : locations_[0];
}

void Session::release(uint64_t handle) {
  Lock lock(*this);
  if (!lost() && handle >= firstHandle_)
    releases_.push_back(handle);
}

void Session::checkCurrent(const Value &v) {
  if (!v.pending() && v.data && v.data->handle < firstHandle_)
    raise(ErrorKind::SessionLost,
          "this tensor belonged to an rgpu session that was lost; rgpu.reset() started a new "
          "one, and the tensor's value is gone: create it again");
}

void Session::close() {
  // A forked child says nothing on its parent's connection, and does not wait for the lock,
  // which a thread of the parent may have held at the fork.
  if (transport_.inherited())
    return transport_.close();
  // At exit: what is queued and unsent is dropped (nothing can read its results), and the Bye
  // is sent once, without a resume, so a dead server never delays the exit.
  Lock lock(*this);
  inflight_.clear();
  queue_.clear();
  releases_.clear();
  transport_.close();
}

void Session::reset() {
  Lock lock(*this);
  transport_.reset();
  lastRuns_.clear();
  inflight_.clear();
  deferredError_.clear();
  deferredErrorType_.clear();
  lastReply_ = 0;
  queue_.clear();
  releases_.clear();
  group_.clear();
  fetched_.clear();
  remembered_.clear();
  rememberedIndex_.clear();
  held_.clear();
  heldIndex_.clear();
  heldBytes_ = 0;
  runsInFrame_.clear();
  retired_.clear();
  nodesSinceCut_ = 0;
  // Every live tensor of the old session now names handle 0, below every handle of the new
  // one: using it raises (checkCurrent), and freeing it sends nothing.
  firstHandle_ = nextHandle_;
  for (LazyTensorImpl *impl = head_; impl; impl = impl->next) {
    ir::TensorMeta meta = impl->value.pending()
                              ? impl->value.node->node.outputs[impl->value.index]
                              : impl->value.data->meta;
    impl->value = Value{nullptr, 0, llvm::IntrusiveRefCntPtr<DeviceData>(
                                        new DeviceData(0, std::move(meta)))};
  }
  log(20, "rgpu: a new session starts at the next operation (rgpu.reset())");
}

void Session::cutBeforeRng(const char *reason) {
  if (!randomNodes_.empty())
    cut(reason);
}

void Session::seed(uint64_t value) {
  Lock lock(*this);
  cutBeforeRng("torch.manual_seed");
  Command c;
  c.kind = wire::Command::SEED;
  c.handle = value;
  queue(std::move(c));
}

void Session::queue(Command c) {
  if (lost())
    raise(ErrorKind::SessionLost, transport_.lostReason());
  queue_.push_back(std::move(c));
}

//===----------------------------------------------------------------------===//
// Cutting the trace into a graph
//===----------------------------------------------------------------------===//

Session::Traced Session::buildGraph(llvm::ArrayRef<TraceNode *> nodes,
                                    llvm::ArrayRef<std::pair<TraceNode *, uint32_t>> outputs) {
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
      it->second = g.addLocation(locationText(n->location));
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

uint64_t Session::queueRun(Traced t, bool replyMetas, const char *reason,
                           const std::string &executor, const TraceKey *key) {
  return queueResolved(resolve(std::move(t), replyMetas, key), replyMetas, reason, executor);
}

Session::Resolved Session::resolve(Traced t, bool replyMetas, const TraceKey *key) {
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
      ++stats.graphsGeneralized;
      log(20, "rgpu: " + locationText(site_) +
                  (fit.fromHints ? " cut a graph whose inputs have sizes declared dynamic"
                                 : " cut a graph that differs from an earlier one only in sizes") +
                  "; it now runs as one graph over " +
                  std::to_string(fit.graph->symbolCount) + " size symbol(s) (" +
                  llvm::join(ir::symbolSources(*fit.graph), ", ") + "), whatever those sizes are. RGPU_DYNAMIC=0 "
                  "turns this off.");
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

bool Session::replay(const TraceKey &key, llvm::ArrayRef<TraceNode *> nodes, Resolved &res) {
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
    if (!res.graph && !heldIndex_.count(res.hash))
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
    res.locations.push_back(nodes[n]->location);
  return true;
}

uint64_t Session::queueResolved(Resolved r, bool replyMetas, const char *reason,
                                const std::string &executor) {
  Command run;
  run.kind = wire::Command::RUN;
  run.hash = r.hash;
  run.symbols = std::move(r.symbols);
  run.handles = std::move(r.handles);
  run.scalars = std::move(r.scalars);
  run.count = r.outputs;
  run.handle = newHandles(run.count);
  run.replyMetas = replyMetas;
  for (size_t k = 0; k + 1 < restores_.size(); k += 2) {
    auto input = std::find(run.handles.begin(), run.handles.end(), restores_[k + 1]);
    if (input != run.handles.end())
      run.restores.insert(run.restores.end(),
                          {uint32_t(restores_[k]), uint32_t(input - run.handles.begin())});
  }
  restores_.clear();
  const size_t nodes = r.locations.size();
  nodeLocations_[r.hash] = std::move(r.locations);
  if (r.symbolic)
    ++stats.symbolicRuns;
  if (logSink_ && logDebug_)
    log(10, std::string("cut (") + reason + ") at " + locationText(site_) + ": " +
                std::to_string(nodes) + " nodes, graph " + r.hash.hex().substr(0, 12));
  if (!lost() && !transport_.connected())
    transport_.connect(); // the graph budget comes with the Hello's reply
  if (hold(r.hash, r.graph.get())) {
    Command def;
    def.kind = wire::Command::DEFINE;
    def.hash = r.hash;
    def.graph = r.graph;
    def.executor = executor;
    if (!diagnostics_.known(r.hash))
      diagnostics_.newGraph(r.hash, def.graph, reason, site_, locationText(site_));
    else
      log(10, "define graph " + r.hash.hex().substr(0, 12) + " again (forgotten to stay "
              "under the server's graph memory)");
    ++stats.graphsShipped;
    queue(std::move(def));
  }
  diagnostics_.ran(r.hash);
  runsInFrame_.push_back(r.hash);
  ++stats.graphRuns;
  uint64_t first = run.handle;
  queue(std::move(run));
  return first;
}

bool Session::hold(const ir::Hash256 &hash, const ir::Graph *graph) {
  if (auto it = heldIndex_.find(hash); it != heldIndex_.end()) {
    held_.splice(held_.begin(), held_, it->second);
    return false;
  }
  TORCH_INTERNAL_ASSERT(graph, "rgpu: graph ", hash.hex(), " is neither held nor at hand");
  const uint64_t bytes = ir::graphBytes(*graph); // only for a graph the server lacks
  Command forget;
  forget.kind = wire::Command::FORGET;
  while (transport_.graphBudget() && heldBytes_ + bytes > transport_.graphBudget() &&
         !held_.empty()) {
    // Its runs already queued come before this Forget; a later run defines it again.
    auto [victim, victimBytes] = held_.back();
    forget.hashes.push_back(victim);
    heldIndex_.erase(victim);
    heldBytes_ -= victimBytes;
    held_.pop_back();
    ++stats.graphsForgotten;
  }
  if (!forget.hashes.empty())
    queue(std::move(forget));
  held_.emplace_front(hash, bytes);
  heldIndex_[hash] = held_.begin();
  heldBytes_ += bytes;
  return true;
}

namespace {
/// Equal as stored (a NaN equals itself).
bool sameBits(const ir::ScalarValue &a, const ir::ScalarValue &b) {
  return a.kind == b.kind && a.i == b.i && std::memcmp(&a.d, &b.d, sizeof a.d) == 0 &&
         std::memcmp(&a.imag, &b.imag, sizeof a.imag) == 0;
}
} // namespace

Session::CutOutputs Session::cut(const char *reason, const std::string &executor) {
  // Live tensors with pending work, grouped by the value they hold.
  struct Out {
    TraceNode *node;
    uint32_t index;
    llvm::SmallVector<LazyTensorImpl *, 2> impls;
  };
  llvm::DenseMap<std::pair<TraceNode *, uint32_t>, uint32_t> outIndex;
  std::vector<Out> outs;
  for (LazyTensorImpl *impl = head_; impl; impl = impl->next) {
    if (!impl->value.pending())
      continue;
    auto key = std::make_pair(impl->value.node.get(), impl->value.index);
    auto [it, inserted] = outIndex.try_emplace(key, uint32_t(outs.size()));
    if (inserted)
      outs.push_back({key.first, key.second, {}});
    outs[it->second].impls.push_back(impl);
  }
  // A random op runs even if nothing holds its result: its draws advance the generator, as on
  // CPU, so later draws are CPU's. Its first output is a result nobody holds (released at once).
  llvm::DenseSet<TraceNode *> held;
  for (const Out &o : outs)
    held.insert(o.node);
  for (const auto &node : randomNodes_)
    if (held.insert(node.get()).second)
      outs.push_back({node.get(), 0, {}});
  const auto randomNodes = std::move(randomNodes_); // kept alive through this cut
  randomNodes_.clear();
  nodesSinceCut_ = 0;
  CutOutputs placed;
  if (outs.empty()) {
    queueGeneratorDrops();
    return placed;
  }
  std::sort(outs.begin(), outs.end(), [](const Out &a, const Out &b) {
    return a.node->seq != b.node->seq ? a.node->seq < b.node->seq : a.index < b.index;
  });

  // Every node the outputs need, in trace order (which is topological).
  std::vector<TraceNode *> nodes;
  llvm::DenseSet<TraceNode *> seen;
  std::vector<TraceNode *> work;
  for (const Out &o : outs)
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

  std::vector<std::pair<TraceNode *, uint32_t>> outputs;
  for (const Out &o : outs)
    outputs.push_back({o.node, o.index});
  // Outputs that are new versions of device data (Versions.h): a cancelled run binds them back.
  // Functionalization keeps a view and its base as an alias of one another (a Parameter is a
  // detach of its data, and its base is regenerated from the value written): an alias of a
  // version is a version of the same data, and so is what a version aliases.
  llvm::DenseMap<std::pair<TraceNode *, uint32_t>, uint64_t> versions;
  for (const Out &o : outs)
    for (LazyTensorImpl *impl : o.impls)
      if (impl->versionOf) {
        versions[{o.node, o.index}] = impl->versionOf;
        break;
      }
  // The value \p node's output \p index is an alias of, if it is one (same layout).
  using Output = std::pair<TraceNode *, uint32_t>;
  auto aliased = [](TraceNode *node, uint32_t index) -> std::optional<Output> {
    llvm::StringRef op = node->node.op.str();
    if ((op != "aten::detach_copy" && op != "aten::alias_copy") || node->inputs.size() != 1 ||
        !node->inputs[0].pending())
      return std::nullopt;
    const Value &in = node->inputs[0];
    if (!(in.node->node.outputs[in.index] == node->node.outputs[index]))
      return std::nullopt;
    return std::make_pair(in.node.get(), in.index);
  };
  restores_.clear();
  if (!versions.empty()) {
    for (const Out &o : outs)
      if (auto source = aliased(o.node, o.index))
        if (auto it = versions.find({o.node, o.index}); it != versions.end())
          versions.try_emplace(*source, it->second);
    for (size_t k = 0; k < outs.size(); ++k) {
      std::optional<Output> at = Output{outs[k].node, outs[k].index};
      for (int hops = 0; at && hops < 4; ++hops, at = aliased(at->first, at->second))
        if (auto it = versions.find(*at); it != versions.end()) {
          restores_.insert(restores_.end(), {uint64_t(k), it->second});
          break;
        }
    }
  }
  TraceKey key = readTrace(nodes, outputs);
  Resolved replayed;
  uint64_t first;
  if (!replay(key, nodes, replayed)) {
    first = queueRun(buildGraph(nodes, outputs), false, reason, executor, &key);
  } else {
    if (checkReplays_) {
      Resolved full = resolve(buildGraph(nodes, outputs), false, &key);
      if (full.hash != replayed.hash || full.symbols != replayed.symbols ||
          full.handles != replayed.handles ||
          !std::equal(full.scalars.begin(), full.scalars.end(), replayed.scalars.begin(),
                      replayed.scalars.end(), sameBits) ||
          full.outputs != replayed.outputs || full.locations != replayed.locations)
        raise(ErrorKind::Remote, "rgpu: a replayed cut differs from its graph (" +
                                     full.hash.hex() + " vs " + replayed.hash.hex() + ")");
    }
    ++stats.cutsReplayed;
    first = queueResolved(std::move(replayed), false, reason, executor);
  }

  // The live tensors now hold device data. Their traced nodes go after the frame is sent (the
  // server runs meanwhile); the device data those nodes read goes now, so that its handles
  // are released in this frame, as when the nodes went at once.
  for (const Out &o : outs)
    retired_.emplace_back(o.node);
  for (TraceNode *n : nodes)
    for (Value &v : n->inputs)
      v.data = nullptr;
  uint64_t valueBudget = kValueBudget;
  for (size_t k = 0; k < outs.size(); ++k) {
    ir::TensorMeta meta = outs[k].node->node.outputs[outs[k].index];
    llvm::IntrusiveRefCntPtr<DeviceData> data(new DeviceData(first + k, std::move(meta)));
    bool wanted = false;
    for (LazyTensorImpl *impl : outs[k].impls) {
      impl->value = Value{nullptr, 0, data};
      impl->versionOf = 0;
      wanted |= impl->wantValue;
      impl->wantValue = false;
    }
    placed[{outs[k].node, outs[k].index}] = data;
    const auto &known = outs[k].node->known;
    if (outs[k].index < known.size() && known[outs[k].index].defined()) {
      data->value = known[outs[k].index]; // computed here as it was traced (KnownValues.h)
      continue;
    }
    // Small outputs come back with the run's reply, so reading them later costs no wait. (A
    // download arrives dense: its bytes are the elements'.)
    const uint64_t bytes = uint64_t(data->meta.numel()) * ir::dtype::itemSize(data->meta.dtype);
    if (!outs[k].impls.empty() && (wanted || (bytes <= kValueBytes && bytes <= valueBudget))) {
      if (!wanted)
        valueBudget -= bytes;
      queueValue(data, outs[k].impls.front()->downloadLayout());
    }
  }
  queueGeneratorDrops(); // after the run, which may use them
  return placed;
}

void Session::flushGraphCache() {
  Lock lock(*this);
  diagnostics_.flushCache();
}

void Session::markStep(bool wait, const char *reason, const std::string &executor, bool send) {
  uint32_t site = currentLocation();
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, transport_.lostReason());
  site_ = site;
  cut(reason, executor);
  // A process that has not started its session does not start one for seeds alone
  // (torch.manual_seed seeds rgpu as it seeds every device, and frameworks that train on the
  // CPU call it): they go with its first frame that the server must act on.
  if (!started() && std::all_of(queue_.begin(), queue_.end(), [](const Command &c) {
        return c.kind == wire::Command::SEED;
      }))
    return;
  if (wait) {
    Command sync;
    sync.kind = wire::Command::SYNC;
    queue(std::move(sync));
    flush(true);
  } else if (send && !queue_.empty()) {
    flush(false);
  }
}

void Session::synchronize() { markStep(true, "synchronize"); }

void Session::maybeCutAtCap() {
  if (nodesSinceCut_ >= kNodeCap)
    markStep(false, "node cap");
}

//===----------------------------------------------------------------------===//
// Data in and out
//===----------------------------------------------------------------------===//

Value Session::upload(const at::Tensor &src, ir::TensorMeta &meta, int device) {
  Lock lock(*this);
  // Take the bytes now: the caller may overwrite its tensor right after this returns.
  at::Tensor cpu = src.is_non_overlapping_and_dense() && src.storage_offset() == 0
                       ? src.clone(at::MemoryFormat::Preserve)
                       : src.contiguous().clone();
  if (cpu.is_conj() || cpu.is_neg())
    cpu = cpu.resolve_conj().resolve_neg();
  meta = bridge::metaOf(cpu);
  uint64_t total = meta.storageBytes();
  uint64_t handle = newHandles(1);
  uint64_t chunk = transport_.limits().uploadChunkBytes;
  for (uint64_t off = 0; off < total || off == 0; off += chunk) {
    Command c;
    c.kind = wire::Command::UPLOAD;
    c.handle = handle;
    c.device = uint8_t(device);
    c.meta = meta;
    c.data = cpu;
    c.offset = off;
    c.length = std::min(chunk, total - off);
    if (c.length >= kCompressedUpload && compressUploads()) {
      const auto *bytes = static_cast<const uint8_t *>(cpu.data_ptr()) + off;
      if (auto packed = wire::encodePlanes(bytes, c.length, ir::dtype::itemSize(meta.dtype))) {
        stats.uploadBytesSaved += c.length - packed->size();
        c.encoded = std::move(*packed);
        c.data = at::Tensor(); // the frame carries the encoded bytes only
      }
    }
    queue(std::move(c));
    if (total > kSmallUpload)
      flush(false);
    if (total == 0)
      break;
  }
  ++stats.uploads;
  llvm::IntrusiveRefCntPtr<DeviceData> data(new DeviceData(handle, meta));
  if (meta.numel() <= kKnownElements)
    data->value = cpu; // what the server holds: reads and ops on it can be answered here
  return Value{nullptr, 0, std::move(data)};
}

bool Session::compressUploads() {
  if (compress_ != Compress::Auto)
    return compress_ == Compress::Always;
  if (!lost() && !transport_.connected())
    transport_.connect();
  return transport_.connected() && transport_.fastestExchange() >= kCompressRoundTrip;
}

void Session::downloadTogether(std::vector<at::Tensor> tensors) {
  Lock lock(*this);
  group_.clear();
  fetched_.clear();
  for (at::Tensor &t : tensors)
    if (lazyImpl(t))
      group_.push_back(std::move(t));
}

at::Tensor Session::download(LazyTensorImpl *impl, const ir::TensorMeta &want) {
  uint32_t site = currentLocation();
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, transport_.lostReason());
  site_ = site;
  harvest();
  std::string key;
  if (impl->value.pending() && readKey(impl->value, want, key)) {
    if (auto it = rememberedIndex_.find(key); it != rememberedIndex_.end()) {
      // The read still cuts where it always did, so the graphs stay the ones the server has;
      // only the wait is saved.
      cut("read of a value");
      if (!queue_.empty())
        flush(false);
      raiseDeferred();
      ++stats.readsRemembered;
      remembered_.splice(remembered_.end(), remembered_, it->second);
      return it->second->second.clone(at::MemoryFormat::Preserve);
    }
  }
  at::Tensor out = fetch(impl, want);
  if (!key.empty() && out.sizes().equals(want.sizes) && out.strides().equals(want.strides) &&
      out.scalar_type() == static_cast<c10::ScalarType>(want.dtype)) {
    if (remembered_.size() >= kRememberedReads) {
      rememberedIndex_.erase(remembered_.front().first);
      remembered_.pop_front();
    }
    remembered_.emplace_back(key, out.clone(at::MemoryFormat::Preserve));
    rememberedIndex_.emplace(std::move(key), std::prev(remembered_.end()));
  }
  return out;
}

bool Session::readKey(const Value &v, const ir::TensorMeta &want, std::string &key) const {
  const int64_t bytes = want.storageBytes();
  if (bytes < 0 || bytes > kRememberedBytes)
    return false;
  // The nodes that compute v. Random draws differ from run to run; ops outside aten
  // (collectives) read other ranks.
  constexpr size_t kMaxNodes = 8;
  llvm::SmallVector<TraceNode *, kMaxNodes> nodes;
  llvm::SmallVector<const Value *, 16> work{&v};
  while (!work.empty()) {
    const Value &x = *work.pop_back_val();
    if (!x.pending()) {
      if (!x.data || x.data->handle < firstHandle_)
        return false;
      continue;
    }
    TraceNode *t = x.node.get();
    if (llvm::is_contained(nodes, t))
      continue;
    if (nodes.size() == kMaxNodes || t->node.random || !t->node.op.str().startswith("aten::"))
      return false;
    nodes.push_back(t);
    for (const Value &input : t->inputs)
      work.push_back(&input);
  }
  llvm::sort(nodes, [](const TraceNode *a, const TraceNode *b) { return a->seq < b->seq; });
  // What a replay of this trace would key on, and what it leaves out: the positions, the
  // handles read and the scalars' values.
  TraceKey trace = readTrace(nodes, {{v.node.get(), v.index}});
  key = std::move(trace.shape);
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
  return true;
}

at::Tensor Session::fetch(LazyTensorImpl *impl, const ir::TensorMeta &want) {
  if (impl->value.pending())
    cut("read of a value");
  checkCurrent(impl->value);
  DeviceData *data = impl->value.data.get();
  // A value that came, or is coming, with a reply: at most the wait for that reply.
  if (data->valueSeq == DeviceData::kValueQueued)
    flush(true);
  else if (data->valueSeq)
    awaitReply(data->valueSeq);
  raiseDeferred();
  if (data->value.defined() && data->value.sizes().equals(want.sizes) &&
      data->value.scalar_type() == static_cast<c10::ScalarType>(want.dtype)) {
    at::Tensor out = at::empty_strided(want.sizes, want.strides, data->value.options());
    out.copy_(data->value);
    ++stats.downloads;
    return out;
  }
  if (auto it = fetched_.find(data); it != fetched_.end()) {
    Fetched &f = it->second;
    if (f.cpu.defined() && f.cpu.sizes().equals(want.sizes) && f.cpu.strides().equals(want.strides) &&
        f.cpu.scalar_type() == static_cast<c10::ScalarType>(want.dtype)) {
      // The first reader takes the tensor; another reader of the same data gets its own copy.
      if (f.taken)
        return f.cpu.clone(at::MemoryFormat::Preserve);
      f.taken = true;
      return f.cpu;
    }
  }
  const uint64_t bytes = want.storageBytes();
  if (bytes > transport_.limits().uploadChunkBytes)
    return downloadInChunks(*impl->value.data, want);
  // This tensor, and with it members of the download group that are not fetched yet, as many
  // as fit in one reply. The cut above made every live tensor device data. Members are matched
  // by the data they hold: `t.detach().cpu()` reads a member through another tensor.
  std::vector<std::pair<llvm::IntrusiveRefCntPtr<DeviceData>, ir::TensorMeta>> wanted;
  wanted.push_back({impl->value.data, want});
  bool inGroup = std::any_of(group_.begin(), group_.end(), [&](const at::Tensor &t) {
    return lazyImpl(t)->value.data.get() == data;
  });
  if (inGroup) {
    fetched_.try_emplace(data, Fetched{impl->value.data, at::Tensor(), true});
    uint64_t budget = transport_.limits().maxReplyDataBytes - std::min(bytes, transport_.limits().maxReplyDataBytes);
    std::vector<at::Tensor> later; // what does not fit waits for the group's next read
    for (at::Tensor &t : group_) {
      LazyTensorImpl *member = lazyImpl(t);
      DeviceData *d = member->value.data.get();
      if (!d || fetched_.count(d) || d->handle < firstHandle_)
        continue;
      ir::TensorMeta layout = member->downloadLayout();
      uint64_t size = layout.storageBytes();
      if (size > budget || wanted.size() >= transport_.limits().maxCommands / 16) {
        later.push_back(std::move(t));
        continue;
      }
      budget -= size;
      fetched_.try_emplace(d, Fetched{member->value.data});
      wanted.push_back({member->value.data, std::move(layout)});
    }
    group_ = std::move(later);
  }
  for (const auto &[d, layout] : wanted) {
    Command c;
    c.kind = wire::Command::DOWNLOAD;
    c.handle = d->handle;
    c.meta = layout;
    queue(std::move(c));
  }
  Reply reply = flush(true);
  if (reply.data.size() != wanted.size())
    lose("the server did not answer a download");
  at::Tensor result;
  for (size_t k = 0; k < wanted.size(); ++k) {
    at::Tensor out = tensorFromBytes(wanted[k].second, reply.data[k]);
    ++stats.downloads;
    // Device data never changes: a small value read once is read from here after.
    DeviceData &d = *wanted[k].first;
    if (!d.value.defined() && !d.valueSeq && int64_t(reply.data[k].size()) <= kRememberedBytes)
      d.value = out.clone(at::MemoryFormat::Preserve);
    if (k == 0)
      result = out;
    if (auto it = fetched_.find(wanted[k].first.get()); it != fetched_.end())
      it->second.cpu = out;
  }
  return result;
}

at::Tensor Session::downloadInChunks(const DeviceData &data, const ir::TensorMeta &want) {
  at::Tensor out = at::empty_strided(
      want.sizes, want.strides, at::TensorOptions().dtype(static_cast<c10::ScalarType>(want.dtype)));
  const uint64_t total = want.storageBytes(), chunk = transport_.limits().uploadChunkBytes;
  for (uint64_t offset = 0; offset < total; offset += chunk) {
    Command c;
    c.kind = wire::Command::DOWNLOAD;
    c.handle = data.handle;
    c.meta = want;
    c.offset = offset;
    c.length = std::min(chunk, total - offset);
    queue(std::move(c));
    Reply reply = flush(true);
    if (reply.data.size() != 1 || reply.data[0].size() != c.length)
      lose("the server answered a download chunk with the wrong number of bytes");
    std::memcpy(static_cast<char *>(out.data_ptr()) + offset, reply.data[0].data(), c.length);
  }
  ++stats.downloads;
  return out;
}

at::Tensor Session::tensorFromBytes(const ir::TensorMeta &m, const std::string &bytes) {
  if (bytes.size() != uint64_t(m.storageBytes()))
    lose("the server sent " + std::to_string(bytes.size()) + " bytes for a tensor of " +
         std::to_string(m.storageBytes()));
  at::Tensor out = at::empty_strided(
      m.sizes, m.strides, at::TensorOptions().dtype(static_cast<c10::ScalarType>(m.dtype)));
  if (!bytes.empty())
    std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
  return out;
}

std::vector<std::pair<Value, ir::TensorMeta>>
Session::runNow(llvm::IntrusiveRefCntPtr<TraceNode> node) {
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, transport_.lostReason());
  site_ = node->location;
  // Every input is held by a live tensor, so after the cut it is device data.
  CutOutputs placed = cut("data-dependent op");
  for (Value &v : node->inputs) {
    if (!v.pending())
      continue;
    auto data = placed.lookup({v.node.get(), v.index});
    TORCH_INTERNAL_ASSERT(data, "rgpu: an input of a data-dependent op was not materialised");
    v = Value{nullptr, 0, data};
  }
  size_t count = node->node.outputs.size();
  std::vector<std::pair<TraceNode *, uint32_t>> outputs;
  for (uint32_t k = 0; k < count; ++k)
    outputs.push_back({node.get(), k});
  uint64_t first = queueRun(buildGraph({node.get()}, outputs), true, "data-dependent op");
  std::vector<std::vector<ir::TensorMeta>> metas = flush(true).metas;
  std::vector<std::pair<Value, ir::TensorMeta>> outs;
  if (metas.empty() || metas.back().size() != count)
    lose("the server answered a data-dependent op with the wrong number of outputs");
  for (size_t k = 0; k < metas.back().size(); ++k) {
    const ir::TensorMeta &m = metas.back()[k];
    outs.push_back({Value{nullptr, 0, llvm::IntrusiveRefCntPtr<DeviceData>(new DeviceData(first + k, m))}, m});
  }
  return outs;
}

//===----------------------------------------------------------------------===//
// The connection
//===----------------------------------------------------------------------===//

void Session::lose(const std::string &why) {
  inflight_.clear();
  queue_.clear();
  releases_.clear();
  transport_.lose(why);
}

std::string Session::describe(const wire::Error::Reader &e) {
  std::string op = e.getOp();
  std::string where = e.getLocation();
  auto it = nodeLocations_.find(wire::decodeHash(e.getGraph()));
  if (it != nodeLocations_.end() && e.getNode() < it->second.size() && it->second[e.getNode()])
    where = locationText(it->second[e.getNode()]);
  std::string msg = op.empty() ? std::string() : op + " failed on the server";
  if (!where.empty())
    msg += (msg.empty() ? "at " : " at ") + where;
  if (!msg.empty())
    msg += ": ";
  return msg + std::string(e.getMessage());
}

Session::ServerStats Session::serverStats() {
  Lock lock(*this);
  Command c;
  c.kind = wire::Command::STATS;
  queue(std::move(c));
  Reply reply = flush(true);
  if (reply.stats.empty())
    lose("the server did not answer a stats request");
  return reply.stats.back();
}

Transport::ServerHello Session::serverHello() {
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, transport_.lostReason());
  if (!transport_.connected())
    transport_.connect();
  return transport_.serverHello();
}

int Session::deviceCount() {
  try {
    return int(serverHello().devices.size());
  } catch (const std::exception &) {
    return 1;
  }
}

Session::DeviceMemory Session::deviceMemory(int device, bool resetPeak, bool emptyCache) {
  Lock lock(*this);
  cut("memory figures");
  Command c;
  c.kind = wire::Command::MEMORY;
  c.resetPeak = resetPeak;
  c.emptyCache = emptyCache;
  c.device = uint8_t(device);
  queue(std::move(c));
  Reply reply = flush(true);
  if (reply.memory.empty())
    lose("the server did not answer a memory request");
  return reply.memory.back();
}

Session::RngState Session::rngState(int device, uint64_t generator) {
  Lock lock(*this);
  cutBeforeRng("torch.rgpu.get_rng_state");
  Command c;
  c.kind = wire::Command::RNG_STATE;
  c.device = uint8_t(device);
  c.generator = generator;
  queue(std::move(c));
  Reply reply = flush(true);
  if (reply.rngStates.empty())
    lose("the server did not answer a generator state request");
  return reply.rngStates.back();
}

void Session::setRngState(int device, std::string state, uint64_t generator) {
  Lock lock(*this);
  cutBeforeRng("torch.rgpu.set_rng_state");
  Command c;
  c.kind = wire::Command::RNG_STATE;
  c.device = uint8_t(device);
  c.rngState = std::move(state);
  c.generator = generator;
  queue(std::move(c));
}

void Session::queueGenerator(const char *reason, int device, uint64_t id,
                             wire::GeneratorRequest::Which op, uint64_t arg) {
  Lock lock(*this);
  if (reason)
    cutBeforeRng(reason);
  Command c;
  c.kind = wire::Command::GENERATOR;
  c.device = uint8_t(device);
  c.generator = id;
  c.generatorOp = op;
  c.generatorArg = arg;
  queue(std::move(c));
}

uint64_t Session::newGenerator(int device, wire::GeneratorRequest::Which how, uint64_t arg) {
  Lock lock(*this);
  const uint64_t id = nextGenerator_++;
  // A clone or snapshot takes a state after the ops traced so far; a new one none.
  queueGenerator(how == wire::GeneratorRequest::CREATE ? nullptr : "a copy of a generator's state",
                 device, id, how, arg);
  return id;
}

void Session::seedGenerator(int device, uint64_t id, uint64_t seed) {
  queueGenerator("Generator.manual_seed", device, id, wire::GeneratorRequest::SEED, seed);
}

void Session::restoreRng(int device, uint64_t id) {
  queueGenerator("a restore of the generator's state", device, id,
                 wire::GeneratorRequest::RESTORE);
}

void Session::dropGenerator(uint64_t id) noexcept {
  Lock lock(*this);
  droppedGenerators_.push_back(id);
}

void Session::queueGeneratorDrops() noexcept {
  if (lost())
    droppedGenerators_.clear();
  for (uint64_t id : droppedGenerators_) {
    Command c;
    c.kind = wire::Command::GENERATOR;
    c.generator = id;
    c.generatorOp = wire::GeneratorRequest::DROP;
    queue_.push_back(std::move(c));
  }
  droppedGenerators_.clear();
}

std::string Session::askText(Command c, const char *reason) {
  Lock lock(*this);
  cut(reason);
  wire::Command::Which kind = c.kind;
  // A JoinGroup begins its frame: the server serves that frame again from it when the join
  // ends, so nothing before it may share the frame.
  if (kind == wire::Command::JOIN_GROUP && !queue_.empty())
    flush(false);
  queue(std::move(c));
  Reply reply = flush(true);
  if (reply.texts.empty())
    lose("the server did not answer a " +
         std::string(kind == wire::Command::HOST_STORE ? "HostStore" : "JoinGroup"));
  return reply.texts.back();
}

std::string Session::hostStore() {
  Command c;
  c.kind = wire::Command::HOST_STORE;
  return askText(std::move(c), "a rendezvous store");
}

std::string Session::joinGroup(const std::string &store, const std::string &prefix, int rank,
                               int size, uint32_t timeoutMs) {
  Command c;
  c.kind = wire::Command::JOIN_GROUP;
  c.store = store;
  c.prefix = prefix;
  c.handle = uint64_t(rank);
  c.count = uint32_t(size);
  c.length = timeoutMs;
  return askText(std::move(c), "joining a process group");
}

Session::Reply Session::flush(bool wantReply) {
  if (lost())
    raise(ErrorKind::SessionLost, transport_.lostReason());
  if (!transport_.connected())
    transport_.connect();
  if (queue_.empty() && releases_.empty() && !wantReply)
    return {};
  // A frame that runs a graph or asks for values gets a reply even when nobody waits for it:
  // the reply brings the values and acknowledges the frame, and shows how far the server is.
  bool runs = false, values = false;
  for (const Command &c : queue_) {
    runs |= c.kind == wire::Command::RUN;
    values |= bool(c.valueOf);
  }
  if (!wantReply && runs)
    boundInflight();
  // Frames are kept until the server acknowledges them (a resume sends them again), and only
  // replies acknowledge: past this much, this frame waits for one.
  if (transport_.unacknowledged() > kMaxUnacknowledged)
    wantReply = true;
  const bool reply = wantReply || runs || values;
  Targets targets;
  capnp::MallocMessageBuilder b;
  auto frame = b.initRoot<wire::ClientFrame>();
  const uint64_t seq = transport_.nextSeq();
  frame.setSeq(seq);
  frame.setWantReply(reply);
  frame.setReceived(lastReply_);
  auto cmds = frame.initCommands(queue_.size() + (releases_.empty() ? 0 : 1));
  uint64_t dataBytes = 0;
  for (size_t i = 0; i < queue_.size(); ++i) {
    Command &c = queue_[i];
    auto cb = cmds[i];
    switch (c.kind) {
    case wire::Command::DEFINE: {
      auto d = cb.initDefine();
      wire::encodeHash(c.hash, d.initHash());
      wire::encodeGraph(*c.graph, d.initGraph());
      d.setExecutor(c.executor);
      break;
    }
    case wire::Command::RUN: {
      auto r = cb.initRun();
      wire::encodeHash(c.hash, r.initHash());
      encodeRunArgs(c, r);
      r.setFirstOutput(c.handle);
      r.setNumOutputs(c.count);
      r.setReplyMetas(c.replyMetas);
      if (!c.symbols.empty()) {
        auto sy = r.initSymbols(c.symbols.size());
        for (size_t k = 0; k < c.symbols.size(); ++k)
          sy.set(k, c.symbols[k]);
      }
      break;
    }
    case wire::Command::UPLOAD: {
      auto u = cb.initUpload();
      u.setHandle(c.handle);
      wire::encodeMeta(c.meta, u.initMeta());
      u.setOffset(c.offset);
      u.setDevice(c.device);
      u.setTotal(c.meta.storageBytes());
      if (!c.encoded.empty()) {
        u.setEncoding(1);
        u.setLength(c.length);
        u.setData(kj::arrayPtr(reinterpret_cast<const kj::byte *>(c.encoded.data()),
                               c.encoded.size()));
      } else {
        u.setData(kj::arrayPtr(static_cast<const kj::byte *>(c.data.data_ptr()) + c.offset,
                               c.length));
      }
      dataBytes += c.length;
      break;
    }
    case wire::Command::DOWNLOAD: {
      targets.push_back({c.valueOf, c.meta});
      auto d = cb.initDownload();
      d.setHandle(c.handle);
      wire::encodeMeta(c.meta, d.initMeta());
      d.setOffset(c.offset);
      d.setLength(c.length);
      break;
    }
    case wire::Command::FORGET: {
      auto f = cb.initForget(c.hashes.size());
      for (size_t k = 0; k < c.hashes.size(); ++k) {
        wire::encodeHash(c.hashes[k], f[k]);
        lastRuns_.erase(c.hashes[k]); // the server forgets its latest run too
      }
      break;
    }
    case wire::Command::SEED: cb.setSeed(c.handle); break;
    case wire::Command::STATS: cb.setStats(); break;
    case wire::Command::MEMORY: {
      auto m = cb.initMemory();
      m.setResetPeak(c.resetPeak);
      m.setEmptyCache(c.emptyCache);
      m.setDevice(c.device);
      break;
    }
    case wire::Command::SYNC: cb.setSync(); break;
    case wire::Command::GENERATOR: {
      auto r = cb.initGenerator();
      r.setId(c.generator);
      r.setDevice(c.device);
      switch (c.generatorOp) {
      case wire::GeneratorRequest::CREATE: r.setCreate(c.generatorArg); break;
      case wire::GeneratorRequest::CLONE_OF: r.setCloneOf(c.generatorArg); break;
      case wire::GeneratorRequest::SEED: r.setSeed(c.generatorArg); break;
      case wire::GeneratorRequest::DROP: r.setDrop(); break;
      case wire::GeneratorRequest::SNAPSHOT: r.setSnapshot(); break;
      case wire::GeneratorRequest::RESTORE: r.setRestore(); break;
      }
      break;
    }
    case wire::Command::RNG_STATE: {
      auto r = cb.initRngState();
      r.setDevice(c.device);
      r.setGenerator(c.generator);
      if (c.rngState) {
        r.setSet(true);
        r.setState(kj::arrayPtr(reinterpret_cast<const kj::byte *>(c.rngState->data()),
                                c.rngState->size()));
      }
      break;
    }
    case wire::Command::HOST_STORE: cb.setHostStore(); break;
    case wire::Command::JOIN_GROUP: {
      auto j = cb.initJoinGroup();
      j.setStore(c.store);
      j.setPrefix(c.prefix);
      j.setRank(uint32_t(c.handle));
      j.setSize(c.count);
      j.setTimeoutMs(uint32_t(c.length));
      break;
    }
    default: break;
    }
  }
  if (!releases_.empty()) {
    // Last: a handle released here may still be an input of a run in this very frame. As
    // ranges: a step releases the previous step's outputs, which have consecutive handles.
    std::sort(releases_.begin(), releases_.end());
    releases_.erase(std::unique(releases_.begin(), releases_.end()), releases_.end());
    std::vector<uint64_t> ranges; // (first, count) pairs
    for (uint64_t h : releases_) {
      if (!ranges.empty() && ranges[ranges.size() - 2] + ranges.back() == h)
        ++ranges.back();
      else
        ranges.insert(ranges.end(), {h, 1});
    }
    auto rel = cmds[queue_.size()].initReleaseRanges(ranges.size());
    for (size_t k = 0; k < ranges.size(); ++k)
      rel.set(k, ranges[k]);
  }
  std::vector<Command> sent;
  sent.swap(queue_);
  releases_.clear();
  std::vector<ir::Hash256> ranInFrame;
  ranInFrame.swap(runsInFrame_);
  std::string bytes = net::encodeFrame(b, dataBytes < kPackBelow);
  ++stats.messages;
  stats.bytesOut += bytes.size();
  transport_.send(seq, std::move(bytes));
  sent.clear();
  retired_.clear();
  for (Target &t : targets)
    if (t.data)
      t.data->valueSeq = seq;
  if (!wantReply) {
    if (reply)
      inflight_.push_back({seq, std::move(targets), std::move(ranInFrame),
                           std::chrono::steady_clock::now(), runs});
    return {};
  }

  ++stats.waits;
  auto start = std::chrono::steady_clock::now();
  // Replies read here in a burst say nothing about when they came: they are not timed.
  const uint64_t cancelled = transport_.cancelledThrough();
  net::Frame answer =
      awaitFrame(seq, [this](const net::Frame &f) { absorb(f, nullptr, 0, false); }, true);
  auto waited = std::chrono::steady_clock::now() - start;
  diagnostics_.waited(site_, locationText(site_), ranInFrame,
                      std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count());
  Reply results = absorb(answer, &targets, seq);
  if (transport_.cancelledThrough() != cancelled)
    interrupted();
  raiseDeferred();
  if (!results.error.empty())
    raise(ErrorKind::Remote, results.error, results.errorType);
  return results;
}

void Session::encodeRunArgs(const Command &c, wire::Run::Builder r) {
  auto last = lastRuns_.find(c.hash);
  if (last == lastRuns_.end() || last->second.inputs.size() != c.handles.size() ||
      last->second.scalars.size() != c.scalars.size()) {
    auto in = r.initInputs(c.handles.size());
    for (size_t k = 0; k < c.handles.size(); ++k)
      in.set(k, c.handles[k]);
    auto sc = r.initScalars(c.scalars.size());
    for (size_t k = 0; k < c.scalars.size(); ++k)
      wire::encodeScalar(c.scalars[k], sc[k]);
    encodeRestores(c.restores, r);
    lastRuns_[c.hash] = LastRun{c.handles, c.scalars, c.restores};
    return;
  }
  // Relative to the previous run of this graph: handles as runs of equal deltas (a step's
  // inputs are the last step's outputs, all a fixed number of handles on), scalars as the
  // slots that changed and a table of their distinct values (Adam's bias corrections change
  // every step, one value for every parameter).
  LastRun &prev = last->second;
  r.setRelative(true);
  std::vector<int64_t> deltas;
  for (size_t k = 0; k < c.handles.size(); ++k) {
    const int64_t d = int64_t(c.handles[k] - prev.inputs[k]);
    if (!deltas.empty() && deltas[deltas.size() - 2] == d)
      ++deltas.back();
    else
      deltas.insert(deltas.end(), {d, 1});
  }
  auto in = r.initInputDeltas(deltas.size());
  for (size_t k = 0; k < deltas.size(); ++k)
    in.set(k, deltas[k]);
  std::vector<uint32_t> slots;
  std::vector<uint16_t> values;
  std::vector<ir::ScalarValue> table;
  for (size_t k = 0; k < c.scalars.size(); ++k) {
    if (sameBits(c.scalars[k], prev.scalars[k]))
      continue;
    auto it = std::find_if(table.begin(), table.end(),
                           [&](const ir::ScalarValue &v) { return sameBits(v, c.scalars[k]); });
    if (it == table.end()) {
      if (table.size() == 0xffff) { // too varied to say briefly: the whole run instead
        lastRuns_.erase(last);
        r.setRelative(false);
        r.initInputDeltas(0);
        return encodeRunArgs(c, r);
      }
      it = table.insert(table.end(), c.scalars[k]);
    }
    slots.push_back(uint32_t(k));
    values.push_back(uint16_t(it - table.begin()));
  }
  auto sc = r.initScalars(table.size());
  for (size_t k = 0; k < table.size(); ++k)
    wire::encodeScalar(table[k], sc[k]);
  auto sl = r.initChangedSlots(slots.size());
  auto vl = r.initChangedValues(values.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    sl.set(k, slots[k]);
    vl.set(k, values[k]);
  }
  if (c.restores != prev.restores) // else absent: the previous run's
    encodeRestores(c.restores, r);
  prev = LastRun{c.handles, c.scalars, c.restores};
}

void Session::encodeRestores(const std::vector<uint32_t> &restores, wire::Run::Builder r) {
  auto rs = r.initRestores(restores.size());
  for (size_t k = 0; k < restores.size(); ++k)
    rs.set(k, restores[k]);
}

Session::Reply Session::absorb(const net::Frame &frame, const Targets *own, uint64_t ownSeq,
                               bool timed) {
  stats.bytesIn += frame.bytes + net::kHeaderBytes;
  Reply results;
  Targets answered;
  const Targets *targets = own;
  std::string error, errorType;
  bool fatal = false;
  try {
    auto reader = net::openFrame(frame, transport_.limits());
    auto sf = reader->getRoot<wire::ServerFrame>();
    const uint64_t ack = sf.getAckSeq();
    lastReply_ = std::max(lastReply_, ack);
    // Replies come in order: an in-flight frame older than this reply lost its reply in a
    // resume, and its values will be read again if they are wanted.
    auto forget = [](Targets &ts, uint64_t seq) {
      for (Target &t : ts)
        if (t.data && t.data->valueSeq == seq)
          t.data->valueSeq = 0;
    };
    while (!inflight_.empty() && inflight_.front().seq < ack) {
      forget(inflight_.front().targets, inflight_.front().seq);
      inflight_.pop_front();
    }
    if (!own && !inflight_.empty() && inflight_.front().seq == ack) {
      answered = std::move(inflight_.front().targets);
      const auto now = std::chrono::steady_clock::now();
      if (inflight_.front().step && timed) {
        stepReplies_.push_back(now);
        if (stepReplies_.size() > 16)
          stepReplies_.pop_front();
      }
      inflight_.pop_front();
      targets = &answered;
    }
    size_t download = 0;
    for (auto r : sf.getResults()) {
      switch (r.which()) {
      case wire::Result::DATA: {
        auto d = r.getData();
        const Target *t = targets && download < targets->size() ? &(*targets)[download] : nullptr;
        ++download;
        if (t && t->data) {
          // A poisoned output comes back empty (the error says why): it gets no value.
          if (d.size() == uint64_t(t->layout.storageBytes()))
            t->data->value = tensorFromBytes(
                t->layout, std::string(reinterpret_cast<const char *>(d.begin()), d.size()));
        } else {
          results.data.emplace_back(reinterpret_cast<const char *>(d.begin()), d.size());
        }
        break;
      }
      case wire::Result::METAS:
        results.metas.emplace_back();
        for (auto m : r.getMetas()) {
          results.metas.back().emplace_back();
          wire::decodeMeta(m, results.metas.back().back());
        }
        break;
      case wire::Result::STATS: {
        auto st = r.getStats();
        ServerStats out;
        out.planBuilds = st.getPlanBuilds();
        out.graphsCached = st.getGraphsCached();
        out.graphRuns = st.getGraphRuns();
        out.sessions = st.getSessions();
        out.sessionGraphRuns = st.getSessionGraphRuns();
        out.sessionExecuteNs = st.getSessionExecuteNs();
        out.sessionTensors = st.getSessionTensors();
        out.compiler = st.getCompiler();
        out.inductorCompiles = st.getInductorCompiles();
        out.compilesPending = st.getCompilesPending();
        out.compileFailures = st.getCompileFailures();
        out.diskCacheHits = st.getDiskCacheHits();
        out.compiledRuns = st.getCompiledRuns();
        out.sessionCompiledRuns = st.getSessionCompiledRuns();
        out.sessionWritesInPlace = st.getSessionWritesInPlace();
        out.sessionRunsCancelled = st.getSessionRunsCancelled();
        out.connections = st.getConnections();
        out.connectionsRefused = st.getConnectionsRefused();
        out.sessionMemory = st.getSessionMemory();
        out.sessionMemoryPeak = st.getSessionMemoryPeak();
        out.sessionMemoryQuota = st.getSessionMemoryQuota();
        out.sessionMemoryRefused = st.getSessionMemoryRefused();
        out.memoryHeld = st.getMemoryHeld();
        out.memoryKept = st.getMemoryKept();
        out.memoryLimit = st.getMemoryLimit();
        for (uint64_t m : st.getSessionMemories())
          out.sessionMemories.push_back(m);
        out.sessionGraphBytes = st.getSessionGraphBytes();
        out.graphBudget = st.getGraphBudget();
        out.graphsForgotten = st.getGraphsForgotten();
        out.planEvictions = st.getPlanEvictions();
        out.compiledEvictions = st.getCompiledEvictions();
        out.diskEvictions = st.getDiskEvictions();
        out.compilesDropped = st.getCompilesDropped();
        out.sessionsParked = st.getSessionsParked();
        out.resumes = st.getResumes();
        out.sessionsExpired = st.getSessionsExpired();
        for (auto g : st.getGraphs())
          out.graphs.push_back({wire::decodeHash(g.getHash()), g.getNodes(), g.getRuns(),
                                g.getExecuteNs(), g.getBuildNs(), g.getExecutor(),
                                g.getCompiledRuns()});
        results.stats.push_back(std::move(out));
        break;
      }
      case wire::Result::MEMORY: {
        auto m = r.getMemory();
        results.memory.push_back({m.getDevice(), m.getName(), m.getAllocated(),
                                  m.getAllocatedPeak(), m.getReserved(), m.getReservedPeak(),
                                  m.getFree(), m.getTotal(), m.getMultiProcessors(),
                                  m.getMajor(), m.getMinor()});
        break;
      }
      case wire::Result::TEXT: results.texts.push_back(r.getText()); break;
      case wire::Result::RNG_STATE: {
        auto g = r.getRngState();
        results.rngStates.push_back(
            {std::string(reinterpret_cast<const char *>(g.getState().begin()), g.getState().size()),
             g.getInitialSeed()});
        break;
      }
      default: break;
      }
    }
    if (targets)
      for (const Target &t : *targets)
        if (t.data)
          t.data->valueSeq = 0;
    for (auto note : sf.getNotes())
      log(20, "rgpu-opserver: " + std::string(note.cStr()));
    if (sf.hasError()) {
      error = describe(sf.getError());
      errorType = sf.getError().getPythonType();
      fatal = sf.getError().getKind() != wire::Error::Kind::REMOTE;
      // What a Cancel stopped was reported by the wait it interrupted.
      if (errorType == kCancelledType && ack <= transport_.cancelledThrough() + 1) {
        error.clear();
        errorType.clear();
      }
    }
    if (own && ack != ownSeq && !fatal) {
      fatal = true;
      error = "rgpu-opserver no longer had its reply to frame " + std::to_string(ownSeq) +
              " when the session resumed";
    }
  } catch (const kj::Exception &e) {
    lose(std::string("malformed reply from rgpu-opserver: ") + e.getDescription().cStr());
  }
  if (fatal)
    lose(error);
  if (own) {
    results.error = std::move(error);
    results.errorType = std::move(errorType);
  } else if (deferredError_.empty()) {
    deferredError_ = std::move(error);
    deferredErrorType_ = std::move(errorType);
  }
  return results;
}

void Session::harvest() {
  net::Frame frame;
  while (!inflight_.empty() && !lost() && transport_.poll(frame))
    absorb(frame, nullptr);
}

void Session::awaitReply(uint64_t seq, bool throttle) {
  auto it = std::find_if(inflight_.begin(), inflight_.end(),
                         [&](const InFlight &f) { return f.seq == seq; });
  if (it == inflight_.end())
    return;
  std::vector<ir::Hash256> runs = it->runs;
  auto start = std::chrono::steady_clock::now();
  const uint64_t cancelled = transport_.cancelledThrough();
  net::Frame frame =
      awaitFrame(seq, [this](const net::Frame &f) { absorb(f, nullptr); }, /*spin=*/!throttle);
  const uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - start).count();
  if (throttle) {
    ++stats.throttled;
    stats.throttledNs += ns;
  } else {
    ++stats.waits;
    diagnostics_.waited(site_, locationText(site_), runs, ns);
  }
  absorb(frame, nullptr);
  if (transport_.cancelledThrough() != cancelled)
    interrupted();
}

net::Frame Session::awaitFrame(uint64_t seq,
                               const std::function<void(const net::Frame &)> &earlier,
                               bool spin) {
  interrupts::Wait wait; // Ctrl-C now sends a Cancel (Interrupts.h)
  return transport_.receive(seq, earlier, spin);
}

void Session::interrupted() {
  if (deferredErrorType_ == kCancelledType) {
    deferredError_.clear();
    deferredErrorType_.clear();
  }
  raise(ErrorKind::Interrupted,
        "rgpu: interrupted while waiting for rgpu-opserver at " + transport_.address() +
            " (at " + locationText(site_) +
            "): it stopped this session's runs, and tensors they were computing raise "
            "rgpu.Cancelled if read; tensors updated in place keep their values from before "
            "the run");
}

void Session::cancel() {
  interrupts::request(); // a wait in progress takes it
  std::unique_lock<std::recursive_mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || lost() || !transport_.connected())
    return; // another thread traces or waits: its wait takes the request
  ++depth_;
  if (transport_.lastSent() > lastReply_)
    transport_.cancel();
  --depth_;
}

void Session::boundInflight() {
  harvest();
  for (;;) {
    // Steps in transit: as many as finish, at the rate their replies have been coming, in the
    // time an unqueued step takes to be answered, the link's round trip and one step's
    // service (Little's law). The round trip is the fastest Hello's, on an idle link: a
    // latency measured under load would count the queue the window makes, and grow it. The
    // window grows from RGPU_MAX_INFLIGHT as the rate becomes known; a client that waits here
    // reads replies as they come, which keeps the rate honest.
    size_t window = maxInflight_;
    if (stepReplies_.size() >= 4) {
      // The median interval: replies taken in together (a harvest after a long trace) give
      // zero intervals, which must not decide.
      std::vector<std::chrono::steady_clock::duration> gaps;
      for (size_t k = 1; k < stepReplies_.size(); ++k)
        gaps.push_back(stepReplies_[k] - stepReplies_[k - 1]);
      std::nth_element(gaps.begin(), gaps.begin() + gaps.size() / 2, gaps.end());
      auto interval = gaps[gaps.size() / 2];
      window += interval.count() > 0 ? 1 + size_t(transport_.roundTrip() / interval)
                                     : kMaxInFlightFrames;
    }
    size_t steps = 0;
    for (const InFlight &f : inflight_)
      steps += f.step;
    if (steps < std::min(window, kMaxInFlightFrames) && inflight_.size() < kMaxInFlightFrames)
      return;
    awaitReply(inflight_.front().seq, /*throttle=*/true);
  }
}

void Session::queueValue(const llvm::IntrusiveRefCntPtr<DeviceData> &data,
                         const ir::TensorMeta &layout) {
  if (data->value.defined() || data->valueSeq)
    return;
  Command c;
  c.kind = wire::Command::DOWNLOAD;
  c.handle = data->handle;
  c.meta = layout;
  c.valueOf = data;
  data->valueSeq = DeviceData::kValueQueued;
  queue(std::move(c));
}

void Session::raiseDeferred() {
  if (deferredError_.empty())
    return;
  std::string error, type;
  error.swap(deferredError_);
  type.swap(deferredErrorType_);
  raise(ErrorKind::Remote, error, type);
}

bool Session::hasValue(LazyTensorImpl *impl) {
  Lock lock(*this);
  if (!lost())
    harvest();
  return !impl->value.pending() && impl->value.data && impl->value.data->value.defined();
}

void Session::requestValue(LazyTensorImpl *impl) {
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, transport_.lostReason());
  harvest();
  if (impl->value.pending()) {
    impl->wantValue = true;
    return;
  }
  checkCurrent(impl->value);
  queueValue(impl->value.data, impl->downloadLayout());
  if (!queue_.empty())
    flush(false);
}

void Session::send() {
  Lock lock(*this);
  if (!queue_.empty() || !releases_.empty())
    flush(false);
}

} // namespace rgpu::client
