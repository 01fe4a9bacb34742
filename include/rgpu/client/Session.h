//===- rgpu/client/Session.h - The client's connection and graph cutter ----===//
//
// One Session per process talks to one rgpu-opserver. It owns the list of live lazy tensors,
// cuts the pending trace into graphs at sync points, remembers which graph hashes the server
// holds, and batches everything that needs no answer (releases, small uploads, runs) into the
// next frame. Only a frame that needs a value back waits.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/client/Diagnostics.h"
#include "rgpu/client/LazyTensor.h"
#include "rgpu/client/Replay.h"
#include "rgpu/client/Transport.h"
#include "rgpu/ir/Symbolic.h"
#include "rgpu/net/Frame.h"
#include "rgpu/wire/Wire.h"

#include <ATen/core/Tensor.h>
#include <llvm/ADT/DenseMap.h>
#include <llvm/ADT/DenseSet.h>
#include <llvm/ADT/StringMap.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <mutex>
#include <list>
#include <map>
#include <unordered_map>

namespace rgpu::client {

/// Counters reported by rgpu.stats().
struct Stats {
  std::atomic<uint64_t> messages{0}, waits{0}, bytesOut{0}, bytesIn{0}, graphsShipped{0},
      graphRuns{0}, opsTraced{0}, uploads{0}, downloads{0}, graphsForgotten{0},
      graphsGeneralized{0}, symbolicRuns{0}, cutsReplayed{0}, throttled{0}, throttledNs{0},
      readsRemembered{0}, uploadBytesSaved{0};
};

/// How errors reach the user; the Python glue replaces the default (std::runtime_error) so that
/// they surface as rgpu.RemoteError and rgpu.SessionLost.
/// A remote error may name the Python exception CPU eager raises for it (wire::Error.pythonType:
/// "IndexError", ...); it is raised as an rgpu.RemoteError that is also one of those.
/// Interrupted: a wait was interrupted (SIGINT, rgpu.cancel()) and the server stopped this
/// session's runs; raised as what Python's SIGINT handler raises, else rgpu.Cancelled.
enum class ErrorKind { Remote, SessionLost, Auth, Interrupted };
/// wire::Error.pythonType of a value whose run a Cancel stopped.
inline constexpr const char *kCancelledType = "Cancelled";
using ErrorRaiser = void (*)(ErrorKind, const std::string &message, const std::string &pythonType);
void setErrorRaiser(ErrorRaiser raiser);
[[noreturn]] void raise(ErrorKind kind, const std::string &message,
                        const std::string &pythonType = {});

/// Returns the id of the user's current source line (see Session::location); set by Python.
using LocationProvider = uint32_t (*)();
void setLocationProvider(LocationProvider provider);

class Session {
public:
  static Session &get();

  /// The session lock: serialises tracing, cutting and I/O. Recursive (a cut releases tensors,
  /// whose destructors take it again). Whoever holds it never waits for Python's GIL, because
  /// Python frees tensors holding the GIL and then takes this lock: log records written under
  /// it are emitted when the outermost Lock is released, and errors are raised as C++
  /// exceptions that Python's bindings turn into Python ones after the lock is gone.
  class Lock {
  public:
    explicit Lock(Session &session);
    ~Lock();
    Lock(const Lock &) = delete;
    Lock &operator=(const Lock &) = delete;

  private:
    Session &session_;
  };

  const Stats &counters() const { return stats; }

  /// The server address ("host:port"); takes effect at the next connection. Until it is set,
  /// the address is RGPU_OPSERVER as it is when the session connects (else 127.0.0.1:9720).
  void setServer(std::string address) { transport_.setAddress(std::move(address)); }
  std::string server() const;

  // Live tensor registry.
  void track(LazyTensorImpl *impl);
  void untrack(LazyTensorImpl *impl);

  /// A fresh node sequence number; also counts the op for the node cap.
  uint64_t nextSeq();
  /// Interns a source location ("file.py:12") and returns its id.
  uint32_t internLocation(const std::string &loc);
  uint32_t currentLocation();
  /// The text of location \p id. The location table has a lock of its own: the user's line is
  /// interned while Python's GIL is held, before the session lock is taken.
  std::string locationText(uint32_t id);

