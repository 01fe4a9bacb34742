//===- server/Results.h - What a frame's commands answer -------------------===//
//
// One small record per kind of wire::Result, gathered while a frame's commands run and encoded
// into the reply once they all have (STATS and MEMORY report the figures as the frame ends,
// after its runs). Internal to the session's files.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Files.h"
#include "Session.h"

#include <variant>

namespace rgpu::server {

namespace result {
/// Hello's answer: the server's versions, devices and limits; \p serverMac over TCP.
struct Hello {
  std::string serverMac;
};
/// A Download's bytes; empty if it failed (the frame's error says why).
struct Data {
  kj::Array<kj::byte> bytes;
};
/// The metas of a Run's outputs, when the Run asks for them.
struct Metas {
  std::vector<ir::TensorMeta> metas;
};
/// rgpu.server_stats().
struct Stats {};
/// The memory figures of rgpu:device.
struct Memory {
  uint8_t device = 0;
};
/// HostStore's rendezvous address, JoinGroup's group name.
struct Text {
  std::string text;
};
/// A generator's state and its initial seed; empty if the generator refused a state.
struct RngState {
  kj::Array<kj::byte> state;
  uint64_t initialSeed = 0;
};
/// Sync's answer.
struct Done {};
/// HasContent's answer: per digest, whether the principal's store holds it.
struct Present {
  std::vector<bool> present;
};
/// A files-area listing.
struct Files {
  std::vector<FilesArea::Entry> entries;
};
/// A torch.save archive's records: small ones with their bytes, storages bound to handles.
struct Records {
  struct Record {
    std::string name;
    std::string data;
    std::optional<uint64_t> handle; ///< a storage: bound to it, a uint8 tensor of `size` bytes
    uint64_t size = 0;
  };
  std::vector<Record> records;
};
} // namespace result

using Result = std::variant<result::Hello, result::Data, result::Metas, result::Stats,
                            result::Memory, result::Text, result::RngState, result::Done,
                            result::Present, result::Files, result::Records>;

/// The results of the frame being served, in the order of its commands.
struct Session::Reply {
  std::vector<Result> results;
  /// The bytes its Downloads carry: all of them together stay within maxReplyDataBytes.
  uint64_t downloadBytes = 0;
  /// The client asked for a reply (a protocol error gets one anyway).
  bool wanted = false;
  /// A command (a Hello taking over a session, a JoinGroup) waits: the frame is served again
  /// later, from that command, which must begin it.
  bool deferred = false;

  /// Appends \p r; the reference lasts until the next add.
  template <class T> T &add(T r) {
    results.emplace_back(std::move(r));
    return std::get<T>(results.back());
  }
};

} // namespace rgpu::server
