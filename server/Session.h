//===- server/Session.h - One client's tensors, graphs and errors ----------===//
//
// A session owns a handle namespace: handles are chosen by its client, and one session can never
// name another's tensors. Frames of a session are executed in order on one pool thread at a
// time, never on the I/O loop.
//
// Serving a frame can go wrong in three ways, each with its own reach:
// - a node fails (a kernel raises): its outputs hold the error, and whoever reads them gets it;
// - a command fails (a bad handle, a refused graph, a quota): a SessionError, or any exception
//   torch throws while the command runs, becomes the session's error, reported with the next
//   reply; the session goes on;
// - the peer breaks the protocol (a malformed frame, a Hello out of place, a limit of the wire
//   passed): a ProtocolError, caught once per frame, answers with an error and closes the
//   connection.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Context.h"
#include "Groups.h"
#include "Log.h"
#include "Memory.h"
#include "Peer.h"
#include "Plan.h"

#include "rgpu/net/Frame.h"
#include "rgpu/wire/RunArgs.h"
#include "rgpu/wire/Wire.h"

#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <stdexcept>
#include <unordered_map>

namespace rgpu::server {

/// The peer broke the protocol: the reply carries this error (of \p kind: AUTH and VERSION
/// tell the client what to fix) and the connection closes after it. Not a std::exception, so
/// that the catch of a command's failures (which torch throws as std::exceptions) lets it
/// pass to Session::serve, the one place that catches it.
struct ProtocolError {
  std::string message;
  wire::Error::Kind kind = wire::Error::Kind::PROTOCOL;
};

/// A command the session cannot carry out: it becomes the session's error, and the session
/// goes on.
struct SessionError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// An error that belongs to no node (a bad handle, a refused graph, a failed download), as the
/// client reports it.
ErrorPtr sessionError(std::string message, std::string pythonType = "");

/// The outcome of handling one frame.
struct FrameOutcome {
  std::string reply; ///< A framed ServerFrame to send, or empty.
  bool close = false; ///< The frame was malformed: close the connection after the reply.
  uint64_t seq = 0;   ///< The frame's sequence number (0 for a Hello).
  /// A Hello that resumed a parked session: it replaces the one that served the Hello.
  std::unique_ptr<Session> adopted;
  /// The frame (a Hello taking over a session still attached, or a JoinGroup waiting for its
  /// group) was not served yet: serve it again after Context::wakeDeferred.
  bool deferred = false;
  /// A TCP Hello was accepted: what is sent after its reply is sealed, and what arrives after
  /// it opened, under these keys (rgpu/net/Seal.h).
  std::optional<net::SessionKeys> keys;
  /// A resume's replies the client may have lost, sent after \p reply (and sealed if \p keys).
  std::string resent;
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
  struct Reply;   // the results a frame's commands gather (Session.cpp)
  struct Partial; // an upload arriving in chunks
  /// A frame's commands after its last Run. That Run may let its compiled code write into the
  /// buffer of an input they release before anything downloads it (CompiledGraph::run).
  struct FrameTail {
    capnp::List<wire::Command>::Reader commands;
    size_t lastRun; ///< commands.size() if none
    /// The tail of a frame of \p commands; a ProtocolError past limits.maxCommands.
    static FrameTail of(capnp::List<wire::Command>::Reader commands, const wire::Limits &limits);
    bool frees(uint64_t handle) const;
  };

