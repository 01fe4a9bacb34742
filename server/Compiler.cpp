#include "Compiler.h"
#include "CudaGraph.h"
#include "Log.h"
#include "Memory.h"

#include "rgpu/wire/Cache.h"
#include "rgpu/wire/Wire.h"

#include <capnp/serialize.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <llvm/Support/xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include <signal.h>
#include <unistd.h>

// OpenMP's and MKL's per-thread team sizes, from the libraries libtorch loaded (weak: a torch
// built without them leaves these null).
extern "C" int omp_get_max_threads() __attribute__((weak));
extern "C" void omp_set_num_threads(int) __attribute__((weak));
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak)); // MKL's C entry point

namespace rgpu::server {

namespace fs = std::filesystem;

namespace {

/// Graph states kept by the compiler before the oldest idle ones are forgotten.
constexpr size_t kMaxStates = 8192;

/// Bumped whenever inductor_worker.py changes what it builds from the same graph.
constexpr const char *kWorkerFormat = "6";

/// A compiled run whose every input and output has at most this many elements runs on one
/// thread (ATen parallelizes elementwise work from 32,768 elements).
constexpr int64_t kOneThreadElements = 65536;
/// Scalar argument sets a compiled graph keeps for its next runs: runs in flight at once.
constexpr size_t kScalarSetsKept = 8;
/// CUDA graphs one compiled graph captures at most (one at a time; another capture replaces
/// the last when its scalars changed): past it, scalars that keep changing run the package.
constexpr unsigned kMaxCaptures = 4;

/// Runs the calling thread's OpenMP regions and MKL calls on one thread while it lives, and
/// restores its team size after. Both settings are the calling thread's own, so the pool's
/// other threads keep theirs.
class OneThread {
public:
  OneThread() {
    if (omp_get_max_threads && omp_set_num_threads) {
      saved_ = omp_get_max_threads();
      omp_set_num_threads(1);
    }
    if (MKL_Set_Num_Threads_Local)
      mklSaved_ = MKL_Set_Num_Threads_Local(1);
  }
  ~OneThread() {
    if (saved_ > 0)
      omp_set_num_threads(saved_);
    if (MKL_Set_Num_Threads_Local)
      MKL_Set_Num_Threads_Local(mklSaved_);
  }
  OneThread(const OneThread &) = delete;
  OneThread &operator=(const OneThread &) = delete;

private:
  int saved_ = 0;
  int mklSaved_ = 0;
};

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

/// Reads a CompileResult file: what a successful compile specialized on, else a failure
/// saying why not (the worker's error, or why the file cannot be read).
llvm::Expected<Specialization> readResult(const std::string &path) {
  auto words = wire::readMessageFile(path);
  if (!words)
    return words.takeError();
  Specialization spec;
  try {
    capnp::FlatArrayMessageReader reader(
        *words, wire::readerOptions(wire::Limits(), words->asBytes().size(), false));
    auto result = reader.getRoot<wire::CompileResult>();
    if (result.isError())
      return failure(result.getError().cStr());
    for (auto c : result.getOk().getConstants())
      spec.constants.emplace_back(c.getSlot(), wire::decodeScalar(c.getValue()));
    for (auto r : result.getOk().getRanges())
      spec.ranges.push_back({r.getSymbol(), r.getMin(), r.getMax()});
    for (auto r : result.getOk().getRelations())
      spec.relations.push_back({r.getSymbol(), r.getOf(), r.getCoef(), r.getOffset()});
    auto w = result.getOk().getWrites();
    if (w.size() % 2 != 0)
      return failure(path + ": writes are not pairs");
    for (size_t k = 0; k < w.size(); k += 2)
      spec.writes.emplace_back(w[k], w[k + 1]);
  } catch (const kj::Exception &e) {
    return failure(path + ": " + e.getDescription().cStr());
  }
  return std::move(spec);
}

/// The whole of the file at \p path; empty if it cannot be read.
std::string readFile(const std::string &path) {
  std::string out;
  if (FILE *f = std::fopen(path.c_str(), "rb")) {
    char buf[1 << 16];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;)
      out.append(buf, n);
    std::fclose(f);
  }
  return out;
}

/// Writes \p bytes to \p path whole (a temporary file, then renamed).
llvm::Error writeFile(const std::string &path, const std::string &bytes) {
  std::string tmp = path + ".tmp" + std::to_string(getpid());
  FILE *f = std::fopen(tmp.c_str(), "wb");
  bool ok = f && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  ok = f && std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return failure("cannot write " + path);
  }
  return llvm::Error::success();
}

