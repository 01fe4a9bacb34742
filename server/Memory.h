//===- server/Memory.h - Memory quotas: who holds how many bytes ----------===//
//
// Every CPU allocation libtorch makes goes through one allocator (c10::GetAllocator(kCPU)).
// install() puts an accounting allocator in front of it: each allocation is charged to the
// account of the session whose frame the allocating thread is serving (a Charge in scope), and
// to the server as a whole; each free credits the same account, from whatever thread it happens
// on. An allocation that would take a session past its quota (--session-memory) or the server
// past its limit (--memory-limit) throws c10::OutOfMemoryError, which the plan reports as that
// op's error: the session gets an rgpu.RemoteError naming the quota, and goes on.
//
// What is counted: tensors (device tensors of a CPU server, partial uploads, download staging)
// and anything else libtorch allocates through its CPU allocator. Frames and Cap'n Proto
// buffers are bounded by the connection limits instead. A CUDA server's device memory comes
// from CUDA's caching allocator, which is not wrapped; there the quota counts host memory only
// and CUDA's own OutOfMemoryError becomes the same kind of RemoteError.
//
// A block a session frees is kept for that session's next allocation of the same size (a
// decoding or training step allocates the same sizes every time): it skips malloc, free and the
// zeroing of fresh memory, which the session's own bytes need not have. Kept blocks count as
// held by nobody; they are bounded per session and for the server (kKeptPerSession,
// kKeptTotal in Memory.cpp) and freed with the session's account.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace rgpu::server::memory {

/// One session's bytes. Outlives its session while any tensor charged to it lives.
struct Account {
  Account();
  ~Account(); ///< frees the blocks it kept
  uint64_t quota = 0; ///< 0: none (the server's limit still applies).
  std::atomic<uint64_t> held{0}, peak{0}, refused{0};
  /// Of held, the bytes of frames its connection holds not yet served (chargeFrames): they
  /// count toward the quota, not toward the figures torch.rgpu reports, nor the peak.
  std::atomic<uint64_t> frames{0};
  /// held less frames: what the session's own tensors and tables take.
  uint64_t owned() const {
    const uint64_t f = frames.load(), h = held.load();
    return h > f ? h - f : 0;
  }
  /// Blocks this session freed, kept for its next allocations of the same size (Memory.cpp).
  struct Kept;
  std::unique_ptr<Kept> kept;
};

/// Charges \p bytes held outside libtorch's allocator (a session's table of tensor handles, a
/// connection's frames in flight) to \p account (null: to no session) and the server, as an
/// allocation of that size would be: throws c10::OutOfMemoryError, charging nothing, past the
/// quota or the limit.
void charge(Account *account, uint64_t bytes);
/// Gives back what charge() took.
void credit(Account *account, uint64_t bytes);
/// As charge() and credit(), for the bytes of frames a connection holds for \p account's
/// session (Account::frames).
void chargeFrames(Account *account, uint64_t bytes);
void creditFrames(Account *account, uint64_t bytes);

/// Installs the accounting allocator (once; later calls only change the limit). \p limit is
/// the server's total in bytes, 0 for none.
void install(uint64_t limit);
/// The server's limit and the bytes charged to every account and to none.
uint64_t limit();
uint64_t held();
/// The bytes of the blocks sessions freed and their accounts keep for reuse.
uint64_t kept();

/// While a Charge lives, this thread's CPU allocations are charged to \p account.
class Charge {
public:
  explicit Charge(const std::shared_ptr<Account> &account);
  ~Charge();
  Charge(const Charge &) = delete;
  Charge &operator=(const Charge &) = delete;

private:
  const std::shared_ptr<Account> *previous_;
};

/// While an Uncharged lives, this thread's CPU allocations are charged to no session (the
/// server's total still counts them): for buffers the server keeps beyond the session whose
/// frame made them.
class Uncharged {
public:
  Uncharged();
  ~Uncharged();
  Uncharged(const Uncharged &) = delete;
  Uncharged &operator=(const Uncharged &) = delete;

private:
  const std::shared_ptr<Account> *previous_;
};

/// The bytes "8GiB", "512 MiB", "64k", "1.5G" say (powers of 1024; a bare number is bytes);
/// none if \p text is not a size.
std::optional<uint64_t> parseSize(const std::string &text);
/// 1536 -> "1.5 KiB".
std::string sizeText(uint64_t bytes);

} // namespace rgpu::server::memory
