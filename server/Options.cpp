#include "Options.h"

#include "rgpu/ir/Error.h"
#include "rgpu/net/Auth.h"

#include <llvm/ADT/STLExtras.h>
#include <llvm/ADT/SmallVector.h>
#include <llvm/ADT/StringRef.h>

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <unistd.h>

namespace rgpu::server {

namespace {

/// Sets a flag's field from \p value; a failure completes "option --flag ...".
using Parser = llvm::Error (*)(Options &o, llvm::StringRef value);

/// One flag: its name, what it takes (null: nothing), its help (wrapped when printed; the
/// default belongs in it) and its parser.
struct Flag {
  const char *group;
  const char *name;
  const char *takes;
  const char *help;
  Parser parse;
};

/// \p value as a whole number of type T, at least \p least.
template <class T> llvm::Error count(llvm::StringRef value, T &field, long long least) {
  long long n = 0;
  if (value.trim().getAsInteger(10, n))
    return failure("needs a number");
  field = T(std::max(n, least));
  return llvm::Error::success();
}

/// \p value MiB as bytes.
llvm::Error mebibytes(llvm::StringRef value, uint64_t &field, uint64_t least = 0) {
  unsigned long long n = 0;
  if (value.trim().getAsInteger(10, n))
    return failure("needs a number");
  field = std::max<uint64_t>(n, least) << 20;
  return llvm::Error::success();
}

/// \p value seconds as milliseconds, at least \p least seconds.
llvm::Error seconds(llvm::StringRef value, uint64_t &ms, double least) {
  double s = 0;
  if (value.trim().getAsDouble(s))
    return failure("needs a number");
  ms = uint64_t(std::max(least, s) * 1000);
  return llvm::Error::success();
}

/// \p value as a size with a unit ("8GiB").
llvm::Error size(llvm::StringRef value, uint64_t &field) {
  std::optional<uint64_t> bytes = memory::parseSize(value.str());
  if (!bytes)
    return failure("needs a size such as 8GiB, 512MiB or 64k, not '" + value + "'");
  field = *bytes;
  return llvm::Error::success();
}

llvm::Error text(llvm::StringRef value, std::string &field) {
  field = value.str();
  return llvm::Error::success();
}

constexpr const char *kRun = "the device, and how graphs run";
constexpr const char *kListen = "where clients connect, and who may";
constexpr const char *kLimits = "what a client may hold and send";
constexpr const char *kMemory =
    "memory and caches (SIZE: a number with a unit, such as 8GiB, 512MiB or 64k)";
constexpr const char *kData = "data kept on this machine";
constexpr const char *kOther = "other";

// clang-format off
const Flag kFlags[] = {
  {kRun, "--device", "cuda|cpu",
   "device to run on (default: cuda if available, else cpu); exits with an error if the device "
   "is unusable. CUDA out of memory fails that op (the allocator's cache is emptied); an error "
   "CUDA cannot recover from (a device-side assert) fails that run, then the server exits with "
   "status 75 to be restarted",
   [](Options &o, llvm::StringRef v) { return text(v, o.devices); }},
  {kRun, "--devices", "LIST",
   "several devices, comma-separated (cuda:0,cuda:1; cpu,cpu): clients see them as rgpu:0, "
   "rgpu:1, ... (torch.rgpu.device_count()). Copies between them run here. Inductor compiles "
   "graphs on the first one; graphs on the others run on the plan executor",
   [](Options &o, llvm::StringRef v) { return text(v, o.devices); }},
  {kRun, "--compiler", "inductor|plan",
   "how graphs are executed. plan runs libtorch kernels through a plan of resolved operator "
   "handles. inductor (the default when started through the rgpu-opserver command) does the "
   "same, and compiles each graph that has run --compile-after times with TorchInductor in the "
   "background; later runs use the fused, compiled code. No step ever waits for a compile.",
   [](Options &o, llvm::StringRef v) {
     if (v != "inductor" && v != "plan")
       return failure("takes inductor or plan, not '" + v + "'");
     return text(v, o.compiler);
   }},
  {kRun, "--cache-dir", "DIR",
   "where compiled graphs persist, so that a restarted server compiles nothing twice (default: "
   "$XDG_CACHE_HOME/rgpu/server, else ~/.cache/rgpu/server)",
   [](Options &o, llvm::StringRef v) { return text(v, o.compile.cacheDir); }},
  {kRun, "--kernel-cache", "DIR",
   "Inductor's own cache of generated kernels and their compiled code, the compile worker's "
   "TORCHINDUCTOR_CACHE_DIR (default: torchinductor in --cache-dir). Servers on one machine "
   "may share one, each reusing the kernels the others compiled",
   [](Options &o, llvm::StringRef v) { return text(v, o.compile.kernelCacheDir); }},
  {kRun, "--compile-after", "N",
   "compile a graph on its Nth run (default 2: graphs that run once, such as initialization, "
   "are not worth compiling)",
   [](Options &o, llvm::StringRef v) { return count(v, o.compile.after, 1); }},
  {kRun, "--compile-jobs", "N",
   "compiles running at once, each a separate process (default 1)",
   [](Options &o, llvm::StringRef v) { return count(v, o.compile.jobs, 1); }},
  {kRun, "--compile-mode", "MODE",
   "torch.compile's modes: default | reduce-overhead (compiled runs on a CUDA device "
   "replayed as CUDA graphs) | max-autotune (autotuned, and CUDA graphs) | "
   "max-autotune-no-cudagraphs; a graph from torch.compile(mode=...) keeps its own",
   [](Options &o, llvm::StringRef v) {
     if (!compile_mode::known(v))
       return failure("takes default, reduce-overhead, max-autotune or "
                      "max-autotune-no-cudagraphs, not '" + v + "'");
     return text(v == "default" ? "" : v, o.compile.mode);
   }},
  {kRun, "--compile-timeout", "S",
   "wall-clock deadline of one compile, in seconds (default 600)",
   [](Options &o, llvm::StringRef v) { return count(v, o.compile.timeoutSeconds, 1); }},
  {kRun, "--compile-cpu-seconds", "S",
   "CPU time one compile may use (default 900)",
   [](Options &o, llvm::StringRef v) { return count(v, o.compile.cpuSeconds, 1); }},
  {kRun, "--compile-memory-mib", "N",
   "address space one compile may use on a CPU server (default 16384; not applied with CUDA, "
   "which reserves more than that)",
   [](Options &o, llvm::StringRef v) { return count(v, o.compile.memoryMiB, 256); }},
  {kRun, "--compile-queue", "N",
   "compiles waiting at once (default 64); a graph that gets hot while it is full runs on its "
   "plan and is queued later",
   [](Options &o, llvm::StringRef v) { return count(v, o.compile.queueLimit, 1); }},
  {kRun, "--workers", "N",
   "threads executing sessions' frames (default: the number of cores, at least 4; at least 2)",
   [](Options &o, llvm::StringRef v) { return count(v, o.workers, 2); }},
  {kRun, "--spin-us", "N",
   "microseconds an idle worker polls for the next frame before it sleeps, one worker at a "
   "time (default 1000; 0: sleep at once). A client that waits for each reply gets it sooner: "
   "waking a sleeping thread costs 50-100 us on an idle virtual CPU",
   [](Options &o, llvm::StringRef v) { return count(v, o.spinUs, 0); }},

  {kListen, "--socket", "PATH",
   "the Unix-domain socket to listen on (default, when neither --port nor --bind is given: "
   "$XDG_RUNTIME_DIR/rgpu/opserver.sock, else ~/.rgpu/opserver.sock). Its directory is made "
   "private to this user, and only peers of this user's uid are served.",
   [](Options &o, llvm::StringRef v) {
     if (!v.startswith("/"))
       return failure("needs an absolute path");
     return text(v, o.socketPath);
   }},
  {kListen, "--port", "N",
   "also listen on TCP port N (0 picks a free port, printed in the \"listening on\" line). TCP "
   "peers must prove they hold the token (a challenge answered with HMAC-SHA-256; the token "
   "never travels)",
   [](Options &o, llvm::StringRef v) {
     o.tcp = true;
     if (llvm::Error e = count(v, o.port, 0))
       return e;
     return o.port <= 65535 ? llvm::Error::success() : failure("needs a port number");
   }},
  {kListen, "--bind", "ADDR",
   "address for TCP (default 127.0.0.1; implies --port 9720)",
   [](Options &o, llvm::StringRef v) {
     o.tcp = true;
     return text(v, o.bind);
   }},
  {kListen, "--token-file", "PATH",
   "the token TCP clients need (default $XDG_CONFIG_HOME/rgpu/token, else "
   "~/.config/rgpu/token); created, mode 0600, if missing. Its sessions belong to the "
   "principal named by the file's name",
   [](Options &o, llvm::StringRef v) { return text(v, o.tokenFile); }},
  {kListen, "--tokens-dir", "DIR",
   "more principals: each file in DIR is one's token, named by the file's name (e.g. "
   "DIR/alice; mode 0600, of this user). A session is resumed, listed in stats and has its "
   "peaks reset only by its own principal",
   [](Options &o, llvm::StringRef v) { return text(v, o.tokensDir); }},
  {kListen, "--store-host", "ADDR",
   "the one address this server listens on for the other servers of a torch.distributed job: "
   "the rendezvous store one of its sessions hosts, and each process group's Gloo connections "
   "(default: the --bind address, else 127.0.0.1). The job's other servers must reach it. The "
   "store answers only servers holding the job's secret; a group's Gloo listeners take "
   "connections only until the group is set up",
   [](Options &o, llvm::StringRef v) { return text(v, o.storeHost); }},

  {kLimits, "--max-connections", "N",
   "sessions served at once (default 256); one more gets an error frame and is closed",
   [](Options &o, llvm::StringRef v) { return count(v, o.maxConnections, 1); }},
  {kLimits, "--max-pending", "N",
   "connections not yet authenticated at once (default 1024); past it the oldest of them is "
   "closed",
   [](Options &o, llvm::StringRef v) { return count(v, o.connection.maxWaiting, 1); }},
  {kLimits, "--hello-timeout", "S",
   "seconds a new connection has to authenticate (default 10)",
   [](Options &o, llvm::StringRef v) { return seconds(v, o.connection.helloTimeoutMs, 0.05); }},
  {kLimits, "--frame-timeout", "S",
   "seconds a frame that has begun may go without a byte (default 60)",
   [](Options &o, llvm::StringRef v) { return seconds(v, o.connection.frameTimeoutMs, 0.05); }},
  {kLimits, "--max-frame-mib", "N",
   "largest frame accepted from a client, in MiB (default 1024)",
   [](Options &o, llvm::StringRef v) { return mebibytes(v, o.limits.maxFrameBytes); }},
  {kLimits, "--max-buffered-mib", "N",
   "per connection: frames read and not yet served, and replies not yet sent, in MiB (default "
   "64); past it the server stops reading from that client until it catches up",
   [](Options &o, llvm::StringRef v) { return mebibytes(v, o.connection.bufferedBytes, 1); }},
  {kLimits, "--max-tensor-mib", "N",
   "largest tensor a graph may hold or a client may upload, in MiB (default: this machine's "
   "physical memory)",
   [](Options &o, llvm::StringRef v) { return mebibytes(v, o.limits.maxTensorBytes); }},
  {kLimits, "--max-handles", "N",
   "tensor handles one session may hold bound (default 1048576); each costs it 96 bytes of its "
   "--session-memory as well. Past either, the command that binds one more fails with an "
   "error saying so, and the session goes on",
   [](Options &o, llvm::StringRef v) { return count(v, o.budgets.maxHandles, 1); }},
  {kLimits, "--session-grace", "S",
   "seconds a session whose connection dropped is kept, with its tensors, for its client to "
   "resume it (default 120)",
   [](Options &o, llvm::StringRef v) { return seconds(v, o.sessionGraceMs, 0); }},

  {kMemory, "--memory-limit", "SIZE",
   "memory all sessions may hold together (default: 85% of this machine's physical memory). An "
   "allocation past it, or past a session's quota, fails that op with an rgpu.RemoteError "
   "naming the limit; the session goes on. 0: none",
   [](Options &o, llvm::StringRef v) { return size(v, o.memoryLimit); }},
  {kMemory, "--session-memory", "SIZE",
   "memory one session may hold: its tensors, uploads in progress and staging buffers "
   "(default 0: only --memory-limit applies)",
   [](Options &o, llvm::StringRef v) { return size(v, o.budgets.sessionMemory); }},
  {kMemory, "--graph-memory", "SIZE",
   "graphs one session may hold defined (default 64MiB, counted by their size in memory); the "
   "client forgets its least recently run graphs to stay under it and defines them again when "
   "needed",
   [](Options &o, llvm::StringRef v) { return size(v, o.budgets.graphMemory); }},
  {kMemory, "--plan-cache", "SIZE",
   "plans kept for graphs no session holds, least recently defined dropped first (default "
   "256MiB)",
   [](Options &o, llvm::StringRef v) { return size(v, o.budgets.planCache); }},
  {kMemory, "--compiled-cache", "SIZE",
   "compiled packages loaded at once, by package size (default 4GiB); the least recently run "
   "are unloaded, and reloaded from the cache directory when hot again",
   [](Options &o, llvm::StringRef v) { return size(v, o.compile.memoryBytes); }},
  {kMemory, "--disk-cache", "SIZE",
   "size of the cache directory's compiled packages (default 16GiB); the least recently used "
   "are deleted",
   [](Options &o, llvm::StringRef v) { return size(v, o.compile.diskBytes); }},

  {kData, "--store-dir", "DIR",
   "where uploads of 1 MiB or more are kept by the digest of their bytes, each principal's "
   "apart, so that a second upload of the same weights by the same principal sends digests, "
   "not bytes (default: store in --cache-dir)",
   [](Options &o, llvm::StringRef v) { return text(v, o.storeDir); }},
  {kData, "--store-size", "SIZE",
   "bytes the upload store keeps, every principal's together; the least recently used go "
   "first (default 16GiB; 0: keep none)",
   [](Options &o, llvm::StringRef v) { return size(v, o.storeSize); }},
  {kData, "--files-dir", "DIR",
   "a files area: each principal gets DIR/NAME (its principal's name; `uid` for peers of the "
   "Unix socket) for checkpoints, datasets and model directories that rgpu.remote(path) "
   "reads and writes here, without their bytes crossing the client's link. Paths are "
   "relative to it; symbolic links, '..' and special files are refused (default: none)",
   [](Options &o, llvm::StringRef v) { return text(v, o.filesDir); }},
  {kData, "--files-quota", "SIZE",
   "bytes one principal's files may hold (default 64GiB; 0: no limit); a write past it fails "
   "and keeps nothing",
   [](Options &o, llvm::StringRef v) { return size(v, o.filesQuota); }},

  {kOther, "--refused-ops", nullptr,
   "list the aten ops this server refuses to run, with the reason for each, and exit",
   [](Options &o, llvm::StringRef) -> llvm::Error {
     o.refusedOps = true;
     return llvm::Error::success();
   }},
  {kOther, "-h, --help", nullptr, "show this help",
   [](Options &o, llvm::StringRef) -> llvm::Error {
     o.help = true;
     return llvm::Error::success();
   }},
};
// clang-format on

/// The row of \p name; a row may name several ("-h, --help").
const Flag *findFlag(llvm::StringRef name) {
  for (const Flag &f : kFlags) {
    llvm::SmallVector<llvm::StringRef, 2> names;
    llvm::StringRef(f.name).split(names, ", ");
    if (llvm::is_contained(names, name))
      return &f;
  }
  return nullptr;
}

/// Appends \p words to \p out wrapped at \p width columns, each line after the first indented
/// by \p indent.
void wrap(std::string &out, llvm::StringRef words, size_t column, size_t indent, size_t width) {
  while (!words.empty()) {
    auto [word, rest] = words.split(' ');
    if (column > indent && column + 1 + word.size() > width) {
      out += "\n" + std::string(indent, ' ');
      column = indent;
    } else if (column > indent) {
      out += ' ';
      ++column;
    }
    out += word.str();
    column += word.size();
    words = rest;
  }
  out += '\n';
}

std::string defaultCacheDir() {
  if (const char *xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return std::string(xdg) + "/rgpu/server";
  const char *home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/rgpu/server";
}

} // namespace

std::string helpText() {
  constexpr size_t kIndent = 25, kWidth = 92;
  std::string out = "usage: rgpu-opserver [options]\n\n"
                    "Serves rgpu clients: receives lazy graphs once, runs them on this "
                    "machine's device.\n";
  const char *group = nullptr;
  for (const Flag &f : kFlags) {
    if (f.group != group) {
      group = f.group;
      out += std::string("\n") + group + ":\n";
    }
    std::string head = std::string("  ") + f.name + (f.takes ? std::string(" ") + f.takes : "");
    out += head;
    if (head.size() + 1 >= kIndent) {
      out += "\n" + std::string(kIndent, ' ');
    } else {
      out += std::string(kIndent - head.size(), ' ');
    }
    wrap(out, f.help, kIndent, kIndent, kWidth);
  }
  out += "\n";
  wrap(out,
       "Logs go to stderr, prefixed with \"rgpu-opserver:\". The inductor compiler runs "
       "`$RGPU_PYTHON inductor_worker.py` from this program's directory, one process per "
       "compile, with no inherited descriptors and the limits above; the rgpu-opserver command "
       "sets RGPU_PYTHON. A compile that fails or times out leaves its graph on the plan "
       "executor.",
       0, 0, kWidth);
  return out;
}

llvm::Expected<Options> parseOptions(int argc, char **argv, const char *python) {
  Options o;
  const uint64_t physical = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
  o.limits.maxTensorBytes = physical;
  o.memoryLimit = physical / 100 * 85;
  o.workers = std::max(4u, std::thread::hardware_concurrency());
  for (int i = 1; i < argc; ++i) {
    llvm::StringRef name = argv[i];
    const Flag *flag = findFlag(name);
    if (!flag)
      return failure("unknown option " + name + " (see --help)");
    llvm::StringRef value;
    if (flag->takes) {
      if (i + 1 >= argc)
        return failure("option " + name + " needs a value (see --help)");
      value = argv[++i];
    }
    if (llvm::Error e = flag->parse(o, value))
      return failure("option " + name + " " + message(std::move(e)));
  }
  if (o.help || o.refusedOps)
    return o;
  const bool hasPython = python && *python;
  if (o.compiler.empty())
    o.compiler = hasPython ? "inductor" : "plan";
  else if (o.compiler == "inductor" && !hasPython)
    return failure("--compiler inductor needs RGPU_PYTHON, a Python with torch; start the server "
                   "with the rgpu-opserver command, which sets it");
  if (o.compiler == "inductor")
    o.compile.python = python;
  if (o.compile.cacheDir.empty())
    o.compile.cacheDir = defaultCacheDir();
  if (o.storeDir.empty())
    o.storeDir = o.compile.cacheDir + "/store";
  if (o.compile.kernelCacheDir.empty())
    o.compile.kernelCacheDir = o.compile.cacheDir + "/torchinductor";
  // TCP only when asked for; the Unix socket when asked for or when nothing else is.
  if (o.storeHost.empty())
    o.storeHost = o.bind;
  if (o.socketPath.empty() && !o.tcp)
    o.socketPath = net::auth::defaultSocketPath();
  if (o.tcp && o.tokenFile.empty())
    o.tokenFile = net::auth::defaultTokenPath();
  return o;
}

} // namespace rgpu::server
