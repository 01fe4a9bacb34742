//===- server/main.cpp - rgpu-opserver: the libuv loop and the CLI ---------===//
//
// One libuv loop does all socket I/O. A fixed pool of worker threads executes the sessions'
// frames, each session's in order and one frame at a time, so sessions with work take turns;
// a worker sends its reply itself when the loop has none of that connection's bytes to write,
// and hands it to the loop through an async handle otherwise. A malformed frame closes only its own
// connection. Peers prove who they are before anything of theirs is kept: a Unix-socket peer by
// its uid, a TCP peer by answering a challenge with the token (rgpu/net/Auth.h).
//
//===----------------------------------------------------------------------===//
#include "Device.h"
#include "Groups.h"
#include "Policy.h"
#include "Session.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/DeviceType.h>

#include "rgpu/net/Auth.h"

#include <dlfcn.h>
#include <malloc.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <uv.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <system_error>
#include <thread>
#include <unordered_map>

using namespace rgpu;
using namespace rgpu::server;

namespace {

const char *kUsage = R"(usage: rgpu-opserver [options]

Serves rgpu clients: receives lazy graphs once, runs them on this machine's device.

options:
  --device cuda|cpu      device to run on (default: cuda if available, else cpu);
                         exits with an error if the device is unusable. CUDA out of
                         memory fails that op (the allocator's cache is emptied); an
                         error CUDA cannot recover from (a device-side assert) fails
                         that run, then the server exits with status 75 to be restarted
  --devices LIST         several devices, comma-separated (cuda:0,cuda:1; cpu,cpu): clients
                         see them as rgpu:0, rgpu:1, ... (torch.rgpu.device_count()). Copies
                         between them run here. Inductor compiles graphs on the first one;
                         graphs on the others run on the plan executor
  --socket PATH          the Unix-domain socket to listen on (default, when neither
                         --port nor --bind is given: $XDG_RUNTIME_DIR/rgpu/opserver.sock,
                         else ~/.rgpu/opserver.sock). Its directory is made private to
                         this user, and only peers of this user's uid are served.
  --port N               also listen on TCP port N (0 picks a free port, printed in the
                         "listening on" line). TCP peers must prove they hold the token
                         (a challenge answered with HMAC-SHA-256; the token never travels)
  --bind ADDR            address for TCP (default 127.0.0.1; implies --port 9720)
  --token-file PATH      the token TCP clients need (default $XDG_CONFIG_HOME/rgpu/token,
                         else ~/.config/rgpu/token); created, mode 0600, if missing. Its
                         sessions belong to the principal named by the file's name
  --tokens-dir DIR       more principals: each file in DIR is one's token, named by the
                         file's name (e.g. DIR/alice; mode 0600, of this user). A session
                         is resumed, listed in stats and has its peaks reset only by its
                         own principal
  --compiler inductor|plan
                         how graphs are executed. plan runs libtorch kernels through a
                         plan of resolved operator handles. inductor (the default when
                         started through the rgpu-opserver command) does the same, and
                         compiles each graph that has run --compile-after times with
                         TorchInductor in the background; later runs use the fused,
                         compiled code. No step ever waits for a compile.
  --cache-dir DIR        where compiled graphs persist, so that a restarted server
                         compiles nothing twice (default: $XDG_CACHE_HOME/rgpu/server,
                         else ~/.cache/rgpu/server)
  --compile-after N      compile a graph on its Nth run (default 2: graphs that run once,
                         such as initialization, are not worth compiling)
  --compile-jobs N       compiles running at once, each a separate process (default 1)
  --compile-mode MODE    default | max-autotune | reduce-overhead (compiled like
                         default; CUDA graphs are not used yet)
  --compile-timeout S    wall-clock deadline of one compile, in seconds (default 600)
  --compile-cpu-seconds S
                         CPU time one compile may use (default 900)
  --compile-memory-mib N address space one compile may use on a CPU server (default
                         16384; not applied with CUDA, which reserves more than that)
  --max-frame-mib N      largest frame accepted from a client, in MiB (default 1024)
  --max-connections N    sessions served at once (default 256); one more gets an error
                         frame and is closed
  --max-pending N        connections not yet authenticated at once (default 1024); past
                         it the oldest of them is closed
  --hello-timeout S      seconds a new connection has to authenticate (default 10)
  --frame-timeout S      seconds a frame that has begun may go without a byte (default 60)
  --max-buffered-mib N   per connection: frames read and not yet served, and replies not
                         yet sent, in MiB (default 64); past it the server stops reading
                         from that client until it catches up
  --workers N            threads executing sessions' frames (default: the number of
                         cores, at least 4; at least 2)
  --spin-us N            microseconds an idle worker polls for the next frame before it
                         sleeps, one worker at a time (default 1000; 0: sleep at once). A
                         client that waits for each reply gets it sooner: waking a
                         sleeping thread costs 50-100 us on an idle virtual CPU
  --session-grace S      seconds a session whose connection dropped is kept, with its
                         tensors, for its client to resume it (default 120)
  --max-tensor-mib N     largest tensor a graph may hold or a client may upload, in MiB
                         (default: this machine's physical memory)
  --max-handles N        tensor handles one session may hold bound (default 1048576);
                         each costs it 96 bytes of its --session-memory as well. Past
                         either, the session ends with an error saying so

memory and caches (SIZE: a number with a unit, such as 8GiB, 512MiB or 64k):
  --memory-limit SIZE    memory all sessions may hold together (default: 85% of this
                         machine's physical memory). An allocation past it, or past a
                         session's quota, fails that op with an rgpu.RemoteError naming
                         the limit; the session goes on. 0: none
  --session-memory SIZE  memory one session may hold: its tensors, uploads in progress
                         and staging buffers (default 0: only --memory-limit applies)
  --graph-memory SIZE    graphs one session may hold defined (default 64MiB, counted by
                         their size in memory); the client forgets its least recently
                         run graphs to stay under it and defines them again when needed
  --store-host ADDR      the one address this server listens on for the other servers of
                         a torch.distributed job: the rendezvous store one of its
                         sessions hosts, and each process group's Gloo connections
                         (default: the --bind address, else 127.0.0.1). The job's other
                         servers must reach it. The store answers only servers holding
                         the job's secret; a group's Gloo listeners take connections
                         only until the group is set up
  --plan-cache SIZE      plans kept for graphs no session holds, least recently defined
                         dropped first (default 256MiB)
  --compiled-cache SIZE  compiled packages loaded at once, by package size (default
                         4GiB); the least recently run are unloaded, and reloaded from
                         the cache directory when hot again
  --disk-cache SIZE      size of the cache directory's compiled packages (default
                         16GiB); the least recently used are deleted
  --compile-queue N      compiles waiting at once (default 64); a graph that gets hot
                         while it is full runs on its plan and is queued later
  --refused-ops          list the aten ops this server refuses to run, with the reason
                         for each, and exit
  -h, --help             show this help

Logs go to stderr, prefixed with "rgpu-opserver:". The inductor compiler runs
`$RGPU_PYTHON inductor_worker.py` from this program's directory, one process per
compile, with no inherited descriptors and the limits above; the rgpu-opserver command
sets RGPU_PYTHON. A compile that fails or times out leaves its graph on the plan
executor.
)";

struct Server;

constexpr uint64_t kHeartbeatMs = 500;
/// Connections the kernel may hold before they are accepted (it caps this at somaxconn): a burst
/// past it would leave peers whose handshake the server never sees.
constexpr int kListenBacklog = 4096;

/// What the I/O loop and the worker pool share of one connection: its queue of frames and, once
/// its first frame is served, its Session. At most one pool thread serves it at a time, so its
/// frames run in order.
struct Slot {
  uint64_t connId = 0;
  std::string peer;
  Admission admission;
  std::mutex mu;
  std::deque<net::Frame> queue; ///< under mu
  bool stopped = false;         ///< under mu: the connection ended; the session is to go
  bool scheduled = false;       ///< under mu: in the pool's queue or being served
  bool deferred = false;        ///< under mu: its first frame waits for Server::wakeDeferred
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

