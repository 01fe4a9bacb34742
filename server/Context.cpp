#include "Context.h"
#include "Compiler.h"
#include "ContentStore.h"
#include "Files.h"
#include "Log.h"
#include "Session.h"

#include "rgpu/ir/Error.h"

#include <c10/util/Flags.h>

#include <algorithm>
#include <chrono>

C10_DECLARE_bool(caffe2_cpu_allocator_do_zero_fill);

namespace rgpu::server {

Context::Context(std::vector<c10::Device> devices, wire::Limits limits,
                 std::unique_ptr<Compiler> compiler)
    : devices_(std::move(devices)), limits_(limits), compiler_(std::move(compiler)),
      store_(std::make_unique<ContentStore>("", 0)), files_(std::make_unique<FilesArea>("", 0)) {
  if (devices_.empty())
    devices_.push_back(c10::kCPU);
  // Host memory is reused across sessions: every CPU allocation is zeroed, so no session reads
  // bytes another one left behind (the empty family, kernels that leave parts of an output
  // unwritten, staging buffers). The cost is measured in bench/PlanBench.cpp.
  FLAGS_caffe2_cpu_allocator_do_zero_fill = true;
}

Context::Context(std::vector<c10::Device> devices, wire::Limits limits)
    : Context(std::move(devices), limits, nullptr) {}

size_t Context::graphsCached() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t live = 0;
  for (const auto &entry : plans_)
    live += !entry.second.expired();
  return live;
}

std::shared_ptr<const Plan> Context::find(const ir::Hash256 &hash) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(hash);
  std::shared_ptr<const Plan> plan = it == plans_.end() ? nullptr : it->second.lock();
  if (plan)
    keep(plan);
  return plan;
}

void Context::keep(const std::shared_ptr<const Plan> &plan) {
  if (auto it = recentIndex_.find(plan->hash); it != recentIndex_.end()) {
    recent_.splice(recent_.begin(), recent_, it->second);
    return;
  }
  recent_.push_front(plan);
  recentIndex_[plan->hash] = recent_.begin();
  recentBytes_ += plan->bytes;
  while (recentBytes_ > budgets.planCache && recent_.size() > 1) {
    const std::shared_ptr<const Plan> &last = recent_.back();
    recentBytes_ -= last->bytes;
    recentIndex_.erase(last->hash);
    ++planEvictions;
    recent_.pop_back(); // a session that holds it keeps it alive
  }
  // Entries of plans nobody holds any more, at most one sweep per doubling of the table.
  if (plans_.size() > 2 * sweptAt_ + 64) {
    for (auto it = plans_.begin(); it != plans_.end();)
      it = it->second.expired() ? plans_.erase(it) : std::next(it);
    sweptAt_ = plans_.size();
  }
}

Context::~Context() = default;

void Context::setStore(std::unique_ptr<ContentStore> store) { store_ = std::move(store); }
void Context::setFiles(std::unique_ptr<FilesArea> files) { files_ = std::move(files); }

void Context::activate(const std::string &id, uint64_t connId, const std::string &principal) {
  std::lock_guard<std::mutex> lock(parkMu_);
  active_[id] = {connId, principal};
}

void Context::deactivate(const std::string &id) {
  {
    std::lock_guard<std::mutex> lock(parkMu_);
    active_.erase(id);
  }
  if (wakeDeferred)
    wakeDeferred();
}

bool Context::reserveWait(const std::string &principal) {
  std::lock_guard<std::mutex> lock(parkMu_);
  size_t &n = pendingWaits_[principal];
  if (n >= kMaxWaits)
    return false;
  ++n;
  return true;
}

void Context::releaseWait(const std::string &principal) {
  std::lock_guard<std::mutex> lock(parkMu_);
  auto it = pendingWaits_.find(principal);
  if (it != pendingWaits_.end() && --it->second == 0)
    pendingWaits_.erase(it);
}

void Context::loseDevice(const std::string &why) {
  std::lock_guard<std::mutex> lock(lostMu_);
  if (!deviceLost_) {
    lostWhy_ = why;
    deviceLost_ = true;
  }
}

std::optional<std::string> Context::deviceLost() {
  if (!deviceLost_)
    return std::nullopt;
  std::lock_guard<std::mutex> lock(lostMu_);
  return lostWhy_;
}

void Context::park(std::unique_ptr<Session> session) {
  std::string id = session->id();
  session->detach();
  std::unique_ptr<Session> replaced, dropped;
  {
    std::lock_guard<std::mutex> lock(parkMu_);
    active_.erase(id);
    Parked &p = parked_[id];
    replaced = std::move(p.session); // a client reusing an id: the older one goes
    p.session = std::move(session);
    p.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(sessionGraceMs);
    if (parked_.size() > maxSessions) { // as many parked as served, at most: the oldest goes
      auto oldest = std::min_element(parked_.begin(), parked_.end(), [](auto &a, auto &b) {
        return a.second.deadline < b.second.deadline;
      });
      dropped = std::move(oldest->second.session);
      parked_.erase(oldest);
    }
  }
  if (wakeDeferred)
    wakeDeferred();
}

