//===- server/Pool.h - The threads that serve sessions' frames -------------===//
//
// A fixed pool of threads executes the sessions' frames, each session's in order and one frame
// at a time, so sessions with work take turns; a long graph holds one thread. A pool thread
// sends its reply itself when the I/O loop has none of that connection's bytes to write, and
// hands it to the loop otherwise (Slot::send). No ATen here: the I/O loop includes it.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Memory.h"
#include "Peer.h"

#include "rgpu/net/Frame.h"

#include <llvm/ADT/STLFunctionalExtras.h>
#include <llvm/Support/Error.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace rgpu::server {

class Context;
class Session;

/// What the I/O loop and the worker pool share of one connection: its queue of frames and, once
/// its first frame is served, its Session. At most one pool thread serves it at a time, so its
/// frames run in order.
struct Slot {
  Slot();
  ~Slot();

  uint64_t connId = 0;
  std::string peer;
  Admission admission;
  std::mutex mu;
  std::deque<net::Frame> queue; ///< under mu
  bool stopped = false;         ///< under mu: the connection ended; the session is to go
  bool scheduled = false;       ///< under mu: in the pool's queue or being served
  bool deferred = false;        ///< under mu: its first frame waits for Pool::wakeDeferred
  Signals signals; ///< to the session, as they happen
  std::atomic<bool> greeted{false};
  std::atomic<bool> readPaused{false};
  std::atomic<uint64_t> queuedBytes{0}; ///< of the frames in queue
  std::atomic<uint64_t> outBytes{0};    ///< of replies posted and not yet written
  std::unique_ptr<Session> session;     ///< touched only by the pool thread serving the slot
  std::shared_ptr<memory::Account> account; ///< under mu: its session's, once it has one
  bool activated = false;               ///< its session is listed as resumable on this slot

  // A pool thread sends a reply itself when the loop has no write of this connection in
  // flight, sparing the reply a wake-up of the loop (100-250 us on a busy VM); otherwise the
  // reply queues behind the loop's writes, in order.
  std::mutex writeMu;
  int fd = -1;              ///< under writeMu: the socket; -1 once the loop closes it
  size_t loopWrites = 0;    ///< under writeMu: writes handed to the loop and not yet done
  std::atomic<uint64_t> directWriteMs{0}; ///< when a pool thread last sent (uv_hrtime, ms)

  /// Seals what is sent once the session's keys are set (its Hello over TCP). Under writeMu:
  /// what is sealed first is written first.
  std::unique_ptr<net::Sealer> sealer;
  /// Opens what arrives after that Hello: made by the pool thread, taken by the loop.
  std::unique_ptr<net::Opener> pendingOpener; ///< under mu

  /// Hands the loop bytes to write (null: none) and whether to close after them.
  using Post = llvm::function_ref<void(std::shared_ptr<const std::string> bytes, bool close)>;
  /// Sends \p bytes (a reply; null or empty for none) behind everything sent before, and
  /// closes the connection after it if \p close: itself when \p direct and the loop has
  /// nothing of this connection to write, else (and whatever the socket does not take now)
  /// through the loop, by \p post. Sealed when the session's frames are; \p keys (a TCP
  /// Hello's) seal and open what comes after these bytes.
  void send(std::shared_ptr<const std::string> bytes, bool close, bool direct, Post post,
            const net::SessionKeys *keys = nullptr);
};

/// Bytes a pool thread hands the I/O loop to write to connection \p conn.
struct Outgoing {
  uint64_t conn;
  std::shared_ptr<const std::string> bytes; ///< null: nothing to write
  bool close;
};

/// The pool: a fixed number of threads serving the slots that have frames.
class Pool {
public:
  /// Serves \p ctx's sessions; a slot whose unsent replies reach \p bufferedBytes waits until
  /// they are written; an idle thread polls for \p spinUs before it sleeps (--spin-us).
  /// \p post hands the loop what a pool thread does not send itself.
  Pool(Context &ctx, uint64_t bufferedBytes, int spinUs, std::function<void(Outgoing)> post);
  /// Starts \p threads threads (they run until the process exits).
  llvm::Error start(size_t threads);
  /// Queues \p slot for a pool thread if it has work (frames it may serve, or a session to
  /// end) and is not queued already.
  void schedule(const std::shared_ptr<Slot> &slot);
  /// Serves the deferred slots again (FrameOutcome::deferred): called when a session is parked
  /// or ends, and at each tick of the loop.
  void wakeDeferred();

private:
  /// A pool thread: serves one frame of a runnable slot at a time, then puts the slot back at
  /// the end of the queue, so that sessions with frames take turns.
  void work();
  /// Polls for a runnable slot for up to --spin-us before the caller sleeps.
  void awaitSlot();
  /// Serves \p frame of \p slot and sends its reply.
  void serve(const std::shared_ptr<Slot> &slot, net::Frame frame);
  void defer(const std::shared_ptr<Slot> &slot);

  Context &ctx_;
  const uint64_t bufferedBytes_;
  const int spinUs_;
  std::function<void(Outgoing)> post_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Slot>> runnable_; ///< under mu_
  std::vector<std::thread> threads_;
  std::atomic<size_t> queued_{0};     ///< runnable_'s size, read without mu_
  std::atomic<bool> spinning_{false}; ///< a pool thread is polling for the next slot
  /// Slots whose frame was deferred: no pool thread holds them while they wait.
  std::mutex deferredMu_;
  std::vector<std::weak_ptr<Slot>> deferred_; ///< under deferredMu_
};

} // namespace rgpu::server
