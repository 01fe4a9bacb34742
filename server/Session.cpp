#include "Session.h"
#include "Device.h"
#include "Policy.h"

#include "rgpu/net/Auth.h"
#include "rgpu/wire/Planes.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Flags.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <optional>

C10_DECLARE_bool(caffe2_cpu_allocator_do_zero_fill);

namespace rgpu::server {

Context::Context(std::vector<at::Device> devices, wire::Limits limits,
                 std::unique_ptr<Compiler> compiler)
    : devices_(std::move(devices)), limits_(limits), compiler_(std::move(compiler)) {
  if (devices_.empty())
    devices_.push_back(at::kCPU);
  // Host memory is reused across sessions: every CPU allocation is zeroed, so no session reads
  // bytes another one left behind (the empty family, kernels that leave parts of an output
  // unwritten, staging buffers). The cost is measured in bench/PlanBench.cpp.
  FLAGS_caffe2_cpu_allocator_do_zero_fill = true;
}

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

std::shared_ptr<const Plan> Context::define(const ir::Hash256 &hash, ir::Graph graph,
                                            std::string &error) {
  if (ir::hashGraph(graph) != hash) {
    error = "the graph does not match its hash " + hash.hex();
    return nullptr;
  }
  std::shared_ptr<const Plan> known = find(hash);
  if (known && ir::sameStructure(known->graph(), graph))
    return known;
  size_t nodes = graph.nodes.size();
  uint64_t bytes = ir::graphBytes(graph);
  auto start = std::chrono::steady_clock::now();
  std::shared_ptr<Plan> plan = Plan::build(std::move(graph), error, limits_.maxTensorBytes);
  if (!plan)
    return nullptr;
  if (plan->maxDevice >= devices_.size()) {
    error = "the graph names rgpu:" + std::to_string(plan->maxDevice) + ", and this server has " +
            std::to_string(devices_.size()) + " device(s)";
    return nullptr;
  }
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

struct Session::Partial {
  at::Tensor cpu;
  ir::TensorMeta meta;
  uint64_t received = 0;
  uint8_t device = 0;
  ErrorPtr error; ///< Its buffer could not be allocated.
};

Session::Session(Context &ctx, std::string peer, Admission admission, const Signals *signals)
    : ctx_(ctx), peer_(std::move(peer)), admission_(std::move(admission)), signals_(signals) {
  const std::vector<at::Device> &devices = ctx_.devices();
  for (size_t i = 0; i < devices.size(); ++i) {
    auto same = std::find(devices.begin(), devices.begin() + i, devices[i]);
    generators_.push_back(same != devices.begin() + i
                              ? generators_[same - devices.begin()]
                              : at::globalContext().defaultGenerator(devices[i]).clone());
  }
  account_ = ctx_.openAccount();
  ++ctx_.sessions;
}

Session::~Session() {
  if (joining_)
    Groups::cancel(*joining_);
  endWait();
  memory::credit(account_.get(), tensors_.size() * kHandleBytes);
  --ctx_.sessions;
  if (counted_)
    --ctx_.greetedSessions;
  if (!id_.empty())
    ctx_.deactivate(id_);
}

at::Generator &Session::generator(uint64_t id) {
  auto it = explicitGenerators_.find(id);
  if (it == explicitGenerators_.end())
    throw std::runtime_error("rgpu: generator " + std::to_string(id) +
                             " does not exist in this session (made before rgpu.reset()?)");
  return it->second;
}

void Session::fail(ErrorPtr error) {
  if (device::afterError(ctx_.device(), error->message)) {
    ctx_.loseDevice(error->message);
    auto lost = std::make_shared<RemoteError>(*error);
    lost->message += "\n(the CUDA context cannot be used after this error: rgpu-opserver exits "
                     "for its supervisor to restart it, and every session on it is lost)";
    error = std::move(lost);
  }
  if (!pending_)
    pending_ = std::move(error);
}

namespace {
constexpr size_t kSessionIdBytes = 16;

/// An error that belongs to no node: a bad handle, a refused graph, a failed download.
ErrorPtr sessionError(std::string message, std::string pythonType = "") {
  return std::make_shared<RemoteError>(
      RemoteError{"", std::move(message), "", {}, 0, std::move(pythonType)});
}

/// The longest a JoinGroup waits for the group's other servers (its worker waits with it).
constexpr uint32_t kGroupTimeoutMs = 30 * 60 * 1000;
/// A generator state a client may send (a CPU generator's is 5056 bytes, CUDA's 16).
constexpr size_t kMaxRngStateBytes = 64 * 1024;
/// The most torch.Generator(device="rgpu") objects a session may hold at once.
constexpr size_t kMaxGenerators = 4096;

/// One entry of ServerFrame.results, gathered before the reply is built.
struct ResultItem {
  wire::Result::Which kind;
  kj::Array<kj::byte> data;
  std::vector<ir::TensorMeta> metas;
  std::string text;
  uint8_t device = 0; ///< MEMORY: the rgpu device whose figures it gives
  uint64_t seed = 0;  ///< RNG_STATE: the generator's initial seed (its state is in data)
};
} // namespace

FrameOutcome Session::handle(const net::Frame &frame) {
  memory::Charge charge(account_); // what this frame allocates is this session's
  try {
    return serve(frame);
  } catch (const kj::Exception &e) {
    return failure(e.getDescription().cStr());
  } catch (const std::exception &e) {
    return failure(e.what());
  } catch (...) {
    return failure("an unknown exception");
  }
}

FrameOutcome Session::failure(const std::string &why) {
  ended_ = true;
  std::string message = "rgpu-opserver could not serve this session (" + why +
                        "); the session is closed, the server goes on";
  log(peer_ + ": " + message);
  FrameOutcome outcome;
  outcome.close = true;
  try {
    capnp::MallocMessageBuilder reply;
    auto e = reply.initRoot<wire::ServerFrame>().initError();
    e.setMessage(message);
    e.setKind(wire::Error::Kind::PROTOCOL);
    outcome.reply = net::encodeFrame(reply, true);
  } catch (...) {
    // Out of memory even for the error: the closed connection says it.
  }
  return outcome;
}

FrameOutcome Session::serve(const net::Frame &frame) {
  FrameOutcome outcome;
  std::vector<ResultItem> results;
  std::string fatal, serverMac;
  uint64_t seq = 0;
  bool wantReply = false;
  capnp::MallocMessageBuilder reply;
  auto sf = reply.initRoot<wire::ServerFrame>();
  try {
    auto reader = net::openFrame(frame, ctx_.limits());
    auto cf = reader->getRoot<wire::ClientFrame>();
    seq = cf.getSeq();
    wantReply = cf.getWantReply();
    outcome.seq = seq;
    serving_ = seq;
    if (greeted_ && seq != 0 && seq <= lastSeq_) {
      // Sent again after a resume, and executed before: never run twice.
      for (const auto &[kept, bytes] : replies_)
        if (wantReply && kept == seq)
          outcome.reply = *bytes;
      return outcome;
    }
    dropReplies(cf.getReceived());
    auto commands = cf.getCommands();
    if (commands.size() > ctx_.limits().maxCommands)
      fatal = "a frame of " + std::to_string(commands.size()) + " commands, more than the limit of " +
              std::to_string(ctx_.limits().maxCommands);
    uint64_t replyData = 0;
    FrameTail tail{commands, commands.size()};
    for (size_t k = 0; fatal.empty() && k < commands.size(); ++k)
      if (commands[k].isRun())
        tail.lastRun = k;
    size_t index = 0;
    for (auto cmd : commands) {
      const size_t at = index++;
      // A connection that ended has its remaining commands dropped, unless the session waits
      // for a resume: then the frame is run whole, so that a replay never runs half of it.
      if (!fatal.empty() || adopted_ || (signals_ && signals_->closed.load() && !resumable()))
        break;
      if (!greeted_ && cmd.which() != wire::Command::HELLO) {
        fatal = "the first command of a session must be Hello";
        break;
      }
      // A command that fails in a way no node caught (a bad layout in a download, an allocation
      // failure) becomes this session's error; the server and the session go on.
      try {
      switch (cmd.which()) {
      case wire::Command::HELLO:
        results.push_back({wire::Result::HELLO, nullptr, {}});
        hello(cmd.getHello(), fatal, serverMac);
        if (deferHello_) {
          deferHello_ = false;
          outcome.deferred = true;
          return outcome;
        }
        break;
      case wire::Command::DEFINE: define(cmd.getDefine()); break;
      case wire::Command::FORGET: forget(cmd.getForget()); break;
      case wire::Command::BYE: ended_ = true; break;
      case wire::Command::RUN: {
        std::vector<std::vector<ir::TensorMeta>> metas;
        run(cmd.getRun(), metas, at == tail.lastRun ? &tail : nullptr);
        if (cmd.getRun().getReplyMetas())
          results.push_back({wire::Result::METAS, nullptr, std::move(metas[0])});
        break;
      }
      case wire::Command::UPLOAD: upload(cmd.getUpload()); break;
      case wire::Command::DOWNLOAD: {
        ResultItem item{wire::Result::DATA, nullptr, {}};
        if (std::string e = download(cmd.getDownload(), ctx_.limits().maxReplyDataBytes - replyData,
                                     item.data);
            !e.empty())
          fatal = e;
        replyData += item.data.size();
        results.push_back(std::move(item));
        break;
      }
      case wire::Command::RELEASE:
        if (cmd.getRelease().size() > ctx_.limits().maxReleaseHandles) {
          fatal = "a Release of " + std::to_string(cmd.getRelease().size()) +
                  " handles, more than the limit of " +
                  std::to_string(ctx_.limits().maxReleaseHandles);
          break;
        }
        for (uint64_t h : cmd.getRelease())
          release(h);
        break;
      case wire::Command::RELEASE_RANGES: {
        auto ranges = cmd.getReleaseRanges();
        uint64_t total = 0;
        bool ok = ranges.size() % 2 == 0;
        for (size_t k = 1; ok && k < ranges.size(); k += 2)
          ok = (total += std::min<uint64_t>(ranges[k], uint64_t(1) << 32)) <=
               ctx_.limits().maxReleaseHandles;
        if (!ok) {
          fatal = "a Release of ranges that are not pairs or name more than " +
                  std::to_string(ctx_.limits().maxReleaseHandles) + " handles";
          break;
        }
        for (size_t k = 0; k < ranges.size(); k += 2)
          for (uint64_t h = ranges[k], end = ranges[k] + ranges[k + 1]; h != end; ++h)
            release(h);
        break;
      }
      case wire::Command::SEED:
        for (at::Generator &g : generators_) {
          std::lock_guard<std::mutex> lock(g.mutex());
          g.set_current_seed(cmd.getSeed()); // as torch.manual_seed seeds every device
        }
        break;
      case wire::Command::STATS:
        results.push_back({wire::Result::STATS, nullptr, {}});
        break;
      case wire::Command::MEMORY: {
        uint8_t index = cmd.getMemory().getDevice();
        if (index >= ctx_.devices().size()) {
          fatal = "a memory request for rgpu:" + std::to_string(index) + " of a server with " +
                  std::to_string(ctx_.devices().size()) + " devices";
          break;
        }
        device::apply(ctx_.devices()[index], cmd.getMemory(), *account_,
                      ctx_.onlyPrincipal(principal()));
        results.push_back({wire::Result::MEMORY, nullptr, {}});
        results.back().device = index;
        break;
      }
      case wire::Command::RNG_STATE: {
        auto r = cmd.getRngState();
        if (r.getDevice() >= generators_.size()) {
          fatal = "a generator state request for rgpu:" + std::to_string(r.getDevice()) +
                  " of a server with " + std::to_string(generators_.size()) + " devices";
          break;
        }
        if (r.getState().size() > kMaxRngStateBytes) {
          fatal = "a generator state of " + std::to_string(r.getState().size()) +
                  " bytes, more than the limit of " + std::to_string(kMaxRngStateBytes);
          break;
        }
        // The result comes first: a state the generator refuses still gets its (empty) answer,
        // and the error says why.
        results.push_back({wire::Result::RNG_STATE, nullptr, {}});
        at::Generator &g = r.getGenerator() ? generator(r.getGenerator())
                                            : generators_[r.getDevice()];
        std::lock_guard<std::mutex> lock(g.mutex());
        if (r.getSet()) {
          auto bytes = r.getState();
          at::Tensor state = at::empty({int64_t(bytes.size())}, at::kByte);
          if (bytes.size()) // an empty Data reads as a null pointer, which memcpy may not take
            std::memcpy(state.data_ptr(), bytes.begin(), bytes.size());
          g.set_state(state); // checks the size and the values, as torch.cuda.set_rng_state
        }
        at::Tensor state = g.get_state().contiguous();
        results.back().data =
            kj::heapArray<kj::byte>(state.const_data_ptr<uint8_t>(), state.numel());
        results.back().seed = g.current_seed();
        break;
      }
      case wire::Command::GENERATOR: {
        auto r = cmd.getGenerator();
        if (r.getId() == 0) {
          fatal = "a generator request for generator 0";
          break;
        }
        if (r.getDevice() >= generators_.size()) {
          fatal = "a generator request for rgpu:" + std::to_string(r.getDevice()) +
                  " of a server with " + std::to_string(generators_.size()) + " devices";
          break;
        }
        switch (r.which()) {
        case wire::GeneratorRequest::CREATE:
        case wire::GeneratorRequest::CLONE_OF:
        case wire::GeneratorRequest::SNAPSHOT: {
          if (explicitGenerators_.size() >= kMaxGenerators && !explicitGenerators_.count(r.getId()))
            throw std::runtime_error("rgpu: this session holds " + std::to_string(kMaxGenerators) +
                                     " generators, the most a session may; drop some "
                                     "(del generator) first");
          at::Generator g;
          if (r.which() == wire::GeneratorRequest::CREATE) {
            g = at::globalContext().defaultGenerator(ctx_.devices()[r.getDevice()]).clone();
            std::lock_guard<std::mutex> lock(g.mutex());
            g.set_current_seed(r.getCreate());
          } else {
            at::Generator &from = r.which() == wire::GeneratorRequest::SNAPSHOT
                                      ? generators_[r.getDevice()]
                                      : generator(r.getCloneOf());
            std::lock_guard<std::mutex> lock(from.mutex());
            g = from.clone();
          }
          explicitGenerators_[r.getId()] = std::move(g);
          break;
        }
        case wire::GeneratorRequest::RESTORE: {
          at::Generator &from = generator(r.getId()), &to = generators_[r.getDevice()];
          at::Tensor state;
          {
            std::lock_guard<std::mutex> lock(from.mutex());
            state = from.get_state();
          }
          std::lock_guard<std::mutex> lock(to.mutex());
          to.set_state(state);
          break;
        }
        case wire::GeneratorRequest::SEED: {
          at::Generator &g = generator(r.getId());
          std::lock_guard<std::mutex> lock(g.mutex());
          g.set_current_seed(r.getSeed());
          break;
        }
        case wire::GeneratorRequest::DROP: explicitGenerators_.erase(r.getId()); break;
        }
        break;
      }
      case wire::Command::HOST_STORE:
        results.push_back({wire::Result::TEXT, nullptr, {}, {}});
        // The store's keys and values are this session's memory.
        results.back().text =
            groups_.hostStore(ctx_.storeHost, [account = account_](int64_t bytes) {
              try {
                if (bytes > 0)
                  memory::charge(account.get(), uint64_t(bytes));
                else
                  memory::credit(account.get(), uint64_t(-bytes));
                return true;
              } catch (const c10::Error &) {
                return false;
              }
            });
        break;
      case wire::Command::JOIN_GROUP: {
        // It waits for the group's other ranks off the worker pool: its frame is deferred
        // (served again from this command, which must begin it) until the join ends.
        if (at != 0) {
          fatal = "a JoinGroup that does not begin its frame";
          break;
        }
        auto j = cmd.getJoinGroup();
        results.push_back({wire::Result::TEXT, nullptr, {}, {}});
        if (!joining_) {
          if (!ctx_.reserveWait(principal()))
            throw std::runtime_error(
                std::to_string(Context::kMaxWaits) + " joins or resumes of this principal are "
                "waiting already; join once one of them is done");
          holdsWait_ = true;
          try {
            joining_ = groups_.startJoin(
                j.getStore(), j.getPrefix(), int(j.getRank()), int(j.getSize()),
                ctx_.storeHost,
                std::chrono::milliseconds(std::min<uint32_t>(
                    j.getTimeoutMs() ? j.getTimeoutMs() : kGroupTimeoutMs, kGroupTimeoutMs)),
                [&ctx = ctx_] {
                  if (ctx.wakeDeferred)
                    ctx.wakeDeferred();
                });
          } catch (...) {
            endWait();
            throw;
          }
        }
        std::optional<std::string> name;
        try {
          name = groups_.finish(*joining_);
        } catch (...) {
          joining_.reset();
          endWait();
          throw;
        }
        if (!name) {
          outcome.deferred = true;
          return outcome;
        }
        joining_.reset();
        endWait();
        results.back().text = *name;
        log(peer_ + ": joined process group " + *name + " as rank " +
            std::to_string(j.getRank()) + " of " + std::to_string(j.getSize()));
        break;
      }
      case wire::Command::CANCEL: break; // the I/O loop acted on it as it arrived
      case wire::Command::SYNC:
        for (const at::Device &d : ctx_.devices())
          if (d.is_cuda())
            at::detail::getCUDAHooks().deviceSynchronize(d.index());
        results.push_back({wire::Result::DONE, nullptr, {}});
        break;
      default:
        fatal = "unknown command";
      }
      } catch (const kj::Exception &) {
        throw;
      } catch (const std::exception &e) {
        const c10::Error *ce = dynamic_cast<const c10::Error *>(&e);
        fail(sessionError(ce ? ce->what_without_backtrace() : e.what(), pythonTypeOf(e)));
        if (cmd.which() == wire::Command::DOWNLOAD && results.size() &&
            results.back().kind == wire::Result::DATA)
          results.back().data = nullptr;
      }
      if (!fatal.empty())
        break;
    }
  } catch (const kj::Exception &e) {
    fatal = "malformed message: " + std::string(e.getDescription().cStr());
  }

  if (!fatal.empty()) {
    log(peer_ + ": " + fatal + "; closing the connection");
    outcome.close = true;
    ended_ = true;
    wantReply = true;
  }
  if (greeted_ && seq > lastSeq_)
    lastSeq_ = seq;
  if (keys_ && fatal.empty() && (greeted_ || adopted_))
    outcome.keys = std::move(keys_);
  keys_.reset();
  if (!wantReply)
    return outcome;

  sf.setAckSeq(seq);
  auto rs = sf.initResults(results.size());
  for (size_t i = 0; i < results.size(); ++i) {
    ResultItem &item = results[i];
    switch (item.kind) {
    case wire::Result::HELLO: fillHello(rs[i].initHello(), serverMac); break;
    case wire::Result::DATA: rs[i].setData(item.data); break;
    case wire::Result::METAS: {
      auto ms = rs[i].initMetas(item.metas.size());
      for (size_t k = 0; k < item.metas.size(); ++k)
        wire::encodeMeta(item.metas[k], ms[k]);
      break;
    }
    case wire::Result::STATS: stats(rs[i].initStats()); break;
    case wire::Result::MEMORY:
      device::figures(ctx_.devices()[item.device], rs[i].initMemory(), *account_);
      break;
    case wire::Result::TEXT: rs[i].setText(item.text); break;
    case wire::Result::RNG_STATE: {
      auto g = rs[i].initRngState();
      g.setState(item.data);
      g.setInitialSeed(item.seed);
      break;
    }
    default: rs[i].setDone(); break;
    }
  }
  if (!fatal.empty()) {
    auto e = sf.initError();
    e.setMessage(fatal);
    e.setKind(fatalKind_);
  } else if (pending_) {
    auto e = sf.initError();
    e.setOp(pending_->op);
    e.setMessage(pending_->message);
    e.setLocation(pending_->location);
    e.setPythonType(pending_->pythonType);
    wire::encodeHash(pending_->graph, e.initGraph());
    e.setNode(pending_->node);
    pending_.reset();
  }
  if (!notes_.empty()) {
    auto notes = sf.initNotes(notes_.size());
    for (size_t i = 0; i < notes_.size(); ++i)
      notes.set(i, notes_[i]);
    notes_.clear();
  }
  // Tensor bytes are not packed: a mostly-zero tensor packs a thousandfold, and the client bounds
  // how far a packed frame may expand (every result counts, not only the first: a Hello's reply
  // comes before the data of a session's first download).
  uint64_t dataBytes = 0;
  for (const ResultItem &item : results)
    dataBytes += item.data.size();
  outcome.reply = net::encodeFrame(reply, frame.bytes < (1u << 16) && results.size() <= 4 &&
                                              dataBytes < 4096);
  if (adopted_) {
    // The reply the client lost in the drop, if it did, follows the Hello's.
    for (const auto &[kept, bytes] : adopted_->replies_)
      if (kept >= resumeFrom_)
        outcome.resent += *bytes;
    outcome.adopted = std::move(adopted_);
  }
  return outcome;
}

bool Session::FrameTail::frees(uint64_t handle) const {
  for (size_t k = lastRun + 1; k < commands.size(); ++k) {
    auto c = commands[k];
    if (c.isDownload() && c.getDownload().getHandle() == handle)
      return false;
    if (c.isRelease())
      for (uint64_t h : c.getRelease())
        if (h == handle)
          return true;
    if (c.isReleaseRanges()) {
      auto r = c.getReleaseRanges();
      for (size_t i = 0; i + 1 < r.size(); i += 2)
        if (handle - r[i] < r[i + 1])
          return true;
    }
  }
  return false;
}

void Session::bind(uint64_t handle, Entry e) {
  auto [it, fresh] = tensors_.try_emplace(handle);
  if (fresh) {
    // Every handle is charged, a poisoned one too: a Run of a graph the session lacks binds
    // thousands of them for a few bytes of frame.
    try {
      if (tensors_.size() > ctx_.budgets.maxHandles)
        throw std::runtime_error("it holds " + std::to_string(ctx_.budgets.maxHandles) +
                                 " tensor handles, the most a session may (--max-handles)");
      memory::charge(account_.get(), kHandleBytes);
    } catch (const std::exception &ex) {
      tensors_.erase(it);
      const c10::Error *ce = dynamic_cast<const c10::Error *>(&ex);
      throw std::runtime_error("binding tensor handle " + std::to_string(handle) + ": " +
                               (ce ? ce->what_without_backtrace() : ex.what()));
    }
  }
  it->second = std::move(e);
  if (handle == stagedHandle_)
    staged_ = at::Tensor();
}

void Session::release(uint64_t handle) {
  if (tensors_.erase(handle))
    memory::credit(account_.get(), kHandleBytes);
  if (handle == stagedHandle_)
    staged_ = at::Tensor();
}

void Session::keepReply(uint64_t seq, std::shared_ptr<const std::string> reply) {
  constexpr size_t kKeptReplies = 256;
  constexpr uint64_t kKeptReplyBytes = uint64_t(64) << 20;
  replyBytes_ += reply->size();
  replies_.emplace_back(seq, std::move(reply));
  while (replies_.size() > 1 &&
         (replies_.size() > kKeptReplies ||
          replyBytes_ - replies_.back().second->size() > kKeptReplyBytes)) {
    replyBytes_ -= replies_.front().second->size();
    replies_.pop_front();
  }
}

void Session::dropReplies(uint64_t seq) {
  while (!replies_.empty() && replies_.front().first <= seq) {
    replyBytes_ -= replies_.front().second->size();
    replies_.pop_front();
  }
}

void Session::fillHello(wire::HelloReply::Builder h, const std::string &serverMac) {
  auto data = [](const std::string &s) {
    return kj::arrayPtr(reinterpret_cast<const kj::byte *>(s.data()), s.size());
  };
  h.setProtocol(wire::kProtocolVersion);
  h.setTorchVersion(bridge::torchVersion());
  h.setDevice(ctx_.device().str());
  auto devices = h.initDevices(ctx_.devices().size());
  for (size_t i = 0; i < ctx_.devices().size(); ++i)
    devices.set(i, ctx_.devices()[i].str());
  h.setCompiler(ctx_.compiler() ? "inductor" : "plan");
  h.setGraphBudget(ctx_.budgets.graphMemory);
  h.setUploadChunk(ctx_.uploadChunkBytes());
  h.setInstance(data(ctx_.instance));
  h.setSessionGrace(uint32_t(ctx_.sessionGraceMs / 1000));
  if (!serverMac.empty())
    h.setServerMac(data(serverMac));
  if (adopted_) {
    h.setResumed(true);
    h.setLastSeq(adopted_->lastSeq_);
  }
}

void Session::endWait() {
  if (holdsWait_)
    ctx_.releaseWait(principal());
  holdsWait_ = false;
}

void Session::detach() {
  signals_ = nullptr;
  // A join ends when its client leaves; a client that resumes sends its JoinGroup again.
  if (joining_) {
    Groups::cancel(*joining_);
    joining_.reset();
  }
  endWait();
  if (counted_) // a parked session is not served: it holds no place of --max-connections
    --ctx_.greetedSessions;
  counted_ = false;
}

void Session::attach(std::string peer, const Signals *signals) {
  ++ctx_.greetedSessions; // a resume is let in even at the limit: the session exists already
  counted_ = true;
  log(peer + ": resumed the session of " + peer_ + " after its frame " + std::to_string(lastSeq_));
  peer_ = std::move(peer);
  signals_ = signals;
  ++ctx_.resumes;
}

void Session::stats(wire::ServerStats::Builder out) {
  out.setPlanBuilds(ctx_.planBuilds);
  out.setGraphsCached(ctx_.graphsCached());
  out.setGraphRuns(ctx_.graphRuns);
  out.setSessions(ctx_.sessions);
  out.setSessionGraphRuns(runs_);
  out.setSessionExecuteNs(executeNs_);
  out.setSessionTensors(tensors_.size());
  out.setCompiledRuns(ctx_.compiledRuns);
  out.setSessionCompiledRuns(compiledRuns_);
  out.setSessionWritesInPlace(writesInPlace_);
  out.setSessionRunsCancelled(runsCancelled_);
  out.setConnections(ctx_.connectionsOpen);
  out.setConnectionsRefused(ctx_.connectionsRefused);
  out.setSessionMemory(account_->held);
  out.setSessionMemoryPeak(account_->peak);
  out.setSessionMemoryQuota(account_->quota);
  out.setSessionMemoryRefused(account_->refused);
  out.setMemoryHeld(memory::held());
  out.setMemoryKept(memory::kept());
  out.setMemoryLimit(memory::limit());
  std::vector<uint64_t> memories = ctx_.sessionMemories(principal());
  auto ms = out.initSessionMemories(memories.size());
  for (size_t i = 0; i < memories.size(); ++i)
    ms.set(i, memories[i]);
  out.setSessionGraphBytes(graphBytes_);
  out.setGraphBudget(ctx_.budgets.graphMemory);
  out.setGraphsForgotten(graphsForgotten_);
  out.setPlanEvictions(ctx_.planEvictions);
  out.setSessionsParked(ctx_.sessionsParked());
  out.setResumes(ctx_.resumes);
  out.setSessionsExpired(ctx_.sessionsExpired);
  if (Compiler *c = ctx_.compiler()) {
    out.setCompiler("inductor");
    out.setInductorCompiles(c->compiles);
    out.setCompilesPending(c->pending);
    out.setCompileFailures(c->failures);
    out.setDiskCacheHits(c->diskHits);
    out.setCompiledEvictions(c->evictions);
    out.setDiskEvictions(c->diskEvictions);
    out.setCompilesDropped(c->dropped);
  } else {
    out.setCompiler("plan");
  }
  auto graphs = out.initGraphs(used_.size());
  size_t i = 0;
  for (const auto &[hash, use] : used_) {
    auto g = graphs[i++];
    wire::encodeHash(hash, g.initHash());
    g.setNodes(use.nodes);
    g.setRuns(use.runs);
    g.setExecuteNs(use.executeNs);
    g.setBuildNs(use.buildNs);
    g.setExecutor(ctx_.compiler() && use.shared ? ctx_.compiler()->executorOf(hash) : "plan");
    g.setCompiledRuns(use.compiledRuns);
  }
}

void Session::hello(wire::Hello::Reader r, std::string &fatal, std::string &serverMac) {
  if (greeted_) {
    fatal = "a second Hello in one session";
    return;
  }
  // Who the peer is comes first: an unauthenticated peer learns nothing, not even versions.
  if (!admission_.challenge.empty()) {
    auto bytes = [](capnp::Data::Reader d) {
      return std::string(reinterpret_cast<const char *>(d.begin()), d.size());
    };
    std::string nonce = bytes(r.getClientNonce());
    // Every principal's MAC is computed and compared: the time taken says nothing of which.
    const Principal *proved = nullptr;
    if (r.hasAuthMac() && nonce.size() == net::auth::kNonceBytes && admission_.principals)
      for (const Principal &p : *admission_.principals)
        if (net::auth::sameMac(bytes(r.getAuthMac()),
                               net::auth::clientMac(p.token, admission_.challenge, nonce)))
          proved = &p;
    if (!proved) {
      fatalKind_ = wire::Error::Kind::AUTH;
      fatal = r.hasAuthMac() ? "authentication failed: the client's token is not this server's"
                             : "authentication failed: this server needs a token over TCP, and "
                               "the client sent none";
      return;
    }
    serverMac = net::auth::serverMac(proved->token, admission_.challenge, nonce);
    keys_ = net::deriveKeys(proved->token, admission_.challenge, nonce);
    principal_ = proved->name;
  }
  if (r.getProtocol() != wire::kProtocolVersion) {
    fatalKind_ = wire::Error::Kind::VERSION;
    fatal = "version mismatch: client speaks rgpu protocol " + std::to_string(r.getProtocol()) +
            ", this server speaks " + std::to_string(wire::kProtocolVersion);
    return;
  }
  if (r.hasSessionId() && r.getSessionId().size() == kSessionIdBytes) {
    std::string id(reinterpret_cast<const char *>(r.getSessionId().begin()), kSessionIdBytes);
    if (r.getResumeFrom() == 0) {
      id_ = id;
    } else {
      resumeFrom_ = r.getResumeFrom();
      auto now = std::chrono::steady_clock::now();
      Context::Takeover t = deferredSince_ && now - *deferredSince_ > kTakeoverWait
                                ? Context::Takeover::Absent
                                : ctx_.takeParked(id, principal(), adopted_);
      if (t == Context::Takeover::Wait && !holdsWait_) {
        holdsWait_ = ctx_.reserveWait(principal());
        deferredSince_ = now;
        if (!holdsWait_) {
          log(peer_ + ": " + std::to_string(Context::kMaxWaits) +
              " resumes of its principal are waiting already; this one is not resumed");
          t = Context::Takeover::Absent;
        }
      }
      if (t == Context::Takeover::Wait) {
        deferHello_ = true; // served again once the session it takes over is parked
        return;
      }
      endWait();
      if (t == Context::Takeover::Taken)
        return; // this session only answered the Hello; the one it found goes on
      // Answered "not resumed" (the client then says the session is lost), and not resumable.
      log(peer_ + ": asked to resume a session this server does not hold");
    }
  }
  if (++ctx_.greetedSessions > ctx_.maxSessions) {
    --ctx_.greetedSessions;
    fatal = "rgpu-opserver is serving its limit of " + std::to_string(ctx_.maxSessions) +
            " sessions (--max-connections); try again later";
    return;
  }
  greeted_ = counted_ = true;
  ctx_.own(*account_, principal_);
}

void Session::define(wire::Define::Reader r) {
  ir::Hash256 hash = wire::decodeHash(r.getHash());
  if (defined_.count(hash))
    return;
  ir::Graph graph;
  std::string error = wire::decodeGraph(r.getGraph(), ctx_.limits(), graph, policy::admit);
  std::shared_ptr<const Plan> plan;
  const uint64_t budget = ctx_.budgets.graphMemory;
  if (error.empty())
    error = groups_.check(graph);
  if (error.empty()) {
    uint64_t bytes = ir::graphBytes(graph);
    if (budget && graphBytes_ + bytes > budget)
      error = "its " + memory::sizeText(bytes) + " would take this session past its graph "
              "memory of " + memory::sizeText(budget) + " (--graph-memory; it holds " +
              memory::sizeText(graphBytes_) + " in " + std::to_string(defined_.size()) +
              " graphs, and the client forgets the least recently run ones to make room)";
    else
      plan = ctx_.define(hash, std::move(graph), error);
  }
  if (plan) {
    defined_[hash] = plan;
    graphBytes_ += plan->bytes;
    refused_.erase(hash);
    if (ctx_.compiler() && plan->shared && r.hasExecutor() && r.getExecutor().size())
      ctx_.compiler()->prefer(hash, r.getExecutor());
    return;
  }
  log(peer_ + ": refused graph " + hash.hex().substr(0, 12) + ": " + error);
  auto e = sessionError("rgpu-opserver refused the graph: " + error);
  if (refused_.size() >= kMaxRefused) // an earlier refusal's runs then say "unknown graph"
    refused_.erase(refused_.begin());
  refused_[hash] = e;
  fail(e);
}

void Session::forget(capnp::List<wire::Hash>::Reader hashes) {
  for (auto h : hashes) {
    ir::Hash256 hash = wire::decodeHash(h);
    auto it = defined_.find(hash);
    if (it == defined_.end())
      continue;
    graphBytes_ -= it->second->bytes;
    defined_.erase(it);
    used_.erase(hash);
    lastRuns_.erase(hash);
    ++graphsForgotten_;
  }
}

std::string Session::runArgs(wire::Run::Reader r, const ir::Hash256 &hash, const ir::Graph &g,
                             std::vector<uint64_t> &inputs,
                             llvm::SmallVectorImpl<ir::ScalarValue> &scalars,
                             std::vector<uint32_t> &restores) {
  auto table = r.getScalars();
  // The previous run is forgotten whatever goes wrong here: a later relative Run then fails
  // too, loudly, instead of running on handles the two sides no longer agree on.
  std::optional<LastRun> previous;
  if (auto last = lastRuns_.find(hash); last != lastRuns_.end()) {
    previous = std::move(last->second);
    lastRuns_.erase(last);
  }
  if (!r.getRelative()) {
    if (r.getInputs().size() != g.inputs.size() || table.size() != g.scalars.size())
      return "the wrong number of inputs or scalars";
    for (uint64_t h : r.getInputs())
      inputs.push_back(h);
    for (auto s : table)
      scalars.push_back(wire::decodeScalar(s));
  } else {
    if (!previous)
      return "relative to a run this session has not made";
    if (previous->inputs.size() != g.inputs.size() || previous->scalars.size() != g.scalars.size())
      return "relative to a run of another shape";
    auto deltas = r.getInputDeltas();
    if (deltas.size() % 2)
      return "input deltas are not (delta, count) pairs";
    for (size_t k = 0; k < deltas.size(); k += 2) {
      const uint64_t count = uint64_t(deltas[k + 1]);
      if (count > g.inputs.size() - inputs.size())
        return "more input deltas than inputs";
      for (uint64_t j = 0; j < count; ++j)
        inputs.push_back(previous->inputs[inputs.size()] + uint64_t(deltas[k]));
    }
    if (inputs.size() != g.inputs.size())
      return "fewer input deltas than inputs";
    scalars.assign(previous->scalars.begin(), previous->scalars.end());
    auto slots = r.getChangedSlots();
    auto values = r.getChangedValues();
    if (slots.size() != values.size())
      return "changed scalar slots and values differ in number";
    for (size_t k = 0; k < slots.size(); ++k) {
      if (slots[k] >= scalars.size() || values[k] >= table.size())
        return "a changed scalar out of range";
      scalars[slots[k]] = wire::decodeScalar(table[values[k]]);
    }
  }
  if (r.hasRestores() || !r.getRelative()) {
    auto rs = r.getRestores();
    if (rs.size() % 2 != 0 || rs.size() / 2 > g.outputs.size())
      return "restores that are not (output, input) pairs, or more of them than outputs";
    restores.clear();
    for (uint32_t v : rs)
      restores.push_back(v);
  } else {
    restores = std::move(previous->restores);
  }
  for (size_t k = 0; k < restores.size(); k += 2)
    if (restores[k] >= g.outputs.size() || restores[k + 1] >= g.inputs.size())
      return "a restore out of range";
  lastRuns_[hash] = LastRun{inputs, {scalars.begin(), scalars.end()}, restores};
  return "";
}

void Session::run(wire::Run::Reader r, std::vector<std::vector<ir::TensorMeta>> &metas,
                  const FrameTail *tail) {
  metas.assign(1, {});
  ir::Hash256 hash = wire::decodeHash(r.getHash());
  // Only graphs this session defined: a Run cannot learn whether another session defined one.
  auto defined = defined_.find(hash);
  std::shared_ptr<const Plan> plan = defined == defined_.end() ? nullptr : defined->second;
  uint64_t first = r.getFirstOutput();
  auto poisonAll = [&](ErrorPtr e, size_t count) {
    for (size_t k = 0; k < count; ++k)
      bind(first + k, {at::Tensor(), e});
  };
  if (!plan) {
    // Refused at Define (that error stays with its outputs) or never defined.
    auto refused = refused_.find(hash);
    ErrorPtr e = refused != refused_.end() ? refused->second
                                           : sessionError("unknown graph " + hash.hex());
    fail(e);
    // Without a graph there is no output count to check numOutputs against: poison at most
    // the limit, so a 100-byte Run cannot bind millions of handles.
    poisonAll(e, std::min<uint64_t>(r.getNumOutputs(), ctx_.limits().maxRunOutputs));
    return;
  }
  const ir::Graph &g = plan->graph();
  std::vector<uint64_t> handles;
  llvm::SmallVector<ir::ScalarValue, 8> scalars;
  std::vector<uint32_t> restores;
  std::string argError = runArgs(r, hash, g, handles, scalars, restores);
  if (argError.empty() && r.getNumOutputs() != g.outputs.size())
    argError = "the wrong number of outputs";
  if (!argError.empty()) {
    auto e = sessionError("run of graph " + hash.hex().substr(0, 12) + ": " + argError);
    fail(e);
    poisonAll(e, g.outputs.size());
    return;
  }
  // A symbolic graph's layouts and size-derived arguments for this run's sizes.
  Shapes shapes;
  const Shapes *sized = nullptr;
  llvm::SmallVector<int64_t, 4> symbols;
  if (plan->symbolic() || r.getSymbols().size() != 0) {
    for (int64_t v : r.getSymbols())
      symbols.push_back(v);
    ErrorPtr e = plan->symbolic() ? plan->resolve(symbols, shapes)
                                  : sessionError("run of graph " + hash.hex().substr(0, 12) +
                                                 ": size symbols for a static graph");
    if (e) {
      fail(e);
      poisonAll(e, g.outputs.size());
      return;
    }
    sized = &shapes;
  }
  std::vector<Entry> inputs;
  inputs.reserve(g.inputs.size());
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    uint64_t h = handles[i];
    auto it = tensors_.find(h);
    if (it == tensors_.end()) {
      auto e = sessionError("unknown tensor handle " + std::to_string(h));
      fail(e);
      poisonAll(e, g.outputs.size());
      return;
    }
    Entry in = it->second;
    const ir::TensorMeta &m = sized ? *sized->metas[i] : g.inputs[i];
    if (!in.error && (in.tensor.sizes() != c10::IntArrayRef(m.sizes) ||
                      in.tensor.scalar_type() != bridge::scalarType(m.dtype))) {
      auto e = sessionError("tensor handle " + std::to_string(h) + " does not match input " +
                             std::to_string(i) + " " + m.str());
      fail(e);
      poisonAll(e, g.outputs.size());
      return;
    }
    if (!in.error)
      in.tensor = restride(in.tensor, m);
    inputs.push_back(std::move(in));
  }
  if (cancelling()) {
    cancelRun(first, handles, g.outputs.size(), restores,
              std::make_shared<RemoteError>(RemoteError{
                  "", "cancelled (Ctrl-C or rgpu.cancel()) before this graph ran",
                  g.nodes.empty() ? "" : g.locations[g.nodes.back().loc], hash,
                  uint32_t(g.nodes.empty() ? 0 : g.nodes.size() - 1), RemoteError::kCancelled}));
    return;
  }
  std::vector<Entry> outputs;
  ++ctx_.graphRuns;
  GraphUse &use = used_[hash];
  use.nodes = g.nodes.size();
  use.buildNs = plan->buildNs;
  use.shared = plan->shared;
  // Compiled code runs only when every input holds a value (the plan propagates errors node by
  // node) and the output layouts are known (not the data-dependent path). Inductor compiles
  // for rgpu:0's device: a graph on another one runs on the plan.
  std::shared_ptr<const CompiledGraph> compiled;
  bool queued = false;
  auto onCompilerDevice = [&] {
    for (uint32_t d = 0; d <= plan->maxDevice; ++d)
      if (ctx_.devices()[d] != ctx_.device())
        return false;
    return std::all_of(inputs.begin(), inputs.end(),
                       [&](const Entry &e) { return e.tensor.device() == ctx_.device(); });
  };
  if (ctx_.compiler() && plan->shared && !r.getReplyMetas() &&
      std::none_of(inputs.begin(), inputs.end(), [](const Entry &e) { return bool(e.error); }) &&
      onCompilerDevice())
    compiled = ctx_.compiler()->lookup(plan, scalars, symbols, inputs, queued);
  auto name = [&] { return "graph " + hash.hex().substr(0, 12); };
  if (queued)
    notes_.push_back(name() + " (" + std::to_string(g.nodes.size()) +
                     " nodes) is compiling with Inductor on the server; until it is ready it "
                     "runs on the plan executor");
  auto start = std::chrono::steady_clock::now();
  bool ran = false;
  if (compiled) {
    // An input the compiled code writes, released later in this frame with nothing reading it
    // in between, is released now: its buffer can take the write if nothing else holds it (an
    // input given twice holds it twice: CompiledGraph::run counts references).
    if (tail)
      for (auto [o, i] : compiled->writes())
        if (tail->frees(handles[i]))
          release(handles[i]);
    try {
      compiled->run(*plan, inputs, scalars, outputs, sized, &writesInPlace_);
      ran = true;
      ++ctx_.compiledRuns;
      ++compiledRuns_;
      if (use.compiledRuns++ == 0)
        notes_.push_back(name() + " now runs Inductor-compiled code");
    } catch (const std::exception &e) {
      // Rerun on the plan, which names the failing op and the user's line.
      const c10::Error *ce = dynamic_cast<const c10::Error *>(&e);
      log(peer_ + ": " + name() + ": compiled run failed (" +
          (ce ? ce->what_without_backtrace() : e.what()) + "); running it on the plan executor");
    }
  }
  if (!ran) {
    ErrorPtr e = plan->run(inputs, scalars,
                           {ctx_.devices(), generators_, &explicitGenerators_,
                            [this] { return cancelling(); }},
                           outputs, !r.getReplyMetas(), sized);
    if (e && e->cancelled()) {
      cancelRun(first, handles, g.outputs.size(), restores, e);
      return;
    }
    if (e)
      fail(e);
  }
  uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - start).count();
  ++use.runs;
  use.executeNs += ns;
  ++runs_;
  executeNs_ += ns;
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (r.getReplyMetas()) {
      ir::TensorMeta m;
      if (outputs[k].tensor.defined())
        m = bridge::metaOf(outputs[k].tensor);
      metas[0].push_back(std::move(m));
    }
    bind(first + k, std::move(outputs[k]));
  }
}