/// Removes temporary files (`NAME.tmpPID...`) whose writer is no longer running.
void sweepTemporaries(const std::string &dir) {
  std::error_code ec;
  for (const auto &entry : fs::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    size_t at = name.find(".tmp");
    if (at == std::string::npos)
      continue;
    int pid = std::atoi(name.c_str() + at + 4);
    if (pid <= 0 || (kill(pid, 0) != 0 && errno == ESRCH))
      fs::remove(entry.path(), ec);
  }
}
} // namespace

CompiledGraph::CompiledGraph(std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader,
                             Specialization spec, std::string record,
                             const std::shared_ptr<const Plan> &plan, at::Device device,
                             bool cudaGraphs, std::shared_ptr<CudaGraphCounters> counters)
    : loader_(std::move(loader)), spec_(std::move(spec)), record_(std::move(record)),
      inputs_(plan->graph().inputs.begin(), plan->graph().inputs.end()), device_(device),
      verified_(plan), cudaGraphs_(cudaGraphs), counters_(std::move(counters)) {
  for (auto [o, i] : spec_.writes)
    written_.push_back(i);
  if (cudaGraphs_) {
    whyNot_ = CudaGraph::unavailable(device_);
    if (whyNot_.empty() && plan->symbolic())
      whyNot_ = "its sizes are symbolic";
    status_ = whyNot_.empty() ? "not captured yet (at the second run in a row with the same "
                                "scalars)"
                              : "not used: " + whyNot_;
  }
}

std::vector<at::Tensor> CompiledGraph::runPackage(std::vector<at::Tensor> &args,
                                                  llvm::ArrayRef<ir::ScalarValue> scalars,
                                                  bool symbolic) const {
  if (!cudaGraphs_)
    return loader_->run(args);
  // Loaded single-threaded (no events between runs, which a capture may not query): one run
  // at a time.
  std::lock_guard<std::mutex> lock(graphMu_);
  if (symbolic || !whyNot_.empty())
    return loader_->run(args);
  auto replay = [&] {
    ++replays_;
    if (counters_)
      ++counters_->replays;
    return graph_->replay(args, written_);
  };
  if (graph_ && llvm::ArrayRef<ir::ScalarValue>(graphScalars_) == scalars)
    return replay();
  const bool same = warm_ && llvm::ArrayRef<ir::ScalarValue>(lastScalars_) == scalars;
  // Captured at the second run in a row with these scalars: the first ran the package, which
  // loads its kernels and sets up its state (nothing a capture may do).
  if (!same || captures_ >= kMaxCaptures) {
    lastScalars_.assign(scalars.begin(), scalars.end());
    warm_ = true;
    return loader_->run(args);
  }
  graph_.reset();
  try {
    graph_ = std::make_unique<CudaGraph>(
        device_, args, [this](std::vector<at::Tensor> &a) { return loader_->run(a); });
  } catch (const std::exception &e) {
    const c10::Error *ce = dynamic_cast<const c10::Error *>(&e);
    whyNot_ = std::string("its capture failed: ") + (ce ? ce->what_without_backtrace() : e.what());
    log("a compiled graph runs without a CUDA graph: " + whyNot_);
    setStatus("not used: " + whyNot_);
    return loader_->run(args);
  }
  ++captures_;
  setStatus(captures_ < kMaxCaptures ? "replayed"
                                     : "replayed (for its last scalars only: they changed after " +
                                           std::to_string(kMaxCaptures) + " captures)");
  if (counters_)
    ++counters_->captures;
  graphScalars_.assign(scalars.begin(), scalars.end());
  return replay();
}

std::string CompiledGraph::cudaGraphStatus() const {
  std::lock_guard<std::mutex> lock(statusMu_);
  return status_;
}

