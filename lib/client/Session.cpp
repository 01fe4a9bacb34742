#include "SessionState.h"

#include "rgpu/client/Interrupts.h"

#include <algorithm>

namespace rgpu::client {

namespace {
ErrorRaiser gRaiser = nullptr;
LocationProvider gLocation = nullptr;
} // namespace

void setErrorRaiser(ErrorRaiser raiser) { gRaiser = raiser; }
void setLocationProvider(LocationProvider provider) { gLocation = provider; }

void raise(ErrorKind kind, const std::string &message, const std::string &pythonType) {
  if (gRaiser)
    gRaiser(kind, message, pythonType);
  throw std::runtime_error(message);
}

Session &Session::get() {
  static Session *session = new Session(); // outlives every tensor, even at exit
  return *session;
}

Session::Session() : s_(std::make_unique<State>()) {}

Session::State::State()
    : options(Options::fromEnvironment()),
      diagnostics([this](int level, const std::string &message) { log(level, message); }),
      transport([this](int level, const std::string &message) { log(level, message); }),
      cutter(stats, locations, [this](int level, const std::string &message) { log(level, message); }),
      maxInflight(options.maxInflight) {
  transport.setInterruptCheck([] { return interrupts::take(); });
  diagnostics.setCacheDir(options.cacheDir);
  cutter.setDynamic(options.dynamic);
}

//===----------------------------------------------------------------------===//
// The lock and the log
//===----------------------------------------------------------------------===//

Session::Lock::Lock(Session &session) : session_(session) {
  session_.s_->mu.lock();
  ++session_.s_->depth;
}

Session::Lock::~Lock() {
  State &s = *session_.s_;
  std::vector<std::pair<int, std::string>> logs;
  LogSink sink = s.logSink;
  if (--s.depth == 0)
    logs.swap(s.pendingLogs);
  s.mu.unlock();
  for (const auto &[level, message] : logs) {
    try {
      sink(level, message);
    } catch (...) {
      // A logging handler that fails loses its record, never the operation (which may be
      // unwinding with an error of its own).
    }
  }
}

void Session::State::log(int level, const std::string &message) {
  if (logSink && (level > 10 || logDebug))
    pendingLogs.emplace_back(level, message); // under the session lock; see Lock
}

void Session::setLogSink(LogSink sink, bool debug) {
  s_->logSink = sink;
  s_->logDebug = debug;
}

const Stats &Session::counters() const { return s_->stats; }

//===----------------------------------------------------------------------===//
// The live-tensor registry and the trace
//===----------------------------------------------------------------------===//

void Session::track(LazyTensorImpl *impl) {
  Lock lock(*this);
  s_->live.add(impl);
}

void Session::untrack(LazyTensorImpl *impl) {
  Lock lock(*this);
  s_->live.remove(impl);
}

uint64_t Session::liveTensors() const { return s_->live.size(); }

uint64_t Session::nextSeq() { return s_->cutter.nextSeq(); }

void Session::noteRandom(llvm::IntrusiveRefCntPtr<TraceNode> node) {
  s_->cutter.noteRandom(std::move(node));
}

uint32_t Session::internLocation(const std::string &loc) { return s_->locations.intern(loc); }

uint32_t Session::currentLocation() { return gLocation ? gLocation() : 0; }

std::string Session::locationText(uint32_t id) { return s_->locations.text(id); }

void Session::release(uint64_t handle) {
  Lock lock(*this);
  if (!lost() && handle >= s_->firstHandle)
    s_->releases.push_back(handle);
}

void Session::checkCurrent(const Value &v) { s_->checkCurrent(v); }

void Session::State::checkCurrent(const Value &v) {
  if (!v.pending() && v.data && v.data->handle < firstHandle)
    raise(ErrorKind::SessionLost,
          "this tensor belonged to an rgpu session that was lost; rgpu.reset() started a new "
          "one, and the tensor's value is gone: create it again");
}

void Session::setCheckReplays(bool on) { s_->cutter.setCheckReplays(on); }
void Session::setDynamic(bool on) { s_->cutter.setDynamic(on); }

//===----------------------------------------------------------------------===//
// Cuts
//===----------------------------------------------------------------------===//

CutOutputs Session::State::cut(const char *reason, const std::string &executor) {
  GraphCutter::Cut c = cutter.collect(live);
  CutOutputs placed;
  if (c.outs.empty()) {
    queueGeneratorDrops();
    return placed;
  }
  TraceKey key = readTrace(c.nodes, c.outputs);
  GraphCutter::Resolved resolved;
  if (cutter.replay(key, c, budget, resolved, site))
    ++stats.cutsReplayed;
  else
    resolved = cutter.resolve(cutter.buildGraph(c.nodes, c.outputs), false, &key, site);
  const uint64_t first = queueResolved(std::move(resolved), false, reason, executor, c.restores);

  // The live tensors now hold device data. Their traced nodes go after the frame is sent (the
  // server runs meanwhile); the device data those nodes read goes now, so that its handles
  // are released in this frame, as when the nodes went at once.
  for (const auto &o : c.outs)
    retired.emplace_back(o.node);
  for (TraceNode *n : c.nodes)
    for (Value &v : n->inputs)
      v.data = nullptr;
  uint64_t valueBudget = kValueBudget;
  for (size_t k = 0; k < c.outs.size(); ++k) {
    const auto &out = c.outs[k];
    ir::TensorMeta meta = out.node->node.outputs[out.index];
    llvm::IntrusiveRefCntPtr<DeviceData> data(new DeviceData(first + k, std::move(meta)));
    bool wanted = false;
    for (LazyTensorImpl *impl : out.impls) {
      impl->value = Value{nullptr, 0, data};
      impl->versionOf = 0;
      wanted |= impl->wantValue;
      impl->wantValue = false;
    }
    placed[{out.node, out.index}] = data;
    const auto &known = out.node->known;
    if (out.index < known.size() && known[out.index].defined()) {
      data->value = known[out.index]; // computed here as it was traced (KnownValues.h)
      continue;
    }
    // Small outputs come back with the run's reply, so reading them later costs no wait. (A
    // download arrives dense: its bytes are the elements'.)
    const uint64_t bytes = uint64_t(data->meta.numel()) * ir::dtype::itemSize(data->meta.dtype);
    // A value asked for (rgpu.on_ready) comes back in any case, and takes its share of the
    // budget like any other, so that a loop that asks for its loss sends no more than one
    // that reads it.
    if (!out.impls.empty() && (wanted || (bytes <= kValueBytes && bytes <= valueBudget))) {
      valueBudget -= std::min(bytes, valueBudget);
      queueValue(data, out.impls.front()->downloadLayout());
    }
  }
  queueGeneratorDrops(); // after the run, which may use them
  return placed;
}

uint64_t Session::State::queueResolved(GraphCutter::Resolved r, bool replyMetas,
                                       const char *reason, const std::string &executor,
                                       llvm::ArrayRef<uint64_t> restores) {
  command::Run run;
  run.hash = r.hash;
  run.symbols = std::move(r.symbols);
  run.args.inputs = std::move(r.handles);
  run.args.scalars = std::move(r.scalars);
  run.outputs = r.outputs;
  run.firstOutput = newHandles(run.outputs);
  run.replyMetas = replyMetas;
  for (size_t k = 0; k + 1 < restores.size(); k += 2) {
    auto input = std::find(run.args.inputs.begin(), run.args.inputs.end(), restores[k + 1]);
    if (input != run.args.inputs.end())
      run.args.restores.insert(run.args.restores.end(), {uint32_t(restores[k]),
                                                         uint32_t(input - run.args.inputs.begin())});
  }
  const size_t nodes = r.locations.size();
  nodeLocations[r.hash] = std::move(r.locations);
  if (r.symbolic)
    ++stats.symbolicRuns;
  if (logSink && logDebug)
    log(10, std::string("cut (") + reason + ") at " + locations.text(site) + ": " +
                std::to_string(nodes) + " nodes, graph " + r.hash.hex().substr(0, 12));
  if (!transport.lost() && !transport.connected())
    transport.connect(); // the graph budget comes with the Hello's reply
  if (hold(r.hash, r.graph.get())) {
    if (!diagnostics.known(r.hash))
      diagnostics.newGraph(r.hash, r.graph, reason, site, locations.text(site));
    else
      log(10, "define graph " + r.hash.hex().substr(0, 12) + " again (forgotten to stay "
              "under the server's graph memory)");
    ++stats.graphsShipped;
    queue(command::Define{r.hash, r.graph, executor});
  }
  diagnostics.ran(r.hash);
  runsInFrame.push_back(r.hash);
  ++stats.graphRuns;
  const uint64_t first = run.firstOutput;
  queue(std::move(run));
  return first;
}

bool Session::State::hold(const ir::Hash256 &hash, const ir::Graph *graph) {
  if (budget.touch(hash))
    return false;
  TORCH_INTERNAL_ASSERT(graph, "rgpu: graph ", hash.hex(), " is neither held nor at hand");
  // Its runs already queued come before this Forget; a later run defines it again.
  std::vector<ir::Hash256> forgotten =
      budget.admit(hash, ir::graphBytes(*graph), transport.graphBudget());
  if (!forgotten.empty()) {
    stats.graphsForgotten += forgotten.size();
    queue(command::Forget{std::move(forgotten)});
  }
  return true;
}

void Session::markStep(bool wait, const char *reason, const std::string &executor, bool send) {
  uint32_t site = currentLocation();
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, s_->transport.lostReason());
  s_->site = site;
  s_->cut(reason, executor);
  // A process that has not started its session does not start one for seeds alone
  // (torch.manual_seed seeds rgpu as it seeds every device, and frameworks that train on the
  // CPU call it): they go with its first frame that the server must act on.
  if (!started() && std::all_of(s_->queued.begin(), s_->queued.end(), [](const Command &c) {
        return std::holds_alternative<command::Seed>(c);
      }))
    return;
  if (wait) {
    s_->queue(command::Sync{});
    s_->flush(true);
  } else if (send && !s_->queued.empty()) {
    s_->flush(false);
  }
}

