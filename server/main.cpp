//===- server/main.cpp - rgpu-opserver: the libuv loop and the CLI ---------===//
//
// One libuv loop does all socket I/O. Each connection is a session with its own worker thread,
// which decodes and executes frames in order; replies come back to the loop through an async
// handle. A slow graph therefore delays only its own session, and a malformed frame closes only
// its own connection.
//
//===----------------------------------------------------------------------===//
#include "Policy.h"
#include "Session.h"

#include <ATen/Context.h>
#include <c10/core/DeviceType.h>

#include <malloc.h>
#include <uv.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
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
                         exits with an error if the device is unusable
  --port N               TCP port to listen on (default 9720; 0 picks a free port,
                         printed in the "listening on" line)
  --bind ADDR            address to bind (default 127.0.0.1: reach it through an ssh
                         tunnel, e.g. with rgpu-run; bind 0.0.0.0 only on a trusted network)
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
  --max-connections N    connections served at once (default 256); one more gets an
                         error frame and is closed
  --hello-timeout S      seconds a new connection has to send its Hello before it is
                         closed (default 10)
  --max-tensor-mib N     largest tensor a graph may hold or a client may upload, in MiB
                         (default: this machine's physical memory)
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

/// A connection's worker: executes its session's frames in order, off the loop thread.
struct Worker {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<net::Frame> queue;
  bool stopped = false;
  std::atomic<bool> greeted{false}; ///< the session's Hello was accepted
};

struct Connection {
  uv_tcp_t tcp;
  /// Closes a connection that has not said Hello in time: one that never speaks costs a
  /// socket for a few seconds, not for ever.
  uv_timer_t helloTimer;
  int handlesOpen = 2; ///< tcp and helloTimer; the connection is freed when both are closed
  uint64_t framesReceived = 0;
  uint64_t id;
  Server *server;
  net::FrameDecoder decoder;
  std::shared_ptr<Worker> worker;
  std::string peer;
  bool closing = false;
  Connection(uint64_t maxFrame) : decoder(maxFrame) {}
};

struct Outgoing {
  uint64_t conn;
  std::string bytes;
  bool close;
};

struct Server {
  uv_loop_t *loop;
  uv_tcp_t listener;
  uv_async_t wake;
  uv_signal_t sigint, sigterm;
  std::unique_ptr<Context> ctx;
  size_t maxConnections = 256;
  uint64_t helloTimeoutMs = 10000;
  uint64_t nextId = 1;
  std::unordered_map<uint64_t, Connection *> conns;
  std::mutex outMu;
  std::deque<Outgoing> outbox;

  void post(Outgoing o) {
    {
      std::lock_guard<std::mutex> lock(outMu);
      outbox.push_back(std::move(o));
    }
    uv_async_send(&wake);
  }
};

/// The close callback of a connection's handles; the last one frees the connection.
void onHandleClosed(uv_handle_t *h) {
  auto *conn = static_cast<Connection *>(h->data);
  if (--conn->handlesOpen == 0)
    delete conn;
}

void closeConnection(Connection *c) {
  if (c->closing)
    return;
  c->closing = true;
  {
    std::lock_guard<std::mutex> lock(c->worker->mu);
    c->worker->stopped = true;
    c->worker->queue.clear();
  }
  c->worker->cv.notify_all();
  c->server->conns.erase(c->id);
  uv_timer_stop(&c->helloTimer);
  uv_close(reinterpret_cast<uv_handle_t *>(&c->helloTimer), onHandleClosed);
  uv_close(reinterpret_cast<uv_handle_t *>(&c->tcp), onHandleClosed);
}

void serveSession(Server *server, uint64_t connId, const std::string &peer,
                  const std::shared_ptr<Worker> &w) {
  Session session(*server->ctx, peer);
  for (;;) {
    net::Frame frame;
    {
      std::unique_lock<std::mutex> lock(w->mu);
      w->cv.wait(lock, [&] { return w->stopped || !w->queue.empty(); });
      if (w->stopped)
        break;
      frame = std::move(w->queue.front());
      w->queue.pop_front();
    }
    FrameOutcome out = session.handle(frame);
    if (!out.reply.empty() || out.close)
      server->post({connId, std::move(out.reply), out.close});
    if (out.close)
      break;
    w->greeted = true; // a first frame that did not start with a Hello closed the session
  }
}

void runWorker(Server *server, uint64_t connId, std::string peer, std::shared_ptr<Worker> w) {
  serveSession(server, connId, peer, w);
  // The session's memory goes back to the system, not only to this thread's malloc arena, so
  // what a finished session allocated does not stay resident.
  malloc_trim(0);
}

void onAlloc(uv_handle_t *, size_t suggested, uv_buf_t *buf) {
  buf->base = static_cast<char *>(malloc(suggested));
  buf->len = suggested;
}

void onRead(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf) {
  auto *c = static_cast<Connection *>(stream->data);
  if (n < 0) {
    if (n != UV_EOF)
      log(c->peer + ": " + uv_strerror(n));
    closeConnection(c);
  } else if (n > 0 && !c->closing) {
    if (!c->decoder.feed(buf->base, n)) {
      log(c->peer + ": " + c->decoder.error() + "; closing the connection");
      closeConnection(c);
    } else {
      net::Frame frame;
      bool any = false;
      std::lock_guard<std::mutex> lock(c->worker->mu);
      while (c->decoder.next(frame)) {
        if (c->worker->stopped) // a refused connection: read and dropped
          continue;
        c->worker->queue.push_back(std::move(frame));
        ++c->framesReceived;
        any = true;
      }
      if (any)
        c->worker->cv.notify_one();
    }
  }
  free(buf->base);
}

void onConnection(uv_stream_t *listener, int status) {
  auto *server = static_cast<Server *>(listener->data);
  if (status < 0) {
    log(std::string("accept failed: ") + uv_strerror(status));
    return;
  }
  auto *c = new Connection(server->ctx->limits().maxFrameBytes);
  c->server = server;
  c->id = server->nextId++;
  uv_tcp_init(server->loop, &c->tcp);
  c->tcp.data = c;
  uv_timer_init(server->loop, &c->helloTimer);
  c->helloTimer.data = c;
  c->worker = std::make_shared<Worker>();
  if (uv_accept(listener, reinterpret_cast<uv_stream_t *>(&c->tcp)) != 0) {
    c->closing = true;
    uv_close(reinterpret_cast<uv_handle_t *>(&c->helloTimer), onHandleClosed);
    uv_close(reinterpret_cast<uv_handle_t *>(&c->tcp), onHandleClosed);
    return;
  }
  uv_tcp_nodelay(&c->tcp, 1);
  sockaddr_storage addr{};
  int len = sizeof addr;
  char host[64] = "?";
  if (uv_tcp_getpeername(&c->tcp, reinterpret_cast<sockaddr *>(&addr), &len) == 0) {
    if (addr.ss_family == AF_INET)
      uv_ip4_name(reinterpret_cast<sockaddr_in *>(&addr), host, sizeof host);
    else
      uv_ip6_name(reinterpret_cast<sockaddr_in6 *>(&addr), host, sizeof host);
  }
  c->peer = std::string("session ") + std::to_string(c->id) + " (" + host + ")";
  bool full = server->conns.size() >= server->maxConnections;
  server->conns[c->id] = c;
  std::string refusal;
  if (full) {
    refusal = "rgpu-opserver is serving its limit of " + std::to_string(server->maxConnections) +
              " connections (--max-connections); try again later";
  } else {
    try {
      std::thread(runWorker, server, c->id, c->peer, c->worker).detach();
    } catch (const std::system_error &e) {
      refusal = std::string("rgpu-opserver cannot start a session now (") + e.what() +
                "); try again later";
    }
  }
  if (!refusal.empty()) {
    // Refused whole: one error frame, then the connection closes; nothing of it remains.
    log(c->peer + ": " + refusal);
    c->worker->stopped = true;
    capnp::MallocMessageBuilder reply;
    auto e = reply.initRoot<wire::ServerFrame>().initError();
    e.setMessage(refusal);
    e.setKind(wire::Error::Kind::PROTOCOL);
    server->post({c->id, net::encodeFrame(reply, true), true});
  }
  uv_timer_start(
      &c->helloTimer,
      [](uv_timer_t *t) {
        auto *conn = static_cast<Connection *>(t->data);
        if (conn->worker->greeted || conn->closing)
          return;
        if (conn->framesReceived > 0 || conn->decoder.pendingBytes() > 0) {
          // Its first frame is arriving or being served (a slow link, a large first frame):
          // look again later rather than cut a client off mid-Hello.
          uv_timer_start(t, t->timer_cb, conn->server->helloTimeoutMs, 0);
          return;
        }
        log(conn->peer + ": no Hello within " +
            std::to_string(conn->server->helloTimeoutMs / 1000.0).substr(0, 4) +
            " s; closing the connection");
        closeConnection(conn);
      },
      server->helloTimeoutMs, 0);
  // A refused connection is read too (its worker is stopped, so nothing is kept): closing a
  // socket with unread bytes would reset it before the client reads the error frame.
  uv_read_start(reinterpret_cast<uv_stream_t *>(&c->tcp), onAlloc, onRead);
}

void onWake(uv_async_t *handle) {
  auto *server = static_cast<Server *>(handle->data);
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
    if (!o.bytes.empty()) {
      struct Write {
        uv_write_t req;
        std::string bytes;
        Connection *conn;
        bool close;
      };
      auto *w = new Write{{}, std::move(o.bytes), c, o.close};
      uv_buf_t buf = uv_buf_init(w->bytes.data(), w->bytes.size());
      w->req.data = w;
      uv_write(&w->req, reinterpret_cast<uv_stream_t *>(&c->tcp), &buf, 1,
               [](uv_write_t *req, int) {
                 auto *w = static_cast<Write *>(req->data);
                 if (w->close)
                   closeConnection(w->conn);
                 delete w;
               });
    } else if (o.close) {
      closeConnection(c);
    }
  }
}

