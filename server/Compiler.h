//===- server/Compiler.h - Inductor compiles in the background ---------------===//
//
// With --compiler inductor, a graph that has run often enough is compiled with AOTInductor in a
// separate Python process (inductor_worker.py, next to the server) while it keeps running on its
// plan; later runs switch to the compiled package, which the server runs from C++ without
// Python. Only graphs whose plan was built are compiled, so everything the plan builder checks
// (the op allow-list, argument values, string tables) holds for compiled code too. The worker
// gets one Cap'n Proto CompileJob and answers with a CompileResult; it runs with no inherited
// descriptors, a CPU-time and an address-space limit and a wall-clock deadline, and a compile
// that fails in any way leaves its graph on the plan executor.
//
// Compiled packages live in the cache directory, named by the graph hash and a key of everything
// else that shapes the artifact (torch version, device, mode, worker format), so a restarted
// server loads what it compiled before instead of compiling again, and never loads an artifact
// built for another torch or device. Beside each package, `.pt2.graph` records the canonical
// bytes of the graph it was compiled from: a package runs only for a plan of that very graph,
// with inputs of the recorded metas, and AOTInductor checks its inputs as well. Files appear only by rename; a compile cut short by a
// shutdown leaves at most a temporary file, which is removed (or swept at the next start).
//
// Some scalars of a graph are compiled as constants (those that Inductor's decompositions branch
// on, such as addmm's beta). The package records them; a run with other values for them simply
// runs on the plan executor.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "CompileWorker.h"
#include "Plan.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

namespace torch::inductor {
class AOTIModelPackageLoader;
}

namespace rgpu::server {

class CudaGraph;

/// Compiled runs replayed as CUDA graphs, and captures, of every graph of a compiler.
struct CudaGraphCounters {
  std::atomic<uint64_t> replays{0}, captures{0};
};

/// torch.compile's modes, as the server compiles and runs a graph in them ("" is "default").
namespace compile_mode {
bool known(llvm::StringRef mode);
/// max-autotune and max-autotune-no-cudagraphs: Inductor autotunes its kernels.
bool autotunes(llvm::StringRef mode);
/// reduce-overhead and max-autotune: compiled runs are replayed as CUDA graphs (CudaGraph.h).
bool cudaGraphs(llvm::StringRef mode);
} // namespace compile_mode

struct CompilerOptions {
  std::string cacheDir;       ///< Where packages persist.
  std::string kernelCacheDir; ///< Inductor's cache (the worker's TORCHINDUCTOR_CACHE_DIR).
  std::string python;   ///< An interpreter that can import torch.
  std::string worker;   ///< inductor_worker.py, shipped next to rgpu-opserver.
  std::string mode;     ///< A graph's compile mode unless its Define names one (compile_mode).
  unsigned after = 2;   ///< Compile a graph once it has run this many times.
  unsigned jobs = 1;    ///< Compiles running at once.
  /// Limits of each compile process: CPU seconds, address space (CPU devices only: CUDA
  /// reserves more address space than any sane limit) and a wall-clock deadline.
  unsigned cpuSeconds = 900, memoryMiB = 16384, timeoutSeconds = 600;
  /// Compiles waiting at once; a graph that gets hot while the queue is full stays on its plan
  /// and is queued at a later run.
  size_t queueLimit = 64;
  /// Bytes of compiled packages loaded in memory (their package files' sizes), and kept in
  /// the cache directory: past either, the least recently run ones are unloaded or deleted.
  uint64_t memoryBytes = uint64_t(4) << 30, diskBytes = uint64_t(16) << 30;
};

/// What a package was specialized on: scalar slots compiled as constants, and the sizes of a
/// symbolic graph's symbols it holds for (max -1: unbounded) and the relations between them.
struct Specialization {
  std::vector<std::pair<uint32_t, ir::ScalarValue>> constants;
  struct Range {
    uint32_t symbol;
    int64_t min, max;
  };
  std::vector<Range> ranges;
  /// symbol == coef * of + offset: sizes export found tied (a mask one longer than the cache).
  struct Relation {
    uint32_t symbol, of;
    int64_t coef, offset;
  };
  std::vector<Relation> relations;
  /// (output, input): the package writes that output into that input's buffer and does not
  /// return it (inductor_worker.py's written_inputs).
  std::vector<std::pair<uint32_t, uint32_t>> writes;
};

/// A graph compiled by AOTInductor, ready to run.
class CompiledGraph {
public:
  /// \p record is the canonical bytes (ir::canonicalBytes) of the graph the package was
  /// compiled from, \p plan a plan of that graph.
  /// With \p cudaGraphs, runs are replayed as CUDA graphs where they can be; \p counters count
  /// them (the compiler's, shared: a package may outlive its compiler).
  CompiledGraph(std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader,
                Specialization spec, std::string record, const std::shared_ptr<const Plan> &plan,
                at::Device device, bool cudaGraphs = false,
                std::shared_ptr<CudaGraphCounters> counters = nullptr);
  ~CompiledGraph();

