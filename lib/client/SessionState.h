//===- lib/client/SessionState.h - What a Session holds, and how its parts meet -===//
//
// The session's state, behind Session's public header so that a change here recompiles the
// client only. Each concept lives in a part of its own with a narrow header: the live-tensor
// registry (LiveTensors), the graph cutter (GraphCutter), the server's graph budget
// (GraphBudget), the read caches (ReadCache), the frame codec (FrameCodec), the connection
// (Transport) and the options (Options). What is left here is what joins them: the queue of
// commands for the next frame, the frames in flight, and the steps of a cut that touch several
// parts. Its functions are defined beside the part they serve most:
//
//   Session.cpp    the lock, the registry, cuts (cut, queueResolved, hold), new sessions
//   Frames.cpp     the queue, flush and absorb, the in-flight window, waits, errors
//   Transfers.cpp  uploads, downloads, reads (fetch), data-dependent runs
//   Requests.cpp   RNG and generator commands, process groups, server queries
//
// Everything here is guarded by the session lock (mu), but for the location table (its own
// lock) and the counters (atomic).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Commands.h"
#include "FrameCodec.h"
#include "GraphBudget.h"
#include "GraphCutter.h"
#include "LiveTensors.h"
#include "Locations.h"
#include "Options.h"
#include "ReadCache.h"
#include "Transport.h"

#include "rgpu/client/Diagnostics.h"
#include "rgpu/client/Session.h"

#include <llvm/ADT/DenseMap.h>

#include <chrono>
#include <deque>
#include <mutex>

namespace rgpu::client {

/// Uploads up to this size wait for the next frame; larger ones are sent at once.
inline constexpr uint64_t kSmallUpload = 64 << 10;
/// Uploads from this size are named by their content (Session::State::deferredUploads)...
inline constexpr uint64_t kContentUpload = 1 << 20;
/// ...and wait for the next frame, up to this many bytes of them.
inline constexpr uint64_t kDeferredBytes = uint64_t(256) << 20;
/// An output this small comes back with the reply to its run, up to kValueBudget per cut: a
/// loss, an accuracy, a gradient norm, GradScaler's found_inf.
inline constexpr uint64_t kValueBytes = 16;
inline constexpr uint64_t kValueBudget = 256;

/// Per Download of a frame, the data whose value it brings, in what layout (null data: an
/// ordinary download, whose bytes the caller reads from the Reply).
struct Target {
  llvm::IntrusiveRefCntPtr<DeviceData> data;
  ir::TensorMeta layout;
};
using Targets = std::vector<Target>;

/// Where each pending value of a cut went.
using CutOutputs =
    llvm::DenseMap<std::pair<TraceNode *, uint32_t>, llvm::IntrusiveRefCntPtr<DeviceData>>;

struct Session::State {
  State();

  //===--- The lock and the log (Session.cpp) ---===//
  std::recursive_mutex mu;
  unsigned depth = 0;                                   ///< Locks held (under mu).
  std::vector<std::pair<int, std::string>> pendingLogs; ///< Emitted by the outermost Lock.
  LogSink logSink = nullptr;
  bool logDebug = false;
  void log(int level, const std::string &message);

  Stats stats;
  Options options;
  Locations locations;
  uint32_t site = 0; ///< The user's line whose sync is being served.
  LiveTensors live;
  Diagnostics diagnostics;
  Transport transport;
  GraphCutter cutter;
  GraphBudget budget;
  ReadCache reads;
  DownloadGroup group;

  //===--- Handles ---===//
  uint64_t nextHandle = 1;
  /// Handles below this belong to a session lost before reset(): using them raises.
  uint64_t firstHandle = 1;
  uint64_t newHandles(uint64_t n) {
    uint64_t h = nextHandle;
    nextHandle += n;
    return h;
  }
  /// Raises SessionLost if \p v is data of a session that reset() ended.
  void checkCurrent(const Value &v);