  /// Sends \p bytes (a reply; null or empty for none) behind everything sent before, and
  /// closes the connection after it if \p close: itself when \p direct and the loop has
  /// nothing of this connection to write, else (and whatever the socket does not take now)
  /// through the loop, by \p post(bytes, close). Sealed when the session's frames are; \p keys
  /// (a TCP Hello's) seal and open what comes after these bytes.
  template <class Post>
  void send(std::shared_ptr<const std::string> bytes, bool close, bool direct, Post post,
            const net::SessionKeys *keys = nullptr) {
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
};

namespace fs = std::filesystem;

struct Connection {
  /// The stream: TCP or a Unix-domain socket (both begin with a uv_stream_t).
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } h;
  /// Closes a connection that does not authenticate in time, or whose frame stalls.
  uv_timer_t timer;
  int handlesOpen = 2; ///< the stream and the timer; the connection is freed when both are closed
  uint64_t id = 0;
  uint64_t acceptedMs = 0, lastByteMs = 0;
  Server *server = nullptr;
  net::FrameDecoder decoder;
  std::unique_ptr<net::Opener> opener; ///< once its TCP Hello set the session's keys
  std::string opened;                  ///< what the last read opened
  /// Bytes of frames not yet served (the one arriving, those queued) charged to chargedTo
  /// (null: to the server alone), see chargeFrames.
  uint64_t charged = 0;
  std::shared_ptr<memory::Account> chargedTo;
  std::shared_ptr<Slot> slot;
  std::list<Connection *>::iterator unauthenticated; ///< its place in Server::waiting
  bool waiting = false;                               ///< in Server::waiting
  bool closing = false;
  bool reading = false;
  uint64_t lastWriteMs = 0;
  Connection(uint64_t maxFrame) : decoder(maxFrame) {}
  uv_stream_t *stream() { return reinterpret_cast<uv_stream_t *>(&h); }
  uv_handle_t *handle() { return reinterpret_cast<uv_handle_t *>(&h); }
};

struct Outgoing {
  uint64_t conn;
  std::shared_ptr<const std::string> bytes; ///< null: nothing to write
  bool close;
};

/// One listening socket.
struct Listener {
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } h;
  bool isUnix = false;
  Server *server = nullptr;
  uv_stream_t *stream() { return reinterpret_cast<uv_stream_t *>(&h); }
};

/// The limits the I/O loop applies to each connection.
struct ConnectionLimits {
  uint64_t helloTimeoutMs = 10000; ///< to authenticate
  uint64_t frameTimeoutMs = 60000; ///< between two bytes of a frame that has begun
  uint64_t bufferedBytes = 64 << 20; ///< frames read and not yet served; replies not yet sent
  size_t bufferedFrames = 64;
  size_t maxWaiting = 1024; ///< unauthenticated connections at once; the oldest goes first
  /// Frames before the Hello is accepted are small: a peer that has not proved who it is cannot
  /// make the server buffer much.
  uint64_t helloFrameBytes = 64 << 10;
};

void serveSlots(Server *server);

struct Server {
  uv_loop_t *loop;
  std::vector<std::unique_ptr<Listener>> listeners;
  std::string socketPath; ///< removed at exit
  /// Who TCP peers may prove to be; empty if there is no TCP listener.
  std::shared_ptr<const std::vector<Principal>> principals;
  uv_async_t wake;
  uv_timer_t ticker; ///< heartbeats, and parked sessions whose grace passed
  uv_timer_t exitTimer; ///< started once the CUDA context is lost
  uv_signal_t sigint, sigterm;
  std::unique_ptr<Context> ctx;
  ConnectionLimits limits;
  uint64_t nextId = 1;
  std::unordered_map<uint64_t, Connection *> conns;
  std::list<Connection *> waiting; ///< unauthenticated connections, oldest first
  uint64_t waitingDropped = 0, lastDropLogMs = 0;
  std::mutex outMu;
  std::deque<Outgoing> outbox;

  // The worker pool: a fixed number of threads serving the slots that have frames.
  std::mutex poolMu;
  std::condition_variable poolCv;
  std::deque<std::shared_ptr<Slot>> runnable;
  std::vector<std::thread> workers;
  std::atomic<size_t> queued{0};      ///< runnable's size, read without poolMu
  std::atomic<bool> spinning{false};  ///< a pool thread is polling for the next slot
  int spinUs = 1000;                  ///< --spin-us

  void post(Outgoing o) {
    {
      std::lock_guard<std::mutex> lock(outMu);
      outbox.push_back(std::move(o));
    }
    uv_async_send(&wake);
  }