void CompiledGraph::setStatus(std::string status) const {
  std::lock_guard<std::mutex> lock(statusMu_);
  status_ = std::move(status);
}

CompiledGraph::~CompiledGraph() = default;

bool CompiledGraph::compiledFrom(const std::shared_ptr<const Plan> &plan) const {
  std::lock_guard<std::mutex> lock(verifiedMu_);
  // Owner comparison: an expired plan's control block lives on with this weak reference, so a
  // new plan can never compare equal to it.
  if (!verified_.owner_before(plan) && !plan.owner_before(verified_))
    return true;
  if (ir::canonicalBytes(plan->graph()) != record_)
    return false;
  verified_ = plan;
  return true;
}

bool CompiledGraph::accepts(const Plan &plan, llvm::ArrayRef<ir::ScalarValue> scalars,
                            llvm::ArrayRef<int64_t> symbols,
                            const std::vector<Entry> &inputs) const {
  for (const auto &[slot, value] : spec_.constants)
    if (slot >= scalars.size() || !(scalars[slot] == value))
      return false;
  if (!plan.symbolic())
    return true;
  // Every symbol must be given a range: one the worker left out is not known to hold.
  if (spec_.ranges.size() != plan.graph().symbolCount || symbols.size() != spec_.ranges.size())
    return false;
  for (const auto &r : spec_.ranges)
    if (r.symbol >= symbols.size() || symbols[r.symbol] < r.min ||
        (r.max >= 0 && symbols[r.symbol] > r.max))
      return false;
  for (const auto &r : spec_.relations) {
    int64_t want;
    if (r.symbol >= symbols.size() || r.of >= symbols.size() ||
        __builtin_mul_overflow(r.coef, symbols[r.of], &want) ||
        __builtin_add_overflow(want, r.offset, &want) || symbols[r.symbol] != want)
      return false;
  }
  for (uint32_t i : plan.symbolicInputs())
    if (i >= inputs.size() || !inputs[i].tensor.is_contiguous())
      return false;
  return true;
}

bool CompiledGraph::exportable(const Plan &plan, llvm::ArrayRef<int64_t> symbols,
                               const std::vector<Entry> &inputs) {
  for (size_t k = 0; k < symbols.size(); ++k) {
    if (symbols[k] < 2)
      return false;
    for (size_t j = 0; j < k; ++j)
      if (symbols[j] == symbols[k])
        return false;
  }
  for (uint32_t i : plan.symbolicInputs())
    if (i >= inputs.size() || !inputs[i].tensor.is_contiguous())
      return false;
  return true;
}

