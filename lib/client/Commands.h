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
  /// Named by its content: the BLAKE2b-256 of all its bytes, and, if \p stored, the server's
  /// store has them and no bytes are sent.
  std::optional<ir::Hash256> digest;
  bool stored = false;
};

/// Asks which of \p digests the server's content store holds for this principal.
struct HasContent {
  std::vector<ir::Hash256> digests;
};

/// A tensor of the session, as a file's bytes in the layout \p meta.
struct StoredTensor {
  uint64_t handle = 0;
  ir::TensorMeta meta;
};

/// A request of the server's files area for \p path (wire::FileRequest); one of:
namespace file {
struct List {};
struct Read {
  uint64_t offset = 0, length = 0;
};
struct Write {
  uint64_t offset = 0;
  /// Bytes, or a tensor's bytes, in order.
  std::vector<std::variant<std::string, StoredTensor>> parts;
  bool commit = false;
  std::optional<ir::Hash256> digest;
};
struct Remove {};
struct Tensor {
  uint64_t handle = 0, offset = 0;
  ir::TensorMeta meta;
  uint8_t device = 0;
};
struct Gather {
  uint64_t handle = 0, index = 0, rows = 0, offset = 0;
  int8_t dtype = 0;
  std::vector<int64_t> rowSizes;
  uint8_t device = 0;
};
/// Records of a torch.save archive, by name: bytes, or a tensor's.
struct SaveArchive {
  std::vector<std::pair<std::string, std::variant<std::string, StoredTensor>>> records;
};
struct LoadArchive {
  uint64_t firstHandle = 0;
  uint8_t device = 0;
};
} // namespace file

struct File {
  std::string path;
  std::variant<file::List, file::Read, file::Write, file::Remove, file::Tensor, file::Gather,
               file::SaveArchive, file::LoadArchive>
      op;
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
                             command::HostStore, command::JoinGroup, command::HasContent,
                             command::File>;

} // namespace rgpu::client