  /// Queues \p slot for a pool thread if it has work (frames it may serve, or a session to end)
  /// and is not queued already.
  void schedule(const std::shared_ptr<Slot> &slot) {
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      bool work = slot->stopped || (!slot->queue.empty() && !slot->deferred &&
                                    slot->outBytes < limits.bufferedBytes);
      if (slot->scheduled || !work)
        return;
      slot->scheduled = true;
    }
    {
      std::lock_guard<std::mutex> lock(poolMu);
      runnable.push_back(slot);
      queued.fetch_add(1);
    }
    if (!spinning.load())
      poolCv.notify_one();
  }

  /// Slots whose frame was deferred (FrameOutcome::deferred): no pool thread holds them while
  /// they wait. wakeDeferred serves each again.
  std::mutex deferredMu;
  std::vector<std::weak_ptr<Slot>> deferred;
  void defer(const std::shared_ptr<Slot> &slot) {
    std::lock_guard<std::mutex> lock(deferredMu);
    deferred.push_back(slot);
  }
  void wakeDeferred() {
    std::vector<std::weak_ptr<Slot>> waiting;
    {
      std::lock_guard<std::mutex> lock(deferredMu);
      waiting.swap(deferred);
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

  void startWorkers(size_t n) {
    for (size_t i = 0; i < n; ++i)
      workers.emplace_back(serveSlots, this);
  }
};

std::string errorFrame(const std::string &message, wire::Error::Kind kind) {
  capnp::MallocMessageBuilder reply;
  auto e = reply.initRoot<wire::ServerFrame>().initError();
  e.setMessage(message);
  e.setKind(kind);
  return net::encodeFrame(reply, true);
}

/// Frames this large give their memory back to the system once handled: a session that sends
/// many would otherwise keep the arenas that held them large.
constexpr uint64_t kTrimAfterFrameBytes = 1 << 20;

/// Polls for a runnable slot for up to --spin-us before the caller sleeps on the pool's
/// condition variable, one pool thread at a time: a client that waits for each reply
/// (generation reads every token) sends its next frame soon, and a thread woken from sleep
/// costs an idle virtual CPU 50-100 us (a trivial run's round trip: 62 us sleeping, 24 us
/// polling, on the CI machine).
void awaitSlot(Server *server) {
  if (server->spinUs == 0 || server->queued.load() > 0 || server->spinning.exchange(true))
    return;
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(server->spinUs);
  while (server->queued.load() == 0 &&
         std::chrono::steady_clock::now() < until)
    sched_yield();
  server->spinning.store(false);
  // A slot queued while this thread spun did not notify: it is taken below, or wakes another.
  if (server->queued.load() > 1)
    server->poolCv.notify_all();
}

/// A pool thread: serves one frame of a runnable slot at a time, then puts the slot back at the
/// end of the queue, so that sessions with frames take turns.
void serveSlots(Server *server) {
  for (;;) {
    std::shared_ptr<Slot> slot;
    awaitSlot(server);
    {
      std::unique_lock<std::mutex> lock(server->poolMu);
      server->poolCv.wait(lock, [&] { return !server->runnable.empty(); });
      slot = std::move(server->runnable.front());
      server->runnable.pop_front();
      server->queued.fetch_sub(1);
    }
    net::Frame frame;
    bool stop = false;
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      if (slot->stopped) {
        stop = true;
      } else if (slot->queue.empty() || slot->outBytes >= server->limits.bufferedBytes) {
        slot->scheduled = false; // its replies are unread: it waits until they are written
        continue;
      } else {
        frame = std::move(slot->queue.front());
        slot->queue.pop_front();
      }
    }
    if (stop) {
      // The session is parked for a resume, or ends here, off the loop: its tensors are freed,
      // and its memory goes back to the system, not only to this thread's malloc arena. The
      // slot is never scheduled again.
      if (slot->session && slot->session->resumable()) {
        server->ctx->park(std::move(slot->session));
      } else if (slot->session) {
        slot->session.reset();
        malloc_trim(0);
      }
      continue;
    }
    slot->queuedBytes -= frame.bytes;
    if (!slot->session) {
      slot->session = std::make_unique<Session>(*server->ctx, slot->peer, slot->admission,
                                                &slot->signals);
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
      server->defer(slot);
      continue;
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
      server->ctx->activate(slot->session->id(), slot->connId, slot->session->principal());
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
        server->post({slot->connId, std::move(rest), close});
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
    server->schedule(slot);
  }
}

/// The close callback of a connection's handles; the last one frees the connection.
void onHandleClosed(uv_handle_t *h) {
  auto *conn = static_cast<Connection *>(h->data);
  if (--conn->handlesOpen == 0)
    delete conn;
}

void leaveWaiting(Connection *c) {
  if (c->waiting) {
    c->server->waiting.erase(c->unauthenticated);
    c->waiting = false;
  }
}

void closeConnection(Connection *c) {
  if (c->closing)
    return;
  c->closing = true;
  Server *server = c->server;
  memory::creditFrames(c->chargedTo.get(), c->charged);
  c->charged = 0;
  {
    std::lock_guard<std::mutex> lock(c->slot->mu);
    c->slot->stopped = true;
    c->slot->queue.clear();
  }
  {
    std::lock_guard<std::mutex> lock(c->slot->writeMu); // no pool thread sends past this
    c->slot->fd = -1;
  }
  c->slot->signals.closed = true;
  server->schedule(c->slot); // a pool thread ends the session
  server->conns.erase(c->id);
  --server->ctx->connectionsOpen;
  leaveWaiting(c);
  uv_timer_stop(&c->timer);
  uv_close(reinterpret_cast<uv_handle_t *>(&c->timer), onHandleClosed);
  uv_close(c->handle(), onHandleClosed);
}

void onRead(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf);

void onAlloc(uv_handle_t *, size_t suggested, uv_buf_t *buf) {
  buf->base = static_cast<char *>(malloc(suggested));
  buf->len = buf->base ? suggested : 0;
}

void write(Connection *c, std::shared_ptr<const std::string> bytes, bool close, bool counted);

/// Ends \p c after an error frame saying \p why (sealed if its frames are), logged too.
void endWith(Connection *c, const std::string &why) {
  log(c->slot->peer + ": " + why + "; closing the connection");
  std::shared_ptr<const std::string> bytes;
  c->slot->send(std::make_shared<const std::string>(errorFrame(why, wire::Error::Kind::PROTOCOL)),
                false, false, [&](std::shared_ptr<const std::string> b, bool) { bytes = b; });
  c->slot->outBytes += bytes ? bytes->size() : 0;
  if (bytes)
    write(c, std::move(bytes), true, /*counted=*/true);
  else
    closeConnection(c);
}

/// Charges the bytes \p c holds of frames not yet served (the one arriving and those
/// queued) to its session's memory account once it has one, and to the server's total in any
/// case: half-received frames count toward --session-memory and --memory-limit like tensors.
/// False, the connection ended with an error saying so, past either.
bool chargeFrames(Connection *c) {
  std::shared_ptr<memory::Account> account;
  {
    std::lock_guard<std::mutex> lock(c->slot->mu);
    account = c->slot->account;
  }
  if (account != c->chargedTo) { // the session started, or was resumed: its account from now
    memory::creditFrames(c->chargedTo.get(), c->charged);
    c->charged = 0;
    c->chargedTo = account;
  }
  const uint64_t now = c->decoder.bufferedBytes() + c->slot->queuedBytes.load();
  if (now < c->charged) {
    memory::creditFrames(account.get(), c->charged - now);
  } else if (now > c->charged) {
    try {
      memory::chargeFrames(account.get(), now - c->charged);
    } catch (const c10::Error &e) {
      endWith(c, std::string("its frames in flight: ") + e.what_without_backtrace());
      return false;
    }
  }
  c->charged = now;
  return true;
}

/// What the frame \p c is receiving may still be given, in bytes: what its session's quota
/// and the server's limit leave, besides what they hold (its frames counted as chargeFrames
/// last charged them, so the frame being received counts as room).
uint64_t frameBudget(Connection *c) {
  const uint64_t queued = c->slot->queuedBytes.load(), mine = c->charged;
  auto left = [&](uint64_t cap, uint64_t held) {
    const uint64_t others = held > mine ? held - mine : 0;
    return cap > others + queued ? cap - others - queued : 0;
  };
  uint64_t budget = ~uint64_t(0);
  if (uint64_t limit = memory::limit())
    budget = left(limit, memory::held());
  std::lock_guard<std::mutex> lock(c->slot->mu);
  if (const auto &a = c->slot->account; a && a->quota && a == c->chargedTo)
    budget = std::min(budget, left(a->quota, a->held));
  return budget;
}

/// Reads while the connection has room: fewer frames waiting than its limits, fewer reply bytes
/// unsent. A peer that stops reading its replies is therefore no longer read either.
void updateReading(Connection *c) {
  if (c->closing || !chargeFrames(c))
    return;
  const ConnectionLimits &l = c->server->limits;
  bool full;
  {
    std::lock_guard<std::mutex> lock(c->slot->mu);
    full = c->slot->queue.size() >= l.bufferedFrames;
  }
  full = full || c->slot->queuedBytes >= l.bufferedBytes || c->slot->outBytes >= l.bufferedBytes;
  c->slot->readPaused = full;
  if (full && c->reading) {
    uv_read_stop(c->stream());
    c->reading = false;
  } else if (!full && !c->reading) {
    uv_read_start(c->stream(), onAlloc, onRead);
    c->reading = true;
  }
}

constexpr uint64_t kMaxCancelBytes = 256;

/// A frame flagged net::kFlagCancel, as it arrives: the runs of every earlier frame of the
/// session stop now, not when the pool thread reaches this frame. Anything malformed is left to
/// the pool thread, which serves the frame in its turn.
void noteCancel(Slot &slot, const net::Frame &frame, const wire::Limits &limits) {
  if (frame.bytes > kMaxCancelBytes) // a Cancel is tens of bytes: the loop opens nothing large
    return;
  try {
    auto cf = net::openFrame(frame, limits)->getRoot<wire::ClientFrame>();
    auto commands = cf.getCommands();
    if (cf.getSeq() == 0 || commands.size() != 1 || !commands[0].isCancel())
      return;
    uint64_t through = cf.getSeq() - 1, now = slot.signals.cancelThrough.load();
    while (now < through && !slot.signals.cancelThrough.compare_exchange_weak(now, through)) {
    }
  } catch (const kj::Exception &) {
  }
}

void onRead(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf) {
  auto *c = static_cast<Connection *>(stream->data);
  if (n < 0) {
    if (n != UV_EOF)
      log(c->slot->peer + ": " + uv_strerror(n));
    closeConnection(c);
  } else if (n > 0 && !c->closing) {
    c->lastByteMs = uv_now(c->server->loop);
    bool greeted = c->slot->greeted;
    if (greeted)
      leaveWaiting(c);
    c->decoder.setMaxFrameBytes(greeted ? c->server->ctx->limits().maxFrameBytes
                                        : c->server->limits.helloFrameBytes);
    c->decoder.setBufferBudget(frameBudget(c));
    if (!c->opener) {
      std::lock_guard<std::mutex> lock(c->slot->mu);
      c->opener = std::move(c->slot->pendingOpener);
    }
    const char *bytes = buf->base;
    size_t length = size_t(n);
    if (c->opener) {
      c->opened.clear();
      if (!c->opener->open(buf->base, length, c->opened)) {
        log(c->slot->peer + ": " + c->opener->error() + "; closing the connection");
        closeConnection(c);
        free(buf->base);
        return;
      }
      bytes = c->opened.data();
      length = c->opened.size();
    }
    if (!c->decoder.feed(bytes, length)) {
      const bool memory = c->decoder.error().find("of memory left") != std::string::npos;
      if (greeted)
        endWith(c, c->decoder.error() + (memory ? " (--session-memory, --memory-limit)" : ""));
      else {
        log(c->slot->peer + ": " + c->decoder.error() + " (before its Hello was accepted); "
            "closing the connection");
        closeConnection(c);
      }
    } else {
      net::Frame frame;
      bool any = false;
      {
        std::lock_guard<std::mutex> lock(c->slot->mu);
        while (c->decoder.next(frame)) {
          if (c->slot->stopped) // a refused connection: read and dropped
            continue;
          if ((frame.flags & net::kFlagCancel) && greeted)
            noteCancel(*c->slot, frame, c->server->ctx->limits());
          c->slot->queuedBytes += frame.bytes;
          c->slot->queue.push_back(std::move(frame));
          any = true;
        }
      }
      if (any)
        c->server->schedule(c->slot);
      updateReading(c); // charges what the read added, first
    }
  }
  free(buf->base);
}

/// Writes \p bytes to \p c; closes it afterwards if \p close. \p counted: the write is in the
/// slot's loopWrites already (a pool thread's reply).
void write(Connection *c, std::shared_ptr<const std::string> bytes, bool close,
           bool counted = false) {
  if (!counted) {
    std::lock_guard<std::mutex> lock(c->slot->writeMu);
    ++c->slot->loopWrites;
  }
  struct Write {
    uv_write_t req;
    std::shared_ptr<const std::string> bytes;
    Connection *conn;
    bool close;
  };
  c->lastWriteMs = uv_now(c->server->loop);
  auto *w = new Write{{}, std::move(bytes), c, close};
  uv_buf_t buf = uv_buf_init(const_cast<char *>(w->bytes->data()), w->bytes->size());
  w->req.data = w;
  int rc = uv_write(&w->req, c->stream(), &buf, 1, [](uv_write_t *req, int) {
    auto *w = static_cast<Write *>(req->data);
    Connection *conn = w->conn;
    conn->slot->outBytes -= w->bytes->size();
    {
      std::lock_guard<std::mutex> lock(conn->slot->writeMu);
      --conn->slot->loopWrites;
    }
    if (w->close) {
      closeConnection(conn);
    } else {
      updateReading(conn);
      conn->server->schedule(conn->slot); // a session waiting for its replies to go out
    }
    delete w;
  });
  if (rc != 0) {
    c->slot->outBytes -= w->bytes->size();
    {
      std::lock_guard<std::mutex> lock(c->slot->writeMu);
      --c->slot->loopWrites;
    }
    delete w;
    closeConnection(c);
  }
}

/// Refuses \p c whole: one error frame, then the connection closes; nothing of it remains.
void refuse(Connection *c, const std::string &why, wire::Error::Kind kind) {
  log(c->slot->peer + ": " + why);
  ++c->server->ctx->connectionsRefused;
  {
    std::lock_guard<std::mutex> lock(c->slot->mu);
    c->slot->stopped = true;
  }
  auto frame = std::make_shared<const std::string>(errorFrame(why, kind));
  c->slot->outBytes += frame->size();
  write(c, std::move(frame), true);
}

void onTimer(uv_timer_t *t) {
  auto *c = static_cast<Connection *>(t->data);
  Server *server = c->server;
  uint64_t now = uv_now(server->loop);
  if (c->closing)
    return;
  if (!c->slot->greeted && now - c->acceptedMs >= server->limits.helloTimeoutMs) {
    log(c->slot->peer + ": not authenticated within " +
        std::to_string(server->limits.helloTimeoutMs / 1000.0).substr(0, 4) +
        " s (--hello-timeout); closing the connection");
    closeConnection(c);
  } else if (c->decoder.pendingBytes() > 0 && c->reading &&
             now - c->lastByteMs >= server->limits.frameTimeoutMs) {
    log(c->slot->peer + ": a frame stalled with " + std::to_string(c->decoder.pendingBytes()) +
        " bytes still to come, nothing for " +
        std::to_string(server->limits.frameTimeoutMs / 1000.0).substr(0, 4) +
        " s (--frame-timeout); closing the connection");
    closeConnection(c);
  }
}

void onConnection(uv_stream_t *stream, int status) {
  auto *listener = static_cast<Listener *>(stream->data);
  Server *server = listener->server;
  if (status < 0) {
    log(std::string("accept failed: ") + uv_strerror(status));
    return;
  }
  auto *c = new Connection(server->limits.helloFrameBytes);
  c->server = server;
  c->id = server->nextId++;
  if (listener->isUnix)
    uv_pipe_init(server->loop, &c->h.pipe, 0);
  else
    uv_tcp_init(server->loop, &c->h.tcp);
  c->handle()->data = c;
  uv_timer_init(server->loop, &c->timer);
  c->timer.data = c;
  c->slot = std::make_shared<Slot>();
  c->slot->connId = c->id;
  if (uv_accept(stream, c->stream()) != 0) {
    c->closing = true;
    uv_close(reinterpret_cast<uv_handle_t *>(&c->timer), onHandleClosed);
    uv_close(c->handle(), onHandleClosed);
    return;
  }
  c->acceptedMs = c->lastByteMs = uv_now(server->loop);
  uv_os_fd_t fd = -1;
  if (uv_fileno(c->handle(), &fd) == 0)
    c->slot->fd = fd; // no pool thread serves the slot yet
  server->conns[c->id] = c;
  ++server->ctx->connectionsOpen;
  std::string refusal;
  if (listener->isUnix) {
    ucred cred{};
    socklen_t len = sizeof cred;
    uv_os_fd_t fd = -1;
    bool known = uv_fileno(c->handle(), &fd) == 0 &&
                 getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
    c->slot->peer = "session " + std::to_string(c->id) + " (uid " +
                    (known ? std::to_string(cred.uid) : std::string("?")) + ")";
    if (!known || cred.uid != geteuid())
      refusal = "rgpu-opserver serves only its own user (uid " + std::to_string(geteuid()) +
                "); this connection comes from " +
                (known ? "uid " + std::to_string(cred.uid) : std::string("an unknown user"));
  } else {
    uv_tcp_nodelay(&c->h.tcp, 1);
    sockaddr_storage addr{};
    int len = sizeof addr;
    char host[64] = "?";
    if (uv_tcp_getpeername(&c->h.tcp, reinterpret_cast<sockaddr *>(&addr), &len) == 0) {
      if (addr.ss_family == AF_INET)
        uv_ip4_name(reinterpret_cast<sockaddr_in *>(&addr), host, sizeof host);
      else
        uv_ip6_name(reinterpret_cast<sockaddr_in6 *>(&addr), host, sizeof host);
    }
    c->slot->peer = "session " + std::to_string(c->id) + " (" + host + ")";
    c->slot->admission = {net::auth::randomBytes(net::auth::kNonceBytes), server->principals};
  }
  const uint64_t tickMs = std::clamp<uint64_t>(
      std::min(server->limits.helloTimeoutMs, server->limits.frameTimeoutMs) / 4, 50, 1000);
  uv_timer_start(&c->timer, onTimer, tickMs, tickMs);
  // A refused connection is read too (its slot is stopped, so nothing is kept): closing a
  // socket with unread bytes would reset it before the client reads the error frame.
  c->reading = true;
  uv_read_start(c->stream(), onAlloc, onRead);
  if (!refusal.empty()) {
    refuse(c, refusal, wire::Error::Kind::AUTH);
    return;
  }
  // Unauthenticated connections are bounded: past the limit the oldest one goes, so a flood
  // of idle peers delays a real client by no more than its own handshake.
  if (server->waiting.size() >= server->limits.maxWaiting) {
    Connection *oldest = server->waiting.front();
    ++server->waitingDropped;
    uint64_t now = uv_now(server->loop);
    if (now - server->lastDropLogMs >= 1000) {
      log(std::to_string(server->waitingDropped) + " unauthenticated connection(s) closed to "
          "stay within " + std::to_string(server->limits.maxWaiting) + " (--max-pending)");
      server->lastDropLogMs = now;
      server->waitingDropped = 0;
    }
    closeConnection(oldest);
  }
  c->unauthenticated = server->waiting.insert(server->waiting.end(), c);
  c->waiting = true;
  if (!c->slot->admission.challenge.empty()) {
    capnp::MallocMessageBuilder b;
    const std::string &nonce = c->slot->admission.challenge;
    b.initRoot<wire::ServerFrame>().initChallenge().setNonce(
        kj::arrayPtr(reinterpret_cast<const kj::byte *>(nonce.data()), nonce.size()));
    auto frame = std::make_shared<const std::string>(net::encodeFrame(b, true));
    c->slot->outBytes += frame->size();
    write(c, std::move(frame), false);
  }
}

/// Ends the server the way SIGTERM does: running compiles killed, the socket removed.
[[noreturn]] void shutDown(Server *server, int status) {
  if (Compiler *c = server->ctx->compiler())
    c->shutdown();
  if (!server->socketPath.empty())
    unlink(server->socketPath.c_str());
  std::_Exit(status);
}

void onDeviceLost(uv_timer_t *t) {
  auto *server = static_cast<Server *>(t->data);
  log("exiting with status " + std::to_string(device::kExitDeviceLost) + " for a supervisor to "
      "restart the server: the CUDA context cannot be used after: " +
      server->ctx->deviceLost().value_or(""));
  shutDown(server, device::kExitDeviceLost);
}

void onWake(uv_async_t *handle) {
  auto *server = static_cast<Server *>(handle->data);
  // The CUDA context is lost: the failing session's reply (in this batch) goes out first.
  if (server->ctx->deviceLost() && !uv_is_active(reinterpret_cast<uv_handle_t *>(&server->exitTimer)))
    uv_timer_start(&server->exitTimer, onDeviceLost, 200, 0);
  std::deque<Outgoing> batch;
  {
    std::lock_guard<std::mutex> lock(server->outMu);
    batch.swap(server->outbox);
  }
  for (Outgoing &o : batch) {
    auto it = server->conns.find(o.conn);
    if (it == server->conns.end())
      continue;
    Connection *c = it->second;
    if (c->slot->greeted)
      leaveWaiting(c);
    if (o.bytes)
      write(c, std::move(o.bytes), o.close, true);
    else if (o.close)
      closeConnection(c);
    else
      updateReading(c); // a frame was served: room to read again, perhaps
  }
}

/// Every half second: a heartbeat to each client whose frames are being served and that has
/// heard nothing for that long (so it can tell a busy server from a hung one), and parked
/// sessions whose grace passed are dropped.
void onTick(uv_timer_t *t) {
  auto *server = static_cast<Server *>(t->data);
  static const auto heartbeat = [] {
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::ServerFrame>().setHeartbeat(true);
    return std::make_shared<const std::string>(net::encodeFrame(b, true));
  }();
  uint64_t now = uv_now(server->loop);
  std::vector<Connection *> busy;
  for (auto &[id, c] : server->conns) {
    uint64_t lastWrite = std::max(c->lastWriteMs, c->slot->directWriteMs.load());
    if (c->closing || !c->slot->greeted || now - std::min(now, lastWrite) < kHeartbeatMs)
      continue;
    std::lock_guard<std::mutex> lock(c->slot->mu);
    if (c->slot->scheduled || !c->slot->queue.empty())
      busy.push_back(c);
  }
  for (Connection *c : busy) {
    std::shared_ptr<const std::string> beat = heartbeat;
    {
      std::lock_guard<std::mutex> lock(c->slot->writeMu);
      if (c->slot->loopWrites > 0) // bytes are on their way already
        continue;
      if (c->slot->sealer)
        beat = std::make_shared<const std::string>(c->slot->sealer->seal(*heartbeat));
      ++c->slot->loopWrites;
    }
    c->slot->outBytes += beat->size();
    write(c, std::move(beat), false, /*counted=*/true);
  }
  server->wakeDeferred(); // a resume's deadline may have passed
  if (size_t n = server->ctx->expireParked())
    log(std::to_string(n) + " disconnected session(s) dropped: not resumed within " +
        std::to_string(server->ctx->sessionGraceMs / 1000) + " s (--session-grace)");
}

void onSignal(uv_signal_t *handle, int signum) {
  log(std::string("received ") + (signum == SIGINT ? "SIGINT" : "SIGTERM") + ", shutting down");
  auto *server = static_cast<Server *>(handle->data);
  // Sessions hold only in-memory state. Compiles in flight are killed and their temporary files
  // removed, so the cache holds only whole artifacts.
  shutDown(server, 0);
}

/// Listens on the Unix-domain socket \p path, in a directory only this user can open. A socket
/// left by a server that died is replaced; one that answers belongs to a live server.
std::string listenUnix(Server &server, const std::string &path) {
  std::string error;
  std::string dir = path.substr(0, path.rfind('/'));
  if (!dir.empty() && !net::auth::ensurePrivateDir(dir, error))
    return "cannot listen on " + path + ": " + error;
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    net::Socket probe;
    std::string ignored;
    if (!S_ISSOCK(st.st_mode))
      return "cannot listen on " + path + ": it exists and is not a socket";
    if (probe.connectUnix(path, ignored))
      return "another rgpu-opserver is listening on " + path;
    unlink(path.c_str());
  }
  auto l = std::make_unique<Listener>();
  l->isUnix = true;
  l->server = &server;
  uv_pipe_init(server.loop, &l->h.pipe, 0);
  l->h.pipe.data = l.get();
  int rc = uv_pipe_bind(&l->h.pipe, path.c_str());
  if (rc == 0) {
    chmod(path.c_str(), 0600);
    rc = uv_listen(l->stream(), kListenBacklog, onConnection);
  }
  if (rc != 0)
    return "cannot listen on " + path + ": " + uv_strerror(rc);
  server.socketPath = path;
  server.listeners.push_back(std::move(l));
  return "";
}

