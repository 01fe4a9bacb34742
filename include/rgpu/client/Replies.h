//===- rgpu/client/Replies.h - What the server answers the client's questions with -===//
//
// Plain values, decoded from the server's frames in one place (lib/client/FrameCodec.cpp), so
// that the Python glue and the rest of the client never read the wire themselves.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <cstdint>
#include <string>
#include <vector>

namespace rgpu::client {

/// What the server said of itself when the session began.
struct ServerHello {
  uint32_t protocol = 0;
  std::string torchVersion, device, compiler;
  std::vector<std::string> devices; ///< rgpu:i is devices[i] on the server
};

/// The server's counters, and this session's on the server (rgpu.server_stats()): the
/// server's wire::ServerStats as a Cap'n Proto message of its own (flat words), which the Python
/// glue reads field by field through Cap'n Proto's dynamic API, so that a counter the server
/// adds needs no code here.
struct ServerStats {
  std::string message;
};

/// The server device's memory figures and properties (torch.rgpu.memory_allocated and the rest).
struct DeviceMemory {
  std::string device, name;
  uint64_t allocated = 0, allocatedPeak = 0, reserved = 0, reservedPeak = 0, free = 0, total = 0;
  uint32_t multiProcessors = 0, major = 0, minor = 0;
};

/// The state of one of the session's generators on the server.
struct RngState {
  std::string state;
  uint64_t initialSeed = 0;
};

/// An entry of the server's files area.
struct FileEntry {
  std::string name;
  uint64_t size = 0;
  bool directory = false;
};

/// A record of a torch.save archive the server read: its bytes, or (a storage) the handle the
/// server bound to its bytes, a uint8 tensor of \p size.
struct ArchiveRecord {
  std::string name, data;
  uint64_t handle = 0; ///< 0: not a storage
  uint64_t size = 0;
};

} // namespace rgpu::client