  /// True if \p plan runs the graph this package was compiled from: its canonical bytes are
  /// the record. A package is found by its graph's hash; this check does not rest on the hash.
  /// The last plan that passed is remembered, so a steady run compares nothing.
  bool compiledFrom(const std::shared_ptr<const Plan> &plan) const;

  /// True if \p scalars agree with the values this package was specialized on and, for a
  /// symbolic plan, the run is one the package was exported for (see acceptsSizes).
  bool accepts(const Plan &plan, llvm::ArrayRef<ir::ScalarValue> scalars,
               llvm::ArrayRef<int64_t> symbols, const std::vector<Entry> &inputs) const;
  /// Whether a run of a symbolic graph can be the one it is compiled from: every symbol at
  /// least 2 (export specializes sizes 0 and 1) and no two equal (export would merge them), and
  /// contiguous inputs wherever a layout holds a symbol, as the package will require.
  static bool exportable(const Plan &plan, llvm::ArrayRef<int64_t> symbols,
                         const std::vector<Entry> &inputs);
  /// Runs the package; outputs get the layouts \p plan's graph records (for a symbolic plan,
  /// those of \p shapes). An input the package writes is written in place when nothing but
  /// \p inputs holds its tensor or storage (the session released its handle), else a copy of
  /// it is; \p inPlace counts the former. Throws on failure.
  void run(const Plan &plan, const std::vector<Entry> &inputs,
           llvm::ArrayRef<ir::ScalarValue> scalars, std::vector<Entry> &outputs,
           const Shapes *shapes = nullptr, uint64_t *inPlace = nullptr) const;
  const std::vector<std::pair<uint32_t, uint32_t>> &writes() const { return spec_.writes; }
  /// In a CUDA-graph mode: "replayed" once captured, else why its runs are not; else "".
  std::string cudaGraphStatus() const;
  /// Of every session's runs, those replayed as a CUDA graph.
  uint64_t cudaGraphReplays() const { return replays_; }

private:
  /// Runs the package on \p args, or replays its CUDA graph: captured, in a CUDA-graph mode,
  /// at the second run in a row with the same \p scalars (those a capture holds as constants),
  /// and replayed for runs with them; runs with other scalars run the package, and after
  /// kMaxCaptures captures the graph stays as it is. In a CUDA-graph mode the package is
  /// single-threaded: runs take turns.
  std::vector<at::Tensor> runPackage(std::vector<at::Tensor> &args,
                                     llvm::ArrayRef<ir::ScalarValue> scalars,
                                     bool symbolic) const;

  /// 0-dim CPU tensors for a run's scalars, the form the worker exported them in, with the
  /// graph's scalar dtypes.
  std::vector<at::Tensor> takeScalars(const ir::Graph &g) const;
  void giveScalars(std::vector<at::Tensor> tensors) const;

  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
  Specialization spec_;
  std::string record_;
  /// The recorded graph's input metas (0 where a symbolic graph has a symbol) and the device
  /// the package was compiled for: every run's inputs are checked against them before the
  /// package sees a buffer (packages are built without checks of their own).
  std::vector<ir::TensorMeta> inputs_;
  at::Device device_;
  mutable std::mutex verifiedMu_;
  mutable std::weak_ptr<const Plan> verified_; ///< compared by owner, never dereferenced
  /// Scalar tensors of earlier runs, refilled by later ones: making them anew took about a
  /// tenth of a decoding step's run. One set per run in flight.
  mutable std::mutex scalarsMu_;
  mutable std::vector<std::vector<at::Tensor>> scalarSets_;

  void setStatus(std::string status) const;

  /// CUDA graphs (CudaGraph.h). graphMu_ guards the rest; replays_ is read without it.
  bool cudaGraphs_;
  std::shared_ptr<CudaGraphCounters> counters_;
  std::vector<uint32_t> written_;                     ///< Inputs the package writes.
  mutable std::mutex graphMu_;
  mutable std::unique_ptr<CudaGraph> graph_;
  mutable std::vector<ir::ScalarValue> graphScalars_, lastScalars_;
  mutable bool warm_ = false; ///< The last run had lastScalars_.
  mutable unsigned captures_ = 0;
  mutable std::string whyNot_; ///< Why runs are not captured (empty: they may be).
  mutable std::atomic<uint64_t> replays_{0};
  mutable std::mutex statusMu_;
  mutable std::string status_; ///< cudaGraphStatus.
};

class Compiler {
public:
  Compiler(CompilerOptions options, at::Device device);
  ~Compiler();