void CompiledGraph::run(const Plan &plan, const std::vector<Entry> &inputs,
                        llvm::ArrayRef<ir::ScalarValue> scalars, std::vector<Entry> &outputs,
                        const Shapes *shapes, uint64_t *inPlace) const {
  const ir::Graph &g = plan.graph();
  std::vector<const ir::TensorMeta *> metas = shapes ? shapes->metas : g.valueMetas();
  // The buffers must be what the package was compiled for (the session restrides each input
  // to its graph's meta; this holds that graph to the package's record).
  if (inputs.size() != inputs_.size())
    throw std::runtime_error("the compiled graph takes " + std::to_string(inputs_.size()) +
                             " inputs, the run gives " + std::to_string(inputs.size()));
  for (size_t k = 0; k < inputs.size(); ++k) {
    const at::Tensor &t = inputs[k].tensor;
    const ir::TensorMeta &m = *metas[k];
    if (!t.defined() || t.device() != device_ ||
        t.scalar_type() != bridge::scalarType(inputs_[k].dtype) ||
        size_t(t.dim()) != inputs_[k].sizes.size() || t.sizes() != c10::IntArrayRef(m.sizes) ||
        t.strides() != c10::IntArrayRef(m.strides) ||
        (!shapes && (m.sizes != inputs_[k].sizes || m.strides != inputs_[k].strides)))
      throw std::runtime_error("input " + std::to_string(k) + " is not the compiled graph's " +
                               inputs_[k].str());
  }
  // A small run spends more waking OpenMP's team than computing (see docs/architecture.md,
  // "Threads of a run").
  bool small = true;
  for (const Entry &e : inputs)
    small = small && e.tensor.device().is_cpu() && e.tensor.numel() <= kOneThreadElements;
  for (uint32_t out : g.outputs) {
    int64_t n = 1;
    for (int64_t d : metas[out]->sizes)
      n = d > 0 && n > kOneThreadElements / d ? kOneThreadElements + 1 : n * d;
    small = small && n <= kOneThreadElements;
  }
  std::optional<OneThread> oneThread;
  if (small)
    oneThread.emplace();
  c10::InferenceMode inference;
  std::vector<at::Tensor> args;
  args.reserve(inputs.size() + scalars.size());
  for (const Entry &e : inputs)
    args.push_back(e.tensor);
  for (auto [o, i] : spec_.writes) {
    at::Tensor &t = args[i];
    // Held by its entry and by args alone, and the only tensor of its storage: nobody can see
    // the write. Otherwise the package writes a copy.
    if (t.use_count() == 2 && t.storage().use_count() == 1 && !t.is_neg() && !t.is_conj()) {
      if (inPlace)
        ++*inPlace;
    } else {
      t = at::empty_strided(t.sizes(), t.strides(), t.options()).copy_(t);
    }
  }
  std::vector<at::Tensor> scalarArgs = takeScalars(g);
  for (size_t k = 0; k < scalars.size(); ++k) {
    at::Tensor &t = scalarArgs[k];
    const c10::Scalar value = toScalar(scalars[k]);
    AT_DISPATCH_V2(t.scalar_type(), "rgpu scalar argument",
                   AT_WRAP([&] { *t.mutable_data_ptr<scalar_t>() = value.to<scalar_t>(); }),
                   AT_EXPAND(AT_ALL_TYPES_AND_COMPLEX), at::kBool, at::kHalf, at::kBFloat16);
    args.push_back(t);
  }
  std::vector<at::Tensor> results = runPackage(args, scalars, shapes != nullptr);
  giveScalars(std::move(scalarArgs));
  for (auto [o, i] : spec_.writes) // in output order (written_inputs)
    results.insert(results.begin() + std::min<size_t>(o, results.size()), args[i]);
  args.clear();
  if (results.size() != g.outputs.size())
    throw std::runtime_error("the compiled graph returned " + std::to_string(results.size()) +
                             " outputs, the graph has " + std::to_string(g.outputs.size()));
  outputs.clear();
  outputs.reserve(results.size());
  for (size_t k = 0; k < results.size(); ++k) {
    const ir::TensorMeta &m = *metas[g.outputs[k]];
    if (m.dtype == ir::dtype::Undefined) {
      outputs.push_back({});
      continue;
    }
    const at::Tensor &t = results[k];
    if (!t.defined() || t.sizes() != c10::IntArrayRef(m.sizes) ||
        t.scalar_type() != bridge::scalarType(m.dtype))
      throw std::runtime_error("the compiled graph's output " + std::to_string(k) +
                               " does not match " + m.str());
    outputs.push_back({restride(t, m), nullptr});
  }
}

std::vector<at::Tensor> CompiledGraph::takeScalars(const ir::Graph &g) const {
  {
    std::lock_guard<std::mutex> lock(scalarsMu_);
    if (!scalarSets_.empty()) {
      std::vector<at::Tensor> set = std::move(scalarSets_.back());
      scalarSets_.pop_back();
      return set;
    }
  }
  memory::Uncharged uncharged; // kept with the package, beyond this session
  std::vector<at::Tensor> set;
  for (const ir::ScalarSlot &slot : g.scalars)
    set.push_back(at::empty({}, at::TensorOptions().dtype(bridge::scalarType(slot.dtype))));
  return set;
}

void CompiledGraph::giveScalars(std::vector<at::Tensor> tensors) const {
  // Only a set nothing else holds: an output that is a scalar argument itself keeps it.
  for (const at::Tensor &t : tensors)
    if (t.use_count() != 1 || t.storage().use_count() != 1)
      return;
  std::lock_guard<std::mutex> lock(scalarsMu_);
  if (scalarSets_.size() < kScalarSetsKept)
    scalarSets_.push_back(std::move(tensors));
}

