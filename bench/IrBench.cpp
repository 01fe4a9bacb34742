// The client's per-cut costs on a 5,000-node graph, without torch: canonicalising it, hashing
// it, and encoding and decoding it as the Cap'n Proto Define that ships it once. And the cost of
// an upload compressed by byte plane, both ways, on a batch of float32 noise and of token ids.
#include "rgpu/ir/Digest.h"
#include "rgpu/ir/Graph.h"
#include "rgpu/net/Seal.h"
#include "rgpu/wire/Planes.h"
#include "rgpu/wire/Wire.h"

#include <benchmark/benchmark.h>
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <llvm/Support/xxhash.h>

#include <cstring>
#include <memory>
#include <random>

using namespace rgpu;

namespace {
constexpr uint32_t kNodes = 5000;

/// A layered MLP-like DAG: every node reads the previous node and one earlier value, with a
/// lifted scalar on every third node, over [64,256] f32 values.
ir::Graph bigGraph() {
  ir::Graph g;
  ir::TensorMeta m = ir::TensorMeta::contiguous(ir::dtype::Float, {64, 256});
  g.inputs = {m, m, m, m};
  for (uint32_t i = 0; i < kNodes; ++i) {
    uint32_t prev = 4 + i - 1, other = (i * 7919) % (4 + i);
    ir::Node n;
    n.outputs = {m};
    if (i % 3 == 0) {
      n.op = ir::Symbol::get("aten::add.Tensor");
      n.operands = {i == 0 ? 0 : prev, other};
      n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0), ir::Arg::ref(ir::Arg::Kind::Tensor, 1),
                ir::Arg::ref(ir::Arg::Kind::Scalar, 0)};
      n.scalars = {uint32_t(g.scalars.size())};
      g.scalars.push_back({ir::dtype::Double, ir::ScalarForm::Scalar});
    } else if (i % 3 == 1) {
      n.op = ir::Symbol::get("aten::mul.Tensor");
      n.operands = {prev, other};
      n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0), ir::Arg::ref(ir::Arg::Kind::Tensor, 1)};
    } else {
      n.op = ir::Symbol::get("aten::sum.dim_IntList");
      n.outputs = {ir::TensorMeta::contiguous(ir::dtype::Float, {64, 256})};
      n.operands = {prev};
      n.args = {ir::Arg::ref(ir::Arg::Kind::Tensor, 0), ir::Arg::ref(ir::Arg::Kind::List, 1),
                ir::Arg::integer(1), ir::Arg::boolean(true), ir::Arg::none()};
    }
    g.nodes.push_back(std::move(n));
  }
  g.outputs = {4 + kNodes - 1, 4 + kNodes / 2};
  return g;
}

const ir::Graph &graph() {
  static ir::Graph g = bigGraph();
  return g;
}

void BM_Canonicalize5000(benchmark::State &state) {
  for (auto _ : state)
    benchmark::DoNotOptimize(ir::canonicalize(graph()));
  state.SetItemsProcessed(state.iterations() * kNodes);
}

void BM_Hash5000(benchmark::State &state) {
  ir::Graph g = ir::canonicalize(graph()).graph;
  for (auto _ : state)
    benchmark::DoNotOptimize(ir::hashGraph(g));
  state.SetItemsProcessed(state.iterations() * kNodes);
}

/// The hash's two parts: serialising the graph into its canonical bytes, and the digest.
void BM_CanonicalBytes5000(benchmark::State &state) {
  ir::Graph g = ir::canonicalize(graph()).graph;
  for (auto _ : state)
    benchmark::DoNotOptimize(ir::canonicalBytes(g));
  state.SetItemsProcessed(state.iterations() * kNodes);
}

/// What the identity cost as two XXH64 passes over the same bytes (the identity before
/// BLAKE2b-256, which a peer could forge): the price of the cryptographic digest is the
/// difference from BM_Hash5000.
void BM_XxHashPair5000(benchmark::State &state) {
  ir::Graph g = ir::canonicalize(graph()).graph;
  for (auto _ : state) {
    std::string bytes = ir::canonicalBytes(g);
    uint64_t first = llvm::xxHash64(bytes);
    bytes[0] ^= 1;
    benchmark::DoNotOptimize(first + llvm::xxHash64(bytes));
  }
  state.SetItemsProcessed(state.iterations() * kNodes);
}

/// The digest that names an upload of 1 MiB or more (the client makes it as the upload is
/// called; the server checks it as the last chunk arrives): bytes a second.
void BM_ContentDigest(benchmark::State &state) {
  std::vector<char> bytes(size_t(state.range(0)), 1);
  for (auto _ : state)
    benchmark::DoNotOptimize(ir::digestOf(bytes.data(), bytes.size()));
  state.SetBytesProcessed(state.iterations() * int64_t(bytes.size()));
}