void Session::synchronize() { markStep(true, "synchronize"); }

void Session::maybeCutAtCap() {
  if (s_->cutter.pastNodeCap())
    markStep(false, "node cap");
}

void Session::cutBeforeBackward() {
  {
    Lock lock(*this);
    const uint64_t at = s_->options.streamCutNodes;
    if (at == 0 || lost() || s_->cutter.nodesSinceCut() < at)
      return;
  }
  markStep(false, "backward starts");
}

void Session::send() {
  Lock lock(*this);
  if (!s_->queued.empty() || !s_->releases.empty())
    s_->flush(false);
}

//===----------------------------------------------------------------------===//
// The session's life
//===----------------------------------------------------------------------===//

void Session::setServer(std::string address) { s_->transport.setAddress(std::move(address)); }
std::string Session::server() const { return s_->transport.address(); }
bool Session::lost() const { return s_->transport.lost(); }
bool Session::started() const { return s_->transport.started(); }
uint64_t Session::reconnects() const { return s_->transport.reconnects(); }

void Session::close() {
  // A forked child says nothing on its parent's connection, and does not wait for the lock,
  // which a thread of the parent may have held at the fork.
  if (s_->transport.inherited())
    return s_->transport.close();
  // At exit: what is queued and unsent is dropped (nothing can read its results), and the Bye
  // is sent once, without a resume, so a dead server never delays the exit.
  Lock lock(*this);
  s_->inflight.clear();
  s_->dropQueued();
  s_->transport.close();
}

