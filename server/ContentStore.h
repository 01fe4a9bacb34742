//===- server/ContentStore.h - Uploads kept by their digest, per principal -===//
//
// The bytes of every upload of 1 MiB or more, named by their BLAKE2b-256 digest, on disk
// (--store-dir), so that a principal who uploads the same weights again sends digests, not
// bytes (wire::Command.hasContent, wire::Upload.stored). Each principal has a store of its own:
// nobody can read or fill another principal's entries by naming a digest, and an entry is only
// ever made of bytes the server checked against their digest. All principals' entries together
// stay under --store-size, the least recently used dropped first.
//
// No ATen here.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <string>

namespace rgpu::server {

class ContentStore {
public:
  /// A store in \p dir of at most \p capacity bytes; 0 keeps nothing (every lookup misses).
  /// Entries a store left in \p dir before are kept, oldest used first to go.
  ContentStore(std::string dir, uint64_t capacity);

  bool enabled() const { return capacity_ > 0; }
  /// Whether \p principal's store holds \p digest; a hit counts as a use.
  bool has(const std::string &principal, const ir::Hash256 &digest);
  /// Reads the \p size bytes \p principal's store holds under \p digest into \p out; false if
  /// it holds none of that size (it may have been dropped since has() said it held them).
  bool read(const std::string &principal, const ir::Hash256 &digest, void *out, uint64_t size);
  /// Keeps \p size bytes at \p bytes, which the caller checked against \p digest, for
  /// \p principal. Entries larger than the store, and failures to write, keep nothing.
  void put(const std::string &principal, const ir::Hash256 &digest, const void *bytes,
           uint64_t size);

  uint64_t bytes();
  std::atomic<uint64_t> evictions{0};

private:
  /// "PRINCIPALKEY/DIGEST": the entry's path under dir_.
  std::string key(const std::string &principal, const ir::Hash256 &digest) const;
  void use(const std::string &key);           // under mu_
  void evict(uint64_t room);                  // under mu_

  std::string dir_;
  uint64_t capacity_;
  std::mutex mu_;
  struct Entry {
    uint64_t size;
    std::list<std::string>::iterator lru;
  };
  std::map<std::string, Entry> entries_; ///< under mu_
  std::list<std::string> lru_;           ///< most recently used first, under mu_
  uint64_t bytes_ = 0;                   ///< under mu_
  std::atomic<uint64_t> temporaries_{0};
};

/// A name for \p principal that is one safe path component: the name itself when it is made
/// of letters, digits, '-', '_' and '.' (not first), else a digest of it.
std::string principalDirectory(const std::string &principal);

} // namespace rgpu::server
