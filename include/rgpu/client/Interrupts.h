//===- rgpu/client/Interrupts.h - Ctrl-C during a wait for the server -----===//
//
// A wait for the server blocks in C++, where Python's SIGINT handler does not run until the
// wait ends: a Ctrl-C during a long graph would be seen only when the server is done. So while
// a wait is in progress, SIGINT is also noted here: the process's handler (Python's, or the
// one a notebook or framework installed) is wrapped by one that notes the signal and then
// calls it, so that Python still sees every SIGINT. The wait asks requested() every
// Transport::kInterruptPollMs and cancels what the server is running for this session
// (wire::Command's cancel). rgpu.cancel() requests the same from code.
//
//===----------------------------------------------------------------------===//
#pragma once

namespace rgpu::client::interrupts {

/// Marks a wait for the server, for its lifetime. It (re)wraps the process's SIGINT handler if
/// someone installed another since (Python code may set one at any time); a handler of
/// SIG_DFL or SIG_IGN is left alone. A request made before the wait began is not this wait's.
class Wait {
public:
  Wait();
  ~Wait();
  Wait(const Wait &) = delete;
  Wait &operator=(const Wait &) = delete;
};

/// Whether a SIGINT arrived, or request() was called, during the current wait; takes it.
bool take();
/// Interrupts the current wait, if one is in progress (rgpu.cancel()). Async-signal-safe.
void request();
/// Whether a wait is in progress.
bool waiting();

} // namespace rgpu::client::interrupts
