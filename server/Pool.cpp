#include "Pool.h"
#include "Session.h"

#include "rgpu/ir/Error.h"

#include <malloc.h>
#include <sched.h>
#include <sys/socket.h>
#include <uv.h>

#include <cerrno>
#include <chrono>
#include <system_error>

namespace rgpu::server {

namespace {
/// Frames this large give their memory back to the system once handled: a session that sends
/// many would otherwise keep the arenas that held them large.
constexpr uint64_t kTrimAfterFrameBytes = 1 << 20;
} // namespace

Slot::Slot() = default;
Slot::~Slot() = default;

void Slot::send(std::shared_ptr<const std::string> bytes, bool close, bool direct, Post post,
                const net::SessionKeys *keys) {
  std::lock_guard<std::mutex> lock(writeMu);
  if (bytes && bytes->empty())
    bytes = nullptr;
  if (bytes && sealer)
    bytes = std::make_shared<const std::string>(sealer->seal(*bytes));
  if (keys) {
    // Before the Hello's answer leaves: the client's first sealed byte may come at once.
    sealer = std::make_unique<net::Sealer>(keys->serverToClient);
    std::lock_guard<std::mutex> opening(mu);
    pendingOpener = std::make_unique<net::Opener>(keys->clientToServer);
  }
  size_t sent = 0;
  if (bytes && direct && !close && fd >= 0 && loopWrites == 0) {
    while (sent < bytes->size()) {
      ssize_t n = ::send(fd, bytes->data() + sent, bytes->size() - sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0)
        sent += size_t(n);
      else if (n < 0 && errno == EINTR)
        continue;
      else
        break; // full, or an error the loop's write will meet and report
    }
    if (sent > 0)
      directWriteMs = uv_hrtime() / 1000000;
    if (sent == bytes->size())
      return;
  }
  if (bytes) {
    ++loopWrites;
    if (sent > 0)
      bytes = std::make_shared<const std::string>(bytes->substr(sent));
  }
  post(std::move(bytes), close);
}

Pool::Pool(Context &ctx, uint64_t bufferedBytes, int spinUs, std::function<void(Outgoing)> post)
    : ctx_(ctx), bufferedBytes_(bufferedBytes), spinUs_(spinUs), post_(std::move(post)) {}

llvm::Error Pool::start(size_t threads) {
  try {
    for (size_t i = 0; i < threads; ++i)
      threads_.emplace_back([this] { work(); });
  } catch (const std::system_error &e) {
    return failure(std::string("cannot start the worker threads: ") + e.what());
  }
  return llvm::Error::success();
}

void Pool::schedule(const std::shared_ptr<Slot> &slot) {
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    bool work = slot->stopped ||
                (!slot->queue.empty() && !slot->deferred && slot->outBytes < bufferedBytes_);
    if (slot->scheduled || !work)
      return;
    slot->scheduled = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    runnable_.push_back(slot);
    queued_.fetch_add(1);
  }
  if (!spinning_.load())
    cv_.notify_one();
}

void Pool::defer(const std::shared_ptr<Slot> &slot) {
  std::lock_guard<std::mutex> lock(deferredMu_);
  deferred_.push_back(slot);
}

void Pool::wakeDeferred() {
  std::vector<std::weak_ptr<Slot>> waiting;
  {
    std::lock_guard<std::mutex> lock(deferredMu_);
    waiting.swap(deferred_);
  }
  for (const std::weak_ptr<Slot> &w : waiting)
    if (std::shared_ptr<Slot> slot = w.lock()) {
      {
        std::lock_guard<std::mutex> lock(slot->mu);
        slot->deferred = false;
      }
      schedule(slot);
    }
}