void Session::reset() {
  Lock lock(*this);
  State &s = *s_;
  s.transport.reset();
  s.encoder.clear();
  s.inflight.clear();
  s.deferredError.clear();
  s.deferredErrorType.clear();
  s.lastReply = 0;
  s.dropQueued();
  s.group.clear();
  s.reads.clear();
  s.budget.clear();
  s.runsInFrame.clear();
  s.retired.clear();
  s.cutter.restartNodeCap();
  // Every live tensor of the old session now names handle 0, below every handle of the new
  // one: using it raises (checkCurrent), and freeing it sends nothing.
  s.firstHandle = s.nextHandle;
  s.live.forEach([](LazyTensorImpl *impl) {
    ir::TensorMeta meta = impl->value.pending()
                              ? impl->value.node->node.outputs[impl->value.index]
                              : impl->value.data->meta;
    impl->value = Value{nullptr, 0, llvm::IntrusiveRefCntPtr<DeviceData>(
                                        new DeviceData(0, std::move(meta)))};
  });
  s.log(20, "rgpu: a new session starts at the next operation (rgpu.reset())");
}

void Session::setCacheDir(std::string dir) { s_->diagnostics.setCacheDir(std::move(dir)); }

void Session::flushGraphCache() {
  Lock lock(*this);
  s_->diagnostics.flushCache();
}

const std::map<ir::Hash256, Diagnostics::GraphInfo> &Session::graphs() const {
  return s_->diagnostics.graphs();
}

const std::map<uint32_t, Diagnostics::SiteInfo> &Session::sites() const {
  return s_->diagnostics.sites();
}

void Session::setRecompileWarningThreshold(uint64_t n) {
  s_->diagnostics.setRecompileWarningThreshold(n);
}

} // namespace rgpu::client