/// Listens on TCP \p bind:\p port; \p bound gets the port (for --port 0).
/// The most principals a server knows: each TCP Hello is checked against all of them.
constexpr size_t kMaxPrincipals = 1024;

/// Adds a principal for each token file in \p dir (named by the file's name) to \p out.
bool readPrincipals(const std::string &dir, std::vector<Principal> &out, std::string &error) {
  std::error_code ec;
  std::vector<fs::path> files;
  for (const auto &entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string()[0] != '.')
      files.push_back(entry.path());
  if (ec) {
    error = "cannot read --tokens-dir " + dir + ": " + ec.message();
    return false;
  }
  std::sort(files.begin(), files.end());
  for (const fs::path &path : files) {
    std::string name = path.filename().string(), token;
    if (name.size() > 64 || !std::all_of(name.begin(), name.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
        })) {
      error = "--tokens-dir " + dir + ": '" + name + "' is not a principal's name (letters, "
              "digits, '-', '_' and '.', at most 64)";
      return false;
    }
    if (!net::auth::readToken(path.string(), token, error))
      return false;
    for (const Principal &p : out)
      if (p.name == name || p.token == token) {
        error = "--tokens-dir " + dir + ": " + name + (p.name == name ? " is named twice" :
                " has the token of " + p.name) + "; each principal needs a token of its own";
        return false;
      }
    out.push_back({name, token});
  }
  if (out.size() > kMaxPrincipals) {
    error = "--tokens-dir " + dir + " names more than " + std::to_string(kMaxPrincipals) +
            " principals";
    return false;
  }
  return true;
}