  /// What the server should run \p plan with for this run's \p scalars (and size \p symbols,
  /// of a symbolic plan, with these \p inputs): the compiled graph, or null for the plan
  /// executor. Counts the run, and queues a compile when the graph gets hot. Sets \p queued
  /// when this call queued it. A symbolic plan compiles once, for all its sizes.
  std::shared_ptr<const CompiledGraph> lookup(const std::shared_ptr<const Plan> &plan,
                                              llvm::ArrayRef<ir::ScalarValue> scalars,
                                              llvm::ArrayRef<int64_t> symbols,
                                              const std::vector<Entry> &inputs, bool &queued);
  /// Follows a client's hints for a graph before its first run. \p executor: "inductor" compiles it
  /// at its second run (or first, with --compile-after 1) whatever --compile-after says, "plan"
  /// never. Not the first: the first step of a torch.compile region often traces a graph that
  /// later steps do not (their parameters are the optimizer's outputs), which would be compiled
  /// for one run.
  /// \p mode, if not empty: a compile_mode the graph is compiled and run in instead of the
  /// server's --compile-mode ("default" too).
  void prefer(const ir::Hash256 &hash, llvm::StringRef executor, llvm::StringRef mode);
  /// What one graph runs on, and its compile, for the statistics.
  struct Report {
    /// "inductor", "plan (inductor compiling)", "plan (inductor failed)" or "plan".
    std::string executor = "plan";
    /// How long its compile took, from its start to its package loaded (0: none ended).
    uint64_t compileNs = 0;
    /// CompiledGraph::cudaGraphStatus and cudaGraphReplays, of a loaded package.
    std::string cudaGraph;
    uint64_t cudaGraphReplays = 0;
  };
  Report report(const ir::Hash256 &hash);

  /// Stops: kills running compiles and removes their temporary files. Idempotent.
  void shutdown();

  std::atomic<uint64_t> compiles{0}, failures{0}, diskHits{0}, pending{0};
  std::atomic<uint64_t> dropped{0}, evictions{0}, diskEvictions{0};
  std::atomic<uint64_t> compileNs{0}; ///< The time of every compile that ended, together.
  std::shared_ptr<CudaGraphCounters> cudaGraphs = std::make_shared<CudaGraphCounters>();

private:
  enum class State { Counting, Queued, Ready, Failed, Skipped };
  struct GraphState {
    State state = State::Counting;
    uint32_t runs = 0;
    unsigned after = 0; ///< 0: the server's --compile-after.
    std::shared_ptr<const CompiledGraph> compiled;
    uint64_t bytes = 0;    ///< Of the loaded package.
    uint64_t lastUse = 0;  ///< The lookup tick of its latest run.
    uint64_t compileNs = 0; ///< How long its compile took (0: none ended).
    std::string mode;       ///< Its compile mode, if not the server's.
  };
  struct Job {
    std::shared_ptr<const Plan> plan;
    std::string mode;
    std::vector<ir::ScalarValue> scalars;
    std::vector<int64_t> symbols;
  };

  /// A compile thread, compiling in \p worker.
  void work(CompileWorker &worker);
  /// Loads the package for \p job from the cache, compiling it in \p worker first if needed.
  std::shared_ptr<const CompiledGraph> build(const Job &job, CompileWorker &worker,
                                             std::string &error);
  /// Where the package of \p hash compiled in \p mode lives, less its extension.
  std::string stem(const ir::Hash256 &hash, llvm::StringRef mode) const;
  /// A graph's compile mode.
  const std::string &modeOf(const GraphState &g) const {
    return g.mode.empty() ? options_.mode : g.mode;
  }
  /// Unloads the least recently run packages until those loaded fit memoryBytes. Under mu_.
  void unloadPastLimit(const ir::Hash256 &keep);
  /// Forgets the states of graphs not run for long, so the table stays bounded. Under mu_.
  void pruneStates();
  /// Deletes the least recently used packages until the cache directory fits diskBytes.
  void trimDisk(const std::string &keep);

  CompilerOptions options_;
  at::Device device_;
  std::string keys_[2]; ///< A package's cache key, without and with autotuning (stem).
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::map<ir::Hash256, GraphState> graphs_;
  uint64_t tick_ = 0, loadedBytes_ = 0;
  bool stopping_ = false;
  std::vector<std::unique_ptr<CompileWorker>> workers_; ///< One per compile thread.
  std::vector<std::thread> threads_;
};

} // namespace rgpu::server