void Session::cancelRun(uint64_t first, llvm::ArrayRef<uint64_t> inputs, size_t outputs,
                        llvm::ArrayRef<uint32_t> restores, ErrorPtr why) {
  // runArgs checked the pairs against the graph, run() that every input is bound.
  std::vector<Entry> bound(outputs, Entry{at::Tensor(), why});
  for (size_t k = 0; k + 1 < restores.size(); k += 2)
    if (auto it = tensors_.find(inputs[restores[k + 1]]); it != tensors_.end())
      bound[restores[k]] = it->second;
  for (size_t k = 0; k < outputs; ++k)
    bind(first + k, std::move(bound[k]));
  ++runsCancelled_;
}

void Session::upload(wire::Upload::Reader r) {
  uint64_t handle = r.getHandle();
  ir::TensorMeta meta;
  auto data = r.getData();
  const uint64_t total = r.getTotal(), offset = r.getOffset();
  // The bytes this chunk brings: data itself, or what it decodes to (rgpu/wire/Planes.h).
  const bool packed = r.getEncoding() == 1;
  const uint64_t length = packed ? r.getLength() : data.size();
  auto found = partial_.find(handle);
  Partial *earlier = found == partial_.end() ? nullptr : found->second.get();
  // Exact bounds that cannot wrap, and every chunk after the first agrees with it on meta and
  // total (the buffer was allocated for the first).
  std::string why;
  if (!wire::decodeMeta(r.getMeta(), meta) || meta.storageBytes() < 0)
    why = "its tensor meta is malformed";
  else if (r.getDevice() >= ctx_.devices().size())
    why = "it names rgpu:" + std::to_string(r.getDevice()) + ", and this server has " +
          std::to_string(ctx_.devices().size()) + " device(s)";
  else if (uint64_t(meta.storageBytes()) > ctx_.limits().maxTensorBytes)
    why = "its " + std::to_string(meta.storageBytes() >> 20) +
          " MiB are more than this server's limit per tensor";
  else if (uint64_t(meta.storageBytes()) != total)
    why = "its total of " + std::to_string(total) + " bytes is not its meta's " +
          std::to_string(meta.storageBytes());
  else if (r.getEncoding() > 1)
    why = "its encoding " + std::to_string(r.getEncoding()) + " is unknown";
  else if (packed && length > ctx_.limits().uploadChunkBytes)
    why = "its chunk decodes to " + std::to_string(length) + " bytes, more than a chunk's " +
          std::to_string(ctx_.limits().uploadChunkBytes);
  else if (offset > total || length > total - offset)
    why = "its chunk at offset " + std::to_string(offset) + " of " + std::to_string(length) +
          " bytes ends past the total";
  else if (offset != 0 && (!earlier || !(earlier->meta == meta) || earlier->device != r.getDevice()))
    why = "a chunk at offset " + std::to_string(offset) +
          (earlier ? " disagrees with the first chunk's meta or device"
                   : " came without a first chunk");
  else if (offset != 0 && offset != earlier->received)
    why = "its chunk at offset " + std::to_string(offset) + " does not follow the " +
          std::to_string(earlier->received) + " bytes received"; // chunks cover every byte once
  auto refuse = [&] {
    partial_.erase(handle);
    auto e = sessionError("malformed upload for handle " + std::to_string(handle) + ": " + why);
    fail(e);
    bind(handle, {at::Tensor(), e});
  };
  if (!why.empty())
    return refuse();
  auto &part = partial_[handle];
  if (offset == 0) {
    part = std::make_unique<Partial>();
    part->meta = meta;
    part->device = r.getDevice();
    try {
      part->cpu = at::empty_strided(meta.sizes, meta.strides,
                                    at::TensorOptions()
                                        .dtype(bridge::scalarType(meta.dtype))
                                        .pinned_memory(device::pinned(ctx_.devices()[part->device])));
    } catch (const c10::Error &e) {
      // Over a quota, or out of memory: the upload's chunks are taken and dropped, and its
      // handle holds the error; the session goes on.
      part->error = sessionError("upload of " + memory::sizeText(total) + " for handle " +
                                     std::to_string(handle) + ": " + e.what_without_backtrace(),
                                 pythonTypeOf(e));
      fail(part->error);
    }
  }
  if (length && !part->error) {
    auto *at = static_cast<uint8_t *>(part->cpu.data_ptr()) + offset;
    if (!packed) {
      std::memcpy(at, data.begin(), length);
    } else if (!wire::decodePlanes(data.begin(), data.size(), at, length,
                                   ir::dtype::itemSize(meta.dtype), why)) {
      return refuse();
    }
  }
  part->received += length;
  if (part->received < r.getTotal())
    return;
  if (part->error) {
    bind(handle, {at::Tensor(), part->error});
    partial_.erase(handle);
    return;
  }
  Entry e;
  try {
    const at::Device &dev = ctx_.devices()[part->device];
    e.tensor = dev.is_cpu() ? part->cpu : device::toDevice(part->cpu, dev);
  } catch (const c10::Error &err) { // CUDA out of memory
    e.error = sessionError("upload of " + memory::sizeText(total) + " for handle " +
                               std::to_string(handle) + ": " + err.what_without_backtrace(),
                           pythonTypeOf(err));
    fail(e.error);
  }
  partial_.erase(handle);
  bind(handle, std::move(e));
}

