//===- lib/client/Frames.cpp - The next frame, and the frames in flight ----===//
//
// Commands wait in the queue for the next frame; a frame that runs a graph or asks for values
// gets a reply even when nobody waits for it, taken in later (harvest). How many steps may be
// unanswered is bounded (boundInflight); a remote error in a reply nobody waited for is kept
// and raised at the next read or sync.
//
//===----------------------------------------------------------------------===//
#include "SessionState.h"

#include "rgpu/client/Interrupts.h"
#include "rgpu/net/Frame.h"

#include <algorithm>

namespace rgpu::client {

namespace {
/// Frames below this size are packed; larger ones carry tensor bytes, which do not pack.
constexpr uint64_t kPackBelow = 64 << 10;
/// Bytes of frames sent without a reply after which the next frame waits for one.
constexpr uint64_t kMaxUnacknowledged = uint64_t(256) << 20;
} // namespace

void Session::State::queue(Command c) {
  if (transport.lost())
    raise(ErrorKind::SessionLost, transport.lostReason());
  queued.push_back(std::move(c));
}

void Session::State::queueDownload(command::Download d,
                                   llvm::IntrusiveRefCntPtr<DeviceData> valueOf) {
  ir::TensorMeta layout = d.meta;
  queue(std::move(d));
  queuedTargets.push_back({std::move(valueOf), std::move(layout)});
}

void Session::State::queueValue(const llvm::IntrusiveRefCntPtr<DeviceData> &data,
                                const ir::TensorMeta &layout) {
  if (data->value.defined() || data->valueSeq)
    return;
  queueDownload(command::Download{data->handle, layout}, data);
  data->valueSeq = DeviceData::kValueQueued;
}

void Session::State::dropQueued() {
  queued.clear();
  queuedTargets.clear();
  releases.clear();
  deferredUploads.clear();
  deferredBytes = 0;
}

Reply Session::State::flush(bool wantReply) {
  if (transport.lost())
    raise(ErrorKind::SessionLost, transport.lostReason());
  if (!transport.connected())
    transport.connect();
  if (!deferredUploads.empty())
    sendDeferred();
  if (queued.empty() && releases.empty() && !wantReply)
    return {};
  // A frame that runs a graph or asks for values gets a reply even when nobody waits for it:
  // the reply brings the values and acknowledges the frame, and shows how far the server is.
  const bool runs = std::any_of(queued.begin(), queued.end(), [](const Command &c) {
    return std::holds_alternative<command::Run>(c);
  });
  const bool values = std::any_of(queuedTargets.begin(), queuedTargets.end(),
                                  [](const Target &t) { return bool(t.data); });
  if (!wantReply && runs)
    boundInflight();
  // Frames are kept until the server acknowledges them (a resume sends them again), and only
  // replies acknowledge: past this much, this frame waits for one.
  if (transport.unacknowledged() > kMaxUnacknowledged)
    wantReply = true;
  const bool reply = wantReply || runs || values;
  capnp::MallocMessageBuilder b;
  auto frame = b.initRoot<wire::ClientFrame>();
  const uint64_t seq = transport.nextSeq();
  frame.setSeq(seq);
  frame.setWantReply(reply);
  frame.setReceived(lastReply);
  const uint64_t dataBytes = encoder.encode(frame, queued, std::move(releases));
  std::vector<Command> sent;
  sent.swap(queued);
  Targets targets;
  targets.swap(queuedTargets);
  releases.clear();
  std::vector<ir::Hash256> ranInFrame;
  ranInFrame.swap(runsInFrame);
  std::string bytes = net::encodeFrame(b, dataBytes < kPackBelow);
  ++stats.messages;
  stats.bytesOut += bytes.size();
  transport.send(seq, std::move(bytes));
  sent.clear();
  retired.clear();
  for (Target &t : targets)
    if (t.data)
      t.data->valueSeq = seq;
  if (!wantReply) {
    if (reply)
      inflight.push_back({seq, std::move(targets), std::move(ranInFrame),
                          std::chrono::steady_clock::now(), runs});
    return {};
  }

  ++stats.waits;
  auto start = std::chrono::steady_clock::now();
  // Replies read here in a burst say nothing about when they came: they are not timed.
  const uint64_t cancelled = transport.cancelledThrough();
  net::Frame answer =
      awaitFrame(seq, [this](const net::Frame &f) { absorb(f, nullptr, 0, false); }, true);
  auto waited = std::chrono::steady_clock::now() - start;
  diagnostics.waited(site, locations.text(site), ranInFrame,
                     std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count());
  Reply results = absorb(answer, &targets, seq);
  if (transport.cancelledThrough() != cancelled)
    interrupted();
  raiseDeferred();
  if (results.error)
    raise(ErrorKind::Remote, describe(*results.error), results.error->pythonType);
  return results;
}

Reply Session::State::absorb(const net::Frame &frame, const Targets *own, uint64_t ownSeq,
                             bool timed) {
  stats.bytesIn += frame.bytes + net::kHeaderBytes;
  Reply results;
  Targets answered;
  const Targets *targets = own;
  try {
    auto reader = net::openFrame(frame, transport.limits());
    results = decodeReply(reader->getRoot<wire::ServerFrame>());
  } catch (const kj::Exception &e) {
    lose(std::string("malformed reply from rgpu-opserver: ") + e.getDescription().cStr());
  }
  const uint64_t ack = results.ackSeq;
  lastReply = std::max(lastReply, ack);
  // Replies come in order: an in-flight frame older than this reply lost its reply in a
  // resume, and its values will be read again if they are wanted.
  auto forget = [](Targets &ts, uint64_t seq) {
    for (Target &t : ts)
      if (t.data && t.data->valueSeq == seq)
        t.data->valueSeq = 0;
  };
  while (!inflight.empty() && inflight.front().seq < ack) {
    forget(inflight.front().targets, inflight.front().seq);
    inflight.pop_front();
  }
  if (!own && !inflight.empty() && inflight.front().seq == ack) {
    answered = std::move(inflight.front().targets);
    const auto now = std::chrono::steady_clock::now();
    if (inflight.front().step && timed) {
      stepReplies.push_back(now);
      if (stepReplies.size() > 16)
        stepReplies.pop_front();
    }
    inflight.pop_front();
    targets = &answered;
  }
  // Each Download's bytes go to the data whose value it brings, or to the caller.
  std::vector<std::string> data = std::move(results.data);
  results.data.clear();
  for (size_t k = 0; k < data.size(); ++k) {
    const Target *t = targets && k < targets->size() ? &(*targets)[k] : nullptr;
    if (!t || !t->data) {
      results.data.push_back(std::move(data[k]));
      continue;
    }
    // A poisoned output comes back empty (the error says why): it gets no value.
    if (data[k].size() == uint64_t(t->layout.storageBytes()))
      t->data->value = tensorFromBytes(t->layout, data[k]);
  }
  if (targets)
    for (const Target &t : *targets)
      if (t.data)
        t.data->valueSeq = 0;
  for (const std::string &note : results.notes)
    log(20, "rgpu-opserver: " + note);
  // What a Cancel stopped was reported by the wait it interrupted.
  if (results.error && !results.error->fatal && results.error->pythonType == kCancelledType &&
      ack <= transport.cancelledThrough() + 1)
    results.error.reset();
  if (results.error && results.error->fatal)
    lose(describe(*results.error));
  if (own && ack != ownSeq)
    lose("rgpu-opserver no longer had its reply to frame " + std::to_string(ownSeq) +
         " when the session resumed");
  if (!own) {
    if (deferredError.empty() && results.error) {
      deferredError = describe(*results.error);
      deferredErrorType = results.error->pythonType;
    }
    results.error.reset();
  }
  return results;
}

std::string Session::State::describe(const RemoteError &e) {
  std::string where = e.location;
  auto it = nodeLocations.find(e.graph);
  if (it != nodeLocations.end() && e.node < it->second.size() && it->second[e.node])
    where = locations.text(it->second[e.node]);
  std::string msg = e.op.empty() ? std::string() : e.op + " failed on the server";
  if (!where.empty())
    msg += (msg.empty() ? "at " : " at ") + where;
  if (!msg.empty())
    msg += ": ";
  return msg + e.message;
}

void Session::State::harvest() {
  net::Frame frame;
  while (!inflight.empty() && !transport.lost() && transport.poll(frame))
    absorb(frame, nullptr);
}

void Session::State::awaitReply(uint64_t seq, bool throttle) {
  auto it = std::find_if(inflight.begin(), inflight.end(),
                         [&](const InFlight &f) { return f.seq == seq; });
  if (it == inflight.end())
    return;
  std::vector<ir::Hash256> runs = it->runs;
  auto start = std::chrono::steady_clock::now();
  const uint64_t cancelled = transport.cancelledThrough();
  net::Frame frame =
      awaitFrame(seq, [this](const net::Frame &f) { absorb(f, nullptr); }, /*spin=*/!throttle);
  const uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - start).count();
  if (throttle) {
    ++stats.throttled;
    stats.throttledNs += ns;
  } else {
    ++stats.waits;
    diagnostics.waited(site, locations.text(site), runs, ns);
  }
  absorb(frame, nullptr);
  if (transport.cancelledThrough() != cancelled)
    interrupted();
}