Compiler::Compiler(CompilerOptions options, at::Device device)
    : options_(std::move(options)), device_(device) {
  // Everything else that shapes a package: whether it autotunes, not how it is replayed.
  for (bool autotunes : {false, true}) {
    std::string key = "torch " + bridge::torchVersion() + "|" + device_.str() + "|" +
                      (autotunes ? "autotune" : "") + "|" + kWorkerFormat;
    keys_[autotunes] = hex64(llvm::xxHash64(llvm::StringRef(key)));
  }
  std::error_code ec;
  fs::create_directories(options_.cacheDir + "/inductor", ec);
  sweepTemporaries(options_.cacheDir + "/inductor");
  trimDisk(""); // a server started with a smaller --disk-cache than the last one
  WorkerCommand command{options_.python, options_.worker, options_.kernelCacheDir,
                        options_.cacheDir + "/inductor/worker.log", options_.cpuSeconds,
                        device_.is_cuda() ? 0 : uint64_t(options_.memoryMiB) << 20};
  for (unsigned i = 0; i < std::max(1u, options_.jobs); ++i)
    workers_.push_back(std::make_unique<CompileWorker>(command));
  for (auto &worker : workers_)
    threads_.emplace_back([this, w = worker.get()] { work(*w); });
}

Compiler::~Compiler() { shutdown(); }

void Compiler::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_)
      return;
    stopping_ = true;
  }
  for (auto &worker : workers_)
    worker->stop();
  cv_.notify_all();
  for (std::thread &t : threads_)
    t.join();
  sweepTemporaries(options_.cacheDir + "/inductor");
}

std::string Compiler::stem(const ir::Hash256 &hash, llvm::StringRef mode) const {
  return options_.cacheDir + "/inductor/" + hash.hex() + "-" +
         keys_[compile_mode::autotunes(mode)];
}

namespace compile_mode {
bool known(llvm::StringRef mode) {
  return mode.empty() || mode == "default" || mode == "reduce-overhead" || autotunes(mode);
}
bool autotunes(llvm::StringRef mode) {
  return mode == "max-autotune" || mode == "max-autotune-no-cudagraphs";
}
bool cudaGraphs(llvm::StringRef mode) {
  return mode == "reduce-overhead" || mode == "max-autotune";
}
} // namespace compile_mode

std::shared_ptr<const CompiledGraph> Compiler::lookup(const std::shared_ptr<const Plan> &plan,
                                                      llvm::ArrayRef<ir::ScalarValue> scalars,
                                                      llvm::ArrayRef<int64_t> symbols,
                                                      const std::vector<Entry> &inputs,
                                                      bool &queued) {
  queued = false;
  std::lock_guard<std::mutex> lock(mu_);
  if (graphs_.size() > kMaxStates)
    pruneStates();
  GraphState &g = graphs_[plan->hash];
  g.lastUse = ++tick_;
  switch (g.state) {
  case State::Ready:
    return g.compiled->compiledFrom(plan) && g.compiled->accepts(*plan, scalars, symbols, inputs)
               ? g.compiled
               : nullptr;
  case State::Counting:
    // Random ops draw from the session's generator, which compiled code cannot reach; some ops
    // are safe only on the plan (policy::compilable); CPU stand-ins run only on the plan.
    if (plan->drawsRandom() || !plan->compilable() || plan->graph().nodes.empty() ||
        (plan->hasCpuStandIns() && device_.is_cpu())) {
      g.state = State::Skipped;
      return nullptr;
    }
    // A symbolic graph compiles from a run with sizes it can be exported at.
    if (!CompiledGraph::exportable(*plan, symbols, inputs))
      return nullptr;
    // A graph compiled before (by this server or an earlier one) is loaded on its first run.
    ++g.runs;
    if (stopping_ || (g.runs < (g.after ? g.after : options_.after) &&
                      !(g.runs == 1 && fs::exists(stem(plan->hash, modeOf(g)) + ".pt2"))))
      return nullptr;
    if (queue_.size() >= options_.queueLimit) {
      ++dropped; // tried again at its next run
      return nullptr;
    }
    g.state = State::Queued;
    queue_.push_back({plan, modeOf(g),
                      std::vector<ir::ScalarValue>(scalars.begin(), scalars.end()),
                      std::vector<int64_t>(symbols.begin(), symbols.end())});
    ++pending;
    queued = true;
    cv_.notify_one();
    return nullptr;
  default: return nullptr;
  }
}