std::string Session::download(wire::Download::Reader r, uint64_t room, kj::Array<kj::byte> &bytes) {
  uint64_t handle = r.getHandle();
  auto it = tensors_.find(handle);
  if (it == tensors_.end()) {
    fail(sessionError("download of unknown tensor handle " + std::to_string(handle)));
    return "";
  }
  if (it->second.error) {
    fail(it->second.error);
    return "";
  }
  ir::TensorMeta meta;
  const at::Tensor &t = it->second.tensor;
  if (!wire::decodeMeta(r.getMeta(), meta) || t.sizes() != c10::IntArrayRef(meta.sizes) ||
      t.scalar_type() != bridge::scalarType(meta.dtype)) {
    fail(sessionError("download of handle " + std::to_string(handle) +
                       " asks for a layout that does not match the tensor"));
    return "";
  }
  const uint64_t total = meta.storageBytes(), offset = r.getOffset();
  const uint64_t length = r.getLength() ? r.getLength() : total - std::min(offset, total);
  if (offset > total || length > total - offset || length > ctx_.limits().maxDownloadBytes) {
    fail(sessionError("download of handle " + std::to_string(handle) + " asks for bytes [" +
                      std::to_string(offset) + ", +" + std::to_string(length) +
                      ") outside its " + std::to_string(total) + " bytes or above one chunk"));
    return "";
  }
  if (length > room) {
    fail(sessionError("download of handle " + std::to_string(handle) + " would take this reply past " +
                      std::to_string(ctx_.limits().maxReplyDataBytes >> 20) +
                      " MiB of tensor data; ask for it in another frame"));
    return "";
  }
  // The tensor in the wanted layout on the CPU: the stored tensor itself when it already is
  // that (not a ZeroTensor, which autograd makes for zero gradients: it has no storage), else
  // a copy, staged while its chunks are read.
  at::Tensor cpu;
  if (t.device().is_cpu() && t.strides().equals(meta.strides) && t.storage_offset() == 0 &&
      !t.is_conj() && !t.is_neg() && !t._is_zerotensor() && t.is_non_overlapping_and_dense() &&
      t.has_storage() && t.const_data_ptr()) {
    cpu = t;
  } else if (staged_.defined() && stagedHandle_ == handle && offset != 0) {
    cpu = staged_;
  } else {
    cpu = at::empty_strided(meta.sizes, meta.strides,
                            at::TensorOptions().dtype(t.scalar_type()).pinned_memory(device::pinned(t.device())));
    if (t.device().is_cpu())
      cpu.copy_(t);
    else
      device::toHost(t, cpu);
    if (offset + length < total) {
      stagedHandle_ = handle;
      staged_ = cpu;
    }
  }
  if (offset + length >= total && stagedHandle_ == handle)
    staged_ = at::Tensor();
  bytes = kj::heapArray<kj::byte>(length);
  if (length)
    std::memcpy(bytes.begin(), static_cast<const char *>(cpu.data_ptr()) + offset, length);
  return "";
}

} // namespace rgpu::server