net::Frame Session::State::awaitFrame(uint64_t seq,
                                      const std::function<void(const net::Frame &)> &earlier,
                                      bool spin) {
  interrupts::Wait wait; // Ctrl-C now sends a Cancel (Interrupts.h)
  return transport.receive(seq, earlier, spin);
}

void Session::State::boundInflight() {
  harvest();
  for (;;) {
    // Steps in transit: as many as finish, at the rate their replies have been coming, in the
    // time an unqueued step takes to be answered, the link's round trip and one step's
    // service (Little's law). The round trip is the fastest Hello's, on an idle link: a
    // latency measured under load would count the queue the window makes, and grow it. The
    // window grows from RGPU_MAX_INFLIGHT as the rate becomes known; a client that waits here
    // reads replies as they come, which keeps the rate honest.
    size_t window = maxInflight;
    if (stepReplies.size() >= 4) {
      // The median interval: replies taken in together (a harvest after a long trace) give
      // zero intervals, which must not decide.
      std::vector<std::chrono::steady_clock::duration> gaps;
      for (size_t k = 1; k < stepReplies.size(); ++k)
        gaps.push_back(stepReplies[k] - stepReplies[k - 1]);
      std::nth_element(gaps.begin(), gaps.begin() + gaps.size() / 2, gaps.end());
      auto interval = gaps[gaps.size() / 2];
      window += interval.count() > 0 ? 1 + size_t(transport.roundTrip() / interval)
                                     : kMaxInFlightFrames;
    }
    size_t steps = 0;
    for (const InFlight &f : inflight)
      steps += f.step;
    if (steps < std::min(window, kMaxInFlightFrames) && inflight.size() < kMaxInFlightFrames)
      return;
    awaitReply(inflight.front().seq, /*throttle=*/true);
  }
}

