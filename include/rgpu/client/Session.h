//===- rgpu/client/Session.h - The client's session with one rgpu-opserver -===//
//
// One Session per process talks to one rgpu-opserver. It owns the list of live lazy tensors,
// cuts the pending trace into graphs at sync points, remembers which graph hashes the server
// holds, and batches everything that needs no answer (releases, small uploads, runs) into the
// next frame. Only a frame that needs a value back waits. This header is its public API; what
// it holds is in lib/client (SessionState.h and the parts it names).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/client/Diagnostics.h"
#include "rgpu/client/Errors.h"
#include "rgpu/client/LazyTensor.h"
#include "rgpu/client/Replies.h"

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace rgpu::client {

/// Counters reported by rgpu.stats().
struct Stats {
  std::atomic<uint64_t> messages{0}, waits{0}, bytesOut{0}, bytesIn{0}, graphsShipped{0},
      graphRuns{0}, opsTraced{0}, uploads{0}, downloads{0}, graphsForgotten{0},
      graphsGeneralized{0}, symbolicRuns{0}, cutsReplayed{0}, throttled{0}, throttledNs{0},
      readsRemembered{0}, uploadBytesSaved{0}, uploadBytesDeduplicated{0};
};

/// Returns the id of the user's current source line (Session::currentLocation); set by Python.
using LocationProvider = uint32_t (*)();
void setLocationProvider(LocationProvider provider);

/// How Session::newGenerator makes a generator.
enum class NewGenerator {
  Seeded,  ///< Seeded with its argument.
  CloneOf, ///< In the state generator (its argument) is in at this point of the trace.
  Snapshot ///< In the state the session's generator of the device is in there.
};

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

  const Stats &counters() const;

  /// The server address ("host:port"); takes effect at the next connection. Until it is set,
  /// the address is RGPU_OPSERVER as it is when the session connects (else the Unix socket).
  void setServer(std::string address);
  std::string server() const;

  /// The live-tensor registry.
  void track(LazyTensorImpl *impl);
  void untrack(LazyTensorImpl *impl);
  uint64_t liveTensors() const;

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
  /// "inductor" asks it to compile the graph at its second run ("inductor:reduce-overhead" and the
  /// like, in that torch.compile mode), "plan" never to compile it. Without
  /// \p send (and \p wait), the run stays queued until the next message goes out.
  void markStep(bool wait, const char *reason = "mark_step", const std::string &executor = "",
                bool send = true);
  /// Cuts if the trace has grown past the node cap (no wait).
  void maybeCutAtCap();
  /// Autograd's backward is about to start: if RGPU_STREAM_CUT ops are pending, cuts them and
  /// sends their run (no wait), so that the server runs the forward while the backward and the
  /// optimizer are traced.
  void cutBeforeBackward();
  /// Waits until the server has executed everything sent so far.
  void synchronize();
  /// A random op was traced: what touches a generator's state cuts the trace first (only then),
  /// and the next cut runs it even if nothing holds its result, so that it draws as on CPU.
  void noteRandom(llvm::IntrusiveRefCntPtr<TraceNode> node);

  /// The bytes of \p impl, in the layout of \p want (a dense layout of the same sizes).
  at::Tensor download(LazyTensorImpl *impl, const ir::TensorMeta &want);
  /// Downloads \p tensors together: the first download of any of them fetches the others in
  /// the same frame (as many as fit in one reply), and later downloads of them are answered
  /// from what arrived. Replaces any group already set; an empty list ends the group.
  void downloadTogether(std::vector<at::Tensor> tensors);
  /// Uploads a CPU tensor to rgpu:\p device; the bytes are copied now and sent without waiting
  /// for an answer.
  Value upload(const at::Tensor &cpu, ir::TensorMeta &meta, int device);
  /// Runs \p node (whose inputs must all be device data) right away and returns its outputs'
  /// metas as the server computed them: the path for data-dependent output shapes.
  std::vector<std::pair<Value, ir::TensorMeta>> runNow(llvm::IntrusiveRefCntPtr<TraceNode> node);
  /// Whether \p impl's bytes are here (a reply brought them), so reading it costs no wait.
  bool hasValue(LazyTensorImpl *impl);
  /// Asks for \p impl's bytes without waiting for them (rgpu.on_ready).
  void requestValue(LazyTensorImpl *impl);
  /// Sends what is queued (uploads) now, without cutting the trace or waiting.
  void send();
  /// The server is to free \p handle (sent with the next frame).
  void release(uint64_t handle);
  /// Raises SessionLost if \p v is data of a session that reset() ended.
  void checkCurrent(const Value &v);

  /// rgpu.cancel(): interrupts the wait in progress on any thread, as Ctrl-C does; if none is,
  /// the server stops the runs of every frame sent so far. Never blocks.
  void cancel();
  /// How many steps may wait on the server (RGPU_MAX_INFLIGHT); returns the previous bound.
  size_t setMaxInflight(size_t n);

  /// The server's counters, and this session's on the server (one round trip).
  ServerStats serverStats();
  /// What the server said of itself when the session began (connecting first if need be).
  ServerHello serverHello();
  /// The server device's memory figures, after running what is pending; one round trip.
  DeviceMemory deviceMemory(int device = 0, bool resetPeak = false, bool emptyCache = false);
  /// How many devices the server has (rgpu:0..n-1), connecting first if need be; 1 if it
  /// cannot be reached (the next sync then says why).
  int deviceCount();

  /// torch.distributed among servers: starts the job's rendezvous store on this session's
  /// server and returns its "host:port"; joins a process group of the job's servers as \p rank
  /// of \p size (waiting for all of them) and returns the group's name.
  std::string hostStore();
  std::string joinGroup(const std::string &store, const std::string &prefix, int rank, int size,
                        uint32_t timeoutMs);

  /// torch.manual_seed: seeds the session's generator of every device, after the random ops
  /// traced before it.
  void seed(uint64_t seed);
  /// The state of the session's generator of \p device (or of generator \p generator), after
  /// everything traced so far has drawn from it. One round trip.
  RngState rngState(int device, uint64_t generator = 0);
  /// Sets that state at this point of the trace; a state the server refuses is a RemoteError
  /// at the next sync.
  void setRngState(int device, std::string state, uint64_t generator = 0);
  /// torch.Generator(device="rgpu"): a generator of this session on the server, named by the
  /// id returned, made as \p how says with \p arg at this point of the trace.
  uint64_t newGenerator(int device, NewGenerator how, uint64_t arg = 0);
  void seedGenerator(int device, uint64_t id, uint64_t seed);
  /// The session's generator of \p device takes the state of generator \p id (a Snapshot).
  void restoreRng(int device, uint64_t id);
  /// The server drops generator \p id after the runs that may still use it. Never throws.
  void dropGenerator(uint64_t id) noexcept;

  /// The server's files area (rgpu.remote; lib/client/RemoteFiles.cpp). A part of a file or a
  /// record of a torch.save archive: \p data, or, if \p tensor is defined, an rgpu tensor's
  /// bytes in its own layout. Requests that answer or write wait for the server, and raise its
  /// error (FileNotFoundError and the like); those that make a tensor do not wait, and a
  /// failure is that tensor's error.
  struct FilePart {
    std::string name, data;
    at::Tensor tensor;
  };
  std::vector<FileEntry> listFiles(const std::string &path);
  std::string readFile(const std::string &path, uint64_t offset, uint64_t length);
  /// Appends \p parts to PATH.partial from \p offset (its size); \p commit renames it to
  /// PATH, after checking \p digest (64 hex digits) if one is given.
  void writeFile(const std::string &path, uint64_t offset, const std::vector<FilePart> &parts,
                 bool commit, const std::string &digest);
  void removeFile(const std::string &path);
  /// Writes a torch.save archive of \p records (named as torch.save names them).
  void saveArchive(const std::string &path, const std::vector<FilePart> &records);
  /// Reads one: its storages come as uint8 tensors on rgpu:\p device, the rest as bytes.
  std::vector<FilePart> loadArchive(const std::string &path, int device);
  /// The tensor of \p dtype, \p sizes and \p strides whose storage is the file's bytes from
  /// \p offset.
  at::Tensor fileTensor(const std::string &path, uint64_t offset, at::ScalarType dtype,
                        at::IntArrayRef sizes, at::IntArrayRef strides, int device);
  /// Rows \p index (an integer rgpu tensor) of the file's \p rows rows of \p rowSizes elements
  /// of \p dtype from \p offset: index.sizes() + rowSizes.
  at::Tensor gatherFile(const std::string &path, uint64_t offset, at::ScalarType dtype,
                        uint64_t rows, at::IntArrayRef rowSizes, const at::Tensor &index,
                        int device);

  /// After a lost connection every call raises SessionLost.
  bool lost() const;
  /// Whether this process ever started its session on a server.
  bool started() const;
  /// Resumes after a dropped connection: how many times it did.
  uint64_t reconnects() const;
  /// Ends this session on the server (at exit), keeping nothing there for a resume.
  void close();
  /// Starts a new session (after SessionLost): tensors of the old one raise when used.
  void reset();

  /// Where shipped graphs are kept for rgpu-trace-dump; empty keeps none.
  void setCacheDir(std::string dir);
  /// Writes this process's run counts into the graph cache files (at exit).
  void flushGraphCache();
  const std::map<ir::Hash256, Diagnostics::GraphInfo> &graphs() const;
  const std::map<uint32_t, Diagnostics::SiteInfo> &sites() const;
  /// Log events go to \p sink (Python's logger "rgpu"); debug events only if \p debug.
  using LogSink = void (*)(int level, const std::string &message);
  void setLogSink(LogSink sink, bool debug);
  /// Every replayed cut is also resolved in full, and a difference raises (for tests).
  void setCheckReplays(bool on);
  /// Whether graphs that differ only in sizes run as one symbolic graph (RGPU_DYNAMIC).
  void setDynamic(bool on);
  /// Warn when one sync site has cut more than this many graphs differing only in shapes.
  void setRecompileWarningThreshold(uint64_t n);

private:
  Session();
  struct State;
  std::unique_ptr<State> s_; ///< Never destroyed: the session outlives every tensor.
};

} // namespace rgpu::client
