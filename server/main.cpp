//===- server/main.cpp - rgpu-opserver: from the command line to the loop ---===//
//
// Reads the options (Options.h), resolves the devices and the principals, builds the Context
// every session shares and runs the I/O loop (Loop.h) with its worker pool (Pool.h).
//
//===----------------------------------------------------------------------===//
#include "ContentStore.h"
#include "Context.h"
#include "Device.h"
#include "Files.h"
#include "Groups.h"
#include "Log.h"
#include "Loop.h"
#include "Options.h"
#include "Policy.h"

#include "rgpu/ir/Error.h"
#include "rgpu/net/Auth.h"

#include <dlfcn.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <system_error>
#include <tuple>

using namespace rgpu;
using namespace rgpu::server;

namespace {

namespace fs = std::filesystem;

/// The most principals a server knows: each TCP Hello is checked against all of them.
constexpr size_t kMaxPrincipals = 1024;

/// A principal for each token file in \p dir, named by the file's name, after \p known (no two
/// share a name or a token).
llvm::Expected<std::vector<Principal>> readPrincipals(const std::string &dir,
                                                      std::vector<Principal> known) {
  std::error_code ec;
  std::vector<fs::path> files;
  for (const auto &entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string()[0] != '.')
      files.push_back(entry.path());
  if (ec)
    return failure("cannot read --tokens-dir " + dir + ": " + ec.message());
  std::sort(files.begin(), files.end());
  for (const fs::path &path : files) {
    std::string name = path.filename().string();
    if (name.size() > 64 || !std::all_of(name.begin(), name.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
        }))
      return failure("--tokens-dir " + dir + ": '" + name + "' is not a principal's name "
                     "(letters, digits, '-', '_' and '.', at most 64)");
    auto read = net::auth::readToken(path.string());
    if (!read)
      return read.takeError();
    const std::string &token = *read;
    for (const Principal &p : known)
      if (p.name == name || p.token == token)
        return failure("--tokens-dir " + dir + ": " + name +
                       (p.name == name ? " is named twice" : " has the token of " + p.name) +
                       "; each principal needs a token of its own");
    known.push_back({name, token});
  }
  if (known.size() > kMaxPrincipals)
    return failure("--tokens-dir " + dir + " names more than " + std::to_string(kMaxPrincipals) +
                   " principals");
  return known;
}

/// Listens on TCP as \p o says, for the principals of --token-file and --tokens-dir; returns
/// where ("host:port") and a line for the log about the token.
llvm::Expected<std::pair<std::string, std::string>> listenTcp(Loop &loop, const Options &o) {
  auto loaded = net::auth::loadOrCreateToken(o.tokenFile);
  if (!loaded)
    return failure(message(loaded.takeError()) +
                   " (TCP clients are let in by this token; see --token-file)");
  const std::string token = loaded->token;
  const bool created = loaded->created;
  std::vector<Principal> principals = {{fs::path(o.tokenFile).filename().string(), token}};
  if (!o.tokensDir.empty()) {
    auto more = readPrincipals(o.tokensDir, std::move(principals));
    if (!more)
      return more.takeError();
    principals = std::move(*more);
  }
  const size_t others = principals.size() - 1;
  llvm::Expected<int> port = loop.listenTcp(
      o.bind, o.port, std::make_shared<const std::vector<Principal>>(std::move(principals)));
  if (!port)
    return port.takeError();
  std::string note = std::string(created ? "created the token file " : "TCP clients need the token in ") +
                     o.tokenFile + " (fingerprint " + net::auth::fingerprint(token) +
                     "): `rgpu-run --host` fetches it over ssh; elsewhere set RGPU_TOKEN or "
                     "RGPU_TOKEN_FILE";
  if (others)
    note += "; and " + std::to_string(others) + " more principal(s) from " + o.tokensDir;
  return std::make_pair(o.bind + ":" + std::to_string(*port), note);
}