std::string listenTcp(Server &server, const std::string &bind, int port, int &bound) {
  sockaddr_storage addr{};
  if (uv_ip4_addr(bind.c_str(), port, reinterpret_cast<sockaddr_in *>(&addr)) != 0 &&
      uv_ip6_addr(bind.c_str(), port, reinterpret_cast<sockaddr_in6 *>(&addr)) != 0)
    return "--bind " + bind + ": not an IP address";
  auto l = std::make_unique<Listener>();
  l->server = &server;
  uv_tcp_init(server.loop, &l->h.tcp);
  l->h.tcp.data = l.get();
  int rc = uv_tcp_bind(&l->h.tcp, reinterpret_cast<sockaddr *>(&addr), 0);
  if (rc == 0)
    rc = uv_listen(l->stream(), kListenBacklog, onConnection);
  if (rc != 0)
    return "cannot listen on " + bind + ":" + std::to_string(port) + ": " + uv_strerror(rc);
  int len = sizeof addr;
  uv_tcp_getsockname(&l->h.tcp, reinterpret_cast<sockaddr *>(&addr), &len);
  bound = ntohs(reinterpret_cast<sockaddr_in *>(&addr)->sin_port);
  server.listeners.push_back(std::move(l));
  return "";
}

std::string defaultCacheDir() {
  if (const char *xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return std::string(xdg) + "/rgpu/server";
  const char *home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/rgpu/server";
}

int fail(const std::string &message) {
  log(message);
  return 2;
}

} // namespace