void BM_Encode5000(benchmark::State &state) {
  ir::Graph g = ir::canonicalize(graph()).graph;
  size_t bytes = 0;
  for (auto _ : state) {
    capnp::MallocMessageBuilder b;
    wire::encodeGraph(g, b.initRoot<wire::Graph>());
    auto words = capnp::messageToFlatArray(b);
    bytes = words.asBytes().size();
    benchmark::DoNotOptimize(words.begin());
  }
  state.counters["bytes"] = double(bytes);
  state.SetItemsProcessed(state.iterations() * kNodes);
}

void BM_Decode5000(benchmark::State &state) {
  ir::Graph g = ir::canonicalize(graph()).graph;
  capnp::MallocMessageBuilder b;
  wire::encodeGraph(g, b.initRoot<wire::Graph>());
  auto words = capnp::messageToFlatArray(b);
  wire::Limits limits;
  for (auto _ : state) {
    capnp::FlatArrayMessageReader reader(words, wire::readerOptions(limits, words.asBytes().size(), false));
    ir::Graph out;
    if (llvm::Error e = wire::decodeGraph(reader.getRoot<wire::Graph>(), limits, out))
      state.SkipWithError(rgpu::message(std::move(e)).c_str());
    benchmark::DoNotOptimize(out.nodes.data());
  }
  state.SetItemsProcessed(state.iterations() * kNodes);
}
/// A 64x256 float32 batch of normal noise (width 4), or 16x256 int64 token ids (width 8).
std::vector<uint8_t> batch(unsigned width) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<uint8_t> bytes(width == 4 ? 64 * 256 * 4 : 16 * 256 * 8);
  for (size_t i = 0; i < bytes.size() / width; ++i) {
    float f = normal(rng);
    int64_t id = int64_t(rng() % 50257);
    std::memcpy(&bytes[i * width], width == 4 ? static_cast<void *>(&f) : &id, width);
  }
  return bytes;
}

void BM_EncodePlanes(benchmark::State &state) {
  const unsigned width = unsigned(state.range(0));
  auto data = batch(width);
  size_t bytes = 0;
  for (auto _ : state)
    bytes = wire::encodePlanes(data.data(), data.size(), width)->size();
  state.counters["bytes"] = double(bytes);
  state.SetBytesProcessed(state.iterations() * data.size());
}

void BM_DecodePlanes(benchmark::State &state) {
  const unsigned width = unsigned(state.range(0));
  auto data = batch(width);
  std::string blob = *wire::encodePlanes(data.data(), data.size(), width), why;
  std::vector<uint8_t> out(data.size());
  for (auto _ : state)
    if (!wire::decodePlanes(reinterpret_cast<const uint8_t *>(blob.data()), blob.size(),
                            out.data(), out.size(), width, why))
      state.SkipWithError(why.c_str());
  state.counters["bytes"] = double(blob.size());
  state.SetBytesProcessed(state.iterations() * data.size());
}
} // namespace

/// Sealing and opening a TCP session's bytes (rgpu/net/Seal.h) on one core: \p state.range(0)
/// bytes at a time (a small control frame, a 1 MiB upload chunk).
void BM_Seal(benchmark::State &state) {
  const std::string plain(size_t(state.range(0)), 'x');
  net::Sealer sealer(net::deriveKeys("token", "challenge", "nonce").clientToServer);
  std::string out;
  for (auto _ : state) {
    out.clear();
    sealer.seal(plain.data(), plain.size(), out);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_Open(benchmark::State &state) {
  const std::string plain(size_t(state.range(0)), 'x');
  const net::SessionKeys keys = net::deriveKeys("token", "challenge", "nonce");
  std::unique_ptr<net::Opener> opener;
  std::vector<std::string> records(64);
  std::string out;
  size_t next = records.size();
  for (auto _ : state) {
    if (next == records.size()) { // a fresh stream once every record was opened
      state.PauseTiming();
      net::Sealer sealer(keys.clientToServer);
      opener = std::make_unique<net::Opener>(keys.clientToServer);
      std::string header = sealer.seal(""); // the stream's header alone
      opener->open(header.data(), header.size(), out);
      for (std::string &r : records)
        r = sealer.seal(plain);
      next = 0;
      state.ResumeTiming();
    }
    out.clear();
    if (!opener->open(records[next].data(), records[next].size(), out))
      state.SkipWithError("a record did not open");
    ++next;
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

BENCHMARK(BM_Canonicalize5000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Hash5000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CanonicalBytes5000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_XxHashPair5000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ContentDigest)->Arg(1 << 20)->Arg(64 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Encode5000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Decode5000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Seal)->Arg(256)->Arg(1 << 20);
BENCHMARK(BM_Open)->Arg(256)->Arg(1 << 20);
BENCHMARK(BM_EncodePlanes)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodePlanes)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
