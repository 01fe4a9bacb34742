//===- server/Session.h - One client's tensors, graphs and errors ----------===//
//
// A session owns a handle namespace: handles are chosen by its client, and one session can never
// name another's tensors. Frames of a session are executed in order on that session's worker
// thread, never on the I/O loop.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Compiler.h"
#include "Groups.h"
#include "Log.h"
#include "Memory.h"
#include "Plan.h"

#include "rgpu/net/Frame.h"
#include "rgpu/wire/Wire.h"


#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace rgpu::server {

/// What a server lets each session hold, and how much it caches for all of them.
struct Budgets {
  uint64_t sessionMemory = 0;              ///< --session-memory; 0: none
  uint64_t graphMemory = uint64_t(64) << 20; ///< --graph-memory: graphs one session holds
  uint64_t planCache = uint64_t(256) << 20;  ///< --plan-cache: plans kept once unheld
  uint64_t maxHandles = uint64_t(1) << 20;   ///< --max-handles: tensor handles one session binds
};

class Session;

/// State shared by every session of one server: the device, the graph cache and the compiler.
///
/// A plan lives while a session holds its graph (defined and not forgotten), and after that in
/// a least-recently-defined cache of --plan-cache bytes, so a session that reconnects or
/// defines a graph another one built gets it without building it again.
class Context {
public:
  /// \p compiler is null for --compiler plan.
  /// rgpu:i runs on \p devices[i] (--devices); \p compiler compiles for devices[0].
  Context(std::vector<at::Device> devices, wire::Limits limits,
          std::unique_ptr<Compiler> compiler = nullptr);

  /// rgpu:0's device: the one memory figures and Inductor are for by default.
  at::Device device() const { return devices_[0]; }
  const std::vector<at::Device> &devices() const { return devices_; }
  const wire::Limits &limits() const { return limits_; }
  /// The most bytes one Upload carries: a quarter of --session-memory (at least 1 MiB), so
  /// that a chunk's frame, which counts toward the quota while it arrives, leaves room for
  /// its tensor; limits().uploadChunkBytes without a quota.
  uint64_t uploadChunkBytes() const {
    const uint64_t quarter = std::max<uint64_t>(budgets.sessionMemory / 4, 1 << 20);
    return budgets.sessionMemory ? std::min(limits_.uploadChunkBytes, quarter)
                                 : limits_.uploadChunkBytes;
  }
  Compiler *compiler() const { return compiler_.get(); }

  /// The shared plan for \p hash, or null if no session has defined it.
  std::shared_ptr<const Plan> find(const ir::Hash256 &hash);
  /// Verifies \p graph (\p hash must be its own hash) and returns its plan: the shared one if
  /// a session defined the same graph before, else a new one, cached for every session unless
  /// another graph already holds the hash (then it is private to the caller, see Plan::shared).
  std::shared_ptr<const Plan> define(const ir::Hash256 &hash, ir::Graph graph, std::string &error);

  Budgets budgets;
  /// Where a job's rendezvous store listens when a session hosts it (--store-host).
  std::string storeHost = "127.0.0.1";

  /// Resuming. A session whose client gave it an id is parked when its connection ends, for
  /// sessionGraceMs; a Hello asking to resume it (with the same kind of authentication) takes
  /// it back. One still attached to a connection (the server has not seen the old connection
  /// end) is taken over: that connection is closed (closeConnection, set by the I/O loop's
  /// owner) and the Hello waits, off the worker pool, for the session to be parked (its frame
  /// is deferred and served again at wakeDeferred).
  uint64_t sessionGraceMs = 120000;
  std::string instance; ///< 8 random bytes for this process
  std::function<void(uint64_t connId)> closeConnection;
  /// Serves deferred frames again: set by the I/O loop's owner, called when a session is
  /// parked or ends.
  std::function<void()> wakeDeferred;
  void activate(const std::string &id, uint64_t connId, const std::string &principal);
  void deactivate(const std::string &id);
  void park(std::unique_ptr<Session> session);
  enum class Takeover { Taken, Absent, Wait };
  /// Takes the parked session \p id into \p out if \p principal may have it (Taken). One
  /// still attached to a connection of the same principal has that connection closed, and
  /// the caller is to ask again once it is parked (Wait); a session of another principal is
  /// never touched (Absent).
  Takeover takeParked(const std::string &id, const std::string &principal,
                      std::unique_ptr<Session> &out);
  /// Requests one principal may have waiting on the outside world at once (resume takeovers,
  /// process-group joins); reserveWait is false past it.
  static constexpr size_t kMaxWaits = 4;
  bool reserveWait(const std::string &principal);
  void releaseWait(const std::string &principal);
  /// Drops parked sessions whose grace has passed; returns how many.
  size_t expireParked();
  size_t sessionsParked();
  std::atomic<uint64_t> resumes{0}, sessionsExpired{0};
  ~Context();