/// This process's accept(2): Gloo's listeners take their connections with it (libuv takes the
/// server's own with accept4), and Groups keeps them from running the process out of
/// descriptors, which would end it.
extern "C" __attribute__((visibility("default"))) int accept(int fd, sockaddr *address,
                                                        socklen_t *length) {
  static const auto real =
      reinterpret_cast<rgpu::server::Groups::AcceptFn>(dlsym(RTLD_NEXT, "accept"));
  return rgpu::server::Groups::acceptConnection(fd, address, length, real);
}

int main(int argc, char **argv) {
  std::string device, bind, compiler, socketPath, tokenPath, tokensDir;
  CompilerOptions compile;
  const char *python = std::getenv("RGPU_PYTHON");
  int port = -1;
  wire::Limits limits;
  ConnectionLimits conn;
  size_t maxConnections = 256;
  size_t workers = std::max(4u, std::thread::hardware_concurrency());
  int spinUs = 1000;
  const uint64_t physical = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
  limits.maxTensorBytes = physical;
  Budgets budgets;
  std::string storeHost;
  uint64_t memoryLimit = physical / 100 * 85;
  uint64_t sessionGraceMs = 120000;
  auto seconds = [](const std::string &v) { return uint64_t(std::max(0.05, std::stod(v)) * 1000); };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        log("option " + a + " needs a value (see --help)");
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (a == "-h" || a == "--help") {
        fputs(kUsage, stdout);
        return 0;
      } else if (a == "--refused-ops") {
        for (const auto &[op, why] : policy::refusedOps())
          std::printf("%s: %s\n", op.c_str(), why.c_str());
        return 0;
      } else if (a == "--device" || a == "--devices") {
        device = value();
      } else if (a == "--port") {
        port = std::stoi(value());
      } else if (a == "--bind") {
        bind = value();
      } else if (a == "--socket") {
        socketPath = value();
        if (socketPath.empty() || socketPath[0] != '/')
          return fail("--socket needs an absolute path");
      } else if (a == "--token-file") {
        tokenPath = value();
      } else if (a == "--tokens-dir") {
        tokensDir = value();
      } else if (a == "--compiler") {
        compiler = value();
      } else if (a == "--cache-dir") {
        compile.cacheDir = value();
      } else if (a == "--compile-after") {
        compile.after = std::max(1, std::stoi(value()));
      } else if (a == "--compile-jobs") {
        compile.jobs = std::max(1, std::stoi(value()));
      } else if (a == "--compile-mode") {
        compile.mode = value();
        if (compile.mode == "default")
          compile.mode.clear();
        else if (compile.mode != "max-autotune" && compile.mode != "reduce-overhead")
          return fail("unknown --compile-mode '" + compile.mode +
                      "': use default, max-autotune or reduce-overhead");
      } else if (a == "--compile-timeout") {
        compile.timeoutSeconds = std::max(1, std::stoi(value()));
      } else if (a == "--compile-cpu-seconds") {
        compile.cpuSeconds = std::max(1, std::stoi(value()));
      } else if (a == "--compile-memory-mib") {
        compile.memoryMiB = std::max(256, std::stoi(value()));
      } else if (a == "--hello-timeout") {
        conn.helloTimeoutMs = seconds(value());
      } else if (a == "--frame-timeout") {
        conn.frameTimeoutMs = seconds(value());
      } else if (a == "--max-connections") {
        maxConnections = std::max(1, std::stoi(value()));
      } else if (a == "--max-pending") {
        conn.maxWaiting = std::max(1, std::stoi(value()));
      } else if (a == "--max-buffered-mib") {
        conn.bufferedBytes = std::max<uint64_t>(1, std::stoull(value())) << 20;
      } else if (a == "--store-host") {
        storeHost = value();
      } else if (a == "--spin-us") {
        spinUs = std::max(0, std::stoi(value()));
      } else if (a == "--workers") {
        workers = std::max(2, std::stoi(value()));
      } else if (a == "--session-grace") {
        sessionGraceMs = uint64_t(std::max(0.0, std::stod(value())) * 1000);
      } else if (a == "--max-tensor-mib") {
        limits.maxTensorBytes = std::stoull(value()) << 20;
      } else if (a == "--max-handles") {
        budgets.maxHandles = std::max<uint64_t>(1, std::stoull(value()));
      } else if (a == "--max-frame-mib") {
        limits.maxFrameBytes = std::stoull(value()) << 20;
      } else if (a == "--memory-limit" || a == "--session-memory" || a == "--graph-memory" ||
                 a == "--plan-cache" || a == "--compiled-cache" || a == "--disk-cache") {
        std::string v = value();
        uint64_t bytes = 0;
        if (!memory::parseSize(v, bytes))
          return fail("option " + a + " needs a size such as 8GiB, 512MiB or 64k, not '" + v +
                      "'");
        (a == "--memory-limit"     ? memoryLimit
         : a == "--session-memory" ? budgets.sessionMemory
         : a == "--graph-memory"   ? budgets.graphMemory
         : a == "--plan-cache"     ? budgets.planCache
         : a == "--compiled-cache" ? compile.memoryBytes
                                   : compile.diskBytes) = bytes;
      } else if (a == "--compile-queue") {
        compile.queueLimit = std::max(1, std::stoi(value()));
      } else {
        return fail("unknown option " + a + " (see --help)");
      }
    } catch (const std::exception &) {
      return fail("option " + a + " needs a number");
    }
  }
  if (compiler.empty()) {
    compiler = python && *python ? "inductor" : "plan";
  } else if (compiler != "plan" && compiler != "inductor") {
    return fail("unknown compiler '" + compiler + "': use --compiler inductor or --compiler plan");
  } else if (compiler == "inductor" && !(python && *python)) {
    return fail("--compiler inductor needs RGPU_PYTHON, a Python with torch; start the server "
                "with the rgpu-opserver command, which sets it");
  }
  if (compile.cacheDir.empty())
    compile.cacheDir = defaultCacheDir();
  bool cuda = at::globalContext().hasCUDA();
  if (device.empty())
    device = cuda ? "cuda" : "cpu";
  std::vector<at::Device> devices;
  llvm::SmallVector<llvm::StringRef, 8> items;
  llvm::StringRef(device).split(items, ',', -1, /*KeepEmpty=*/true);
  for (llvm::StringRef item : items) {
    if (item == "cpu") {
      devices.emplace_back(at::kCPU);
      continue;
    }
    unsigned index = 0;
    llvm::StringRef number = item;
    if (item != "cuda" && (!number.consume_front("cuda:") || number.getAsInteger(10, index)))
      return fail("unknown device '" + item.str() + "': use cuda, cuda:N or cpu (--devices "
                  "cuda:0,cuda:1)");
    if (!cuda)
      return fail("--device " + device + ": no usable CUDA device on this machine (use cpu)");
    int count = at::detail::getCUDAHooks().deviceCount();
    if (int(index) >= count)
      return fail("--device " + device + ": this machine has " + std::to_string(count) +
                  " CUDA device(s), numbered from 0");
    devices.emplace_back(at::kCUDA, c10::DeviceIndex(index));
  }
  if (devices.empty() || devices.size() > size_t(wire::kMaxDevices))
    return fail("--devices takes 1 to " + std::to_string(wire::kMaxDevices) + " devices, not '" +
                device + "'");
  if (std::any_of(devices.begin(), devices.end(),
                  [&](const at::Device &d) { return d.type() != devices[0].type(); }))
    return fail("--devices " + device + " mixes CPU and CUDA devices");
  // TCP only when asked for; the Unix socket when asked for or when nothing else is.
  bool tcp = port >= 0 || !bind.empty();
  if (port < 0)
    port = 9720;
  if (bind.empty())
    bind = "127.0.0.1";
  if (storeHost.empty())
    storeHost = bind;
  if (socketPath.empty() && !tcp)
    socketPath = net::auth::defaultSocketPath();

  // Buffers of 2 MiB and more (large frames, large tensors) are mapped on their own and
  // unmapped when freed: glibc's default threshold would rise after a large free and leave a
  // hostile session's frames resident in the pool's arenas (frames past 1 MiB also trim the
  // arenas once handled, kTrimAfterFrameBytes). Smaller ones, a small model's activations,
  // weights and optimizer temporaries, are reused from the arenas, which are not trimmed below
  // 64 MiB of free memory while sessions run (a session's end trims them all, malloc_trim
  // above): mapped afresh, each would cost its page faults every step. With a 256 KiB
  // threshold and the default trim, the bench's MLP step spent 11.4 ms on the server; with
  // these, 5.5 ms.
  mallopt(M_MMAP_THRESHOLD, 2 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  // Every connection is a descriptor: take what the hard limit allows.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }

  Server server;
  const at::Device dev = devices[0];
  std::unique_ptr<Compiler> inductor;
  if (compiler == "inductor") {
    compile.python = python;
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    std::string dir = n > 0 ? std::string(self, n) : std::string(argv[0]);
    compile.worker = dir.substr(0, dir.rfind('/') + 1) + "inductor_worker.py";
    inductor = std::make_unique<Compiler>(compile, dev);
  }
  server.ctx = std::make_unique<Context>(devices, limits, std::move(inductor));
  server.ctx->maxSessions = maxConnections;
  server.ctx->budgets = budgets;
  server.ctx->storeHost = storeHost;
  server.ctx->sessionGraceMs = sessionGraceMs;
  server.ctx->instance = net::auth::randomBytes(8);
  server.ctx->closeConnection = [&server](uint64_t connId) {
    server.post({connId, nullptr, true});
  };
  server.ctx->wakeDeferred = [&server] { server.wakeDeferred(); };
  memory::install(memoryLimit);
  server.limits = conn;
  server.loop = uv_default_loop();
  std::string where, tokenNote;
  if (tcp) {
    if (tokenPath.empty())
      tokenPath = net::auth::defaultTokenPath();
    std::string error, token;
    bool created = false;
    if (!net::auth::loadOrCreateToken(tokenPath, token, created, error))
      return fail(error + " (TCP clients are let in by this token; see --token-file)");
    std::vector<Principal> principals = {{fs::path(tokenPath).filename().string(), token}};
    if (!tokensDir.empty() && !readPrincipals(tokensDir, principals, error))
      return fail(error);
    server.principals = std::make_shared<const std::vector<Principal>>(std::move(principals));
    int bound = 0;
    if (std::string e = listenTcp(server, bind, port, bound); !e.empty())
      return fail(e);
    where = bind + ":" + std::to_string(bound);
    tokenNote = std::string(created ? "created the token file " : "TCP clients need the token in ") +
                tokenPath + " (fingerprint " + net::auth::fingerprint(token) +
                "): `rgpu-run --host` fetches it over ssh; elsewhere set RGPU_TOKEN or "
                "RGPU_TOKEN_FILE";
    if (server.principals->size() > 1)
      tokenNote += "; and " + std::to_string(server.principals->size() - 1) +
                   " more principal(s) from " + tokensDir;
  }
  if (!socketPath.empty()) {
    if (std::string e = listenUnix(server, socketPath); !e.empty())
      return fail(e);
    where += (where.empty() ? "unix:" : " and unix:") + socketPath;
  }
  uv_async_init(server.loop, &server.wake, onWake);
  server.wake.data = &server;
  uv_timer_init(server.loop, &server.exitTimer);
  server.exitTimer.data = &server;
  uv_timer_init(server.loop, &server.ticker);
  server.ticker.data = &server;
  uv_timer_start(&server.ticker, onTick, kHeartbeatMs, kHeartbeatMs);
  uv_signal_init(server.loop, &server.sigint);
  uv_signal_start(&server.sigint, onSignal, SIGINT);
  uv_signal_init(server.loop, &server.sigterm);
  server.sigint.data = server.sigterm.data = &server;
  uv_signal_start(&server.sigterm, onSignal, SIGTERM);
  try {
    server.spinUs = spinUs;
    server.startWorkers(workers);
  } catch (const std::system_error &e) {
    return fail(std::string("cannot start the worker threads: ") + e.what());
  }
  std::string deviceText;
  for (const at::Device &d : devices)
    deviceText += (deviceText.empty() ? "" : ",") + d.str();
  log("listening on " + where + (devices.size() > 1 ? ", devices " : ", device ") + deviceText +
      ", compiler " +
      compiler + (compiler == "inductor" ? ", cache " + compile.cacheDir : "") + ", " +
      std::to_string(workers) + " workers, memory limit " +
      (memoryLimit ? memory::sizeText(memoryLimit) : std::string("none")) +
      (budgets.sessionMemory ? " (" + memory::sizeText(budgets.sessionMemory) + " a session)"
                             : std::string()));
  if (!tokenNote.empty())
    log(tokenNote);
  return uv_run(server.loop, UV_RUN_DEFAULT);
}