  /// Cuts every live pending tensor into one graph and queues its run. With \p wait, blocks
  /// until the server has executed it (and raises any pending error). \p reason is logged.
  /// \p executor, if not empty, is sent with the Define of a graph the server has not seen:
  /// "inductor" asks it to compile the graph right away, "plan" never to compile it. Without
  /// \p send (and \p wait), the run stays queued until the next message goes out.
  void markStep(bool wait, const char *reason = "mark_step", const std::string &executor = "",
                bool send = true);
  /// Cuts if the trace has grown past the node cap (no wait).
  void maybeCutAtCap();

  /// The bytes of \p impl, in the layout of \p want (a dense layout of the same sizes).
  at::Tensor download(LazyTensorImpl *impl, const ir::TensorMeta &want);
  /// Downloads \p tensors together: the first download of any of them fetches the others in
  /// the same frame (as many as fit in one reply, maxDownloadBytes), and later downloads of them
  /// are answered from what arrived. Moving a
  /// model or a state_dict to the CPU then costs one round trip instead of one per tensor.
  /// Replaces any group already set; an empty list ends the group and drops what it fetched.
  void downloadTogether(std::vector<at::Tensor> tensors);
  /// Uploads a CPU tensor to rgpu:\p device; the bytes are copied now and sent without waiting
  /// for an answer.
  Value upload(const at::Tensor &cpu, ir::TensorMeta &meta, int device);
  /// Runs \p node (whose inputs must all be device data) right away and returns its outputs'
  /// metas as the server computed them: the path for data-dependent output shapes.
  std::vector<std::pair<Value, ir::TensorMeta>> runNow(llvm::IntrusiveRefCntPtr<TraceNode> node);

  /// Whether \p impl's bytes are here (a reply brought them), so reading it costs no wait. Takes
  /// in the replies that have arrived.
  bool hasValue(LazyTensorImpl *impl);
  /// Asks for \p impl's bytes without waiting for them (rgpu.on_ready): a pending tensor's come
  /// with the reply to the cut that computes it, device data's in the reply to a Download sent
  /// now.
  void requestValue(LazyTensorImpl *impl);
  /// Sends what is queued (uploads) now, without cutting the trace or waiting.
  void send();
  /// rgpu.cancel(): interrupts the wait in progress on any thread, as Ctrl-C does; if none is,
  /// the server stops the runs of every frame sent so far. Never blocks.
  void cancel();
  /// How many steps may wait on the server (RGPU_MAX_INFLIGHT); returns the previous bound.
  size_t setMaxInflight(size_t n) {
    std::swap(n, maxInflight_);
    return n;
  }
  /// The server's counters, and this session's on the server (one round trip).
  struct ServerStats {
    uint64_t planBuilds = 0, graphsCached = 0, graphRuns = 0, sessions = 0;
    uint64_t sessionGraphRuns = 0, sessionExecuteNs = 0, sessionTensors = 0;
    std::string compiler;
    uint64_t inductorCompiles = 0, compilesPending = 0, compileFailures = 0, diskCacheHits = 0;
    uint64_t compiledRuns = 0, sessionCompiledRuns = 0, sessionWritesInPlace = 0,
             sessionRunsCancelled = 0;
    uint64_t connections = 0, connectionsRefused = 0;
    uint64_t sessionMemory = 0, sessionMemoryPeak = 0, sessionMemoryQuota = 0,
             sessionMemoryRefused = 0, memoryHeld = 0, memoryKept = 0, memoryLimit = 0;
    std::vector<uint64_t> sessionMemories;
    uint64_t sessionGraphBytes = 0, graphBudget = 0, graphsForgotten = 0, planEvictions = 0,
             compiledEvictions = 0, diskEvictions = 0, compilesDropped = 0;
    uint64_t sessionsParked = 0, resumes = 0, sessionsExpired = 0;
    struct Graph {
      ir::Hash256 hash;
      uint32_t nodes = 0;
      uint64_t runs = 0, executeNs = 0, buildNs = 0;
      std::string executor;
      uint64_t compiledRuns = 0;
    };
    std::vector<Graph> graphs;
  };
  ServerStats serverStats();
  /// What the server said of itself when the session began (connecting first if need be).
  Transport::ServerHello serverHello();
  /// The server device's memory figures and properties (torch.rgpu.memory_allocated and the
  /// rest). Runs what is pending first, so that its tensors are counted; one round trip.
  struct DeviceMemory {
    std::string device, name;
    uint64_t allocated = 0, allocatedPeak = 0, reserved = 0, reservedPeak = 0, free = 0, total = 0;
    uint32_t multiProcessors = 0, major = 0, minor = 0;
  };
  DeviceMemory deviceMemory(int device = 0, bool resetPeak = false, bool emptyCache = false);
  /// How many devices the server has (rgpu:0..n-1), connecting first if need be; 1 if it
  /// cannot be reached (the next sync then says why).
  int deviceCount();
  /// torch.distributed among servers (python/rgpu/distributed.py): starts the job's rendezvous
  /// store on this session's server and returns its "host:port"; joins a process group of the
  /// job's servers as \p rank of \p size (waiting for all of them) and returns the group's name
  /// for this session's graphs.
  std::string hostStore();
  std::string joinGroup(const std::string &store, const std::string &prefix, int rank, int size,
                        uint32_t timeoutMs);

