//===- lib/client/GraphBudget.h - Which graphs the server holds for us -----===//
//
// The server holds a session's graphs within a budget of bytes (ir::graphBytes) that its Hello
// reply announces (--graph-memory). The client keeps the same account, most recently run
// first, and before a Define that would pass the budget it forgets the least recently run
// graphs: the Forget goes out after the runs already queued, and a graph run again later is
// defined again. Both sides count the same bytes, so the server never has to refuse.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <cstdint>
#include <list>
#include <map>
#include <vector>

namespace rgpu::client {

class GraphBudget {
public:
  /// Whether the server holds \p hash.
  bool holds(const ir::Hash256 &hash) const { return index_.count(hash) != 0; }
  /// Marks \p hash as just run; false if the server does not hold it.
  bool touch(const ir::Hash256 &hash);
  /// Records that the server holds \p hash (not held yet), of \p bytes, from its next Define
  /// on. Returns the least recently run graphs it must forget first so that everything fits in
  /// \p budget (0: no limit). The new graph is admitted even if it alone is over the budget:
  /// the server is then the one to refuse it.
  std::vector<ir::Hash256> admit(const ir::Hash256 &hash, uint64_t bytes, uint64_t budget);
  /// The bytes of the graphs held.
  uint64_t bytes() const { return bytes_; }
  size_t size() const { return held_.size(); }
  void clear();

private:
  std::list<std::pair<ir::Hash256, uint64_t>> held_; ///< Most recently run first.
  std::map<ir::Hash256, std::list<std::pair<ir::Hash256, uint64_t>>::iterator> index_;
  uint64_t bytes_ = 0;
};

} // namespace rgpu::client
