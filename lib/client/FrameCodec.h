//===- lib/client/FrameCodec.h - The client's side of the frame format -----===//
//
// The one place where the client writes commands into a wire::ClientFrame and reads a
// wire::ServerFrame back into values. Neither side of it waits, sends or knows about tensors:
// the session decides what to queue and what a reply's results mean.
//
// A Run's arguments go through wire::RunArgsWriter (rgpu/wire/RunArgs.h): relative to the
// graph's latest run where the server holds that run too.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Commands.h"

#include "rgpu/client/Replies.h"

#include <llvm/ADT/ArrayRef.h>

#include <map>
#include <optional>

namespace rgpu::client {

/// Writes commands into client frames.
class FrameEncoder {
public:
  /// Writes \p commands into \p frame's command list, then \p releases as (first, count)
  /// ranges, last: a handle released here may be an input of a run in this very frame.
  /// Returns the bytes of tensor data the frame carries.
  uint64_t encode(wire::ClientFrame::Builder frame, llvm::ArrayRef<Command> commands,
                  std::vector<uint64_t> releases);
  /// Forgets every graph's latest run (a new session).
  void clear() { runArgs_.clear(); }

private:
  void put(const command::Define &c, wire::Command::Builder b);
  void put(const command::Run &c, wire::Command::Builder b);
  void put(const command::Upload &c, wire::Command::Builder b);
  void put(const command::Download &c, wire::Command::Builder b);
  void put(const command::Forget &c, wire::Command::Builder b);
  void put(const command::Seed &c, wire::Command::Builder b);
  void put(const command::Stats &c, wire::Command::Builder b);
  void put(const command::Memory &c, wire::Command::Builder b);
  void put(const command::Sync &c, wire::Command::Builder b);
  void put(const command::Generator &c, wire::Command::Builder b);
  void put(const command::RngState &c, wire::Command::Builder b);
  void put(const command::HostStore &c, wire::Command::Builder b);
  void put(const command::JoinGroup &c, wire::Command::Builder b);
  void put(const command::HasContent &c, wire::Command::Builder b);
  void put(const command::File &c, wire::Command::Builder b);

  wire::RunArgsWriter runArgs_;
};

/// A failure the server reported in a frame.
struct RemoteError {
  bool fatal = false; ///< It ends the session (wire::Error.kind other than REMOTE).
  std::string op, location, message;
  std::string pythonType; ///< wire::Error.pythonType: the exception CPU eager raises for it.
  ir::Hash256 graph;      ///< Where it failed: a node of this graph, if any.
  uint32_t node = 0;
};

/// A server frame, read: its results in order, per kind.
struct Reply {
  uint64_t ackSeq = 0;                            ///< The last frame the server executed.
  std::vector<std::string> data;                  ///< Every Download's bytes, in command order.
  std::vector<std::vector<ir::TensorMeta>> metas; ///< Runs that asked for their outputs' metas.
  std::vector<ServerStats> stats;
  std::vector<DeviceMemory> memory;
  std::vector<std::string> texts; ///< HostStore and JoinGroup answers.
  std::vector<RngState> rngStates;
  std::vector<std::vector<bool>> present; ///< HasContent answers.
  std::vector<std::vector<FileEntry>> files; ///< Files-area listings.
  std::vector<std::vector<ArchiveRecord>> records; ///< LoadArchive answers.
  std::vector<std::string> notes; ///< For the log.
  std::optional<RemoteError> error;
};

/// Reads \p frame. A malformed frame throws kj::Exception, as Cap'n Proto's readers do.
Reply decodeReply(wire::ServerFrame::Reader frame);

} // namespace rgpu::client
