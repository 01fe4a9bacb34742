//===- lib/client/Transfers.cpp - Bytes in and out of the server -----------===//
//
// Uploads copy a CPU tensor's bytes at once and send them with the next frame (large ones at
// once, in chunks, compressed by byte plane on a slow link). Reads cost at most one wait: a
// value that came with a reply costs none, one still on its way only the rest of its round
// trip, and a read of a download group fetches the group's other tensors in the same frame.
//
//===----------------------------------------------------------------------===//
#include "SessionState.h"

#include "rgpu/bridge/Bridge.h"
#include "rgpu/client/KnownValues.h"
#include "rgpu/ir/Digest.h"
#include "rgpu/wire/Planes.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace rgpu::client {

namespace {
/// Upload chunks smaller than this always go as they are.
constexpr uint64_t kCompressedUpload = 4 << 10;
/// RGPU_COMPRESS=auto compresses uploads on a link with at least this round trip.
constexpr auto kCompressRoundTrip = std::chrono::milliseconds(2);
} // namespace

Value Session::upload(const at::Tensor &src, ir::TensorMeta &meta, int device) {
  Lock lock(*this);
  State &s = *s_;
  // Take the bytes now: the caller may overwrite its tensor right after this returns.
  at::Tensor cpu = src.is_non_overlapping_and_dense() && src.storage_offset() == 0
                       ? src.clone(at::MemoryFormat::Preserve)
                       : src.contiguous().clone();
  if (cpu.is_conj() || cpu.is_neg())
    cpu = cpu.resolve_conj().resolve_neg();
  meta = bridge::metaOf(cpu);
  // The chunks share the copy: it lives until the last of their frames is sent.
  auto owner = std::make_shared<at::Tensor>(cpu);
  const std::shared_ptr<const uint8_t> bytes(owner, static_cast<const uint8_t *>(cpu.data_ptr()));
  const uint64_t total = meta.storageBytes();
  const uint64_t handle = s.newHandles(1);
  if (total >= kContentUpload && s.options.contentUploads) {
    s.deferredUploads.push_back({handle, uint8_t(device), meta, bytes, ir::Hash256()});
    s.deferredBytes += total;
    if (s.deferredBytes >= kDeferredBytes)
      s.flush(false);
  } else {
    s.queueUpload(handle, uint8_t(device), meta, bytes, std::nullopt);
  }
  ++s.stats.uploads;
  llvm::IntrusiveRefCntPtr<DeviceData> data(new DeviceData(handle, meta));
  if (meta.numel() <= kKnownElements)
    data->value = cpu; // what the server holds: reads and ops on it can be answered here
  return Value{nullptr, 0, std::move(data)};
}

void Session::State::queueUpload(uint64_t handle, uint8_t device, const ir::TensorMeta &meta,
                                 std::shared_ptr<const uint8_t> bytes,
                                 std::optional<ir::Hash256> digest) {
  const uint64_t total = meta.storageBytes();
  const uint64_t chunk = transport.limits().uploadChunkBytes;
  for (uint64_t off = 0; off < total || off == 0; off += chunk) {
    command::Upload c;
    c.handle = handle;
    c.device = device;
    c.meta = meta;
    c.bytes = bytes;
    c.offset = off;
    c.length = std::min(chunk, total - off);
    c.digest = digest;
    if (c.length >= kCompressedUpload && compressUploads()) {
      if (auto packed =
              wire::encodePlanes(bytes.get() + off, c.length, ir::dtype::itemSize(meta.dtype))) {
        stats.uploadBytesSaved += c.length - packed->size();
        c.encoded = std::move(*packed);
        c.bytes = nullptr; // the frame carries the encoded bytes only
      }
    }
    queue(std::move(c));
    if (total > kSmallUpload)
      flush(false);
    if (total == 0)
      break;
  }
}

