#include "GraphBudget.h"

namespace rgpu::client {

bool GraphBudget::touch(const ir::Hash256 &hash) {
  auto it = index_.find(hash);
  if (it == index_.end())
    return false;
  held_.splice(held_.begin(), held_, it->second);
  return true;
}

std::vector<ir::Hash256> GraphBudget::admit(const ir::Hash256 &hash, uint64_t bytes,
                                            uint64_t budget) {
  std::vector<ir::Hash256> forgotten;
  while (budget && bytes_ + bytes > budget && !held_.empty()) {
    auto [victim, victimBytes] = held_.back();
    forgotten.push_back(victim);
    index_.erase(victim);
    bytes_ -= victimBytes;
    held_.pop_back();
  }
  held_.emplace_front(hash, bytes);
  index_[hash] = held_.begin();
  bytes_ += bytes;
  return forgotten;
}

void GraphBudget::clear() {
  held_.clear();
  index_.clear();
  bytes_ = 0;
}

} // namespace rgpu::client