  //===--- Cuts (Session.cpp) ---===//
  /// Cuts every live pending tensor into one graph and queues its run (and the generator drops
  /// due after it); returns where each pending value went.
  CutOutputs cut(const char *reason, const std::string &executor = "");
  /// Queues the Define (if the server lacks the graph) and the Run of \p r; returns its first
  /// output handle. \p restores: (output, handle) pairs of the cut (GraphCutter::Cut).
  uint64_t queueResolved(GraphCutter::Resolved r, bool replyMetas, const char *reason,
                         const std::string &executor = "",
                         llvm::ArrayRef<uint64_t> restores = {});
  /// Records that the server is to hold \p graph (hashed \p hash) for its next Run, queueing
  /// Forgets that make room if it does not hold it yet. True if its Define must be queued.
  bool hold(const ir::Hash256 &hash, const ir::Graph *graph);
  /// Per graph hash, the location id of each node at its latest run: a remote error names the
  /// user's line as it is now, whatever line first defined the graph.
  std::map<ir::Hash256, std::vector<uint32_t>> nodeLocations;

  //===--- The next frame (Frames.cpp) ---===//
  std::vector<Command> queued;
  Targets queuedTargets; ///< One per Download queued, in order.
  std::vector<uint64_t> releases;
  std::vector<ir::Hash256> runsInFrame;
  /// The traced nodes of cuts whose frame is not sent yet, without their device data: freed
  /// once it is, while the server runs it.
  std::vector<llvm::IntrusiveRefCntPtr<TraceNode>> retired;
  FrameEncoder encoder;
  /// Queues \p c for the next frame; raises SessionLost if the session is lost.
  void queue(Command c);
  /// Queues a Download whose bytes go into \p valueOf (else into the Reply).
  void queueDownload(command::Download d, llvm::IntrusiveRefCntPtr<DeviceData> valueOf = nullptr);
  /// Asks, in the next frame, for \p data's bytes in \p layout.
  void queueValue(const llvm::IntrusiveRefCntPtr<DeviceData> &data, const ir::TensorMeta &layout);
  /// Drops what is queued and unsent.
  void dropQueued();
  /// Sends the queued commands as one frame. With \p wantReply, waits for the server's answer.
  /// Without it, a frame that runs a graph or asks for values still gets a reply, taken in
  /// later (harvest) or when one of its values is read.
  Reply flush(bool wantReply);

  //===--- Frames in flight (Frames.cpp) ---===//
  /// A frame sent with a reply that nobody has waited for yet.
  struct InFlight {
    uint64_t seq = 0;
    Targets targets;
    std::vector<ir::Hash256> runs;
    std::chrono::steady_clock::time_point sent;
    bool step = false; ///< It runs a graph: it counts against RGPU_MAX_INFLIGHT.
  };
  /// Oldest first; replies arrive in this order.
  std::deque<InFlight> inflight;
  /// When the latest step replies were read: the rate at which server and link finish steps.
  std::deque<std::chrono::steady_clock::time_point> stepReplies;
  size_t maxInflight = 8;
  uint64_t lastReply = 0; ///< The last frame whose reply was read (ClientFrame.received).
  /// A remote error an unawaited reply brought (described), and its wire::Error.pythonType.
  std::string deferredError, deferredErrorType;
  /// Reads one reply: values into their data (\p own: the targets of frame \p ownSeq, being
  /// waited for; else the in-flight frame it answers), the rest into the returned Reply, whose
  /// data then holds only ordinary downloads. Notes are logged; an error that ends the session
  /// loses it. A \p timed reply was read about when it arrived: it tells how fast steps are
  /// answered (boundInflight).
  Reply absorb(const net::Frame &frame, const Targets *own, uint64_t ownSeq = 0,
               bool timed = true);
  /// Takes in every reply that has arrived; a remote error among them is kept for the next
  /// read (raiseDeferred).
  void harvest();
  /// Waits for the reply to in-flight frame \p seq: one wait for a value, or with \p throttle
  /// one wait for the server to catch up (counted apart).
  void awaitReply(uint64_t seq, bool throttle = false);
  /// Transport::receive as a wait that Ctrl-C or rgpu.cancel() interrupts (Interrupts.h).
  net::Frame awaitFrame(uint64_t seq, const std::function<void(const net::Frame &)> &earlier,
                        bool spin);
  /// Waits while more steps are unanswered than RGPU_MAX_INFLIGHT plus those in transit (the
  /// link's round trip and one step, over the interval between step replies).
  void boundInflight();
  /// Raises the remote error an unawaited reply brought, once.
  void raiseDeferred();
  /// After a wait that sent a Cancel: raises ErrorKind::Interrupted.
  [[noreturn]] void interrupted();
  /// Ends the session for good with \p why (SessionLost).
  [[noreturn]] void lose(const std::string &why);
  /// \p e as the user reads it: the op, the user's line as it is now, the message.
  std::string describe(const RemoteError &e);