void Session::State::sendDeferred() {
  std::vector<DeferredUpload> uploads;
  uploads.swap(deferredUploads);
  deferredBytes = 0;
  // The question goes alone; what was queued follows the uploads (it may use them).
  std::vector<Command> later;
  later.swap(queued);
  Targets laterTargets;
  laterTargets.swap(queuedTargets);
  std::vector<uint64_t> laterReleases;
  laterReleases.swap(releases);
  // Their digests, made side by side: the copies are private, nothing changed them since.
  at::parallel_for(0, int64_t(uploads.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      uploads[k].digest = ir::digestOf(uploads[k].bytes.get(), uploads[k].meta.storageBytes());
  });
  std::vector<bool> present;
  try {
    command::HasContent ask;
    for (const DeferredUpload &u : uploads)
      ask.digests.push_back(u.digest);
    queue(std::move(ask));
    Reply answer = flush(true);
    if (answer.present.size() != 1 || answer.present[0].size() != uploads.size())
      lose("the server did not answer which uploads its store holds");
    present = std::move(answer.present[0]);
  } catch (...) {
    // An error an earlier frame brought (or an interrupt): everything waits for the next
    // frame, as it was.
    queued = std::move(later);
    queuedTargets = std::move(laterTargets);
    releases = std::move(laterReleases);
    for (DeferredUpload &u : uploads)
      deferredBytes += uint64_t(u.meta.storageBytes());
    deferredUploads = std::move(uploads);
    throw;
  }
  for (size_t k = 0; k < uploads.size(); ++k) {
    DeferredUpload &u = uploads[k];
    if (!present[k]) {
      queueUpload(u.handle, u.device, u.meta, std::move(u.bytes), u.digest);
      continue;
    }
    command::Upload c;
    c.handle = u.handle;
    c.device = u.device;
    c.meta = u.meta;
    c.digest = u.digest;
    c.stored = true;
    stats.uploadBytesDeduplicated += uint64_t(u.meta.storageBytes());
    queue(std::move(c));
  }
  for (Command &c : later)
    queued.push_back(std::move(c));
  for (Target &t : laterTargets)
    queuedTargets.push_back(std::move(t));
  for (uint64_t h : laterReleases)
    releases.push_back(h);
}

bool Session::State::compressUploads() {
  if (options.compress != Options::Compress::Auto)
    return options.compress == Options::Compress::Always;
  if (!transport.lost() && !transport.connected())
    transport.connect();
  return transport.connected() && transport.fastestExchange() >= kCompressRoundTrip;
}

void Session::downloadTogether(std::vector<at::Tensor> tensors) {
  Lock lock(*this);
  s_->group.clear();
  for (at::Tensor &t : tensors)
    if (lazyImpl(t))
      s_->group.members.push_back(std::move(t));
}

at::Tensor Session::download(LazyTensorImpl *impl, const ir::TensorMeta &want) {
  uint32_t site = currentLocation();
  Lock lock(*this);
  State &s = *s_;
  if (lost())
    raise(ErrorKind::SessionLost, s.transport.lostReason());
  s.site = site;
  s.harvest();
  std::optional<std::string> key;
  if (impl->value.pending())
    key = readKey(impl->value, want, s.firstHandle);
  if (key) {
    if (const at::Tensor *hit = s.reads.find(*key)) {
      at::Tensor remembered = *hit;
      // The read still cuts where it always did, so the graphs stay the ones the server has;
      // only the wait is saved.
      s.cut("read of a value");
      if (!s.queued.empty())
        s.flush(false);
      s.raiseDeferred();
      ++s.stats.readsRemembered;
      return remembered.clone(at::MemoryFormat::Preserve);
    }
  }
  at::Tensor out = s.fetch(impl, want);
  if (key && out.sizes().equals(want.sizes) && out.strides().equals(want.strides) &&
      out.scalar_type() == static_cast<c10::ScalarType>(want.dtype))
    s.reads.remember(std::move(*key), out.clone(at::MemoryFormat::Preserve));
  return out;
}

