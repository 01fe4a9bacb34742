#include "Groups.h"

#include "Policy.h"
#include "Rendezvous.h"

#include "rgpu/ir/Error.h"
#include "rgpu/net/Auth.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <llvm/ADT/StringRef.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

#ifdef RGPU_WITH_GLOO
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace rgpu::server {

struct Groups::State {
  std::unique_ptr<rendezvous::Service> hosted;
#ifdef RGPU_WITH_GLOO
  /// c10d's registry holds groups weakly: the session holds them.
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> held;
#endif
  std::string hostedAddress;
  std::set<std::string> names;
};

namespace {
std::atomic<int> gStores{0}; ///< stores the server's sessions host
} // namespace

Groups::Groups() : s_(std::make_unique<State>()) {}

Groups::~Groups() {
  if (s_->hosted) {
    s_->hosted.reset();
    --gStores;
  }
#ifdef RGPU_WITH_GLOO
  for (const std::string &name : s_->names)
    c10d::unregister_process_group(name);
#endif
}

#ifndef RGPU_WITH_GLOO
namespace {
[[noreturn]] void unavailable() {
  throw std::runtime_error("this rgpu-opserver was built without Gloo (libgloo-dev's headers), "
                           "so it cannot join torch.distributed process groups");
}
} // namespace
#endif

std::string Groups::hostStore(const std::string &host, std::function<bool(int64_t)> charge) {
#ifdef RGPU_WITH_GLOO
  if (!s_->hosted) { // one store serves every group of the job
    if (++gStores > kMaxStores) {
      --gStores;
      throw std::runtime_error("this server hosts " + std::to_string(kMaxStores) +
                               " rendezvous stores already; host one once a job ends");
    }
    try {
      std::string secret = net::auth::randomBytes(rendezvous::kSecretBytes);
      s_->hosted = std::make_unique<rendezvous::Service>(host, secret, std::move(charge));
      s_->hostedAddress = rendezvous::address(host, s_->hosted->port(), secret);
    } catch (...) {
      --gStores;
      throw;
    }
  }
  return s_->hostedAddress;
#else
  (void)host;
  (void)charge;
  unavailable();
#endif
}

#ifdef RGPU_WITH_GLOO
namespace {
/// Gloo's listeners. Gloo keeps one open for as long as its group lives and keeps every
/// connection anyone makes to it, and a failed accept (a process out of descriptors) ends the
/// process. So each listener is closed to the network (a socket filter that drops every packet:
/// no new connection is ever made to it, while the group's own connections go on) as soon as
/// its group is set up; while its join waits, Gloo's accepts on it go through acceptConnection,
/// which closes it when descriptors run low.
struct GlooListeners {
  std::mutex mu;
  std::set<int> closed;  ///< listeners `accept` closed to the network
  int reserve = -1;      ///< given up to take a connection off a listener when none is left
};

GlooListeners &glooListeners() {
  static auto *l = new GlooListeners; // used from detached join threads
  return *l;
}

/// This process's listening socket bound to \p address; -1 if none.
int findListener(const char *address) {
  sockaddr_storage want;
  std::memcpy(&want, address, sizeof want);
  DIR *dir = opendir("/proc/self/fd");
  if (!dir)
    return -1;
  int found = -1;
  while (dirent *e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9')
      continue;
    const int fd = std::atoi(e->d_name);
    int listening = 0;
    socklen_t n = sizeof listening;
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) != 0 || !listening ||
        getsockname(fd, reinterpret_cast<sockaddr *>(&bound), &len) != 0 ||
        bound.ss_family != want.ss_family)
      continue;
    const bool same =
        want.ss_family == AF_INET
            ? std::memcmp(&reinterpret_cast<sockaddr_in &>(bound).sin_port,
                          &reinterpret_cast<sockaddr_in &>(want).sin_port, 2) == 0 &&
                  std::memcmp(&reinterpret_cast<sockaddr_in &>(bound).sin_addr,
                              &reinterpret_cast<sockaddr_in &>(want).sin_addr, 4) == 0
            : std::memcmp(&reinterpret_cast<sockaddr_in6 &>(bound).sin6_port,
                          &reinterpret_cast<sockaddr_in6 &>(want).sin6_port, 2) == 0 &&
                  std::memcmp(&reinterpret_cast<sockaddr_in6 &>(bound).sin6_addr,
                              &reinterpret_cast<sockaddr_in6 &>(want).sin6_addr, 16) == 0;
    if (same) {
      found = fd;
      break;
    }
  }
  closedir(dir);
  return found;
}

