#include "Groups.h"

#include "Policy.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <llvm/ADT/StringRef.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>

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

std::string Groups::join(const std::string &store, const std::string &prefix, int rank, int size,
                         const std::string &host, std::chrono::milliseconds timeout) {
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
  c10::intrusive_ptr<c10d::Store> base;
  if (store.empty()) {
    if (!s_->hosted)
      throw std::runtime_error("this session hosts no rendezvous store (hostStore first)");
    base = s_->hosted;
  } else {
    size_t colon = store.rfind(':');
    if (colon == std::string::npos)
      throw std::runtime_error("the rendezvous store '" + store + "' is not host:port");
    int port = std::atoi(store.c_str() + colon + 1);
    if (port <= 0 || port > 65535)
      throw std::runtime_error("the rendezvous store '" + store + "' has no valid port");
    c10d::TCPStoreOptions opts;
    opts.port = uint16_t(port);
    opts.isServer = false;
    opts.timeout = timeout;
    base = c10::make_intrusive<c10d::TCPStore>(store.substr(0, colon), opts);
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("rgpu/" + prefix, base);
  // Gloo listens where the operator said (--store-host), not on whatever the machine's host
  // name resolves to.
  auto options = [&] {
    auto o = c10d::ProcessGroupGloo::Options::create(timeout);
    o->devices = {c10d::ProcessGroupGloo::createDeviceForHostname(host)};
    return o;
  };
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options());
  // Collectives that differ between ranks (a shape, an op) would reach Gloo's I/O thread,
  // which aborts the process on them. So every collective is first checked against the other
  // ranks' through a second, small Gloo group (torch's ProcessGroupWrapper, what
  // TORCH_DISTRIBUTED_DEBUG=DETAIL uses): a mismatch fails that run on every rank.
  auto checks = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("rgpu/" + prefix + "/checks", base), rank, size,
      options());
  auto checked = c10::make_intrusive<c10d::ProcessGroupWrapper>(gloo, checks);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(prefixed, rank, size);
  // Gloo takes CUDA tensors too (through host memory; NCCL would be the fast path).
  for (c10::DeviceType type : {c10::DeviceType::CPU, c10::DeviceType::CUDA})
    group->setBackend(type, c10d::ProcessGroup::BackendType::GLOO, checked);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);

  std::random_device rd;
  std::uniform_int_distribution<uint64_t> bits;
  char name[40];
  std::snprintf(name, sizeof name, "rgpu-%016llx", static_cast<unsigned long long>(bits(rd)));
  group->setGroupName(name);
  c10d::register_process_group(name, group);
  s_->held.push_back(group);
  s_->names.insert(name);
  return name;
#else
  unavailable();
#endif
}

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