void Session::State::raiseDeferred() {
  if (deferredError.empty())
    return;
  std::string error, type;
  error.swap(deferredError);
  type.swap(deferredErrorType);
  raise(ErrorKind::Remote, error, type);
}

void Session::State::interrupted() {
  if (deferredErrorType == kCancelledType) {
    deferredError.clear();
    deferredErrorType.clear();
  }
  raise(ErrorKind::Interrupted,
        "rgpu: interrupted while waiting for rgpu-opserver at " + transport.address() +
            " (at " + locations.text(site) +
            "): it stopped this session's runs, and tensors they were computing raise "
            "rgpu.Cancelled if read; tensors updated in place keep their values from before "
            "the run");
}

void Session::State::lose(const std::string &why) {
  inflight.clear();
  dropQueued();
  transport.lose(why);
}

void Session::cancel() {
  interrupts::request(); // a wait in progress takes it
  std::unique_lock<std::recursive_mutex> lock(s_->mu, std::try_to_lock);
  if (!lock.owns_lock() || lost() || !s_->transport.connected())
    return; // another thread traces or waits: its wait takes the request
  ++s_->depth;
  if (s_->transport.lastSent() > s_->lastReply)
    s_->transport.cancel();
  --s_->depth;
}

size_t Session::setMaxInflight(size_t n) {
  std::swap(n, s_->maxInflight);
  return n;
}

} // namespace rgpu::client
