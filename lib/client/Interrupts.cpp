#include "rgpu/client/Interrupts.h"

#include <atomic>
#include <cerrno>
#include <csignal>

#include <pthread.h>

namespace rgpu::client::interrupts {
namespace {

std::atomic<int> gWaits{0};
std::atomic<bool> gRequested{false};
/// The handler wrapped: read by the signal handler, written by Wait with SIGINT blocked.
struct sigaction gWrapped;

void onSigint(int signal, siginfo_t *info, void *context) {
  const int saved = errno;
  if (gWaits.load() > 0)
    gRequested.store(true);
  errno = saved;
  if (gWrapped.sa_flags & SA_SIGINFO)
    gWrapped.sa_sigaction(signal, info, context);
  else if (gWrapped.sa_handler != SIG_DFL && gWrapped.sa_handler != SIG_IGN)
    gWrapped.sa_handler(signal);
}

/// Puts onSigint in front of the process's SIGINT handler, unless it is there already or the
/// handler is the default or ignores the signal.
void wrap() {
  struct sigaction current;
  if (sigaction(SIGINT, nullptr, &current) != 0)
    return;
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == onSigint)
    return;
  if (!(current.sa_flags & SA_SIGINFO) &&
      (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN))
    return;
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  pthread_sigmask(SIG_BLOCK, &block, &old); // this thread's handler never sees half a copy
  gWrapped = current;
  struct sigaction ours = current;
  ours.sa_sigaction = onSigint;
  // No SA_RESTART, as Python's own handler: a poll(2) the signal reaches returns at once.
  ours.sa_flags = SA_SIGINFO | (current.sa_flags & SA_ONSTACK);
  sigaction(SIGINT, &ours, nullptr);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

} // namespace

Wait::Wait() {
  wrap();
  gRequested.store(false);
  gWaits.fetch_add(1);
}

Wait::~Wait() {
  if (gWaits.fetch_sub(1) == 1)
    gRequested.store(false);
}

bool take() { return gRequested.exchange(false); }

void request() {
  if (gWaits.load() > 0)
    gRequested.store(true);
}

bool waiting() { return gWaits.load() > 0; }

} // namespace rgpu::client::interrupts