  void release(uint64_t handle);
  /// Raises SessionLost if \p v is data of a session that reset() ended.
  void checkCurrent(const Value &v);
  /// torch.manual_seed: seeds the session's generator of every device. Ops traced before it
  /// draw before it: the trace is cut first if a random op is pending.
  void seed(uint64_t seed);
  /// A random op was traced: what touches a generator's state cuts the trace first (only then),
  /// and the next cut runs it even if nothing holds its result, so that it draws as on CPU.
  void noteRandom(llvm::IntrusiveRefCntPtr<TraceNode> node) { randomNodes_.push_back(std::move(node)); }
  /// The state of the session's generator of \p device, after everything traced so far has
  /// drawn from it. One round trip.
  struct RngState {
    std::string state;
    uint64_t initialSeed = 0;
  };
  RngState rngState(int device, uint64_t generator = 0);
  /// Sets that state at this point of the trace: ops traced before draw from the old state,
  /// ops traced after from \p state. Sent with the next frame; a state the server refuses is
  /// a RemoteError at the next sync.
  void setRngState(int device, std::string state, uint64_t generator = 0);
  /// torch.Generator(device="rgpu") objects: each is a generator of this session on the server,
  /// named by an id the client picks. newGenerator makes one \p how says: seeded with \p arg
  /// (CREATE), in the state generator \p arg is in at this point of the trace (CLONE_OF), or
  /// in the state the session's generator of \p device is in there (SNAPSHOT); returns its id.
  /// seedGenerator reseeds one there.
  uint64_t newGenerator(int device, wire::GeneratorRequest::Which how, uint64_t arg = 0);
  void seedGenerator(int device, uint64_t id, uint64_t seed);
  /// At this point of the trace, the session's generator of \p device takes the state of
  /// generator \p id (a SNAPSHOT): restoring the device's state without a round trip.
  void restoreRng(int device, uint64_t id);
  /// The generator is gone: the server drops it after the runs that may still use it (the
  /// next cut's). Never throws.
  void dropGenerator(uint64_t id) noexcept;
  /// Waits until the server has executed everything sent so far.
  void synchronize();
  uint64_t liveTensors() const { return live_; }

  /// After a lost connection every call raises SessionLost; this is why.
  bool lost() const { return transport_.lost(); }
  /// Whether this process ever started its session on a server: until then the server holds
  /// nothing of it, and queries of the server's state need not start one.
  bool started() const { return transport_.started(); }
  /// Resumes after a dropped connection: how many times it did.
  uint64_t reconnects() const { return transport_.reconnects(); }
  /// Ends this session on the server (at exit), keeping nothing there for a resume.
  void close();
  /// Starts a new session (after SessionLost): tensors of the old one raise when used.
  void reset();

  /// Where shipped graphs are kept for rgpu-trace-dump; empty keeps none.
  void setCacheDir(std::string dir) { diagnostics_.setCacheDir(std::move(dir)); }
  /// Writes this process's run counts into the graph cache files (at exit).
  void flushGraphCache();

  using GraphInfo = Diagnostics::GraphInfo;
  using SiteInfo = Diagnostics::SiteInfo;
  const std::map<ir::Hash256, GraphInfo> &graphs() const { return diagnostics_.graphs(); }
  const std::map<uint32_t, SiteInfo> &sites() const { return diagnostics_.sites(); }

