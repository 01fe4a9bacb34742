//===- server/Session.cpp - Serving a session's frames ---------------------===//
//
// A frame's commands in order, each handed to its handler; the reply; the Hello and resuming;
// the session's random state, memory figures and process groups. Graphs and tensors (Define,
// Run, Upload, Download, Release) are in Tensors.cpp.
//
//===----------------------------------------------------------------------===//
#include "Session.h"
#include "Compiler.h"
#include "ContentStore.h"
#include "Device.h"
#include "Results.h"

#include "rgpu/net/Auth.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>

namespace rgpu::server {

namespace {
constexpr size_t kSessionIdBytes = 16;
/// The longest a JoinGroup waits for the group's other servers (its worker waits with it).
constexpr uint32_t kGroupTimeoutMs = 30 * 60 * 1000;
/// A generator state a client may send (a CPU generator's is 5056 bytes, CUDA's 16).
constexpr size_t kMaxRngStateBytes = 64 * 1024;
/// The most torch.Generator(device="rgpu") objects a session may hold at once.
constexpr size_t kMaxGenerators = 4096;
/// How long a resume Hello waits for the session it takes over to be parked.
constexpr auto kTakeoverWait = std::chrono::seconds(30);

template <class... F> struct Overloaded : F... {
  using F::operator()...;
};
template <class... F> Overloaded(F...) -> Overloaded<F...>;
} // namespace

ErrorPtr sessionError(std::string message, std::string pythonType) {
  return std::make_shared<RemoteError>(
      RemoteError{"", std::move(message), "", {}, 0, std::move(pythonType)});
}

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

FrameOutcome Session::handle(const net::Frame &frame) {
  memory::Charge charge(account_); // what this frame allocates is this session's
  try {
    return serve(frame);
  } catch (const kj::Exception &e) {
    return endSession(e.getDescription().cStr());
  } catch (const std::exception &e) {
    return endSession(e.what());
  } catch (...) {
    return endSession("an unknown exception");
  }
}

FrameOutcome Session::serve(const net::Frame &frame) {
  FrameOutcome outcome;
  Reply reply;
  std::optional<ProtocolError> violation;
  try {
    auto message = net::openFrame(frame, ctx_.limits());
    auto cf = message->getRoot<wire::ClientFrame>();
    outcome.seq = serving_ = cf.getSeq();
    reply.wanted = cf.getWantReply();
    if (greeted_ && outcome.seq != 0 && outcome.seq <= lastSeq_)
      return replay(outcome.seq, reply.wanted);
    dropReplies(cf.getReceived());
    const FrameTail tail = FrameTail::of(cf.getCommands(), ctx_.limits());
    for (size_t at = 0; at < tail.commands.size() && !dropsCommands(); ++at) {
      wire::Command::Reader cmd = tail.commands[at];
      if (!greeted_ && !cmd.isHello())
        throw ProtocolError{"the first command of a session must be Hello"};
      try {
        switch (cmd.which()) {
        case wire::Command::HELLO: handleHello(cmd.getHello(), reply); break;
        case wire::Command::DEFINE: handleDefine(cmd.getDefine()); break;
        case wire::Command::FORGET: handleForget(cmd.getForget()); break;
        case wire::Command::BYE: ended_ = true; break;
        case wire::Command::RUN: handleRun(cmd.getRun(), at == tail.lastRun ? &tail : nullptr, reply); break;
        case wire::Command::UPLOAD: handleUpload(cmd.getUpload()); break;
        case wire::Command::DOWNLOAD: handleDownload(cmd.getDownload(), reply); break;
        case wire::Command::RELEASE_RANGES: handleReleaseRanges(cmd.getReleaseRanges()); break;
        case wire::Command::SEED: handleSeed(cmd.getSeed()); break;
        case wire::Command::STATS: reply.add(result::Stats{}); break;
        case wire::Command::MEMORY: handleMemory(cmd.getMemory(), reply); break;
        case wire::Command::RNG_STATE: handleRngState(cmd.getRngState(), reply); break;
        case wire::Command::GENERATOR: handleGenerator(cmd.getGenerator()); break;
        case wire::Command::HOST_STORE: handleHostStore(reply); break;
        case wire::Command::JOIN_GROUP: handleJoinGroup(cmd.getJoinGroup(), at, reply); break;
        case wire::Command::CANCEL: break; // the I/O loop acted on it as it arrived
        case wire::Command::SYNC: handleSync(reply); break;
        case wire::Command::HAS_CONTENT: handleHasContent(cmd.getHasContent(), reply); break;
        case wire::Command::FILE: handleFile(cmd.getFile(), reply); break;
        default: throw ProtocolError{"unknown command"};
        }
      } catch (const std::exception &e) {
        failCommand(e);
      }
      if (reply.deferred) {
        outcome.deferred = true; // nothing of the frame is answered or counted yet
        return outcome;
      }
    }
  } catch (const kj::Exception &e) {
    violation = ProtocolError{"malformed message: " + std::string(e.getDescription().cStr())};
  } catch (const ProtocolError &e) {
    violation = e;
  }
  return finish(frame, std::move(outcome), reply, violation);
}

Session::FrameTail Session::FrameTail::of(capnp::List<wire::Command>::Reader commands,
                                          const wire::Limits &limits) {
  if (commands.size() > limits.maxCommands)
    throw ProtocolError{"a frame of " + std::to_string(commands.size()) +
                        " commands, more than the limit of " + std::to_string(limits.maxCommands)};
  FrameTail tail{commands, commands.size()};
  for (size_t k = 0; k < commands.size(); ++k)
    if (commands[k].isRun())
      tail.lastRun = k;
  return tail;
}

bool Session::dropsCommands() const {
  // A connection that ended has its remaining commands dropped, unless the session waits for
  // a resume: then the frame is run whole, so that a replay never runs half of it.
  return adopted_ || (signals_ && signals_->closed && !resumable());
}

void Session::failCommand(const std::exception &e) {
  if (const auto *fe = dynamic_cast<const FileError *>(&e))
    return fail(sessionError(fe->what(), fe->pythonType));
  const c10::Error *ce = dynamic_cast<const c10::Error *>(&e);
  fail(sessionError(ce ? ce->what_without_backtrace() : e.what(), pythonTypeOf(e)));
}

FrameOutcome Session::replay(uint64_t seq, bool wantReply) {
  // Sent again after a resume, and executed before: never run twice.
  FrameOutcome outcome;
  outcome.seq = seq;
  for (const auto &[kept, bytes] : replies_)
    if (wantReply && kept == seq)
      outcome.reply = *bytes;
  return outcome;
}

FrameOutcome Session::finish(const net::Frame &frame, FrameOutcome outcome, Reply &reply,
                             const std::optional<ProtocolError> &violation) {
  if (violation) {
    log(peer_ + ": " + violation->message + "; closing the connection");
    outcome.close = true;
    ended_ = true;
    reply.wanted = true;
  }
  if (greeted_ && outcome.seq > lastSeq_)
    lastSeq_ = outcome.seq;
  if (keys_ && !violation && (greeted_ || adopted_))
    outcome.keys = std::move(keys_);
  keys_.reset();
  if (!reply.wanted)
    return outcome;

  capnp::MallocMessageBuilder message;
  auto sf = message.initRoot<wire::ServerFrame>();
  sf.setAckSeq(outcome.seq);
  auto rs = sf.initResults(reply.results.size());
  // Tensor bytes are not packed: a mostly-zero tensor packs a thousandfold, and the client
  // bounds how far a packed frame may expand (every result counts, not only the first: a
  // Hello's reply comes before the data of a session's first download).
  uint64_t dataBytes = 0;
  for (size_t i = 0; i < reply.results.size(); ++i) {
    wire::Result::Builder out = rs[i];
    std::visit(Overloaded{
                   [&](result::Hello &h) { fillHello(out.initHello(), h.serverMac); },
                   [&](result::Data &d) {
                     out.setData(d.bytes);
                     dataBytes += d.bytes.size();
                   },
                   [&](result::Metas &m) {
                     auto ms = out.initMetas(m.metas.size());
                     for (size_t k = 0; k < m.metas.size(); ++k)
                       wire::encodeMeta(m.metas[k], ms[k]);
                   },
                   [&](result::Stats &) { stats(out.initStats()); },
                   [&](result::Memory &m) {
                     device::figures(ctx_.devices()[m.device], out.initMemory(), *account_);
                   },
                   [&](result::Text &t) { out.setText(t.text); },
                   [&](result::RngState &s) {
                     auto g = out.initRngState();
                     g.setState(s.state);
                     g.setInitialSeed(s.initialSeed);
                     dataBytes += s.state.size();
                   },
                   [&](result::Done &) { out.setDone(); },
                   [&](result::Present &p) {
                     auto ps = out.initPresent(p.present.size());
                     for (size_t k = 0; k < p.present.size(); ++k)
                       ps.set(k, p.present[k]);
                   },
                   [&](result::Files &f) {
                     auto es = out.initFiles(f.entries.size());
                     for (size_t k = 0; k < f.entries.size(); ++k) {
                       es[k].setName(f.entries[k].name);
                       es[k].setSize(f.entries[k].size);
                       es[k].setDirectory(f.entries[k].directory);
                     }
                   },
                   [&](result::Records &r) {
                     auto rs = out.initRecords(r.records.size());
                     for (size_t k = 0; k < r.records.size(); ++k) {
                       const auto &rec = r.records[k];
                       rs[k].setName(rec.name);
                       if (rec.handle) {
                         auto t = rs[k].initTensor();
                         t.setHandle(*rec.handle);
                         wire::encodeMeta(
                             ir::TensorMeta::contiguous(ir::dtype::Byte, {int64_t(rec.size)}),
                             t.initMeta());
                       } else {
                         rs[k].setData(kj::arrayPtr(
                             reinterpret_cast<const kj::byte *>(rec.data.data()), rec.data.size()));
                         dataBytes += rec.data.size();
                       }
                     }
                   },
               },
               reply.results[i]);
  }
  if (violation) {
    auto e = sf.initError();
    e.setMessage(violation->message);
    e.setKind(violation->kind);
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
  outcome.reply = net::encodeFrame(message, frame.bytes < (1u << 16) &&
                                                reply.results.size() <= 4 && dataBytes < 4096);
  if (adopted_) {
    // The reply the client lost in the drop, if it did, follows the Hello's.
    for (const auto &[kept, bytes] : adopted_->replies_)
      if (kept >= resumeFrom_)
        outcome.resent += *bytes;
    outcome.adopted = std::move(adopted_);
  }
  return outcome;
}

FrameOutcome Session::endSession(const std::string &why) {
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

//===----------------------------------------------------------------------===//
// The Hello and resuming
//===----------------------------------------------------------------------===//

void Session::handleHello(wire::Hello::Reader r, Reply &reply) {
  std::string &serverMac = reply.add(result::Hello{}).serverMac;
  if (greeted_)
    throw ProtocolError{"a second Hello in one session"};
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
    if (!proved)
      throw ProtocolError{r.hasAuthMac()
                              ? "authentication failed: the client's token is not this server's"
                              : "authentication failed: this server needs a token over TCP, "
                                "and the client sent none",
                          wire::Error::Kind::AUTH};
    serverMac = net::auth::serverMac(proved->token, admission_.challenge, nonce);
    keys_ = net::deriveKeys(proved->token, admission_.challenge, nonce);
    principal_ = proved->name;
  }
  if (r.getProtocol() != wire::kProtocolVersion)
    throw ProtocolError{"version mismatch: client speaks rgpu protocol " +
                            std::to_string(r.getProtocol()) + ", this server speaks " +
                            std::to_string(wire::kProtocolVersion),
                        wire::Error::Kind::VERSION};
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
        reply.deferred = true; // served again once the session it takes over is parked
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
    throw ProtocolError{"rgpu-opserver is serving its limit of " +
                        std::to_string(ctx_.maxSessions) +
                        " sessions (--max-connections); try again later"};
  }
  greeted_ = counted_ = true;
  ctx_.own(*account_, principal_);
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

//===----------------------------------------------------------------------===//
// Random state, memory figures, statistics
//===----------------------------------------------------------------------===//

at::Generator &Session::generator(uint64_t id) {
  auto it = explicitGenerators_.find(id);
  if (it == explicitGenerators_.end())
    throw SessionError("rgpu: generator " + std::to_string(id) +
                       " does not exist in this session (made before rgpu.reset()?)");
  return it->second;
}

void Session::handleSeed(uint64_t seed) {
  for (at::Generator &g : generators_) {
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(seed); // as torch.manual_seed seeds every device
  }
}

void Session::handleRngState(wire::RngStateRequest::Reader r, Reply &reply) {
  if (r.getDevice() >= generators_.size())
    throw ProtocolError{"a generator state request for rgpu:" + std::to_string(r.getDevice()) +
                        " of a server with " + std::to_string(generators_.size()) + " devices"};
  if (r.getState().size() > kMaxRngStateBytes)
    throw ProtocolError{"a generator state of " + std::to_string(r.getState().size()) +
                        " bytes, more than the limit of " + std::to_string(kMaxRngStateBytes)};
  // The result comes first: a state the generator refuses still gets its (empty) answer, and
  // the error says why.
  result::RngState &answer = reply.add(result::RngState{});
  at::Generator &g = r.getGenerator() ? generator(r.getGenerator()) : generators_[r.getDevice()];
  std::lock_guard<std::mutex> lock(g.mutex());
  if (r.getSet()) {
    auto bytes = r.getState();
    at::Tensor state = at::empty({int64_t(bytes.size())}, at::kByte);
    if (bytes.size()) // an empty Data reads as a null pointer, which memcpy may not take
      std::memcpy(state.data_ptr(), bytes.begin(), bytes.size());
    g.set_state(state); // checks the size and the values, as torch.cuda.set_rng_state
  }
  at::Tensor state = g.get_state().contiguous();
  answer.state = kj::heapArray<kj::byte>(state.const_data_ptr<uint8_t>(), state.numel());
  answer.initialSeed = g.current_seed();
}

void Session::handleGenerator(wire::GeneratorRequest::Reader r) {
  if (r.getId() == 0)
    throw ProtocolError{"a generator request for generator 0"};
  if (r.getDevice() >= generators_.size())
    throw ProtocolError{"a generator request for rgpu:" + std::to_string(r.getDevice()) +
                        " of a server with " + std::to_string(generators_.size()) + " devices"};
  switch (r.which()) {
  case wire::GeneratorRequest::CREATE:
  case wire::GeneratorRequest::CLONE_OF:
  case wire::GeneratorRequest::SNAPSHOT: {
    if (explicitGenerators_.size() >= kMaxGenerators && !explicitGenerators_.count(r.getId()))
      throw SessionError("rgpu: this session holds " + std::to_string(kMaxGenerators) +
                         " generators, the most a session may; drop some (del generator) first");
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
}

void Session::handleMemory(wire::MemoryRequest::Reader r, Reply &reply) {
  uint8_t index = r.getDevice();
  if (index >= ctx_.devices().size())
    throw ProtocolError{"a memory request for rgpu:" + std::to_string(index) +
                        " of a server with " + std::to_string(ctx_.devices().size()) +
                        " devices"};
  device::apply(ctx_.devices()[index], r, *account_, ctx_.onlyPrincipal(principal()));
  reply.add(result::Memory{index});
}

void Session::handleSync(Reply &reply) {
  for (const at::Device &d : ctx_.devices())
    if (d.is_cuda())
      at::detail::getCUDAHooks().deviceSynchronize(d.index());
  reply.add(result::Done{});
}

void Session::stats(wire::ServerStats::Builder out) {
  out.setPlanBuilds(ctx_.planBuilds);
  out.setGraphsCached(ctx_.graphsCached());
  out.setGraphRuns(ctx_.graphRuns);
  out.setSessions(ctx_.sessions);
  out.setCompiledRuns(ctx_.compiledRuns);
  out.setConnections(ctx_.connectionsOpen);
  out.setConnectionsRefused(ctx_.connectionsRefused);
  out.setMemoryHeld(memory::held());
  out.setMemoryKept(memory::kept());
  out.setMemoryLimit(memory::limit());
  std::vector<uint64_t> memories = ctx_.sessionMemories(principal());
  auto ms = out.initSessionMemories(memories.size());
  for (size_t i = 0; i < memories.size(); ++i)
    ms.set(i, memories[i]);
  out.setPlanEvictions(ctx_.planEvictions);
  out.setSessionsParked(ctx_.sessionsParked());
  out.setResumes(ctx_.resumes);
  out.setSessionsExpired(ctx_.sessionsExpired);
  out.setUploadBytesDeduplicated(ctx_.uploadBytesDeduplicated);
  out.setStoreBytes(ctx_.store().bytes());
  out.setStoreEvictions(ctx_.store().evictions);
  if (ctx_.files().enabled()) {
    out.setFilesBytes(ctx_.files().used(principal()));
    out.setFilesQuota(ctx_.files().quota());
  }
  if (Compiler *c = ctx_.compiler()) {
    out.setCompiler("inductor");
    out.setInductorCompiles(c->compiles);
    out.setCompilesPending(c->pending);
    out.setCompileFailures(c->failures);
    out.setDiskCacheHits(c->diskHits);
    out.setCompiledEvictions(c->evictions);
    out.setDiskEvictions(c->diskEvictions);
    out.setCompilesDropped(c->dropped);
    out.setCompileNs(c->compileNs);
    out.setCudaGraphReplays(c->cudaGraphs->replays);
    out.setCudaGraphCaptures(c->cudaGraphs->captures);
  } else {
    out.setCompiler("plan");
  }
  auto own = out.initSession();
  own.setGraphRuns(runs_);
  own.setExecuteNs(executeNs_);
  own.setTensors(tensors_.size());
  own.setCompiledRuns(compiledRuns_);
  own.setWritesInPlace(writesInPlace_);
  own.setRunsCancelled(runsCancelled_);
  own.setMemory(account_->held);
  own.setMemoryPeak(account_->peak);
  own.setMemoryQuota(account_->quota);
  own.setAllocationsRefused(account_->refused);
  own.setGraphBytes(graphBytes_);
  own.setGraphBudget(ctx_.budgets.graphMemory);
  own.setGraphsForgotten(graphsForgotten_);
  auto graphs = own.initGraphs(used_.size());
  size_t i = 0;
  for (const auto &[hash, use] : used_) {
    auto g = graphs[i++];
    wire::encodeHash(hash, g.initHash());
    g.setNodes(use.nodes);
    g.setRuns(use.runs);
    g.setExecuteNs(use.executeNs);
    g.setBuildNs(use.buildNs);
    const Compiler::Report r =
        ctx_.compiler() && use.shared ? ctx_.compiler()->report(hash) : Compiler::Report{};
    g.setExecutor(r.executor);
    g.setCompileNs(r.compileNs);
    g.setCudaGraph(r.cudaGraph);
    g.setCudaGraphReplays(r.cudaGraphReplays);
    g.setCompiledRuns(use.compiledRuns);
  }
}

//===----------------------------------------------------------------------===//
// torch.distributed
//===----------------------------------------------------------------------===//

void Session::handleHostStore(Reply &reply) {
  std::string &address = reply.add(result::Text{}).text;
  // The store's keys and values are this session's memory.
  address = groups_.hostStore(ctx_.storeHost, [account = account_](int64_t bytes) {
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
}

void Session::handleJoinGroup(wire::JoinGroup::Reader j, size_t at, Reply &reply) {
  // It waits for the group's other ranks off the worker pool: its frame is deferred (served
  // again from this command, which must begin it) until the join ends.
  if (at != 0)
    throw ProtocolError{"a JoinGroup that does not begin its frame"};
  std::string &name = reply.add(result::Text{}).text;
  if (!joining_) {
    if (!ctx_.reserveWait(principal()))
      throw SessionError(std::to_string(Context::kMaxWaits) + " joins or resumes of this "
                         "principal are waiting already; join once one of them is done");
    holdsWait_ = true;
    try {
      joining_ = groups_.startJoin(
          j.getStore(), j.getPrefix(), int(j.getRank()), int(j.getSize()), ctx_.storeHost,
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
  std::optional<std::string> joined;
  try {
    joined = groups_.joinedGroupName(*joining_);
  } catch (...) {
    joining_.reset();
    endWait();
    throw;
  }
  if (!joined) {
    reply.deferred = true;
    return;
  }
  joining_.reset();
  endWait();
  name = *joined;
  log(peer_ + ": joined process group " + name + " as rank " + std::to_string(j.getRank()) +
      " of " + std::to_string(j.getSize()));
}

} // namespace rgpu::server