at::Tensor Session::State::fetch(LazyTensorImpl *impl, const ir::TensorMeta &want) {
  if (impl->value.pending())
    cut("read of a value");
  checkCurrent(impl->value);
  DeviceData *data = impl->value.data.get();
  // A value that came, or is coming, with a reply: at most the wait for that reply.
  if (data->valueSeq == DeviceData::kValueQueued)
    flush(true);
  else if (data->valueSeq)
    awaitReply(data->valueSeq);
  raiseDeferred();
  if (data->value.defined() && data->value.sizes().equals(want.sizes) &&
      data->value.scalar_type() == static_cast<c10::ScalarType>(want.dtype)) {
    at::Tensor out = at::empty_strided(want.sizes, want.strides, data->value.options());
    out.copy_(data->value);
    ++stats.downloads;
    return out;
  }
  if (auto it = group.fetched.find(data); it != group.fetched.end()) {
    DownloadGroup::Fetched &f = it->second;
    if (f.cpu.defined() && f.cpu.sizes().equals(want.sizes) &&
        f.cpu.strides().equals(want.strides) &&
        f.cpu.scalar_type() == static_cast<c10::ScalarType>(want.dtype)) {
      // The first reader takes the tensor; another reader of the same data gets its own copy.
      if (f.taken)
        return f.cpu.clone(at::MemoryFormat::Preserve);
      f.taken = true;
      return f.cpu;
    }
  }
  const uint64_t bytes = want.storageBytes();
  const wire::Limits &limits = transport.limits();
  if (bytes > limits.uploadChunkBytes) {
    // Read apart, in chunks: a later read of the group must not fetch it again.
    if (!group.members.empty())
      group.fetched.try_emplace(data, DownloadGroup::Fetched{impl->value.data, at::Tensor(), true});
    return downloadInChunks(*impl->value.data, want);
  }
  // This tensor, and with it members of the download group that are not fetched yet, as many
  // as fit in one reply. The cut above made every live tensor device data. Members are matched
  // by the data they hold: `t.detach().cpu()` reads a member through another tensor.
  std::vector<std::pair<llvm::IntrusiveRefCntPtr<DeviceData>, ir::TensorMeta>> wanted;
  wanted.push_back({impl->value.data, want});
  bool inGroup = std::any_of(group.members.begin(), group.members.end(), [&](const at::Tensor &t) {
    return lazyImpl(t)->value.data.get() == data;
  });
  if (inGroup) {
    group.fetched.try_emplace(data, DownloadGroup::Fetched{impl->value.data, at::Tensor(), true});
    uint64_t budget = limits.maxReplyDataBytes - std::min(bytes, limits.maxReplyDataBytes);
    std::vector<at::Tensor> later; // what does not fit waits for the group's next read
    for (at::Tensor &t : group.members) {
      LazyTensorImpl *member = lazyImpl(t);
      DeviceData *d = member->value.data.get();
      if (!d || group.fetched.count(d) || d->handle < firstHandle)
        continue;
      ir::TensorMeta layout = member->downloadLayout();
      uint64_t size = layout.storageBytes();
      if (size > budget || wanted.size() >= limits.maxCommands / 16) {
        later.push_back(std::move(t));
        continue;
      }
      budget -= size;
      group.fetched.try_emplace(d, DownloadGroup::Fetched{member->value.data});
      wanted.push_back({member->value.data, std::move(layout)});
    }
    group.members = std::move(later);
  }
  for (const auto &[d, layout] : wanted)
    queueDownload(command::Download{d->handle, layout});
  Reply reply = flush(true);
  if (reply.data.size() != wanted.size())
    lose("the server did not answer a download");
  at::Tensor result;
  for (size_t k = 0; k < wanted.size(); ++k) {
    at::Tensor out = tensorFromBytes(wanted[k].second, reply.data[k]);
    ++stats.downloads;
    // Device data never changes: a small value read once is read from here after.
    DeviceData &d = *wanted[k].first;
    if (!d.value.defined() && !d.valueSeq &&
        int64_t(reply.data[k].size()) <= ReadCache::kMaxBytes)
      d.value = out.clone(at::MemoryFormat::Preserve);
    if (k == 0)
      result = out;
    if (auto it = group.fetched.find(wanted[k].first.get()); it != group.fetched.end())
      it->second.cpu = out;
  }
  return result;
}