/// Closes listener \p fd to the network: every packet that reaches it is dropped.
void dropEverything(int fd) {
  sock_filter drop = BPF_STMT(BPF_RET | BPF_K, 0);
  sock_fprog program{1, &drop};
  if (setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &program, sizeof program) != 0)
    std::fprintf(stderr, "rgpu-opserver: cannot close a Gloo listener to new connections: %s\n",
                 std::strerror(errno));
}

/// The job's store as c10d (Gloo) sees it: a rendezvous::Client, whose waits give up within
/// Client::kCancelPollMs of their join being cancelled (the client left), not at the join's timeout.
class RendezvousStore : public c10d::Store {
public:
  explicit RendezvousStore(std::shared_ptr<rendezvous::Client> client)
      : Store(client->timeout()), client_(std::move(client)) {}

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<RendezvousStore>(std::make_shared<rendezvous::Client>(
        client_->host(), client_->port(), client_->secret(), client_->timeout(),
        client_->cancelled()));
  }
  void set(const std::string &key, const std::vector<uint8_t> &value) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::string record = bytes(value);
    // Gloo publishes its listener's address first thing: the listener is found by it.
    if (size_t at = rendezvous::glooAddressAt(record); at != std::string::npos) {
      int fd = findListener(record.data() + at);
      if (fd >= 0 && std::find(listeners_.begin(), listeners_.end(), fd) == listeners_.end())
        listeners_.push_back(fd);
    }
    client_->set(key, rendezvous::zeroAddressPadding(std::move(record)));
  }
  std::vector<uint8_t> compareSet(const std::string &key, const std::vector<uint8_t> &expected,
                                  const std::vector<uint8_t> &desired) override {
    std::lock_guard<std::mutex> lock(mu_);
    return vector(client_->compareSet(key, bytes(expected), bytes(desired)));
  }
  std::vector<uint8_t> get(const std::string &key) override {
    std::lock_guard<std::mutex> lock(mu_);
    waitFor({key}, timeout_);
    auto value = client_->get(key);
    if (!value)
      C10_THROW_ERROR(DistStoreError, "the rendezvous store lost the key " + key);
    return vector(*value);
  }
  int64_t add(const std::string &key, int64_t value) override {
    std::lock_guard<std::mutex> lock(mu_);
    return client_->add(key, value);
  }
  bool deleteKey(const std::string &key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return client_->deleteKey(key);
  }
  bool check(const std::vector<std::string> &keys) override {
    std::lock_guard<std::mutex> lock(mu_);
    return client_->check(keys);
  }
  int64_t getNumKeys() override {
    std::lock_guard<std::mutex> lock(mu_);
    return client_->numKeys();
  }
  void wait(const std::vector<std::string> &keys) override {
    std::lock_guard<std::mutex> lock(mu_);
    waitFor(keys, timeout_);
  }
  void wait(const std::vector<std::string> &keys,
            const std::chrono::milliseconds &timeout) override {
    std::lock_guard<std::mutex> lock(mu_);
    waitFor(keys, timeout);
  }
  void append(const std::string &key, const std::vector<uint8_t> &value) override {
    std::lock_guard<std::mutex> lock(mu_);
    client_->append(key, bytes(value));
  }
  /// The join is over: its connection is closed (a later call opens another), and its Gloo
  /// listeners closed to the network if \p groupUp (else their devices are about to go).
  void endJoin(bool groupUp) {
    std::lock_guard<std::mutex> lock(mu_);
    client_->disconnect();
    GlooListeners &l = glooListeners();
    std::lock_guard<std::mutex> listeners(l.mu);
    for (int fd : listeners_) {
      if (groupUp)
        dropEverything(fd);
      l.closed.erase(fd);
    }
    listeners_.clear();
  }

