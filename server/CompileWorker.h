//===- server/CompileWorker.h - A compile worker kept warm across compiles ---===//
//
// Inductor compiles run in a separate process, so that a compile that crashes, loops or eats
// memory costs the server nothing. Starting Python and importing torch and Inductor takes
// longer than many compiles themselves (6.5 of 15 s for a small graph on 2 cores), so the
// process lives across jobs: `inductor_worker.py --serve` imports once, then forks one child
// per job, which compiles under the job's CPU limit, writes its CompileResult and exits. The
// worker reports each child's pid and exit status over a socket (its stdin and stdout); the
// server kills a child past its deadline, and starts a new worker when one dies.
//
// Sandboxed as a worker started per job was: nothing of the server is inherited (no socket,
// no listener, no file), the environment is the server's with Inductor's cache set, the
// address-space limit covers the worker and its children, and a killed server takes them
// all with it.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace rgpu::server {

/// How to start a compile worker.
struct WorkerCommand {
  std::string python;         ///< An interpreter that can import torch.
  std::string script;         ///< inductor_worker.py.
  std::string kernelCacheDir; ///< Its TORCHINDUCTOR_CACHE_DIR.
  std::string logPath;        ///< Where the worker's own output goes (not a job's).
  unsigned cpuSeconds = 900;  ///< CPU time of each job.
  uint64_t addressSpace = 0;  ///< Bytes of address space of the worker and its jobs; 0: no limit.
};

/// One warm worker process, used by one compile thread at a time.
class CompileWorker {
public:
  /// run()'s status for a job stopped at its deadline.
  static constexpr int kTimedOut = -2;
  /// run()'s status when the worker could not be started (no such interpreter).
  static constexpr int kNotStarted = 127;

  explicit CompileWorker(WorkerCommand command);
  ~CompileWorker();
  CompileWorker(const CompileWorker &) = delete;
  CompileWorker &operator=(const CompileWorker &) = delete;

  /// Compiles the CompileJob in \p jobPath in a child of the worker (started first if it is
  /// not running), its output in \p logPath, waiting at most \p timeout (the first job's wait
  /// includes the worker's start). Returns the child's exit status, kTimedOut, kNotStarted,
  /// or -1 (the child was killed by a signal or a limit, or the worker died or was stopped).
  int run(const std::string &jobPath, const std::string &logPath, std::chrono::seconds timeout);

  /// Starts the worker now, so that the first job finds it warm (it imports torch and Inductor
  /// and prepares what every compile needs); run() starts it otherwise. From run()'s thread.
  void prestart() {
    if (pid_ < 0 && !stopped_)
      start();
  }

  /// Kills the running job and the worker, from any thread; run() returns -1 soon after, and
  /// every later run() at once.
  void stop();

private:
  /// Starts the worker process; false if fork failed.
  bool start();
  /// Reads one reply line, waiting until \p deadline; false at end of file, stop() or the
  /// deadline (\p timedOut says which).
  bool readLine(std::string &line, std::chrono::steady_clock::time_point deadline, bool &timedOut);
  /// Kills and reaps the worker; returns its exit status if it exited by itself, else -1.
  int end();

  WorkerCommand command_;
  std::vector<std::string> env_;
  std::mutex mu_; ///< Guards the pids against stop() from another thread.
  pid_t pid_ = -1, job_ = -1;
  int socket_ = -1; ///< Requests to the worker, its replies back.
  bool ready_ = false;
  std::string buffered_;
  std::atomic<bool> stopped_{false};
};

} // namespace rgpu::server