at::Tensor Session::State::downloadInChunks(const DeviceData &data, const ir::TensorMeta &want) {
  at::Tensor out = at::empty_strided(
      want.sizes, want.strides, at::TensorOptions().dtype(static_cast<c10::ScalarType>(want.dtype)));
  const uint64_t total = want.storageBytes(), chunk = transport.limits().uploadChunkBytes;
  for (uint64_t offset = 0; offset < total; offset += chunk) {
    const uint64_t length = std::min(chunk, total - offset);
    queueDownload(command::Download{data.handle, want, offset, length});
    Reply reply = flush(true);
    if (reply.data.size() != 1 || reply.data[0].size() != length)
      lose("the server answered a download chunk with the wrong number of bytes");
    std::memcpy(static_cast<char *>(out.data_ptr()) + offset, reply.data[0].data(), length);
  }
  ++stats.downloads;
  return out;
}

at::Tensor Session::State::tensorFromBytes(const ir::TensorMeta &m, const std::string &bytes) {
  if (bytes.size() != uint64_t(m.storageBytes()))
    lose("the server sent " + std::to_string(bytes.size()) + " bytes for a tensor of " +
         std::to_string(m.storageBytes()));
  at::Tensor out = at::empty_strided(
      m.sizes, m.strides, at::TensorOptions().dtype(static_cast<c10::ScalarType>(m.dtype)));
  if (!bytes.empty())
    std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
  return out;
}

std::vector<std::pair<Value, ir::TensorMeta>>
Session::runNow(llvm::IntrusiveRefCntPtr<TraceNode> node) {
  Lock lock(*this);
  State &s = *s_;
  if (lost())
    raise(ErrorKind::SessionLost, s.transport.lostReason());
  s.site = node->location;
  // Every input is held by a live tensor, so after the cut it is device data.
  CutOutputs placed = s.cut("data-dependent op");
  for (Value &v : node->inputs) {
    if (!v.pending())
      continue;
    auto data = placed.lookup({v.node.get(), v.index});
    TORCH_INTERNAL_ASSERT(data, "rgpu: an input of a data-dependent op was not materialised");
    v = Value{nullptr, 0, data};
  }
  size_t count = node->node.outputs.size();
  std::vector<std::pair<TraceNode *, uint32_t>> outputs;
  for (uint32_t k = 0; k < count; ++k)
    outputs.push_back({node.get(), k});
  uint64_t first = s.queueResolved(
      s.cutter.resolve(s.cutter.buildGraph({node.get()}, outputs), true, nullptr, s.site), true,
      "data-dependent op");
  std::vector<std::vector<ir::TensorMeta>> metas = s.flush(true).metas;
  std::vector<std::pair<Value, ir::TensorMeta>> outs;
  if (metas.empty() || metas.back().size() != count)
    s.lose("the server answered a data-dependent op with the wrong number of outputs");
  for (size_t k = 0; k < metas.back().size(); ++k) {
    const ir::TensorMeta &m = metas.back()[k];
    outs.push_back(
        {Value{nullptr, 0, llvm::IntrusiveRefCntPtr<DeviceData>(new DeviceData(first + k, m))}, m});
  }
  return outs;
}

bool Session::hasValue(LazyTensorImpl *impl) {
  Lock lock(*this);
  if (!lost())
    s_->harvest();
  return !impl->value.pending() && impl->value.data && impl->value.data->value.defined();
}

void Session::requestValue(LazyTensorImpl *impl) {
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, s_->transport.lostReason());
  s_->harvest();
  if (impl->value.pending()) {
    impl->wantValue = true;
    return;
  }
  checkCurrent(impl->value);
  s_->queueValue(impl->value.data, impl->downloadLayout());
  if (!s_->queued.empty())
    s_->flush(false);
}

} // namespace rgpu::client
