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

/// The server's counters, and this session's on the server (rgpu.server_stats()).
struct ServerStats {
  uint64_t planBuilds = 0, graphsCached = 0, graphRuns = 0, sessions = 0;
  uint64_t sessionGraphRuns = 0, sessionExecuteNs = 0, sessionTensors = 0;
  std::string compiler;
  uint64_t inductorCompiles = 0, compilesPending = 0, compileFailures = 0, diskCacheHits = 0;
  uint64_t compiledRuns = 0, sessionCompiledRuns = 0, sessionWritesInPlace = 0,
           sessionRunsCancelled = 0;
  uint64_t connections = 0, connectionsRefused = 0;
  uint64_t sessionMemory = 0, sessionMemoryPeak = 0, sessionMemoryQuota = 0,
           sessionMemoryRefused = 0, memoryHeld = 0, memoryKept = 0, memoryLimit = 0;
  std::vector<uint64_t> sessionMemories;
  uint64_t sessionGraphBytes = 0, graphBudget = 0, graphsForgotten = 0, planEvictions = 0,
           compiledEvictions = 0, diskEvictions = 0, compilesDropped = 0;
  uint64_t sessionsParked = 0, resumes = 0, sessionsExpired = 0;
  struct Graph {
    ir::Hash256 hash;
    uint32_t nodes = 0;
    uint64_t runs = 0, executeNs = 0, buildNs = 0;
    std::string executor;
    uint64_t compiledRuns = 0;
  };
  std::vector<Graph> graphs;
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

} // namespace rgpu::client