void Compiler::prefer(const ir::Hash256 &hash, llvm::StringRef executor, llvm::StringRef mode) {
  if (executor.empty() && mode.empty())
    return;
  std::lock_guard<std::mutex> lock(mu_);
  GraphState &g = graphs_[hash];
  if (g.state != State::Counting)
    return;
  if (executor == "plan")
    g.state = State::Skipped;
  else if (executor == "inductor")
    g.after = std::min(2u, options_.after);
  if (!mode.empty())
    g.mode = mode.str();
}

Compiler::Report Compiler::report(const ir::Hash256 &hash) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = graphs_.find(hash);
  if (it == graphs_.end())
    return {};
  Report r;
  r.compileNs = it->second.compileNs;
  if (it->second.compiled) {
    r.cudaGraph = it->second.compiled->cudaGraphStatus();
    r.cudaGraphReplays = it->second.compiled->cudaGraphReplays();
  }
  switch (it->second.state) {
  case State::Ready: r.executor = "inductor"; break;
  case State::Queued: r.executor = "plan (inductor compiling)"; break;
  case State::Failed: r.executor = "plan (inductor failed)"; break;
  default: break;
  }
  return r;
}

void Compiler::work(CompileWorker &worker) {
  worker.prestart(); // a server that compiles has its worker warm before its first graph
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_)
        return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error;
    const auto start = std::chrono::steady_clock::now();
    std::shared_ptr<const CompiledGraph> compiled = build(job, worker, error);
    const uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - start).count();
    compileNs += ns;
    std::error_code ec;
    uint64_t bytes = compiled ? fs::file_size(stem(job.plan->hash, job.mode) + ".pt2", ec) : 0;
    if (ec)
      bytes = 0;
    std::lock_guard<std::mutex> lock(mu_);
    GraphState &g = graphs_[job.plan->hash];
    g.compiled = compiled;
    g.state = compiled ? State::Ready : State::Failed;
    g.bytes = bytes;
    g.compileNs = ns;
    loadedBytes_ += bytes;
    unloadPastLimit(job.plan->hash);
    --pending;
  }
}

void Compiler::unloadPastLimit(const ir::Hash256 &keep) {
  while (loadedBytes_ > options_.memoryBytes) {
    auto victim = graphs_.end();
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
      if (it->second.state == State::Ready && it->first != keep &&
          (victim == graphs_.end() || it->second.lastUse < victim->second.lastUse))
        victim = it;
    if (victim == graphs_.end())
      return;
    GraphState &g = victim->second;
    log("graph " + victim->first.hex().substr(0, 12) + ": inductor package unloaded, the least "
        "recently run past --compiled-cache; it runs on its plan until it is hot again");
    loadedBytes_ -= g.bytes;
    g.compiled.reset(); // runs in flight hold their own reference
    g.state = State::Counting;
    g.runs = 0;
    g.bytes = 0;
    ++evictions;
  }
}

void Compiler::pruneStates() {
  // Graphs not run in the last kMaxStates / 2 lookups and holding nothing are forgotten: a
  // forgotten graph that runs again starts counting again, and loads its package from disk.
  uint64_t horizon = tick_ > kMaxStates / 2 ? tick_ - kMaxStates / 2 : 0;
  for (auto it = graphs_.begin(); it != graphs_.end();) {
    const GraphState &g = it->second;
    if (g.lastUse < horizon && g.state != State::Queued && g.state != State::Ready)
      it = graphs_.erase(it);
    else
      ++it;
  }
}

