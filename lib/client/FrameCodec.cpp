#include "FrameCodec.h"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <llvm/ADT/StringRef.h>

#include <tuple>

namespace rgpu::client {

namespace {
template <class... F> struct Overloaded : F... {
  using F::operator()...;
};
template <class... F> Overloaded(F...) -> Overloaded<F...>;
} // namespace

//===----------------------------------------------------------------------===//
// Commands into a client frame
//===----------------------------------------------------------------------===//

uint64_t FrameEncoder::encode(wire::ClientFrame::Builder frame, llvm::ArrayRef<Command> commands,
                              std::vector<uint64_t> releases) {
  auto cmds = frame.initCommands(commands.size() + (releases.empty() ? 0 : 1));
  uint64_t dataBytes = 0;
  for (size_t i = 0; i < commands.size(); ++i) {
    std::visit([&](const auto &c) { put(c, cmds[i]); }, commands[i]);
    if (const auto *u = std::get_if<command::Upload>(&commands[i]); u && !u->stored)
      dataBytes += u->length;
  }
  if (!releases.empty()) {
    std::vector<uint64_t> ranges = wire::releaseRanges(std::move(releases));
    auto rel = cmds[commands.size()].initReleaseRanges(ranges.size());
    for (size_t k = 0; k < ranges.size(); ++k)
      rel.set(k, ranges[k]);
  }
  return dataBytes;
}

void FrameEncoder::put(const command::Define &c, wire::Command::Builder b) {
  auto d = b.initDefine();
  wire::encodeHash(c.hash, d.initHash());
  wire::encodeGraph(*c.graph, d.initGraph());
  // "inductor" or "inductor:MODE" (a torch.compile mode), "plan", or empty.
  llvm::StringRef executor = c.executor, mode;
  std::tie(executor, mode) = executor.split(':');
  d.setExecutor(executor == "inductor" ? wire::Define::Executor::INDUCTOR
                : executor == "plan"   ? wire::Define::Executor::PLAN
                                       : wire::Define::Executor::SERVER_DECIDES);
  using Mode = wire::Define::CompileMode;
  d.setMode(mode == "default"                      ? Mode::STANDARD
            : mode == "reduce-overhead"            ? Mode::REDUCE_OVERHEAD
            : mode == "max-autotune"               ? Mode::MAX_AUTOTUNE
            : mode == "max-autotune-no-cudagraphs" ? Mode::MAX_AUTOTUNE_NO_CUDAGRAPHS
                                                   : Mode::SERVER_DECIDES);
}

void FrameEncoder::put(const command::Run &c, wire::Command::Builder b) {
  auto r = b.initRun();
  wire::encodeHash(c.hash, r.initHash());
  runArgs_.write(c.hash, c.args, r);
  r.setFirstOutput(c.firstOutput);
  r.setNumOutputs(c.outputs);
  r.setReplyMetas(c.replyMetas);
  if (!c.symbols.empty()) {
    auto sy = r.initSymbols(c.symbols.size());
    for (size_t k = 0; k < c.symbols.size(); ++k)
      sy.set(k, c.symbols[k]);
  }
}

void FrameEncoder::put(const command::Upload &c, wire::Command::Builder b) {
  auto u = b.initUpload();
  u.setHandle(c.handle);
  wire::encodeMeta(c.meta, u.initMeta());
  u.setOffset(c.offset);
  u.setDevice(c.device);
  u.setTotal(c.meta.storageBytes());
  if (!c.encoded.empty()) {
    u.setEncoding(wire::Upload::Encoding::BYTE_PLANES);
    u.setLength(c.length);
    u.setData(kj::arrayPtr(reinterpret_cast<const kj::byte *>(c.encoded.data()),
                           c.encoded.size()));
  } else if (!c.stored) {
    u.setData(kj::arrayPtr(c.bytes.get() + c.offset, c.length));
  }
  if (c.digest) {
    wire::encodeHash(*c.digest, u.initDigest());
    u.setStored(c.stored);
  }
}

void FrameEncoder::put(const command::HasContent &c, wire::Command::Builder b) {
  auto ds = b.initHasContent(c.digests.size());
  for (size_t k = 0; k < c.digests.size(); ++k)
    wire::encodeHash(c.digests[k], ds[k]);
}

namespace {
kj::ArrayPtr<const kj::byte> bytesOf(const std::string &s) {
  return kj::arrayPtr(reinterpret_cast<const kj::byte *>(s.data()), s.size());
}

/// A file's part or an archive's record: bytes, or a tensor of the session.
template <class Builder>
void putPart(const std::variant<std::string, command::StoredTensor> &part, Builder b) {
  if (const auto *data = std::get_if<std::string>(&part)) {
    b.setData(bytesOf(*data));
    return;
  }
  const auto &t = std::get<command::StoredTensor>(part);
  auto stored = b.initTensor();
  stored.setHandle(t.handle);
  wire::encodeMeta(t.meta, stored.initMeta());
}
} // namespace

void FrameEncoder::put(const command::File &c, wire::Command::Builder b) {
  auto f = b.initFile();
  f.setPath(c.path);
  std::visit(
      Overloaded{
          [&](const command::file::List &) { f.setList(); },
          [&](const command::file::Read &r) {
            auto rd = f.initRead();
            rd.setOffset(r.offset);
            rd.setLength(r.length);
          },
          [&](const command::file::Write &w) {
            auto wr = f.initWrite();
            wr.setOffset(w.offset);
            wr.setCommit(w.commit);
            if (w.digest)
              wire::encodeHash(*w.digest, wr.initDigest());
            auto parts = wr.initParts(w.parts.size());
            for (size_t k = 0; k < w.parts.size(); ++k)
              putPart(w.parts[k], parts[k]);
          },
          [&](const command::file::Remove &) { f.setRemove(); },
          [&](const command::file::Tensor &t) {
            auto ft = f.initTensor();
            ft.setHandle(t.handle);
            ft.setOffset(t.offset);
            ft.setDevice(t.device);
            wire::encodeMeta(t.meta, ft.initMeta());
          },
          [&](const command::file::Gather &g) {
            auto fg = f.initGather();
            fg.setHandle(g.handle);
            fg.setIndex(g.index);
            fg.setDtype(g.dtype);
            fg.setRows(g.rows);
            fg.setOffset(g.offset);
            fg.setDevice(g.device);
            auto sizes = fg.initRowSizes(g.rowSizes.size());
            for (size_t k = 0; k < g.rowSizes.size(); ++k)
              sizes.set(k, g.rowSizes[k]);
          },
          [&](const command::file::SaveArchive &a) {
            auto rs = f.initSaveArchive(a.records.size());
            for (size_t k = 0; k < a.records.size(); ++k) {
              rs[k].setName(a.records[k].first);
              putPart(a.records[k].second, rs[k]);
            }
          },
          [&](const command::file::LoadArchive &l) {
            auto la = f.initLoadArchive();
            la.setFirstHandle(l.firstHandle);
            la.setDevice(l.device);
          },
      },
      c.op);
}

void FrameEncoder::put(const command::Download &c, wire::Command::Builder b) {
  auto d = b.initDownload();
  d.setHandle(c.handle);
  wire::encodeMeta(c.meta, d.initMeta());
  d.setOffset(c.offset);
  d.setLength(c.length);
}

void FrameEncoder::put(const command::Forget &c, wire::Command::Builder b) {
  auto f = b.initForget(c.hashes.size());
  for (size_t k = 0; k < c.hashes.size(); ++k) {
    wire::encodeHash(c.hashes[k], f[k]);
    runArgs_.forget(c.hashes[k]); // the server forgets its latest run too
  }
}

void FrameEncoder::put(const command::Seed &c, wire::Command::Builder b) { b.setSeed(c.seed); }

void FrameEncoder::put(const command::Stats &, wire::Command::Builder b) { b.setStats(); }

void FrameEncoder::put(const command::Memory &c, wire::Command::Builder b) {
  auto m = b.initMemory();
  m.setResetPeak(c.resetPeak);
  m.setEmptyCache(c.emptyCache);
  m.setDevice(c.device);
}

void FrameEncoder::put(const command::Sync &, wire::Command::Builder b) { b.setSync(); }

void FrameEncoder::put(const command::Generator &c, wire::Command::Builder b) {
  auto r = b.initGenerator();
  r.setId(c.id);
  r.setDevice(c.device);
  switch (c.op) {
  case wire::GeneratorRequest::CREATE: r.setCreate(c.arg); break;
  case wire::GeneratorRequest::CLONE_OF: r.setCloneOf(c.arg); break;
  case wire::GeneratorRequest::SEED: r.setSeed(c.arg); break;
  case wire::GeneratorRequest::DROP: r.setDrop(); break;
  case wire::GeneratorRequest::SNAPSHOT: r.setSnapshot(); break;
  case wire::GeneratorRequest::RESTORE: r.setRestore(); break;
  }
}

void FrameEncoder::put(const command::RngState &c, wire::Command::Builder b) {
  auto r = b.initRngState();
  r.setDevice(c.device);
  r.setGenerator(c.generator);
  if (c.set) {
    r.setSet(true);
    r.setState(kj::arrayPtr(reinterpret_cast<const kj::byte *>(c.set->data()), c.set->size()));
  }
}

void FrameEncoder::put(const command::HostStore &, wire::Command::Builder b) { b.setHostStore(); }

void FrameEncoder::put(const command::JoinGroup &c, wire::Command::Builder b) {
  auto j = b.initJoinGroup();
  j.setStore(c.store);
  j.setPrefix(c.prefix);
  j.setRank(c.rank);
  j.setSize(c.size);
  j.setTimeoutMs(c.timeoutMs);
}

//===----------------------------------------------------------------------===//
// A server frame into values
//===----------------------------------------------------------------------===//

namespace {
/// rgpu.server_stats(): the server's counters, copied out of the frame as they are.
ServerStats decodeStats(wire::ServerStats::Reader st) {
  capnp::MallocMessageBuilder copy;
  copy.setRoot(st);
  kj::Array<capnp::word> words = capnp::messageToFlatArray(copy);
  return {std::string(words.asChars().begin(), words.asChars().end())};
}
} // namespace

Reply decodeReply(wire::ServerFrame::Reader sf) {
  Reply out;
  out.ackSeq = sf.getAckSeq();
  for (auto r : sf.getResults()) {
    switch (r.which()) {
    case wire::Result::DATA: {
      auto d = r.getData();
      out.data.emplace_back(reinterpret_cast<const char *>(d.begin()), d.size());
      break;
    }
    case wire::Result::METAS:
      out.metas.emplace_back();
      for (auto m : r.getMetas()) {
        out.metas.back().emplace_back();
        wire::decodeMeta(m, out.metas.back().back());
      }
      break;
    case wire::Result::STATS: out.stats.push_back(decodeStats(r.getStats())); break;
    case wire::Result::MEMORY: {
      auto m = r.getMemory();
      out.memory.push_back({m.getDevice(), m.getName(), m.getAllocated(), m.getAllocatedPeak(),
                            m.getReserved(), m.getReservedPeak(), m.getFree(), m.getTotal(),
                            m.getMultiProcessors(), m.getMajor(), m.getMinor()});
      break;
    }
    case wire::Result::TEXT: out.texts.push_back(r.getText()); break;
    case wire::Result::PRESENT:
      out.present.emplace_back();
      for (bool p : r.getPresent())
        out.present.back().push_back(p);
      break;
    case wire::Result::FILES:
      out.files.emplace_back();
      for (auto e : r.getFiles())
        out.files.back().push_back({e.getName(), e.getSize(), e.getDirectory()});
      break;
    case wire::Result::RECORDS:
      out.records.emplace_back();
      for (auto rec : r.getRecords()) {
        ArchiveRecord a;
        a.name = rec.getName();
        if (rec.isData()) {
          a.data.assign(reinterpret_cast<const char *>(rec.getData().begin()),
                        rec.getData().size());
          a.size = a.data.size();
        } else {
          ir::TensorMeta m;
          a.handle = rec.getTensor().getHandle();
          if (wire::decodeMeta(rec.getTensor().getMeta(), m) && m.storageBytes() > 0)
            a.size = uint64_t(m.storageBytes());
        }
        out.records.back().push_back(std::move(a));
      }
      break;
    case wire::Result::RNG_STATE: {
      auto g = r.getRngState();
      out.rngStates.push_back(
          {std::string(reinterpret_cast<const char *>(g.getState().begin()), g.getState().size()),
           g.getInitialSeed()});
      break;
    }
    default: break;
    }
  }
  for (auto note : sf.getNotes())
    out.notes.emplace_back(note.cStr());
  if (sf.hasError()) {
    auto e = sf.getError();
    RemoteError error;
    error.fatal = e.getKind() != wire::Error::Kind::REMOTE;
    error.op = e.getOp();
    error.location = e.getLocation();
    error.message = e.getMessage();
    error.pythonType = e.getPythonType();
    error.graph = wire::decodeHash(e.getGraph());
    error.node = e.getNode();
    out.error = std::move(error);
  }
  return out;
}

} // namespace rgpu::client