/// The Inductor compiler of \p o for \p device; null for --compiler plan.
std::unique_ptr<Compiler> compilerFor(Options &o, c10::Device device, const char *argv0) {
  if (o.compiler != "inductor")
    return nullptr;
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  std::string dir = n > 0 ? std::string(self, n) : std::string(argv0);
  o.compile.worker = dir.substr(0, dir.rfind('/') + 1) + "inductor_worker.py";
  return std::make_unique<Compiler>(o.compile, device);
}

int fail(llvm::Error error) {
  log(message(std::move(error)));
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
  llvm::Expected<Options> parsed = parseOptions(argc, argv, std::getenv("RGPU_PYTHON"));
  if (!parsed)
    return fail(parsed.takeError());
  Options &o = *parsed;
  if (o.help) {
    std::fputs(helpText().c_str(), stdout);
    return 0;
  }
  if (o.refusedOps) {
    for (const auto &[op, why] : policy::refusedOps())
      std::printf("%s: %s\n", op.c_str(), why.c_str());
    return 0;
  }
  llvm::Expected<std::vector<c10::Device>> devices = device::parseList(o.devices);
  if (!devices)
    return fail(devices.takeError());

  // Buffers of 2 MiB and more (large frames, large tensors) are mapped on their own and
  // unmapped when freed: glibc's default threshold would rise after a large free and leave a
  // hostile session's frames resident in the pool's arenas (frames past 1 MiB also trim the
  // arenas once handled, Pool.cpp). Smaller ones, a small model's activations, weights and
  // optimizer temporaries, are reused from the arenas, which are not trimmed below 64 MiB of
  // free memory while sessions run (a session's end trims them all): mapped afresh, each would
  // cost its page faults every step. With a 256 KiB threshold and the default trim, the
  // bench's MLP step spent 11.4 ms on the server; with these, 5.5 ms.
  mallopt(M_MMAP_THRESHOLD, 2 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  // Every connection is a descriptor: take what the hard limit allows.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }

  Context ctx(*devices, o.limits, compilerFor(o, devices->front(), argv[0]));
  ctx.maxSessions = o.maxConnections;
  ctx.budgets = o.budgets;
  ctx.storeHost = o.storeHost;
  ctx.sessionGraceMs = o.sessionGraceMs;
  ctx.instance = net::auth::randomBytes(8);
  ctx.setStore(std::make_unique<ContentStore>(o.storeDir, o.storeSize));
  ctx.setFiles(std::make_unique<FilesArea>(o.filesDir, o.filesQuota));
  memory::install(o.memoryLimit);
  Loop loop(ctx, o.connection, o.spinUs);
  std::string where, tokenNote;
  if (o.tcp) {
    auto listening = listenTcp(loop, o);
    if (!listening)
      return fail(listening.takeError());
    std::tie(where, tokenNote) = *listening;
  }
  if (!o.socketPath.empty()) {
    if (llvm::Error e = loop.listenUnix(o.socketPath))
      return fail(std::move(e));
    where += (where.empty() ? "unix:" : " and unix:") + o.socketPath;
  }
  if (llvm::Error e = loop.startWorkers(o.workers))
    return fail(std::move(e));
  std::string deviceText;
  for (const c10::Device &d : *devices)
    deviceText += (deviceText.empty() ? "" : ",") + d.str();
  log("listening on " + where + (devices->size() > 1 ? ", devices " : ", device ") + deviceText +
      ", compiler " + o.compiler +
      (o.compiler == "inductor" ? ", cache " + o.compile.cacheDir : "") + ", " +
      std::to_string(o.workers) + " workers, memory limit " +
      (o.memoryLimit ? memory::sizeText(o.memoryLimit) : std::string("none")) +
      (o.budgets.sessionMemory ? " (" + memory::sizeText(o.budgets.sessionMemory) + " a session)"
                               : std::string()));
  if (!tokenNote.empty())
    log(tokenNote);
  if (!o.filesDir.empty())
    log("files area " + o.filesDir + " (" +
        (o.filesQuota ? memory::sizeText(o.filesQuota) + " a principal" : std::string("no quota")) +
        "), upload store " + (o.storeSize ? o.storeDir : std::string("off")));
  return loop.run();
}
