//===- lib/client/ReadCache.h - Reads answered without a round trip --------===//
//
// A program may read the same small value again and again (Hugging Face's `generate` asks
// before every token whether an attention mask is all ones). A read of a pending value of at
// most 256 bytes is keyed by what computes it (readKey), and its bytes are remembered under
// that key: the same key again gives the same bytes, because a handle is never reused and
// device data never changes (a write makes new data), so an entry can only be stale by being
// unreachable. A download group (rgpu.download_together) keeps what one read fetched for the
// reads of the group's other tensors.
//
// Used under the session lock.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/client/LazyTensor.h"

#include <llvm/ADT/DenseMap.h>

#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace rgpu::client {

/// Small values read before, least recently read first, at most kMaxEntries.
class ReadCache {
public:
  static constexpr size_t kMaxEntries = 256;
  /// Reads of more bytes than this are not remembered (nor the bytes of device data read).
  static constexpr int64_t kMaxBytes = 256;

  /// The bytes remembered under \p key, now the most recently read; null if none.
  const at::Tensor *find(const std::string &key);
  /// Remembers \p value under \p key, forgetting the least recently read entry if full.
  void remember(std::string key, at::Tensor value);
  void clear() {
    entries_.clear();
    index_.clear();
  }

private:
  using Entries = std::list<std::pair<std::string, at::Tensor>>;
  Entries entries_;
  std::unordered_map<std::string, Entries::iterator> index_;
};

/// The key of a read of pending \p v in layout \p want: the trace of the nodes that compute it
/// (readTrace, at most a few, all aten and none random), its positions and scalar values, and
/// the handles it reads. None if such a read is not remembered (too large, random, outside
/// aten, or reading data of a session lost before \p firstHandle).
std::optional<std::string> readKey(const Value &v, const ir::TensorMeta &want,
                                   uint64_t firstHandle);

/// The tensors of rgpu.download_together not fetched yet, and what the group's reads brought
/// in, keyed by the device data they were read from (kept alive so that the key stays unique).
struct DownloadGroup {
  struct Fetched {
    llvm::IntrusiveRefCntPtr<DeviceData> data;
    at::Tensor cpu;
    bool taken = false; ///< The first reader takes `cpu`; later ones get copies.
  };
  std::vector<at::Tensor> members;
  llvm::DenseMap<DeviceData *, Fetched> fetched;

  void clear() {
    members.clear();
    fetched.clear();
  }
};

} // namespace rgpu::client