  //===--- Data in and out (Transfers.cpp) ---===//
  /// download() of a value that may already be device data.
  at::Tensor fetch(LazyTensorImpl *impl, const ir::TensorMeta &want);
  /// A download too large for one reply, one chunk per round trip.
  at::Tensor downloadInChunks(const DeviceData &data, const ir::TensorMeta &want);
  /// A CPU tensor of layout \p m holding \p bytes (which must be exactly its span).
  at::Tensor tensorFromBytes(const ir::TensorMeta &m, const std::string &bytes);
  /// Whether this upload travels compressed by byte plane (Options::compress).
  bool compressUploads();
  /// Queues \p bytes (\p meta's span) for \p handle in chunks, sending each large one at once.
  void queueUpload(uint64_t handle, uint8_t device, const ir::TensorMeta &meta,
                   std::shared_ptr<const uint8_t> bytes, std::optional<ir::Hash256> digest);
  /// Uploads of kContentUpload bytes or more, named by their digest, wait here (up to
  /// kDeferredBytes) until the next frame: their digests are made then, in parallel, one
  /// HasContent asks which of them the server's store holds, and those go as digests.
  struct DeferredUpload {
    uint64_t handle = 0;
    uint8_t device = 0;
    ir::TensorMeta meta;
    std::shared_ptr<const uint8_t> bytes;
    ir::Hash256 digest;
  };
  std::vector<DeferredUpload> deferredUploads;
  uint64_t deferredBytes = 0;
  /// Sends the deferred uploads, ahead of what is queued (one round trip).
  void sendDeferred();
  /// A tensor's handle and layout on the server, for a command that reads it: cuts if it is
  /// pending (no wait).
  command::StoredTensor stored(const at::Tensor &t);

  //===--- The server's files area (RemoteFiles.cpp) ---===//
  /// Sends \p c alone and waits for its answer.
  Reply fileRequest(command::File c);
  std::variant<std::string, command::StoredTensor> partOf(const FilePart &p);

  //===--- RNG, generators, questions for the server (Requests.cpp) ---===//
  uint64_t nextGenerator = 1;
  /// Generators dropped since the last cut (dropGenerator).
  std::vector<uint64_t> droppedGenerators;
  /// Cuts the trace if a random op is pending: a command that reads or changes a generator's
  /// state must come after the runs that draw before it. Other pending ops stay pending (and
  /// fused with what follows).
  void cutBeforeRng(const char *reason);
  /// Queues Generator op \p op of generator \p id, after cutBeforeRng(\p reason) unless
  /// \p reason is null.
  void queueGenerator(const char *reason, int device, uint64_t id,
                      wire::GeneratorRequest::Which op, uint64_t arg = 0);
  /// Queues the drops of droppedGenerators (after a cut's run). Never throws.
  void queueGeneratorDrops() noexcept;
  /// Cuts the trace (\p reason), sends \p c alone and waits for its text answer.
  std::string askText(Command c, const char *reason);
};

} // namespace rgpu::client