void Compiler::trimDisk(const std::string &keep) {
  struct File {
    fs::path path;
    fs::file_time_type used;
    uint64_t bytes;
  };
  std::vector<File> packages;
  uint64_t total = 0;
  std::error_code ec;
  for (const auto &entry : fs::directory_iterator(options_.cacheDir + "/inductor", ec)) {
    uint64_t bytes = entry.is_regular_file(ec) ? entry.file_size(ec) : 0;
    if (ec)
      continue;
    total += bytes;
    if (entry.path().extension() == ".pt2")
      packages.push_back({entry.path(), entry.last_write_time(ec), bytes});
  }
  std::sort(packages.begin(), packages.end(),
            [](const File &a, const File &b) { return a.used < b.used; });
  for (const File &f : packages) {
    if (total <= options_.diskBytes)
      break;
    if (f.path == keep)
      continue;
    std::string stem = f.path.string();
    stem.resize(stem.size() - 4);
    for (const char *ext : {".pt2", ".pt2.spec", ".pt2.graph", ".log"}) {
      uint64_t bytes = fs::file_size(stem + ext, ec);
      if (!ec && fs::remove(stem + ext, ec))
        total -= std::min(total, bytes);
    }
    ++diskEvictions;
    log("cache: deleted " + f.path.filename().string() + ", the least recently used package "
        "past --disk-cache");
  }
}

