//===- lib/client/Commands.h - What the client queues for its next frame ---===//
//
// One small record per kind of command, matched by type: each field means one thing, for one
// kind. The session queues them; FrameCodec encodes them into a wire::ClientFrame. Nothing
// here refers to torch: an upload's bytes are held by a shared pointer that keeps their owner
// (a private CPU copy) alive until the frame is sent.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"
#include "rgpu/wire/RunArgs.h"
#include "rgpu/wire/Wire.h"

#include <llvm/ADT/SmallVector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace rgpu::client {
namespace command {

/// Defines a graph the server does not hold for this session.
struct Define {
  ir::Hash256 hash;
  std::shared_ptr<const ir::Graph> graph;
  /// A hint: "inductor" compiles at the second run ("inductor:MODE" in a torch.compile mode), "plan"
  /// never; empty: neither.
  std::string executor;
};

/// Runs a graph the server holds. Its outputs get handles firstOutput, firstOutput + 1, ...
struct Run {
  ir::Hash256 hash;
  wire::RunArgs args; ///< Input handles, scalars and restores, in canonical order.
  llvm::SmallVector<int64_t, 4> symbols; ///< The size symbols' values, of a symbolic graph.
  uint64_t firstOutput = 0;
  uint32_t outputs = 0;
  bool replyMetas = false; ///< Answer with the outputs' metas (data-dependent shapes).
};

/// One chunk of a CPU tensor's bytes for handle \p handle.
struct Upload {
  uint64_t handle = 0;
  uint8_t device = 0;
  ir::TensorMeta meta;
  /// The whole tensor's bytes (kept alive by the pointer); the chunk is [offset, offset+length).
  std::shared_ptr<const uint8_t> bytes;
  uint64_t offset = 0, length = 0;
  /// The chunk compressed by byte plane (rgpu/wire/Planes.h); if set, `bytes` is not sent.
  std::string encoded;
};

/// Asks for a tensor's bytes in layout \p meta: all of them (length 0) or one chunk.
struct Download {
  uint64_t handle = 0;
  ir::TensorMeta meta;
  uint64_t offset = 0, length = 0;
};

/// The server forgets these graphs (and their latest run's inputs and scalars).
struct Forget {
  std::vector<ir::Hash256> hashes;
};

/// torch.manual_seed: seeds the session's generator of every device.
struct Seed {
  uint64_t seed = 0;
};

/// Asks for the server's counters (ServerStats).
struct Stats {};

/// Asks for a device's memory figures (DeviceMemory), resetting its peaks or emptying its cache
/// first if asked.
struct Memory {
  uint8_t device = 0;
  bool resetPeak = false, emptyCache = false;
};

/// Asks for a reply once everything before it has run.
struct Sync {};

/// Makes, reseeds, snapshots, restores or drops generator \p id (torch.Generator(device="rgpu")).
struct Generator {
  uint64_t id = 0;
  uint8_t device = 0;
  wire::GeneratorRequest::Which op = wire::GeneratorRequest::CREATE;
  uint64_t arg = 0; ///< The seed (CREATE, SEED) or the generator cloned (CLONE_OF).
};

/// Reads (RngState) or, with \p set, sets the state of a generator: the session's generator of
/// \p device if \p generator is 0.
struct RngState {
  uint8_t device = 0;
  uint64_t generator = 0;
  std::optional<std::string> set;
};

/// Starts the job's rendezvous store on this server; answered with its "host:port".
struct HostStore {};

/// Joins a process group of the job's servers; answered with the group's name.
struct JoinGroup {
  std::string store, prefix;
  uint32_t rank = 0, size = 0, timeoutMs = 0;
};

} // namespace command

/// A command waiting for the next frame.
using Command = std::variant<command::Define, command::Run, command::Upload, command::Download,
                             command::Forget, command::Seed, command::Stats, command::Memory,
                             command::Sync, command::Generator, command::RngState,
                             command::HostStore, command::JoinGroup>;

} // namespace rgpu::client
