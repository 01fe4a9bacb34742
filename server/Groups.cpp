#include "Groups.h"

#include "Policy.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <llvm/ADT/StringRef.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
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
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace rgpu::server {

struct Groups::State {
#ifdef RGPU_WITH_GLOO
  c10::intrusive_ptr<c10d::Store> hosted;
  /// c10d's registry holds groups weakly: the session holds them.
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> held;
#endif
  std::string hostedAddress;
  std::set<std::string> names;
};

Groups::Groups() : s_(std::make_unique<State>()) {}

Groups::~Groups() {
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

std::string Groups::hostStore(const std::string &host, std::chrono::milliseconds timeout) {
#ifdef RGPU_WITH_GLOO
  if (s_->hosted)
    return s_->hostedAddress; // one store serves every group of the job
  // torch's TCPStore listens on every interface; it is handed a socket bound to \p host alone.
  addrinfo hints{}, *found = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  if (int rc = getaddrinfo(host.c_str(), "0", &hints, &found); rc != 0)
    throw std::runtime_error("the rendezvous store's address '" + host + "' (--store-host): " +
                             gai_strerror(rc));
  int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool bound = fd >= 0 && ::bind(fd, found->ai_addr, found->ai_addrlen) == 0 &&
               ::listen(fd, 128) == 0;
  freeaddrinfo(found);
  if (!bound) {
    std::string why = std::strerror(errno);
    if (fd >= 0)
      ::close(fd);
    throw std::runtime_error("cannot listen on " + host + " for the rendezvous store: " + why);
  }
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  opts.masterListenFd = fd;
  auto store = c10::make_intrusive<c10d::TCPStore>(host, opts);
  s_->hosted = store;
  s_->hostedAddress = host + ":" + std::to_string(store->getPort());
  return s_->hostedAddress;
#else
  unavailable();
#endif
}

#ifdef RGPU_WITH_GLOO
namespace {
/// The job's store under a key prefix, whose blocking reads give up within kCancelPollMs of
/// their join being cancelled (the client left), instead of at the join's timeout.
class CancellableStore : public c10d::PrefixStore {
public:
  CancellableStore(std::string prefix, c10::intrusive_ptr<c10d::Store> base,
                   std::shared_ptr<std::atomic<bool>> cancelled)
      : PrefixStore(std::move(prefix), std::move(base)), cancelled_(std::move(cancelled)) {}

  std::vector<uint8_t> get(const std::string &key) override {
    waitFor({key}, getTimeout());
    return PrefixStore::get(key);
  }
  void wait(const std::vector<std::string> &keys) override { waitFor(keys, getTimeout()); }
  void wait(const std::vector<std::string> &keys,
            const std::chrono::milliseconds &timeout) override {
    waitFor(keys, timeout);
  }
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string> &keys) override {
    waitFor(keys, getTimeout());
    return PrefixStore::multiGet(keys);
  }

private:
  void waitFor(const std::vector<std::string> &keys, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (*cancelled_)
        throw std::runtime_error("the join was cancelled: its client left");
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      try {
        PrefixStore::wait(keys, std::max(std::chrono::milliseconds(1),
                                         std::min(left, std::chrono::milliseconds(
                                                            Groups::kCancelPollMs))));
        return;
      } catch (const c10::DistStoreError &) {
        if (std::chrono::steady_clock::now() >= deadline)
          throw;
      }
    }
  }
  std::shared_ptr<std::atomic<bool>> cancelled_;
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
  c10::intrusive_ptr<c10d::Store> hosted;
  std::string storeHost;
  int port = 0;
  if (store.empty()) {
    if (!s_->hosted)
      throw std::runtime_error("this session hosts no rendezvous store (hostStore first)");
    hosted = s_->hosted;
  } else {
    size_t colon = store.rfind(':');
    if (colon == std::string::npos)
      throw std::runtime_error("the rendezvous store '" + store + "' is not host:port");
    port = std::atoi(store.c_str() + colon + 1);
    if (port <= 0 || port > 65535)
      throw std::runtime_error("the rendezvous store '" + store + "' has no valid port");
    storeHost = store.substr(0, colon);
  }
  auto join = std::make_shared<Join>();
  std::thread([join, hosted, storeHost, port, prefix, rank, size, host, timeout,
               ended = std::move(ended)]() mutable {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    std::string error;
    try {
      c10::intrusive_ptr<c10d::Store> base = hosted;
      if (!base) {
        c10d::TCPStoreOptions opts;
        opts.port = uint16_t(port);
        opts.isServer = false;
        opts.timeout = timeout;
        base = c10::make_intrusive<c10d::TCPStore>(storeHost, opts);
      }
      auto prefixed =
          c10::make_intrusive<CancellableStore>("rgpu/" + prefix, base, join->cancelled);
      // Gloo listens where the operator said (--store-host), not on whatever the machine's
      // host name resolves to.
      auto options = [&] {
        auto o = c10d::ProcessGroupGloo::Options::create(timeout);
        o->devices = {c10d::ProcessGroupGloo::createDeviceForHostname(host)};
        return o;
      };
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options());
      // Collectives that differ between ranks (a shape, an op) would reach Gloo's I/O thread,
      // which aborts the process on them. So every collective is first checked against the
      // other ranks' through a second, small Gloo group (torch's ProcessGroupWrapper, what
      // TORCH_DISTRIBUTED_DEBUG=DETAIL uses): a mismatch fails that run on every rank.
      auto checks = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<CancellableStore>("rgpu/" + prefix + "/checks", base,
                                                join->cancelled),
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

std::optional<std::string> Groups::finish(Join &join) {
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

std::string Groups::check(const ir::Graph &graph) const {
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
        return n.op.str().str() + " names the process group '" + name +
               "', which this session has not joined";
    }
  }
  return "";
}

} // namespace rgpu::server
