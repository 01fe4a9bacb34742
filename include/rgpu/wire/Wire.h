//===- rgpu/wire/Wire.h - Graphs and frames on the wire ---------------------===//
//
// Conversion between ir::Graph and its Cap'n Proto form, and the limits every reader applies.
// This is a trust boundary: decoding never trusts a count or an index it has not checked, and a
// malformed message is an error string, never a crash.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"
#include "rgpu.capnp.h" // generated from lib/wire/rgpu.capnp

#include <capnp/message.h>
#include <llvm/ADT/STLFunctionalExtras.h>

#include <string>

namespace rgpu::wire {

/// Wire protocol version; bumped on any incompatible schema change.
constexpr uint32_t kProtocolVersion = 13;
/// The most devices one server has (rgpu-opserver --devices).
constexpr int kMaxDevices = 64;

/// Limits applied to every message a peer sends.
struct Limits {
  /// Largest frame accepted (data frames carry uploads); larger frames close the connection.
  uint64_t maxFrameBytes = uint64_t(1) << 30;
  /// Uploads and downloads larger than this are split into chunks of this size.
  uint64_t uploadChunkBytes = uint64_t(64) << 20;
  /// The most bytes one Download may ask for (a Cap'n Proto Data blob holds under 512 MiB).
  uint64_t maxDownloadBytes = uint64_t(256) << 20;
  /// The largest tensor a graph may hold or an upload may carry, in bytes; graphs whose
  /// values are larger are refused at Define (rgpu-opserver --max-tensor-mib).
  uint64_t maxTensorBytes = uint64_t(1) << 40;
  /// Cap'n Proto nesting limit: our schema nests at most 6 deep.
  int nestingLimit = 16;
  /// The largest graph accepted, in nodes.
  uint32_t maxNodes = 1u << 20;
  /// The most output handles a Run of a graph the server does not hold may poison.
  uint32_t maxRunOutputs = 1u << 16;
  /// The most commands one frame may carry; a frame with more is refused and its connection
  /// closed.
  uint32_t maxCommands = 1u << 20;
  /// The most handles one Release may name.
  uint32_t maxReleaseHandles = 1u << 20;
  /// The most tensor bytes one reply may carry, all its downloads together (a Download past
  /// it is an error; the client's download groups stay within it).
  uint64_t maxReplyDataBytes = uint64_t(256) << 20;
};

/// Reader options for a frame of \p frameBytes. The traversal limit, which also bounds what the
/// reader allocates, is tied to the frame's size: twice the words sent for a flat frame, and for a
/// packed one a bounded expansion (packing turns a run of zero words into two bytes), never more
/// than the frame limit.
capnp::ReaderOptions readerOptions(const Limits &limits, uint64_t frameBytes, bool packed);

void encodeMeta(const ir::TensorMeta &m, TensorMeta::Builder b);
/// Returns false if the meta is malformed (rank mismatch, bad dtype, negative size).
bool decodeMeta(TensorMeta::Reader r, ir::TensorMeta &m);

void encodeGraph(const ir::Graph &g, Graph::Builder b);
/// Fails, saying why, if an op name is refused.
using OpCheck = llvm::function_ref<llvm::Error(llvm::StringRef)>;
/// Decodes and structurally verifies a graph; a failure says what is wrong. With \p check,
/// every op name is checked before it is interned, so a refused graph leaves no name behind in
/// the process.
[[nodiscard]] llvm::Error decodeGraph(Graph::Reader r, const Limits &limits, ir::Graph &g,
                                      OpCheck check = nullptr);

void encodeScalar(const ir::ScalarValue &v, ScalarValue::Builder b);
ir::ScalarValue decodeScalar(ScalarValue::Reader r);

inline void encodeHash(const ir::Hash256 &h, Hash::Builder b) {
  b.setW0(h.w[0]);
  b.setW1(h.w[1]);
  b.setW2(h.w[2]);
  b.setW3(h.w[3]);
}
inline ir::Hash256 decodeHash(Hash::Reader r) {
  return {{r.getW0(), r.getW1(), r.getW2(), r.getW3()}};
}

} // namespace rgpu::wire