private:
  static std::string bytes(const std::vector<uint8_t> &v) {
    return std::string(reinterpret_cast<const char *>(v.data()), v.size());
  }
  static std::vector<uint8_t> vector(const std::string &s) {
    return std::vector<uint8_t>(s.begin(), s.end());
  }
  void waitFor(const std::vector<std::string> &keys, std::chrono::milliseconds timeout) {
    if (!client_->wait(keys, timeout))
      C10_THROW_ERROR(DistStoreError, "the job's other servers did not all reach the "
                                      "rendezvous store within " +
                                          std::to_string(timeout.count()) + " ms");
  }
  std::mutex mu_;
  std::shared_ptr<rendezvous::Client> client_;
  std::vector<int> listeners_; ///< of this join's Gloo devices
};
} // namespace
#endif

struct Groups::Join {
  std::mutex mu;
  bool ended = false;
  std::string error;
#ifdef RGPU_WITH_GLOO
  c10::intrusive_ptr<c10d::ProcessGroup> group;
#endif
  std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
};

std::shared_ptr<Groups::Join> Groups::startJoin(const std::string &store,
                                                const std::string &prefix, int rank, int size,
                                                const std::string &host,
                                                std::chrono::milliseconds timeout,
                                                std::function<void()> ended) {
#ifdef RGPU_WITH_GLOO
  if (s_->names.size() >= kMaxGroups)
    throw std::runtime_error("a session may join at most " + std::to_string(kMaxGroups) +
                             " process groups");
  if (size < 1 || size > kMaxRanks || rank < 0 || rank >= size)
    throw std::runtime_error("rank " + std::to_string(rank) + " of a group of " +
                             std::to_string(size) + " (groups have 1 to " +
                             std::to_string(kMaxRanks) + " ranks)");
  if (prefix.size() > kMaxPrefix)
    throw std::runtime_error("a group's key prefix of more than " + std::to_string(kMaxPrefix) +
                             " bytes");
  if (store.empty() && !s_->hosted)
    throw std::runtime_error("this session hosts no rendezvous store (hostStore first)");
  std::optional<rendezvous::StoreAddress> at =
      rendezvous::parseAddress(store.empty() ? s_->hostedAddress : store);
  if (!at)
    throw std::runtime_error("the rendezvous store '" + store +
                             "' is not an address a HostStore gave (host:port#secret)");
  const std::string storeHost = at->host, secret = at->secret;
  const int port = at->port;
  auto join = std::make_shared<Join>();
  std::thread([join, storeHost, port, secret, prefix, rank, size, host, timeout,
               ended = std::move(ended)]() mutable {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    std::string error;
    auto base = c10::make_intrusive<RendezvousStore>(std::make_shared<rendezvous::Client>(
        storeHost, port, secret, timeout, join->cancelled));
    // Held until the join's listeners are done with (endJoin), whatever happens to the group.
    std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
    try {
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("rgpu/" + prefix, base);
      // Gloo listens where the operator said (--store-host), not on whatever the machine's
      // host name resolves to. (Not lazily: every connection is made before the listener
      // closes.)
      auto options = [&] {
        auto o = c10d::ProcessGroupGloo::Options::create(timeout);
        devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host, false));
        o->devices = {devices.back()};
        return o;
      };
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options());
      // Collectives that differ between ranks (a shape, an op) would reach Gloo's I/O thread,
      // which aborts the process on them. So every collective is first checked against the
      // other ranks' through a second, small Gloo group (torch's ProcessGroupWrapper, what
      // TORCH_DISTRIBUTED_DEBUG=DETAIL uses): a mismatch fails that run on every rank.
      auto checks = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("rgpu/" + prefix + "/checks", base),
          rank, size, options());
      auto checked = c10::make_intrusive<c10d::ProcessGroupWrapper>(gloo, checks);
      group = c10::make_intrusive<c10d::ProcessGroup>(prefixed, rank, size);
      // Gloo takes CUDA tensors too (through host memory; NCCL would be the fast path).
      for (c10::DeviceType type : {c10::DeviceType::CPU, c10::DeviceType::CUDA})
        group->setBackend(type, c10d::ProcessGroup::BackendType::GLOO, checked);
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    } catch (const c10::Error &e) {
      error = e.what_without_backtrace();
    } catch (const std::exception &e) {
      error = e.what();
    }
    base->endJoin(group != nullptr);
    {
      std::lock_guard<std::mutex> lock(join->mu);
      join->group = std::move(group);
      join->error = std::move(error);
      join->ended = true;
    }
    ended();
  }).detach();
  return join;
