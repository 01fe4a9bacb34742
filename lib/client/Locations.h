//===- lib/client/Locations.h - The user's source lines, interned ----------===//
//
// Traced nodes, sync sites and error messages name the user's line ("train.py:12") by a small
// id. The table has a lock of its own: a line is interned while Python's GIL is held, before
// the session lock is taken. Id 0 is the empty location.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <llvm/ADT/StringMap.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace rgpu::client {

class Locations {
public:
  /// The id of \p loc, interned at its first sight.
  uint32_t intern(const std::string &loc) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = ids_.try_emplace(loc, uint32_t(texts_.size()));
    if (inserted)
      texts_.push_back(loc);
    return it->second;
  }
  /// The text of location \p id (empty for an unknown id).
  std::string text(uint32_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return id < texts_.size() ? texts_[id] : texts_[0];
  }

private:
  std::mutex mu_;
  llvm::StringMap<uint32_t> ids_;
  std::vector<std::string> texts_{std::string()};
};

} // namespace rgpu::client