  // Serving a frame (Session.cpp): one handler per command.
  FrameOutcome serve(const net::Frame &frame);
  /// A frame the session executed before (sent again after a resume): its kept reply, if any.
  FrameOutcome replay(uint64_t seq, bool wantReply);
  /// Ends a frame: its reply, the error it ended with, what a resume hands on.
  FrameOutcome finish(const net::Frame &frame, FrameOutcome outcome, Reply &reply,
                      const std::optional<ProtocolError> &violation);
  /// The last reply of a session that failed in a way no command caught; closes it.
  FrameOutcome endSession(const std::string &why);
  /// The connection ended, and the rest of the frame is not to run.
  bool dropsCommands() const;
  /// A command failed in a way no node caught: \p e is the session's error; it goes on.
  void failCommand(const std::exception &e);
  void handleHello(wire::Hello::Reader r, Reply &reply);
  void handleMemory(wire::MemoryRequest::Reader r, Reply &reply);
  void handleRngState(wire::RngStateRequest::Reader r, Reply &reply);
  void handleGenerator(wire::GeneratorRequest::Reader r);
  void handleHostStore(Reply &reply);
  void handleJoinGroup(wire::JoinGroup::Reader r, size_t at, Reply &reply);
  void handleSync(Reply &reply);
  void handleSeed(uint64_t seed);
  // Graphs and tensors (Tensors.cpp).
  void handleDefine(wire::Define::Reader r);
  void handleForget(capnp::List<wire::Hash>::Reader hashes);
  void handleRun(wire::Run::Reader r, const FrameTail *tail, Reply &reply);
  void handleUpload(wire::Upload::Reader r);
  void handleDownload(wire::Download::Reader r, Reply &reply);
  void handleReleaseRanges(capnp::List<uint64_t>::Reader ranges);
  // The content store and the files area (FileCommands.cpp).
  void handleHasContent(capnp::List<wire::Hash>::Reader digests, Reply &reply);
  void handleFile(wire::FileRequest::Reader r, Reply &reply);
  void writeFile(const std::string &path, wire::FileWrite::Reader r);
  void fileTensor(const std::string &path, wire::FileTensor::Reader r);
  void gatherFile(const std::string &path, wire::FileGather::Reader r);
  void saveArchive(const std::string &path, capnp::List<wire::ArchiveRecord>::Reader records);
  void loadArchive(const std::string &path, wire::LoadArchive::Reader r, Reply &reply);
  /// The tensor bound to \p handle; a SessionError if none is, or its error.
  const at::Tensor &tensorOf(uint64_t handle, const char *what);
  /// \p host (a CPU tensor read from a file or the store) on rgpu:\p device.
  at::Tensor onDevice(const at::Tensor &host, uint8_t device);

  /// Runs graph \p r; returns its outputs' metas if the Run asks for them.
  std::vector<ir::TensorMeta> run(wire::Run::Reader r, const FrameTail *tail);
  /// Binds the outputs of a run a Cancel stopped: each to \p why, except those \p restores
  /// (wire::Run.restores) binds to the tensor of an earlier version, one of the run's
  /// \p inputs (handles).
  void cancelRun(uint64_t first, llvm::ArrayRef<uint64_t> inputs, size_t outputs,
                 llvm::ArrayRef<uint32_t> restores, ErrorPtr why);
  /// A Cancel covers the frame being served: its runs bind none of their outputs (cancelRun).
  bool cancelling() const {
    return signals_ && serving_ && serving_ <= signals_->cancelThrough.load();
  }
  /// Reads the bytes Download \p r asks for into \p bytes, at most \p room of them (what the
  /// reply has left); else the error that stopped it.
  [[nodiscard]] ErrorPtr download(wire::Download::Reader r, uint64_t room,
                                  kj::Array<kj::byte> &bytes);
  /// Makes \p error the one the next reply reports, unless an earlier one is waiting.
  void fail(ErrorPtr error);
  /// Binds a handle to a value. A client may rebind handles it no longer uses. A new handle
  /// costs the session kHandleBytes of its memory quota, and it holds at most
  /// budgets.maxHandles of them: past either, this throws a SessionError.
  void bind(uint64_t handle, Entry e);
  /// Drops the tensor bound to \p handle (and a download staged from it), if any.
  void release(uint64_t handle);
  /// What one entry of tensors_ costs the server, charged to the session's account.
  static constexpr uint64_t kHandleBytes = 96;
  /// The explicit generator \p id; throws a SessionError if the session has none of that id.
  at::Generator &generator(uint64_t id);
  void stats(wire::ServerStats::Builder out);
  void fillHello(wire::HelloReply::Builder h, const std::string &serverMac);