Context::Takeover Context::takeParked(const std::string &id, const std::string &principal,
                                      std::unique_ptr<Session> &out) {
  std::lock_guard<std::mutex> lock(parkMu_);
  if (auto it = active_.find(id); it != active_.end()) {
    // Who may have it is checked before its connection is touched.
    if (it->second.principal != principal)
      return Takeover::Absent;
    if (!it->second.closing && closeConnection) {
      it->second.closing = true;
      closeConnection(it->second.connId); // dead to its client: take it over once parked
    }
    return Takeover::Wait;
  }
  auto it = parked_.find(id);
  if (it == parked_.end() || it->second.session->principal() != principal)
    return Takeover::Absent;
  out = std::move(it->second.session);
  parked_.erase(it);
  return Takeover::Taken;
}

size_t Context::expireParked() {
  std::vector<std::unique_ptr<Session>> expired;
  {
    std::lock_guard<std::mutex> lock(parkMu_);
    auto now = std::chrono::steady_clock::now();
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->second.deadline <= now) {
        expired.push_back(std::move(it->second.session));
        it = parked_.erase(it);
      } else {
        ++it;
      }
    }
  }
  sessionsExpired += expired.size();
  return expired.size(); // destroyed here, outside the lock: their tensors are freed
}

size_t Context::sessionsParked() {
  std::lock_guard<std::mutex> lock(parkMu_);
  return parked_.size();
}

std::shared_ptr<memory::Account> Context::openAccount() {
  auto account = std::make_shared<memory::Account>();
  account->quota = budgets.sessionMemory;
  std::lock_guard<std::mutex> lock(accountsMu_);
  accounts_.erase(std::remove_if(accounts_.begin(), accounts_.end(),
                                 [](const auto &a) { return a.first.expired(); }),
                  accounts_.end());
  accounts_.push_back({account, ""});
  return account;
}

void Context::own(const memory::Account &account, const std::string &principal) {
  std::lock_guard<std::mutex> lock(accountsMu_);
  for (auto &[weak, owner] : accounts_)
    if (auto a = weak.lock(); a.get() == &account)
      owner = principal;
}

std::vector<uint64_t> Context::sessionMemories(const std::string &principal) {
  std::vector<uint64_t> held;
  {
    std::lock_guard<std::mutex> lock(accountsMu_);
    for (const auto &[weak, owner] : accounts_)
      if (auto a = weak.lock(); a && owner == principal)
        held.push_back(a->held);
  }
  std::sort(held.rbegin(), held.rend());
  return held;
}

bool Context::onlyPrincipal(const std::string &principal) {
  std::lock_guard<std::mutex> lock(accountsMu_);
  for (const auto &[weak, owner] : accounts_)
    if (!weak.expired() && !owner.empty() && owner != principal)
      return false;
  return true;
}

void Context::stopCompiles() {
  if (compiler_)
    compiler_->shutdown();
}

llvm::Expected<std::shared_ptr<const Plan>> Context::define(const ir::Hash256 &hash,
                                                            ir::Graph graph) {
  if (ir::hashGraph(graph) != hash)
    return failure("the graph does not match its hash " + hash.hex());
  std::shared_ptr<const Plan> known = find(hash);
  if (known && ir::sameStructure(known->graph(), graph))
    return known;
  size_t nodes = graph.nodes.size();
  uint64_t bytes = ir::graphBytes(graph);
  auto start = std::chrono::steady_clock::now();
  auto built = Plan::build(std::move(graph), limits_.maxTensorBytes);
  if (!built)
    return built.takeError();
  std::shared_ptr<Plan> plan = std::move(*built);
  if (plan->maxDevice >= devices_.size())
    return failure("the graph names rgpu:" + std::to_string(plan->maxDevice) +
                   ", and this server has " + std::to_string(devices_.size()) + " device(s)");
  plan->hash = hash;
  plan->bytes = bytes;
  plan->buildNs = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start).count();
  ++planBuilds;
  log("graph " + hash.hex().substr(0, 12) + ": plan built, " + std::to_string(nodes) +
      " nodes, " + std::to_string(plan->buildNs / 1000000.0).substr(0, 6) + " ms");
  if (known) {
    // Another graph with the same hash: a collision, met or made. This one gets a plan of its
    // own, which no other session can reach and which is never compiled (compiled packages
    // are filed by hash).
    plan->shared = false;
    log("graph " + hash.hex().substr(0, 12) + ": another graph has this hash; this one is "
        "private to the session that defined it");
    return plan;
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Two sessions may have built the same new graph at once: the first one filed is shared.
  if (auto it = plans_.find(hash); it != plans_.end())
    if (auto filed = it->second.lock()) {
      if (ir::sameStructure(filed->graph(), plan->graph())) {
        keep(filed);
        return filed;
      }
      plan->shared = false;
      return plan;
    }
  plans_[hash] = plan;
  keep(plan);
  return plan;
}

} // namespace rgpu::server