void onSignal(uv_signal_t *handle, int signum) {
  log(std::string("received ") + (signum == SIGINT ? "SIGINT" : "SIGTERM") + ", shutting down");
  // Sessions hold only in-memory state. Compiles in flight are killed and their temporary files
  // removed, so the cache holds only whole artifacts.
  if (Compiler *c = static_cast<Server *>(handle->data)->ctx->compiler())
    c->shutdown();
  std::_Exit(0);
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

int main(int argc, char **argv) {
  std::string device, bind = "127.0.0.1", compiler;
  CompilerOptions compile;
  const char *python = std::getenv("RGPU_PYTHON");
  int port = 9720;
  wire::Limits limits;
  size_t maxConnections = 256;
  uint64_t helloTimeoutMs = 10000;
  limits.maxTensorBytes = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
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
      } else if (a == "--device") {
        device = value();
      } else if (a == "--port") {
        port = std::stoi(value());
      } else if (a == "--bind") {
        bind = value();
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
        helloTimeoutMs = uint64_t(std::max(0.05, std::stod(value())) * 1000);
      } else if (a == "--max-connections") {
        maxConnections = std::max(1, std::stoi(value()));
      } else if (a == "--max-tensor-mib") {
        limits.maxTensorBytes = std::stoull(value()) << 20;
      } else if (a == "--max-frame-mib") {
        limits.maxFrameBytes = std::stoull(value()) << 20;
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
  if (device != "cpu" && device != "cuda")
    return fail("unknown device '" + device + "': use --device cuda or --device cpu");
  if (device == "cuda" && !cuda)
    return fail("--device cuda: no usable CUDA device on this machine (use --device cpu)");

  Server server;
  at::Device dev(device == "cuda" ? at::kCUDA : at::kCPU, device == "cuda" ? 0 : -1);
  std::unique_ptr<Compiler> inductor;
  if (compiler == "inductor") {
    compile.python = python;
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    std::string dir = n > 0 ? std::string(self, n) : std::string(argv[0]);
    compile.worker = dir.substr(0, dir.rfind('/') + 1) + "inductor_worker.py";
    inductor = std::make_unique<Compiler>(compile, dev);
  }
  server.ctx = std::make_unique<Context>(dev, limits, std::move(inductor));
  server.maxConnections = maxConnections;
  server.helloTimeoutMs = helloTimeoutMs;
  server.loop = uv_default_loop();
  uv_tcp_init(server.loop, &server.listener);
  server.listener.data = &server;
  sockaddr_storage addr{};
  if (uv_ip4_addr(bind.c_str(), port, reinterpret_cast<sockaddr_in *>(&addr)) != 0 &&
      uv_ip6_addr(bind.c_str(), port, reinterpret_cast<sockaddr_in6 *>(&addr)) != 0)
    return fail("--bind " + bind + ": not an IP address");
  int rc = uv_tcp_bind(&server.listener, reinterpret_cast<sockaddr *>(&addr), 0);
  if (rc == 0)
    rc = uv_listen(reinterpret_cast<uv_stream_t *>(&server.listener), 128, onConnection);
  if (rc != 0)
    return fail("cannot listen on " + bind + ":" + std::to_string(port) + ": " + uv_strerror(rc));
  int len = sizeof addr;
  uv_tcp_getsockname(&server.listener, reinterpret_cast<sockaddr *>(&addr), &len);
  int bound = ntohs(reinterpret_cast<sockaddr_in *>(&addr)->sin_port);
  uv_async_init(server.loop, &server.wake, onWake);
  server.wake.data = &server;
  uv_signal_init(server.loop, &server.sigint);
  uv_signal_start(&server.sigint, onSignal, SIGINT);
  uv_signal_init(server.loop, &server.sigterm);
  server.sigint.data = server.sigterm.data = &server;
  uv_signal_start(&server.sigterm, onSignal, SIGTERM);
  log("listening on " + bind + ":" + std::to_string(bound) + ", device " +
      server.ctx->device().str() + ", compiler " + compiler +
      (compiler == "inductor" ? ", cache " + compile.cacheDir : ""));
  return uv_run(server.loop, UV_RUN_DEFAULT);
}