#else
  unavailable();
#endif
}

std::optional<std::string> Groups::joinedGroupName(Join &join) {
#ifdef RGPU_WITH_GLOO
  std::lock_guard<std::mutex> lock(join.mu);
  if (!join.ended)
    return std::nullopt;
  if (!join.error.empty())
    throw std::runtime_error(join.error);
  std::random_device rd;
  std::uniform_int_distribution<uint64_t> bits;
  char name[40];
  std::snprintf(name, sizeof name, "rgpu-%016llx", static_cast<unsigned long long>(bits(rd)));
  join.group->setGroupName(name);
  c10d::register_process_group(name, join.group);
  s_->held.push_back(std::move(join.group));
  s_->names.insert(name);
  return std::string(name);
#else
  unavailable();
#endif
}

void Groups::cancel(Join &join) { *join.cancelled = true; }

llvm::Error Groups::check(const ir::Graph &graph) const {
  for (const ir::Node &n : graph.nodes) {
    if (!policy::isCollective(n.op.str()))
      continue;
    // The group is the schema's `group_name`; collectives take no lists, so schema arguments
    // and graph arguments line up one to one (Plan checks the rest of the node).
    auto [base, overload] = ir::splitOpName(n.op.str());
    auto handle = c10::Dispatcher::singleton().findSchema({base.str(), overload.str()});
    if (!handle)
      continue;
    const auto &arguments = handle->schema().arguments();
    for (size_t k = 0; k < arguments.size() && k < n.args.size(); ++k) {
      const ir::Arg &a = n.args[k];
      if (arguments[k].name() != "group_name")
        continue;
      std::string name = a.kind == ir::Arg::Kind::Str ? n.strings[a.i] : "";
      if (!s_->names.count(name))
        return failure(n.op.str() + " names the process group '" + name +
                       "', which this session has not joined");
    }
  }
  return llvm::Error::success();
}

int Groups::acceptConnection(int fd, sockaddr *address, socklen_t *length, AcceptFn real) {
  int taken = real(fd, address, length);
#ifdef RGPU_WITH_GLOO
  // Descriptors are taken lowest first, so the one a connection gets says how many are open.
  const int failure = taken < 0 ? errno : 0;
  if (taken < 0 && failure != EMFILE && failure != ENFILE)
    return taken;
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur == RLIM_INFINITY)
    files.rlim_cur = 1 << 20;
  const uint64_t limit = files.rlim_cur;
  if (taken >= 0 && uint64_t(taken) + std::max<uint64_t>(limit / 8, 64) <= limit)
    return taken;
  GlooListeners &l = glooListeners();
  std::lock_guard<std::mutex> lock(l.mu);
  const uint64_t open = taken >= 0 ? uint64_t(taken) : limit;
  if (taken < 0) {
    // Not one descriptor left: the one kept for this takes the connection off the listener.
    if (l.reserve >= 0)
      ::close(l.reserve);
    l.reserve = -1;
    taken = real(fd, nullptr, nullptr);
  }
  if (taken >= 0)
    ::close(taken);
  if (l.reserve < 0)
    l.reserve = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (l.closed.insert(fd).second) {
    std::fprintf(stderr,
                 "rgpu-opserver: %llu of %llu descriptors are open: a Gloo listener of a join "
                 "in progress takes no new connections\n",
                 static_cast<unsigned long long>(open), static_cast<unsigned long long>(limit));
    dropEverything(fd);
  }
  errno = EAGAIN;
  return -1;
#else
  return taken;
#endif
}

} // namespace rgpu::server