  /// A new session's memory account, listed for sessionMemories.
  std::shared_ptr<memory::Account> openAccount();
  /// Records whose session \p account is (its principal), once its Hello said.
  void own(const memory::Account &account, const std::string &principal);
  /// The bytes each open session of \p principal holds, largest first.
  std::vector<uint64_t> sessionMemories(const std::string &principal);
  /// True if every open session is \p principal's: a device-wide figure it resets is its own.
  bool onlyPrincipal(const std::string &principal);

  std::atomic<uint64_t> planBuilds{0}, graphRuns{0}, compiledRuns{0}, sessions{0},
      planEvictions{0};
  /// Sessions whose Hello was accepted, and how many may be at once (--max-connections).
  std::atomic<uint64_t> greetedSessions{0};
  uint64_t maxSessions = 256;
  /// The server's connection counters, kept by the I/O loop, for rgpu.server_stats().
  std::atomic<uint64_t> connectionsOpen{0}, connectionsRefused{0};
  size_t graphsCached();

  /// A CUDA error that no later call survives (server/Device.h): the first one's message is
  /// kept, and the I/O loop exits the server once the failing session's reply is out.
  void loseDevice(const std::string &why);
  std::optional<std::string> deviceLost();

private:
  std::vector<at::Device> devices_;
  wire::Limits limits_;
  std::unique_ptr<Compiler> compiler_;
  std::atomic<bool> deviceLost_{false};
  std::mutex lostMu_;
  std::string lostWhy_;
  std::mutex mu_;
  /// Every plan some session or the cache holds (under mu_).
  std::map<ir::Hash256, std::weak_ptr<const Plan>> plans_;
  /// The cache: most recently defined first, with the bytes it holds (under mu_).
  std::list<std::shared_ptr<const Plan>> recent_;
  std::map<ir::Hash256, std::list<std::shared_ptr<const Plan>>::iterator> recentIndex_;
  uint64_t recentBytes_ = 0;
  size_t sweptAt_ = 0;
  void keep(const std::shared_ptr<const Plan> &plan); // under mu_
  std::mutex accountsMu_;
  /// Every open session's account and its principal (under accountsMu_).
  std::vector<std::pair<std::weak_ptr<memory::Account>, std::string>> accounts_;
  struct Parked {
    std::unique_ptr<Session> session;
    std::chrono::steady_clock::time_point deadline;
  };
  std::mutex parkMu_;
  std::map<std::string, Parked> parked_;      ///< under parkMu_
  struct Active {
    uint64_t connId;
    std::string principal;
    bool closing = false; ///< a takeover closed its connection already
  };
  std::map<std::string, Active> active_;      ///< under parkMu_
  std::map<std::string, size_t> pendingWaits_; ///< under parkMu_: by principal
};

/// The outcome of handling one frame.
struct FrameOutcome {
  std::string reply; ///< A framed ServerFrame to send, or empty.
  bool close = false; ///< The frame was malformed: close the connection after the reply.
  uint64_t seq = 0;   ///< The frame's sequence number (0 for a Hello).
  /// A Hello that resumed a parked session: it replaces the one that served the Hello.
  std::unique_ptr<Session> adopted;
  /// The frame (a Hello taking over a session still attached) was not served: serve it again
  /// after Context::wakeDeferred. Nothing of it has run.
  bool deferred = false;
  /// A TCP Hello was accepted: what is sent after its reply is sealed, and what arrives after
  /// it opened, under these keys (rgpu/net/Seal.h).
  std::optional<net::SessionKeys> keys;
  /// A resume's replies the client may have lost, sent after \p reply (and sealed if \p keys).
  std::string resent;
};

/// A name and the token that proves it: who a TCP session belongs to.
struct Principal {
  std::string name, token;
};

/// How a session's peer proves who it is, decided by the transport it came in on.
struct Admission {
  /// Empty: the peer is already known (a Unix-socket peer of this server's uid). Else the
  /// challenge sent to a TCP peer, which its Hello must answer with a MAC under the token of
  /// one of \p principals.
  std::string challenge;
  std::shared_ptr<const std::vector<Principal>> principals;
};