  /// Log events go to \p sink (Python's logger "rgpu"); debug events only if \p debug.
  using LogSink = void (*)(int level, const std::string &message);
  void setLogSink(LogSink sink, bool debug) {
    logSink_ = sink;
    logDebug_ = debug;
  }
  /// Every replayed cut is also resolved in full, and a difference raises (for tests).
  void setCheckReplays(bool on) { checkReplays_ = on; }
  /// Whether graphs that differ only in sizes run as one symbolic graph (RGPU_DYNAMIC, on by
  /// default; see rgpu/ir/Symbolic.h).
  void setDynamic(bool on) {
    dynamic_ = on;
    replays_.clear(); // they may run graphs as symbolic ones
  }
  /// Warn when one sync site has cut more than this many graphs differing only in shapes.
  void setRecompileWarningThreshold(uint64_t n) { diagnostics_.setRecompileWarningThreshold(n); }

private:
  Session();

  std::recursive_mutex mu_;
  unsigned depth_ = 0;                                 ///< Locks held (under mu_).
  std::vector<std::pair<int, std::string>> pendingLogs_; ///< Emitted by the outermost Lock.
  Stats stats;
  std::mutex locationsMu_;

  struct Command;
  using CutOutputs = llvm::DenseMap<std::pair<TraceNode *, uint32_t>, llvm::IntrusiveRefCntPtr<DeviceData>>;
  /// Cuts every live pending tensor into one graph and queues its run; returns where each
  /// pending value went.
  CutOutputs cut(const char *reason, const std::string &executor = "");
  /// A raw graph over traced nodes, with what its Run needs besides the graph.
  struct Traced {
    ir::Graph graph;
    std::vector<uint64_t> inputHandles;
    std::vector<uint64_t> inputDynamicDims; ///< DeviceData::dynamicDims, per input.
    std::vector<ir::ScalarValue> scalarValues;
    std::vector<uint32_t> clientLocs; ///< Graph location index -> the client's location id.
  };
  /// Builds the graph of \p nodes (in trace order) producing \p outputs.
  Traced buildGraph(llvm::ArrayRef<TraceNode *> nodes,
                    llvm::ArrayRef<std::pair<TraceNode *, uint32_t>> outputs);
  /// How a cut runs: which graph, with what.
  struct Resolved {
    ir::Hash256 hash;
    /// The graph a Define would send; null only if the server holds it.
    std::shared_ptr<const ir::Graph> graph;
    bool symbolic = false;
    llvm::SmallVector<int64_t, 4> symbols; ///< Of a symbolic graph.
    std::vector<uint64_t> handles;
    std::vector<ir::ScalarValue> scalars;
    uint32_t outputs = 0;
    std::vector<uint32_t> locations; ///< Each canonical node's client location id.
  };
  /// Canonicalises \p t and queues its Define (if the server lacks it) and its Run; returns the
  /// first output handle. With \p key (the trace \p t was built from), records how it resolved
  /// for later cuts of the same shape.
  uint64_t queueRun(Traced t, bool replyMetas, const char *reason,
                    const std::string &executor = "", const TraceKey *key = nullptr);
  Resolved resolve(Traced t, bool replyMetas, const TraceKey *key);
  /// Resolves the cut of \p key (of \p nodes) as an earlier cut of its shape resolved, if it
  /// can (see rgpu/client/Replay.h).
  bool replay(const TraceKey &key, llvm::ArrayRef<TraceNode *> nodes, Resolved &out);
  uint64_t queueResolved(Resolved r, bool replyMetas, const char *reason,
                         const std::string &executor);
  /// The restores (wire::Run.restores) of the Run the cut being made queues.
  std::vector<uint64_t> restores_;
  /// Cuts the trace (\p reason), sends \p c alone and waits for its text answer.
  std::string askText(Command c, const char *reason);
  void log(int level, const std::string &message);
  void queue(Command c);
  /// What an awaited frame brought back, in command order per kind.
  struct Reply {
    std::vector<std::string> data;                  ///< Downloads (besides values).
    std::vector<std::vector<ir::TensorMeta>> metas; ///< Runs of data-dependent ops.
    std::vector<ServerStats> stats;                 ///< Stats requests.
    std::vector<DeviceMemory> memory;               ///< Memory requests.
    std::vector<std::string> texts;                 ///< HostStore and JoinGroup answers.
    std::vector<RngState> rngStates;                ///< RngState requests.
    std::string error;                              ///< A remote error, described,
    std::string errorType;                          ///< and its wire::Error.pythonType.
  };
  /// Per graph, the inputs and scalars of the latest Run sent: the next one says only what
  /// changed (wire::Run.relative). The server keeps the same until a Forget.
  struct LastRun {
    std::vector<uint64_t> inputs;
    std::vector<ir::ScalarValue> scalars;
    std::vector<uint32_t> restores;
  };
  std::map<ir::Hash256, LastRun> lastRuns_;
  void encodeRunArgs(const Command &c, wire::Run::Builder r);
  static void encodeRestores(const std::vector<uint32_t> &restores, wire::Run::Builder r);
  /// Transport::receive as a wait that Ctrl-C or rgpu.cancel() interrupts (Interrupts.h).
  net::Frame awaitFrame(uint64_t seq, const std::function<void(const net::Frame &)> &earlier,
                        bool spin);
  /// After a wait that sent a Cancel: raises ErrorKind::Interrupted.
  [[noreturn]] void interrupted();
  /// Per Download of a frame, the data whose value it brings, in what layout (null data: an
  /// ordinary download).
  struct Target {
    llvm::IntrusiveRefCntPtr<DeviceData> data;
    ir::TensorMeta layout;
  };
  using Targets = std::vector<Target>;
  /// Sends the queued commands as one frame. With \p wantReply, waits for the server's answer.
  /// Without it, a frame that runs a graph or asks for values still gets a reply, taken in
  /// later (harvest) or when one of its values is read.
  Reply flush(bool wantReply);
  /// A frame sent with a reply that nobody has waited for yet.
  struct InFlight {
    uint64_t seq = 0;
    Targets targets;
    std::vector<ir::Hash256> runs;
    std::chrono::steady_clock::time_point sent;
    bool step = false; ///< It runs a graph: it counts against RGPU_MAX_INFLIGHT.
  };
  /// Oldest first; replies arrive in this order.
  std::deque<InFlight> inflight_;
  /// Reads one reply: values into their data (\p own: the targets of frame \p ownSeq, being
  /// waited for; else the in-flight frame it answers), the rest into the returned Reply. Notes
  /// are logged; an error that ends the session loses it. A \p timed reply was read about when
  /// it arrived: it tells how fast steps are answered (boundInflight).
  Reply absorb(const net::Frame &frame, const Targets *own, uint64_t ownSeq = 0,
               bool timed = true);
  /// Takes in every reply that has arrived; a remote error among them is kept for the next
  /// read (raiseDeferred).
  void harvest();
  /// Waits for the reply to in-flight frame \p seq: one wait for a value, or with \p throttle
  /// one wait for the server to catch up (counted apart).
  void awaitReply(uint64_t seq, bool throttle = false);
  /// Waits while more steps are unanswered than RGPU_MAX_INFLIGHT plus those in transit (the
  /// link's round trip and one step, over the interval between step replies).
  void boundInflight();
  /// Asks, in the next frame, for \p data's bytes in \p layout.
  void queueValue(const llvm::IntrusiveRefCntPtr<DeviceData> &data, const ir::TensorMeta &layout);
  /// Raises the remote error an unawaited reply brought, once.
  void raiseDeferred();
  std::string deferredError_, deferredErrorType_;
  uint64_t lastReply_ = 0; ///< The last frame whose reply was read (ClientFrame.received).
  /// When the latest step replies were read: the rate at which server and link finish steps.
  std::deque<std::chrono::steady_clock::time_point> stepReplies_;
  size_t maxInflight_ = 8;
  [[noreturn]] void lose(const std::string &why);
  /// download() of a value that may already be device data.
  at::Tensor fetch(LazyTensorImpl *impl, const ir::TensorMeta &want);
  /// Small values read before, by the ops that computed them (readKey; a read of device data
  /// keeps its bytes in DeviceData::value): the same ops on the same device data give the
  /// same bytes, so reading them again needs no round trip. Handles are never reused, and
  /// device data never changes (writes make new data), so an entry can only be stale by being
  /// unreachable. Least recently read first, at most kRememberedReads.
  static constexpr size_t kRememberedReads = 256;
  static constexpr int64_t kRememberedBytes = 256;
  std::list<std::pair<std::string, at::Tensor>> remembered_;
  std::unordered_map<std::string, std::list<std::pair<std::string, at::Tensor>>::iterator>
      rememberedIndex_;
  /// The key of a read of pending \p v in layout \p want: the trace of the nodes that compute
  /// it (readTrace; at most a few, all aten and none random), its positions and scalar
  /// values, and the handles it reads. False if such a read is not remembered.
  bool readKey(const Value &v, const ir::TensorMeta &want, std::string &key) const;
  /// A download too large for one reply, one chunk per round trip.
  at::Tensor downloadInChunks(const DeviceData &data, const ir::TensorMeta &want);
  /// A CPU tensor of layout \p m holding \p bytes (which must be exactly its span).
  at::Tensor tensorFromBytes(const ir::TensorMeta &m, const std::string &bytes);
  uint64_t newHandles(uint64_t n) { uint64_t h = nextHandle_; nextHandle_ += n; return h; }
  std::string describe(const wire::Error::Reader &e);

