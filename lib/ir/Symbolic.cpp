#include "rgpu/ir/Symbolic.h"

#include <llvm/ADT/STLExtras.h>

#include <algorithm>

namespace rgpu::ir {

bool SymExpr::eval(llvm::ArrayRef<int64_t> s, int64_t &out) const {
  int64_t v = coef;
  for (uint16_t f : factors)
    if (f >= s.size() || __builtin_mul_overflow(v, s[f], &v))
      return false;
  return !__builtin_add_overflow(v, offset, &out);
}

std::string SymExpr::str() const {
  std::string s;
  if (factors.empty())
    return std::to_string(coef + offset);
  if (coef == -1)
    s = "-";
  else if (coef != 1)
    s = std::to_string(coef) + "*";
  for (size_t k = 0; k < factors.size(); ++k)
    s += (k ? "*s" : "s") + std::to_string(factors[k]);
  if (offset > 0)
    s += "+" + std::to_string(offset);
  else if (offset < 0)
    s += std::to_string(offset);
  return s;
}

std::vector<int64_t> positions(const Graph &g) {
  std::vector<int64_t> out;
  forEachPosition(g, [&](int64_t v) { out.push_back(v); });
  return out;
}

namespace {

/// c and d with v[k] == c * x[k] + d for every observation k (d == 0 unless \p offset), c != 0.
bool fitAffine(llvm::ArrayRef<int64_t> x, llvm::ArrayRef<int64_t> v, bool offset, int64_t &c,
               int64_t &d) {
  size_t k1 = 1;
  while (k1 < x.size() && x[k1] == x[0])
    ++k1;
  if (k1 == x.size())
    return false; // x never varies, v does
  int64_t dv, dx;
  if (__builtin_sub_overflow(v[k1], v[0], &dv) || __builtin_sub_overflow(x[k1], x[0], &dx) ||
      dv % dx != 0)
    return false;
  c = dv / dx;
  int64_t cx;
  if (c == 0 || __builtin_mul_overflow(c, x[0], &cx) || __builtin_sub_overflow(v[0], cx, &d) ||
      (!offset && d != 0))
    return false;
  for (size_t k = 0; k < x.size(); ++k) {
    int64_t y;
    if (__builtin_mul_overflow(c, x[k], &y) || __builtin_add_overflow(y, d, &y) || y != v[k])
      return false;
  }
  return true;
}

/// Per position of \p g (\p n of them), whether it is one of an input's sizes.
std::vector<bool> inputSizePositions(const Graph &g, size_t n) {
  std::vector<bool> out(n, false);
  size_t p = 0;
  for (const TensorMeta &m : g.inputs) {
    for (size_t d = 0; d < m.sizes.size() && p + d < n; ++d)
      out[p + d] = true;
    p += m.sizes.size() + m.strides.size();
  }
  return out;
}

} // namespace

bool generalize(const Graph &sample, llvm::ArrayRef<std::vector<int64_t>> observations,
                uint32_t &symbolCount, std::vector<SymbolicInt> &symbolic, uint32_t maxSymbols) {
  if (observations.size() < 2)
    return false;
  const size_t n = observations[0].size(), k = observations.size();
  for (const auto &o : observations)
    if (o.size() != n)
      return false;
  // Positions that are input sizes: these are symbols themselves, never expressions.
  const std::vector<bool> inputSize = inputSizePositions(sample, n);
  symbolCount = 0;
  symbolic.clear();
  std::vector<std::vector<int64_t>> sym; // per symbol, its value in each observation
  llvm::SmallVector<int64_t, 8> v(k), x(k);
  for (size_t p = 0; p < n; ++p) {
    bool varies = false;
    for (size_t j = 0; j < k; ++j) {
      v[j] = observations[j][p];
      varies |= v[j] != v[0];
    }
    if (!varies)
      continue;
    SymbolicInt s;
    s.position = p;
    bool found = false;
    // Candidates, simplest first: a symbol itself, a multiple of one, of a product of two (or a
    // square), then the same with an offset. Products come before offsets: two observations of
    // t*t fit some c*t+d too, which the third shape would refute. An input's size may only be a symbol itself.
    for (int offset = 0; offset < 2 && !found; ++offset) {
      for (size_t a = 0; a < sym.size() && !found; ++a) {
        int64_t c, d;
        if (fitAffine(sym[a], v, offset, c, d) && (!inputSize[p] || (c == 1 && d == 0))) {
          s.expr = {c, d, {uint16_t(a)}};
          found = true;
        }
      }
      for (size_t a = 0; a < sym.size() && !found && !inputSize[p]; ++a)
        for (size_t b = a; b < sym.size() && !found; ++b) { // a square too: t*t scores
          bool ok = true;
          for (size_t j = 0; j < k && ok; ++j)
            ok = !__builtin_mul_overflow(sym[a][j], sym[b][j], &x[j]);
          int64_t c, d;
          if (ok && fitAffine(x, v, offset, c, d)) {
            s.expr = {c, d, {uint16_t(a), uint16_t(b)}};
            found = true;
          }
        }
    }
    if (!found) {
      if (symbolCount == maxSymbols)
        return false;
      s.expr = {1, 0, {uint16_t(symbolCount++)}};
      sym.emplace_back(v.begin(), v.end());
    }
    symbolic.push_back(std::move(s));
  }
  return symbolCount > 0;
}

bool generalizeHinted(const Graph &sample, llvm::ArrayRef<uint32_t> hinted,
                      uint32_t &symbolCount, std::vector<SymbolicInt> &symbolic,
                      uint32_t maxSymbols) {
  const std::vector<int64_t> values = positions(sample);
  const std::vector<bool> inputSize = inputSizePositions(sample, values.size());
  // The values that are symbols; each one is numbered where it is first met.
  llvm::SmallVector<int64_t, 8> symbolValues;
  for (uint32_t p : hinted)
    if (p < values.size() && inputSize[p] && values[p] >= 2 &&
        !llvm::is_contained(symbolValues, values[p]))
      symbolValues.push_back(values[p]);
  llvm::SmallVector<int, 8> id(symbolValues.size(), -1); // per value, its symbol once met
  llvm::SmallVector<int64_t, 8> known;                   // per symbol, its value
  symbolCount = 0;
  symbolic.clear();
  size_t nextHint = 0;
  for (size_t p = 0; p < values.size(); ++p) {
    bool isHinted = nextHint < hinted.size() && hinted[nextHint] == p;
    nextHint += isHinted;
    if (inputSize[p] && !isHinted)
      continue; // an undeclared input keeps its sizes
    const int64_t v = values[p];
    auto at = llvm::find(symbolValues, v);
    if (at != symbolValues.end()) {
      int &k = id[at - symbolValues.begin()];
      if (k < 0) {
        if (symbolCount == maxSymbols)
          return false;
        k = int(symbolCount++);
        known.push_back(v);
      }
      symbolic.push_back({p, {1, 0, {uint16_t(k)}}});
      continue;
    }
    if (inputSize[p])
      continue;
    bool found = false;
    for (size_t a = 0; a < known.size() && !found; ++a)
      for (size_t b = a; b < known.size() && !found; ++b) {
        int64_t x;
        if (!__builtin_mul_overflow(known[a], known[b], &x) && x == v) {
          symbolic.push_back({p, {1, 0, {uint16_t(a), uint16_t(b)}}});
          found = true;
        }
      }
  }
  return symbolCount > 0;
}

Graph makeSymbolic(const Graph &concrete, uint32_t symbolCount,
                   std::vector<SymbolicInt> symbolic) {
  Graph g = concrete;
  size_t p = 0, next = 0;
  forEachPosition(g, [&](int64_t &v) {
    if (next < symbolic.size() && symbolic[next].position == p) {
      v = 0;
      ++next;
    }
    ++p;
  });
  g.symbolCount = symbolCount;
  g.symbolic = std::move(symbolic);
  return g;
}

bool matchPositions(const Graph &g, llvm::ArrayRef<int64_t> gPositions,
                    llvm::ArrayRef<int64_t> concrete, llvm::SmallVectorImpl<int64_t> &symbols) {
  if (gPositions.size() != concrete.size())
    return false;
  symbols.assign(g.symbolCount, 0);
  llvm::SmallVector<bool, 8> known(g.symbolCount, false);
  size_t next = 0;
  for (size_t p = 0; p < concrete.size(); ++p) {
    if (next == g.symbolic.size() || g.symbolic[next].position != p) {
      if (gPositions[p] != concrete[p])
        return false;
      continue;
    }
    const SymExpr &e = g.symbolic[next++].expr;
    if (e.coef == 1 && e.offset == 0 && e.factors.size() == 1 && !known[e.factors[0]]) {
      symbols[e.factors[0]] = concrete[p];
      known[e.factors[0]] = true;
      continue;
    }
    int64_t want;
    for (uint16_t f : e.factors)
      if (!known[f])
        return false;
    if (!e.eval(symbols, want) || want != concrete[p])
      return false;
  }
  return std::all_of(known.begin(), known.end(), [](bool b) { return b; });
}

bool instantiate(Graph &g, llvm::ArrayRef<int64_t> symbols) {
  if (symbols.size() != g.symbolCount)
    return false;
  size_t p = 0, next = 0;
  bool ok = true;
  forEachPosition(g, [&](int64_t &v) {
    if (next < g.symbolic.size() && g.symbolic[next].position == p)
      ok &= g.symbolic[next++].expr.eval(symbols, v);
    ++p;
  });
  g.symbolCount = 0;
  g.symbolic.clear();
  return ok;
}

std::vector<std::string> symbolSources(const Graph &g) {
  std::vector<std::string> out(g.symbolCount);
  llvm::SmallVector<uint64_t, 8> source(g.symbolCount, ~uint64_t(0));
  for (const SymbolicInt &s : g.symbolic)
    if (s.expr.coef == 1 && s.expr.offset == 0 && s.expr.factors.size() == 1 &&
        source[s.expr.factors[0]] == ~uint64_t(0))
      source[s.expr.factors[0]] = s.position;
  uint64_t p = 0;
  auto name = [&](uint64_t at, const std::string &what) {
    for (uint32_t k = 0; k < g.symbolCount; ++k)
      if (source[k] == at)
        out[k] = "s" + std::to_string(k) + " = " + what;
  };
  auto meta = [&](const TensorMeta &m, const std::string &what) {
    for (size_t d = 0; d < m.sizes.size(); ++d)
      name(p++, what + " size " + std::to_string(d));
    for (size_t d = 0; d < m.strides.size(); ++d)
      name(p++, what + " stride " + std::to_string(d));
  };
  for (size_t i = 0; i < g.inputs.size(); ++i)
    meta(g.inputs[i], "input " + std::to_string(i));
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    const Node &node = g.nodes[n];
    std::string where = "node " + std::to_string(n) + " (" + node.op.str().str() + ")";
    size_t k = 0;
    for (const Arg &a : node.args)
      if (a.kind == Arg::Kind::Int)
        name(p++, where + " integer argument " + std::to_string(k++));
    for (size_t o = 0; o < node.outputs.size(); ++o)
      meta(node.outputs[o], where + " output " + std::to_string(o));
  }
  return out;
}