/// What the I/O loop tells the pool thread serving a connection's session, as it happens.
struct Signals {
  /// The connection ended: the commands of a frame still being served are dropped, not run.
  std::atomic<bool> closed{false};
  /// A Cancel arrived in frame cancelThrough + 1: the runs of frames up to cancelThrough stop
  /// (at the plan's next kernel) or are skipped.
  std::atomic<uint64_t> cancelThrough{0};
};

class Session {
public:
  Session(Context &ctx, std::string peer, Admission admission = {},
          const Signals *signals = nullptr);
  ~Session();

  /// Executes every command of \p frame in order. This is the session's one error boundary:
  /// anything that throws while a frame is served, building its reply included, ends this
  /// session with an error naming it, and never the process.
  FrameOutcome handle(const net::Frame &frame);
  /// The session's Hello was accepted (its peer is authenticated).
  bool greeted() const { return greeted_; }
  /// What its memory is charged to.
  const std::shared_ptr<memory::Account> &account() const { return account_; }
  /// Its client gave it an id and has not said Bye: it is parked when its connection ends.
  bool resumable() const { return greeted_ && !id_.empty() && !ended_; }
  const std::string &id() const { return id_; }
  /// Who may resume it, list it in STATS or reset its peaks: "uid" (a Unix-socket peer of the
  /// server's uid) or the principal whose token its TCP Hello proved.
  const std::string &principal() const { return principal_; }
  /// Parked: no connection's end cancels its commands any more, and a join it was waiting for
  /// ends.
  void detach();
  /// Resumed on a new connection.
  void attach(std::string peer, const Signals *signals);
  /// Keeps the reply to frame \p seq until the client says it has it (ClientFrame.received):
  /// a client that lost it in a drop gets it again when it resumes. At most kKeptReplies
  /// replies and kKeptReplyBytes besides the newest are kept; a client that lost an older one
  /// reads its values again.
  void keepReply(uint64_t seq, std::shared_ptr<const std::string> reply);

private:
  struct Partial; // an upload arriving in chunks

  FrameOutcome serve(const net::Frame &frame);
  /// The last reply of a session that failed in a way no command caught; closes it.
  FrameOutcome failure(const std::string &why);

  void hello(wire::Hello::Reader r, std::string &fatal, std::string &serverMac);
  void define(wire::Define::Reader r);
  void forget(capnp::List<wire::Hash>::Reader hashes);
  /// A frame's commands after its last Run. That Run may let its compiled code write into the
  /// buffer of an input they release before anything downloads it (CompiledGraph::run).
  struct FrameTail {
    capnp::List<wire::Command>::Reader commands;
    size_t lastRun;
    bool frees(uint64_t handle) const;
  };
  void run(wire::Run::Reader r, std::vector<std::vector<ir::TensorMeta>> &metas,
           const FrameTail *tail = nullptr);
  void upload(wire::Upload::Reader r);
  /// Reads a tensor's bytes into \p bytes, at most \p room of them (what the reply has left).
  std::string download(wire::Download::Reader r, uint64_t room, kj::Array<kj::byte> &bytes);
  void fail(ErrorPtr error);
  /// Binds a handle to a value. A client may rebind handles it no longer uses. A new handle
  /// costs the session kHandleBytes of its memory quota, and it holds at most
  /// budgets.maxHandles of them: past either, this throws, which ends the session.
  void bind(uint64_t handle, Entry e);
  /// What one entry of tensors_ costs the server, charged to the session's account.
  static constexpr uint64_t kHandleBytes = 96;

