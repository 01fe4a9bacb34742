//===- lib/client/Requests.cpp - Commands about generators, groups and the server -===//
//
// The RNG: torch.manual_seed, the session's generators' states, and torch.Generator objects on
// rgpu, each a generator of the session on the server named by an id the client picks. What
// reads or changes a generator's state comes after the random ops traced before it (which are
// cut first) and before those traced after. Then process groups among servers, and the
// questions whose answers come from the server (its counters, its devices' memory).
//
//===----------------------------------------------------------------------===//
#include "SessionState.h"

namespace rgpu::client {

void Session::State::cutBeforeRng(const char *reason) {
  if (cutter.randomPending())
    cut(reason);
}

void Session::seed(uint64_t value) {
  Lock lock(*this);
  s_->cutBeforeRng("torch.manual_seed");
  s_->queue(command::Seed{value});
}

RngState Session::rngState(int device, uint64_t generator) {
  Lock lock(*this);
  s_->cutBeforeRng("torch.rgpu.get_rng_state");
  s_->queue(command::RngState{uint8_t(device), generator, std::nullopt});
  Reply reply = s_->flush(true);
  if (reply.rngStates.empty())
    s_->lose("the server did not answer a generator state request");
  return reply.rngStates.back();
}

void Session::setRngState(int device, std::string state, uint64_t generator) {
  Lock lock(*this);
  s_->cutBeforeRng("torch.rgpu.set_rng_state");
  s_->queue(command::RngState{uint8_t(device), generator, std::move(state)});
}

void Session::State::queueGenerator(const char *reason, int device, uint64_t id,
                                    wire::GeneratorRequest::Which op, uint64_t arg) {
  if (reason)
    cutBeforeRng(reason);
  queue(command::Generator{id, uint8_t(device), op, arg});
}

uint64_t Session::newGenerator(int device, NewGenerator how, uint64_t arg) {
  Lock lock(*this);
  const uint64_t id = s_->nextGenerator++;
  // A clone or snapshot takes a state after the ops traced so far; a new one none.
  switch (how) {
  case NewGenerator::Seeded:
    s_->queueGenerator(nullptr, device, id, wire::GeneratorRequest::CREATE, arg);
    break;
  case NewGenerator::CloneOf:
    s_->queueGenerator("a copy of a generator's state", device, id,
                       wire::GeneratorRequest::CLONE_OF, arg);
    break;
  case NewGenerator::Snapshot:
    s_->queueGenerator("a copy of a generator's state", device, id,
                       wire::GeneratorRequest::SNAPSHOT, arg);
    break;
  }
  return id;
}

void Session::seedGenerator(int device, uint64_t id, uint64_t seed) {
  Lock lock(*this);
  s_->queueGenerator("Generator.manual_seed", device, id, wire::GeneratorRequest::SEED, seed);
}

void Session::restoreRng(int device, uint64_t id) {
  Lock lock(*this);
  s_->queueGenerator("a restore of the generator's state", device, id,
                     wire::GeneratorRequest::RESTORE);
}

void Session::dropGenerator(uint64_t id) noexcept {
  Lock lock(*this);
  s_->droppedGenerators.push_back(id);
}

void Session::State::queueGeneratorDrops() noexcept {
  if (transport.lost())
    droppedGenerators.clear();
  for (uint64_t id : droppedGenerators)
    queued.push_back(command::Generator{id, 0, wire::GeneratorRequest::DROP, 0});
  droppedGenerators.clear();
}

//===----------------------------------------------------------------------===//
// Process groups among servers
//===----------------------------------------------------------------------===//

std::string Session::State::askText(Command c, const char *reason) {
  cut(reason);
  const bool join = std::holds_alternative<command::JoinGroup>(c);
  // A JoinGroup begins its frame: the server serves that frame again from it when the join
  // ends, so nothing before it may share the frame.
  if (join && !queued.empty())
    flush(false);
  queue(std::move(c));
  Reply reply = flush(true);
  if (reply.texts.empty())
    lose("the server did not answer a " + std::string(join ? "JoinGroup" : "HostStore"));
  return reply.texts.back();
}

std::string Session::hostStore() {
  Lock lock(*this);
  return s_->askText(command::HostStore{}, "a rendezvous store");
}

std::string Session::joinGroup(const std::string &store, const std::string &prefix, int rank,
                               int size, uint32_t timeoutMs) {
  Lock lock(*this);
  return s_->askText(command::JoinGroup{store, prefix, uint32_t(rank), uint32_t(size), timeoutMs},
                     "joining a process group");
}

//===----------------------------------------------------------------------===//
// Questions for the server
//===----------------------------------------------------------------------===//

ServerStats Session::serverStats() {
  Lock lock(*this);
  s_->queue(command::Stats{});
  Reply reply = s_->flush(true);
  if (reply.stats.empty())
    s_->lose("the server did not answer a stats request");
  return reply.stats.back();
}

ServerHello Session::serverHello() {
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, s_->transport.lostReason());
  if (!s_->transport.connected())
    s_->transport.connect();
  return s_->transport.serverHello();
}

int Session::deviceCount() {
  try {
    return int(serverHello().devices.size());
  } catch (const std::exception &) {
    return 1;
  }
}

DeviceMemory Session::deviceMemory(int device, bool resetPeak, bool emptyCache) {
  Lock lock(*this);
  s_->cut("memory figures");
  s_->queue(command::Memory{uint8_t(device), resetPeak, emptyCache});
  Reply reply = s_->flush(true);
  if (reply.memory.empty())
    s_->lose("the server did not answer a memory request");
  return reply.memory.back();
}

} // namespace rgpu::client
