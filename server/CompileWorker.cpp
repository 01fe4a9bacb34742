#include "CompileWorker.h"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

namespace rgpu::server {

CompileWorker::CompileWorker(WorkerCommand command) : command_(std::move(command)) {
  for (char **e = environ; *e; ++e)
    if (std::strncmp(*e, "TORCHINDUCTOR_CACHE_DIR=", 24) != 0)
      env_.push_back(*e);
  env_.push_back("TORCHINDUCTOR_CACHE_DIR=" + command_.kernelCacheDir);
}

CompileWorker::~CompileWorker() { end(); }

bool CompileWorker::start() {
  // Everything the child needs is prepared before fork: after it, only exec-safe calls.
  const std::string cpu = std::to_string(command_.cpuSeconds);
  std::vector<const char *> args = {command_.python.c_str(), command_.script.c_str(), "--serve",
                                    "--cpu-seconds", cpu.c_str(), nullptr};
  std::vector<char *> env;
  for (std::string &e : env_)
    env.push_back(e.data());
  env.push_back(nullptr);
  // One socket both ways (a write to a worker that died is an error, not a SIGPIPE).
  int ends[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0)
    return false;
  const rlim_t addressSpace = command_.addressSpace;
  std::lock_guard<std::mutex> lock(mu_);
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL); // a killed server takes its compiles with it
    int log = open(command_.logPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    dup2(ends[1], 0);
    dup2(ends[1], 1);
    if (log >= 0)
      dup2(log, 2);
    // Nothing of the server is inherited: no client sockets, no listener, no cache files.
    if (syscall(SYS_close_range, 3u, ~0u, 0u) != 0)
      for (int fd = 3; fd < 65536; ++fd)
        close(fd);
    if (addressSpace) {
      rlimit as{addressSpace, addressSpace};
      setrlimit(RLIMIT_AS, &as);
    }
    execve(args[0], const_cast<char *const *>(args.data()), env.data());
    _exit(kNotStarted);
  }
  close(ends[1]);
  if (pid < 0) {
    close(ends[0]);
    return false;
  }
  pid_ = pid;
  socket_ = ends[0];
  ready_ = false;
  buffered_.clear();
  return true;
}

bool CompileWorker::readLine(std::string &line, std::chrono::steady_clock::time_point deadline,
                             bool &timedOut) {
  timedOut = false;
  for (;;) {
    if (size_t nl = buffered_.find('\n'); nl != std::string::npos) {
      line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return true;
    }
    if (stopped_)
      return false;
    if (std::chrono::steady_clock::now() > deadline) {
      timedOut = true;
      return false;
    }
    pollfd p{socket_, POLLIN, 0};
    int r = poll(&p, 1, 20);
    if (r < 0 && errno != EINTR)
      return false;
    if (r <= 0)
      continue;
    char buf[256];
    ssize_t n = recv(socket_, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return false;
    buffered_.append(buf, size_t(n));
    if (buffered_.size() > 4096) // a worker that says nonsense at length
      return false;
  }
}

int CompileWorker::run(const std::string &jobPath, const std::string &logPath,
                       std::chrono::seconds timeout) {
  if (stopped_ || jobPath.find_first_of("\t\n") != std::string::npos ||
      logPath.find_first_of("\t\n") != std::string::npos)
    return -1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string line;
  bool timedOut = false;
  // A worker that died since its last job (killed, or out of memory) is started again: at most
  // once per job, so a worker that cannot start fails the job instead of looping.
  for (bool fresh = false;; fresh = true) {
    if (pid_ < 0) {
      if (!start())
        return -1;
      fresh = true;
    }
    // A new worker says "ready" once torch and Inductor are imported.
    if (!ready_) {
      if (!readLine(line, deadline, timedOut) || line != "ready") {
        int status = end();
        return timedOut ? kTimedOut : status;
      }
      ready_ = true;
    }
    const std::string request = jobPath + "\t" + logPath + "\n";
    if (send(socket_, request.data(), request.size(), MSG_NOSIGNAL) == ssize_t(request.size()) &&
        readLine(line, deadline, timedOut) && line.rfind("started ", 0) == 0)
      break;
    int status = end();
    if (timedOut || stopped_ || fresh)
      return timedOut ? kTimedOut : status == 0 ? -1 : status;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = pid_t(std::atoll(line.c_str() + 8));
  }
  // The child's end, or its deadline: then it is killed, and the worker says so (a worker that
  // does not within a few seconds is ended too).
  bool killed = false;
  auto until = deadline;
  while (!readLine(line, until, timedOut)) {
    if (!timedOut || killed) {
      end();
      return killed ? kTimedOut : -1;
    }
    killed = true;
    until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    std::lock_guard<std::mutex> lock(mu_);
    if (job_ > 0)
      kill(-job_, SIGKILL);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = -1;
  }
  if (killed)
    return kTimedOut;
  if (line.rfind("exited ", 0) == 0)
    return std::atoi(line.c_str() + 7);
  if (line.rfind("killed ", 0) != 0)
    end(); // not the worker we know
  return -1;
}

void CompileWorker::stop() {
  stopped_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  if (job_ > 0)
    kill(-job_, SIGKILL);
  if (pid_ > 0)
    kill(-pid_, SIGKILL);
}

int CompileWorker::end() {
  pid_t pid;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (job_ > 0)
      kill(-job_, SIGKILL);
    job_ = -1;
    pid = pid_;
    pid_ = -1;
  }
  if (socket_ >= 0)
    close(socket_);
  socket_ = -1;
  ready_ = false;
  buffered_.clear();
  if (pid <= 0)
    return -1;
  // A worker that exited by itself (could not start, could not import torch) says how; one
  // still running is killed.
  int status = 0;
  pid_t r;
  for (int k = 0; (r = waitpid(pid, &status, WNOHANG)) == 0 && k < 10; ++k)
    usleep(10000);
  if (r == 0) {
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
  }
  return r == pid && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

} // namespace rgpu::server