  Context &ctx_;
  std::string peer_;
  Admission admission_;
  std::string principal_ = "uid";
  const Signals *signals_;
  uint64_t serving_ = 0; ///< The frame being served.
  /// A Cancel covers the frame being served: its runs bind none of their outputs (see
  /// cancelRun).
  bool cancelling() const {
    return signals_ && serving_ && serving_ <= signals_->cancelThrough.load();
  }
  /// Binds the outputs of a run a Cancel stopped: each to \p why, except those \p restores
  /// (wire::Run.restores) binds to the tensor of an earlier version, one of the run's
  /// \p inputs (handles).
  void cancelRun(uint64_t first, llvm::ArrayRef<uint64_t> inputs, size_t outputs,
                 llvm::ArrayRef<uint32_t> restores, ErrorPtr why);
  bool greeted_ = false;
  bool counted_ = false;     ///< Holds a place of --max-connections (greetedSessions).
  std::string id_;           ///< The client's session id; empty: not resumable.
  bool ended_ = false;       ///< Bye, or a protocol error: never parked.
  uint64_t lastSeq_ = 0;     ///< The last frame executed.
  /// Replies the client may not have, oldest first (see keepReply).
  std::deque<std::pair<uint64_t, std::shared_ptr<const std::string>>> replies_;
  uint64_t replyBytes_ = 0;
  /// Forgets the kept replies to frames up to \p seq.
  void dropReplies(uint64_t seq);
  /// Drops the tensor bound to \p handle (and a download staged from it), if any.
  void release(uint64_t handle);
  std::unique_ptr<Session> adopted_; ///< What this session's resume Hello found.
  uint64_t resumeFrom_ = 0;
  /// A resume Hello waiting for a takeover (FrameOutcome::deferred): since when, and whether
  /// it (or a join) holds one of its principal's waits (Context::reserveWait).
  std::optional<std::chrono::steady_clock::time_point> deferredSince_;
  bool holdsWait_ = false, deferHello_ = false;
  /// Gives back the principal's wait this session holds, if it holds one.
  void endWait();
  /// The keys of an accepted TCP Hello, until its reply hands them to the connection.
  std::optional<net::SessionKeys> keys_;
  /// How long a resume Hello waits for the session it takes over to be parked.
  static constexpr auto kTakeoverWait = std::chrono::seconds(30);
  void fillHello(wire::HelloReply::Builder h, const std::string &serverMac);
  wire::Error::Kind fatalKind_ = wire::Error::Kind::PROTOCOL;
  /// The session's random state for each of ctx_.devices(); devices that are the same device
  /// share one generator.
  std::vector<at::Generator> generators_;
  /// torch.Generator(device="rgpu") objects, by the client's ids (GeneratorRequest).
  std::unordered_map<uint64_t, at::Generator> explicitGenerators_;
  /// The explicit generator \p id; throws if the session has none of that id.
  at::Generator &generator(uint64_t id);
  /// Keyed by the client's handles: any 64-bit value, so not an llvm::DenseMap, which reserves
  /// two keys (session_fuzz found a Run binding ~0 corrupt it).
  std::unordered_map<uint64_t, Entry> tensors_;
  std::map<uint64_t, std::unique_ptr<Partial>> partial_;
  /// The one tensor being downloaded in chunks, copied into the layout asked for, until its
  /// last chunk (a client reads one tensor at a time; a new one replaces it, so it is bounded).
  uint64_t stagedHandle_ = 0;
  at::Tensor staged_;
  /// The graphs this session defined and has not forgotten: the only ones its Runs can name,
  /// and the ir::graphBytes they hold (at most budgets.graphMemory).
  std::map<ir::Hash256, std::shared_ptr<const Plan>> defined_;
  uint64_t graphBytes_ = 0, graphsForgotten_ = 0;
  std::shared_ptr<memory::Account> account_;
  /// Graphs this session defined that failed checks (at most kMaxRefused are remembered).
  std::map<ir::Hash256, ErrorPtr> refused_;
  static constexpr size_t kMaxRefused = 256;
  struct GraphUse {
    uint32_t nodes = 0;
    uint64_t buildNs = 0;
    bool shared = true;
    uint64_t runs = 0, executeNs = 0, compiledRuns = 0;
  };
  /// What rgpu.server_stats() reports of the graphs this session holds.
  std::map<ir::Hash256, GraphUse> used_;
  /// Per graph held, the inputs and scalars of its latest Run: a relative Run says what changed.
  struct LastRun {
    std::vector<uint64_t> inputs;
    std::vector<ir::ScalarValue> scalars;
    std::vector<uint32_t> restores; ///< wire::Run.restores
  };
  std::map<ir::Hash256, LastRun> lastRuns_;
  /// The inputs, scalars and restores of Run \p r of graph \p g (\p hash), whole or relative
  /// to the previous run; an error message if they are not well formed.
  std::string runArgs(wire::Run::Reader r, const ir::Hash256 &hash, const ir::Graph &g,
                      std::vector<uint64_t> &inputs,
                      llvm::SmallVectorImpl<ir::ScalarValue> &scalars,
                      std::vector<uint32_t> &restores);
  uint64_t runs_ = 0, executeNs_ = 0, compiledRuns_ = 0, writesInPlace_ = 0, runsCancelled_ = 0;
  std::vector<std::string> notes_; ///< For the client's log, sent with the next reply.
  void stats(wire::ServerStats::Builder out);
  ErrorPtr pending_; ///< The first error not yet reported to the client.
  Groups groups_;    ///< torch.distributed groups this session joined.
  /// A JoinGroup waiting for its group's other ranks (its frame deferred until it ends).
  std::shared_ptr<Groups::Join> joining_;
};

} // namespace rgpu::server