/// One pool thread at a time polls: a client that waits for each reply (generation reads every
/// token) sends its next frame soon, and a thread woken from sleep costs an idle virtual CPU
/// 50-100 us (a trivial run's round trip: 62 us sleeping, 24 us polling, on the CI machine).
void Pool::awaitSlot() {
  if (spinUs_ == 0 || queued_.load() > 0 || spinning_.exchange(true))
    return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spinUs_);
  while (queued_.load() == 0 && std::chrono::steady_clock::now() < until)
    sched_yield();
  spinning_.store(false);
  // A slot queued while this thread spun did not notify: it is taken below, or wakes another.
  if (queued_.load() > 1)
    cv_.notify_all();
}

void Pool::work() {
  for (;;) {
    std::shared_ptr<Slot> slot;
    awaitSlot();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !runnable_.empty(); });
      slot = std::move(runnable_.front());
      runnable_.pop_front();
      queued_.fetch_sub(1);
    }
    net::Frame frame;
    bool stop = false;
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      if (slot->stopped) {
        stop = true;
      } else if (slot->queue.empty() || slot->outBytes >= bufferedBytes_) {
        slot->scheduled = false; // its replies are unread: it waits until they are written
        continue;
      } else {
        frame = std::move(slot->queue.front());
        slot->queue.pop_front();
      }
    }
    if (!stop) {
      serve(slot, std::move(frame));
      continue;
    }
    // The session is parked for a resume, or ends here, off the loop: its tensors are freed,
    // and its memory goes back to the system, not only to this thread's malloc arena. The
    // slot is never scheduled again.
    if (slot->session && slot->session->resumable()) {
      ctx_.park(std::move(slot->session));
    } else if (slot->session) {
      slot->session.reset();
      malloc_trim(0);
    }
  }
}

void Pool::serve(const std::shared_ptr<Slot> &slot, net::Frame frame) {
  slot->queuedBytes -= frame.bytes;
  if (!slot->session) {
    slot->session = std::make_unique<Session>(ctx_, slot->peer, slot->admission, &slot->signals);
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->account = slot->session->account();
  }
  FrameOutcome out = slot->session->handle(frame);
  if (out.deferred) {
    // Served again when a session is parked or ends, or at the next tick.
    slot->queuedBytes += frame.bytes;
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      slot->queue.push_front(std::move(frame));
      slot->deferred = true;
      slot->scheduled = false;
    }
    defer(slot);
    return;
  }
  const uint64_t frameBytes = frame.bytes;
  frame = net::Frame(); // its bytes go before the reply is sent
  if (frameBytes >= kTrimAfterFrameBytes)
    malloc_trim(0); // a large frame's buffers stay in no arena (see mallopt in main)
  if (out.adopted) {
    slot->session = std::move(out.adopted);
    slot->session->attach(slot->peer, &slot->signals);
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->account = slot->session->account();
  }
  if (slot->session->resumable() && !slot->activated) {
    ctx_.activate(slot->session->id(), slot->connId, slot->session->principal());
    slot->activated = true;
  }
  // Set before the reply is posted: the loop reads it when it lets larger frames in.
  slot->greeted = slot->session->greeted();
  if (!out.reply.empty() || out.close || slot->readPaused || out.keys) {
    auto bytes = std::make_shared<const std::string>(std::move(out.reply));
    if (out.seq && !bytes->empty() && slot->session->resumable())
      slot->session->keepReply(out.seq, bytes);
    auto post = [&](std::shared_ptr<const std::string> rest, bool close) {
      slot->outBytes += rest ? rest->size() : 0;
      post_({slot->connId, std::move(rest), close});
    };
    const bool resent = !out.resent.empty();
    slot->send(bytes, out.close && !resent, !slot->readPaused, post,
               out.keys ? &*out.keys : nullptr);
    if (resent)
      slot->send(std::make_shared<const std::string>(std::move(out.resent)), out.close,
                 !slot->readPaused, post);
  }
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->scheduled = false;
    if (out.close)
      slot->queue.clear();
  }
  schedule(slot);
}

} // namespace rgpu::server