bool ShapeFamilies::fit(const Graph &concrete, const Hash256 &hash, Fit &out,
                        llvm::ArrayRef<uint32_t> hinted) {
  auto it = memo_.find(hash);
  if (it != memo_.end()) {
    out = it->second;
    return out.graph != nullptr;
  }
  bool symbolic = fitNew(concrete, hinted, out);
  if (out.isNew)
    memo_.clear(); // graphs that ran as themselves may fit the new one
  if (memo_.size() >= kMaxMemo)
    memo_.clear();
  Fit &m = memo_[hash];
  if (symbolic) {
    m = out;
    m.isNew = m.fromHints = false;
  }
  return symbolic;
}

bool ShapeFamilies::fitNew(const Graph &concrete, llvm::ArrayRef<uint32_t> hinted, Fit &out) {
  out.isNew = out.fromHints = false;
  Hash256 key = skeletonHash(concrete);
  Family &family = families_[key];
  std::vector<int64_t> values = positions(concrete);
  for (auto it = family.graphs.rbegin(); it != family.graphs.rend(); ++it)
    if (matchPositions(*it->graph, it->positions, values, out.symbols)) {
      out.graph = it->graph;
      out.hash = it->hash;
      out.isNew = false;
      return true;
    }
  uint32_t count;
  std::vector<SymbolicInt> symbolic;
  if (!family.first) {
    family.first = std::make_unique<Graph>(concrete);
    family.observed.push_back(std::move(values));
    if (hinted.empty() || !generalizeHinted(concrete, hinted, count, symbolic))
      return false;
    out.fromHints = true;
    return adopt(family, count, std::move(symbolic), out);
  }
  if (std::find(family.observed.begin(), family.observed.end(), values) != family.observed.end() ||
      family.graphs.size() == kMaxGraphs)
    return false;
  if (family.observed.size() == kMaxObserved)
    family.observed.erase(family.observed.begin() + 1); // keep the first: it made the skeleton
  family.observed.push_back(std::move(values));
  return generalize(*family.first, family.observed, count, symbolic) &&
         adopt(family, count, std::move(symbolic), out);
}

std::vector<ShapeFamilies::Candidate> ShapeFamilies::candidates(const Graph &concrete) const {
  Hash256 key = skeletonHash(concrete);
  auto it = families_.find(key);
  if (it == families_.end())
    return {};
  return {it->second.graphs.rbegin(), it->second.graphs.rend()};
}

bool ShapeFamilies::adopt(Family &family, uint32_t count, std::vector<SymbolicInt> symbolic,
                          Fit &out) {
  Candidate s;
  s.graph = std::make_shared<const Graph>(makeSymbolic(*family.first, count, std::move(symbolic)));
  s.hash = hashGraph(*s.graph);
  s.positions = positions(*s.graph);
  if (!matchPositions(*s.graph, s.positions, family.observed.back(), out.symbols))
    return false; // cannot happen: it was generalized from this very observation
  out.graph = s.graph;
  out.hash = s.hash;
  out.isNew = true;
  family.graphs.push_back(std::move(s));
  ++generation_;
  return true;
}

} // namespace rgpu::ir
