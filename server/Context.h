//===- server/Context.h - What every session of one server shares ----------===//
//
// The devices, the limits, the cache of plans and the compiler; the sessions parked for a
// resume; every open session's memory account; the counters rgpu.server_stats() reports.
// Sessions reach each other only through here, and only for what this header lists.
//
// No ATen here: the I/O loop and the command line include it.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Memory.h"

#include "rgpu/ir/Graph.h"
#include "rgpu/wire/Wire.h"

#include <c10/core/Device.h>
#include <llvm/Support/Error.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace rgpu::server {

class Compiler;
class ContentStore;
class FilesArea;
class Plan;
class Session;

/// What a server lets each session hold, and how much it caches for all of them.
struct Budgets {
  uint64_t sessionMemory = 0;              ///< --session-memory; 0: none
  uint64_t graphMemory = uint64_t(64) << 20; ///< --graph-memory: graphs one session holds
  uint64_t planCache = uint64_t(256) << 20;  ///< --plan-cache: plans kept once unheld
  uint64_t maxHandles = uint64_t(1) << 20;   ///< --max-handles: tensor handles one session binds
};

/// State shared by every session of one server: the device, the graph cache and the compiler.
///
/// A plan lives while a session holds its graph (defined and not forgotten), and after that in
/// a least-recently-defined cache of --plan-cache bytes, so a session that reconnects or
/// defines a graph another one built gets it without building it again.
class Context {
public:
  /// rgpu:i runs on \p devices[i] (--devices); \p compiler, null for --compiler plan, compiles
  /// for devices[0].
  Context(std::vector<c10::Device> devices, wire::Limits limits,
          std::unique_ptr<Compiler> compiler);
  /// A Context without a compiler (--compiler plan).
  Context(std::vector<c10::Device> devices, wire::Limits limits);
  ~Context();

  /// rgpu:0's device: the one memory figures and Inductor are for by default.
  c10::Device device() const { return devices_[0]; }
  const std::vector<c10::Device> &devices() const { return devices_; }
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
  /// Uploads kept by their digest (--store-dir, --store-size); one that keeps nothing unless
  /// set.
  ContentStore &store() { return *store_; }
  void setStore(std::unique_ptr<ContentStore> store);
  /// Each principal's files (--files-dir, --files-quota); none unless set.
  FilesArea &files() { return *files_; }
  void setFiles(std::unique_ptr<FilesArea> files);
  std::atomic<uint64_t> uploadBytesDeduplicated{0};
  /// Kills the compiles in flight and removes their temporary files (a shutdown).
  void stopCompiles();

  /// The shared plan for \p hash, or null if no session has defined it.
  std::shared_ptr<const Plan> find(const ir::Hash256 &hash);
  /// Verifies \p graph (\p hash must be its own hash) and returns its plan: the shared one if
  /// a session defined the same graph before, else a new one, cached for every session unless
  /// another graph already holds the hash (then it is private to the caller, see Plan::shared).
  llvm::Expected<std::shared_ptr<const Plan>> define(const ir::Hash256 &hash, ir::Graph graph);

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
  std::vector<c10::Device> devices_;
  wire::Limits limits_;
  std::unique_ptr<Compiler> compiler_;
  std::unique_ptr<ContentStore> store_;
  std::unique_ptr<FilesArea> files_;
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

} // namespace rgpu::server