  Context &ctx_;
  std::string peer_;
  Admission admission_;
  std::string principal_ = "uid";
  const Signals *signals_;
  std::shared_ptr<memory::Account> account_;
  uint64_t serving_ = 0; ///< The frame being served.
  bool greeted_ = false;
  bool counted_ = false;     ///< Holds a place of --max-connections (greetedSessions).
  bool ended_ = false;       ///< Bye, or a protocol error: never parked.
  ErrorPtr pending_;         ///< The first error not yet reported to the client.
  std::vector<std::string> notes_; ///< For the client's log, sent with the next reply.

  // Resuming.
  std::string id_;           ///< The client's session id; empty: not resumable.
  uint64_t lastSeq_ = 0;     ///< The last frame executed.
  /// Replies the client may not have, oldest first (see keepReply).
  std::deque<std::pair<uint64_t, std::shared_ptr<const std::string>>> replies_;
  uint64_t replyBytes_ = 0;
  /// Forgets the kept replies to frames up to \p seq.
  void dropReplies(uint64_t seq);
  std::unique_ptr<Session> adopted_; ///< What this session's resume Hello found.
  uint64_t resumeFrom_ = 0;
  /// A resume Hello waiting for a takeover (FrameOutcome::deferred): since when, and whether
  /// it (or a join) holds one of its principal's waits (Context::reserveWait).
  std::optional<std::chrono::steady_clock::time_point> deferredSince_;
  bool holdsWait_ = false;
  /// Gives back the principal's wait this session holds, if it holds one.
  void endWait();
  /// The keys of an accepted TCP Hello, until its reply hands them to the connection.
  std::optional<net::SessionKeys> keys_;

  // Random state.
  /// The session's random state for each of ctx_.devices(); devices that are the same device
  /// share one generator.
  std::vector<at::Generator> generators_;
  /// torch.Generator(device="rgpu") objects, by the client's ids (GeneratorRequest).
  std::unordered_map<uint64_t, at::Generator> explicitGenerators_;

  // Tensors.
  /// Keyed by the client's handles: any 64-bit value, so not an llvm::DenseMap, which reserves
  /// two keys (session_fuzz found a Run binding ~0 corrupt it).
  std::unordered_map<uint64_t, Entry> tensors_;
  std::map<uint64_t, std::unique_ptr<Partial>> partial_;
  /// The one tensor being downloaded in chunks, copied into the layout asked for, until its
  /// last chunk (a client reads one tensor at a time; a new one replaces it, so it is bounded).
  uint64_t stagedHandle_ = 0;
  at::Tensor staged_;

  // Graphs.
  /// The graphs this session defined and has not forgotten: the only ones its Runs can name,
  /// and the ir::graphBytes they hold (at most budgets.graphMemory).
  std::map<ir::Hash256, std::shared_ptr<const Plan>> defined_;
  uint64_t graphBytes_ = 0, graphsForgotten_ = 0;
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
  /// Per graph held, its latest Run: a relative Run says what changed.
  wire::RunArgsReader runArgs_;
  uint64_t runs_ = 0, executeNs_ = 0, compiledRuns_ = 0, writesInPlace_ = 0, runsCancelled_ = 0;

  // torch.distributed.
  Groups groups_; ///< The process groups this session joined.
  /// A JoinGroup waiting for its group's other ranks (its frame deferred until it ends).
  std::shared_ptr<Groups::Join> joining_;
};

/// An upload arriving in chunks, until its last.
struct Session::Partial {
  at::Tensor cpu;
  ir::TensorMeta meta;
  uint64_t received = 0;
  uint8_t device = 0;
  ErrorPtr error; ///< Its buffer could not be allocated.
};

} // namespace rgpu::server