std::shared_ptr<const CompiledGraph> Compiler::build(const Job &job, CompileWorker &worker,
                                                     std::string &error) {
  const ir::Hash256 &hash = job.plan->hash;
  std::string name = "graph " + hash.hex().substr(0, 12);
  std::string base = stem(hash, job.mode), package = base + ".pt2", failed = base + ".failed";
  size_t nodes = job.plan->graph().nodes.size();
  // What the package must record (`.pt2.graph`), and what it is recorded as once compiled.
  const std::string record = ir::canonicalBytes(job.plan->graph());
  auto load = [&]() -> std::shared_ptr<const CompiledGraph> {
    if (readFile(package + ".graph") != record) {
      error = "its package records another graph (or none)";
      return nullptr;
    }
    auto read = readResult(package + ".spec");
    if (!read) {
      error = "its package has no readable .spec file (" + message(read.takeError()) + ")";
      return nullptr;
    }
    Specialization spec = std::move(*read);
    const ir::Graph &g = job.plan->graph();
    std::vector<bool> written(g.inputs.size());
    for (size_t k = 0; k < spec.writes.size(); ++k) {
      auto [o, i] = spec.writes[k];
      if (o >= g.outputs.size() || i >= g.inputs.size() || written[i] ||
          (k > 0 && o <= spec.writes[k - 1].first)) {
        error = "its .spec file names writes the graph cannot have";
        return nullptr;
      }
      written[i] = true;
    }
    try {
      // A CUDA graph captures a single-threaded package's run: the other kind records and
      // queries an event around each run, which a capture may not do.
      auto loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
          package, "model", compile_mode::cudaGraphs(job.mode), 1,
          device_.is_cuda() ? device_.index() : -1);
      return std::make_shared<CompiledGraph>(std::move(loader), std::move(spec), record,
                                             job.plan, device_,
                                             compile_mode::cudaGraphs(job.mode),
                                             cudaGraphs);
    } catch (const std::exception &e) {
      const c10::Error *ce = dynamic_cast<const c10::Error *>(&e);
      error = std::string("loading its package failed: ") +
              (ce ? ce->what_without_backtrace() : e.what());
      return nullptr;
    }
  };

  std::error_code ec;
  if (fs::exists(package, ec)) {
    if (auto compiled = load()) {
      ++diskHits;
      fs::last_write_time(package, fs::file_time_type::clock::now(), ec); // for trimDisk
      log(name + ": inductor package loaded from the cache (" + std::to_string(nodes) +
          " nodes)");
      return compiled;
    }
    log(name + ": " + error + "; compiling it again");
    fs::remove(package, ec);
  } else if (fs::exists(failed, ec)) {
    error = "an earlier compile failed: " + message(readResult(failed).takeError()) +
            " (delete " + failed + " to retry)";
    log(name + ": stays on the plan executor; " + error);
    return nullptr;
  }

  // The job: the graph (which passed every check of the plan builder), the op each node runs,
  // and the scalars of the run that asked for it. The worker answers in `result`.
  std::string tmp = ".tmp" + std::to_string(getpid());
  std::string jobPath = base + ".job" + tmp, resultPath = base + ".result" + tmp;
  {
    capnp::MallocMessageBuilder b;
    auto j = b.initRoot<wire::CompileJob>();
    const ir::Graph &g = job.plan->graph();
    wire::encodeHash(hash, j.initHash());
    wire::encodeGraph(g, j.initGraph());
    auto ops = j.initRunOps(g.nodes.size());
    std::vector<uint32_t> zeroFill;
    for (uint32_t n = 0; n < g.nodes.size(); ++n) {
      ops.set(n, job.plan->runOp(n));
      if (job.plan->zeroFills(n))
        zeroFill.push_back(n);
    }
    auto zf = j.initZeroFill(zeroFill.size());
    for (size_t i = 0; i < zeroFill.size(); ++i)
      zf.set(i, zeroFill[i]);
    auto scalars = j.initScalars(job.scalars.size());
    for (size_t i = 0; i < job.scalars.size(); ++i)
      wire::encodeScalar(job.scalars[i], scalars[i]);
    auto symbols = j.initSymbols(job.symbols.size());
    for (size_t i = 0; i < job.symbols.size(); ++i)
      symbols.set(i, job.symbols[i]);
    j.setDevice(device_.str());
    j.setMode(job.mode);
    j.setPackage(package);
    j.setResult(resultPath);
    if (llvm::Error e = wire::writeMessageFile(jobPath, b)) {
      error = "cannot write the compile job: " + message(std::move(e));
      log(name + ": " + error);
      return nullptr;
    }
  }
  log(name + ": compiling with inductor in the background (" + std::to_string(nodes) +
      " nodes); it runs on the plan executor meanwhile");
  auto start = std::chrono::steady_clock::now();
  int status = worker.run(jobPath, base + ".log", std::chrono::seconds(options_.timeoutSeconds));
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fs::remove(jobPath, ec);
  bool answered = fs::exists(resultPath, ec);
  std::string said = answered ? message(readResult(resultPath).takeError()) : "";
  if (status != 0 || !answered || !said.empty()) {
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;
    }
    if (stopping) {
      error = "cancelled by the shutdown";
      log(name + ": compile cancelled by the shutdown; nothing of it is kept");
    } else if (status == 1 && answered) {
      // The worker said why: keep its log and remember the failure across restarts.
      error = said;
      fs::rename(resultPath, failed, ec);
      ++failures;
      log(name + ": inductor compile failed after " + seconds(took) + ": " + error +
          "; it stays on the plan executor (log: " + base + ".log)");
    } else if (status == CompileWorker::kTimedOut) {
      error = "the compile ran past its deadline of " + std::to_string(options_.timeoutSeconds) +
              " s and was stopped";
      ++failures;
      log(name + ": " + error + "; it stays on the plan executor");
    } else if (status == CompileWorker::kNotStarted) {
      error = "could not start the compile worker " + options_.python + " " + options_.worker;
      log(name + ": " + error);
    } else {
      error = "the compile worker stopped (status " + std::to_string(status) +
              "; a CPU-time or memory limit ends it with a signal)";
      ++failures;
      log(name + ": " + error + "; it stays on the plan executor (log: " + base + ".log)");
    }
    fs::remove(resultPath, ec);
    return nullptr;
  }
  fs::rename(resultPath, package + ".spec", ec);
  fs::remove(base + ".log", ec);
  if (llvm::Error e = writeFile(package + ".graph", record)) {
    error = message(std::move(e));
    log(name + ": " + error);
    return nullptr;
  }
  std::shared_ptr<const CompiledGraph> compiled = load();
  if (!compiled) {
    log(name + ": " + error);
    return nullptr;
  }
  ++compiles;
  trimDisk(package);
  log(name + ": inductor compiled in " + seconds(took) + " (" + std::to_string(nodes) +
      " nodes); later runs use it");
  return compiled;
}

} // namespace rgpu::server
