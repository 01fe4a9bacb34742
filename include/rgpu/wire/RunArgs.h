//===- rgpu/wire/RunArgs.h - A Run's arguments, whole or relative ------------===//
//
// The one codec for what a Run binds (wire::Run's `whole` and `relative` arms) and for the
// handles a frame releases. The client writes with RunArgsWriter, the server reads with
// RunArgsReader; both remember each graph's latest run, so a steady training step (the same
// graph on the previous step's outputs, mostly the same scalars) says only what changed:
// its input handles as (delta, count) pairs, its scalars as the slots that changed and a
// table of their distinct values, its restores only if they changed.
//
// Reading is a trust boundary: every count and index is checked against the graph's shape,
// and a failed read forgets the graph's latest run, so a later relative Run fails loudly
// instead of binding handles the two sides no longer agree on.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Error.h"
#include "rgpu/ir/Graph.h"
#include "rgpu.capnp.h" // generated from lib/wire/rgpu.capnp

#include <map>
#include <vector>

namespace rgpu::wire {

/// What one Run binds.
struct RunArgs {
  std::vector<uint64_t> inputs;         ///< Input handles, in canonical input order.
  std::vector<ir::ScalarValue> scalars; ///< Scalar values, in canonical slot order.
  /// (output k, input i) pairs: if the run is cancelled, output k binds input i's tensor.
  std::vector<uint32_t> restores;
};

/// What a graph expects of its runs' arguments.
struct RunShape {
  size_t inputs = 0, scalars = 0, outputs = 0;
};

/// Each graph's latest run, as one side of a session remembers it.
class RunMemory {
public:
  /// Forgets \p graph's latest run (a Forget of the graph, on both sides).
  void forget(const ir::Hash256 &graph) { last_.erase(graph); }
  /// Forgets every graph's (a new session).
  void clear() { last_.clear(); }

protected:
  std::map<ir::Hash256, RunArgs> last_;
};

/// The client's side: writes a Run's arguments, relative to the graph's latest run if the
/// server holds that run too.
class RunArgsWriter : public RunMemory {
public:
  void write(const ir::Hash256 &graph, const RunArgs &args, Run::Builder r);
};

/// The server's side: reads a Run's arguments back and checks them against \p shape.
class RunArgsReader : public RunMemory {
public:
  [[nodiscard]] llvm::Expected<RunArgs> read(const ir::Hash256 &graph, Run::Reader r,
                                             const RunShape &shape);
};

/// Whether two scalar values are equal as stored (a NaN equals itself).
bool sameBits(const ir::ScalarValue &a, const ir::ScalarValue &b);

/// \p handles as (first, count) ranges, ascending, each handle once: a step releases the
/// previous step's outputs, which have consecutive handles.
std::vector<uint64_t> releaseRanges(std::vector<uint64_t> handles);

/// Checks a ReleaseRanges command: (first, count) pairs naming at most \p maxHandles handles.
[[nodiscard]] llvm::Error checkReleaseRanges(capnp::List<uint64_t>::Reader ranges,
                                             uint64_t maxHandles);

} // namespace rgpu::wire