  Transport transport_;
  Diagnostics diagnostics_;
  uint64_t nextHandle_ = 1;
  uint64_t nodeSeq_ = 0;
  uint64_t nodesSinceCut_ = 0;
  uint64_t live_ = 0;
  LazyTensorImpl *head_ = nullptr;
  std::vector<Command> queue_;
  uint64_t nextGenerator_ = 1;
  /// The random ops traced since the last cut (noteRandom).
  std::vector<llvm::IntrusiveRefCntPtr<TraceNode>> randomNodes_;
  /// The traced nodes of cuts whose frame is not sent yet, without their device data: freed
  /// once it is, while the server runs it.
  std::vector<llvm::IntrusiveRefCntPtr<TraceNode>> retired_;
  /// Cuts the trace if a random op is pending: a command that reads or changes a generator's
  /// state must come after the runs that draw before it. Other pending ops stay pending (and
  /// fused with what follows).
  void cutBeforeRng(const char *reason);
  /// Queues a GeneratorRequest \p op of generator \p id, after cutBeforeRng(\p reason) unless
  /// \p reason is null.
  void queueGenerator(const char *reason, int device, uint64_t id,
                      wire::GeneratorRequest::Which op, uint64_t arg = 0);
  /// Generators dropped since the last cut (dropGenerator).
  std::vector<uint64_t> droppedGenerators_;
  /// Queues the drops of droppedGenerators_ (after a cut's run). Never throws.
  void queueGeneratorDrops() noexcept;
  /// The members of the download group not fetched yet, and what its reads brought in (keyed
  /// by the device data they were read from, kept alive so the key stays unique).
  struct Fetched {
    llvm::IntrusiveRefCntPtr<DeviceData> data;
    at::Tensor cpu;
    bool taken = false;
  };
  std::vector<at::Tensor> group_;
  llvm::DenseMap<DeviceData *, Fetched> fetched_;
  std::vector<uint64_t> releases_;
  /// The graphs the server holds for this session, most recently run first, with their
  /// ir::graphBytes: kept under the budget its Hello reply announced by forgetting the least
  /// recently run ones (a graph run again after that is defined again).
  std::list<std::pair<ir::Hash256, uint64_t>> held_;
  std::map<ir::Hash256, std::list<std::pair<ir::Hash256, uint64_t>>::iterator> heldIndex_;
  uint64_t heldBytes_ = 0;
  /// Handles below this belong to a session lost before reset(): using them raises.
  uint64_t firstHandle_ = 1;
  /// Records that the server is to hold \p graph (hashed \p hash) for its next Run, queueing
  /// Forgets that make room if it does not hold it yet. True if its Define must be queued.
  bool hold(const ir::Hash256 &hash, const ir::Graph *graph);
  /// Per graph hash, the location id of each node at its latest run: a remote error names the
  /// user's line as it is now, whatever line first defined the graph.
  std::map<ir::Hash256, std::vector<uint32_t>> nodeLocations_;
  llvm::StringMap<uint32_t> locationIds_;
  uint32_t site_ = 0; ///< The user's line whose sync is being served.
  std::vector<ir::Hash256> runsInFrame_;
  bool dynamic_ = true;
  /// Whether uploads travel compressed by byte plane (RGPU_COMPRESS): auto does so where the
  /// link's fastest exchange took 2 ms or more, where bandwidth, not the client's CPU, is short.
  enum class Compress { Never, Auto, Always } compress_ = Compress::Auto;
  bool compressUploads();
  ir::ShapeFamilies families_;
  ReplayCache replays_;
  bool checkReplays_ = false;
  LogSink logSink_ = nullptr;
  bool logDebug_ = false;
  std::vector<std::string> locations_{std::string()};
};

} // namespace rgpu::client
