#include "Memory.h"

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace rgpu::server::memory {

/// A block of the underlying allocator, and how to give it back.
struct Block {
  void *data;
  void *context;
  c10::DeleterFnPtr deleter;
};

namespace {

std::atomic<uint64_t> gLimit{0}, gHeld{0};

/// Bounds on the blocks kept for reuse: per session, and by all sessions together (the server
/// may hold this much beyond what sessions hold). A decoding step's tensors fit many times
/// over; past the bound, blocks go back to malloc as before.
constexpr uint64_t kKeptPerSession = 32ull << 20, kKeptTotal = 256ull << 20;
std::atomic<uint64_t> gKept{0};

void release(const Block &b) {
  if (b.deleter)
    b.deleter(b.context);
}

} // namespace

/// Exact sizes only: a loop allocates the same sizes every iteration, and an exact match wastes
/// nothing.
struct Account::Kept {
  std::mutex mu;
  std::unordered_map<uint64_t, std::vector<Block>> bySize;
  uint64_t bytes = 0;

  bool take(uint64_t n, Block &b) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = bySize.find(n);
    if (it == bySize.end() || it->second.empty())
      return false;
    b = it->second.back();
    it->second.pop_back();
    bytes -= n;
    gKept -= n;
    return true;
  }

  bool keep(uint64_t n, const Block &b) {
    std::lock_guard<std::mutex> lock(mu);
    if (bytes + n > kKeptPerSession)
      return false;
    if (gKept.fetch_add(n) + n > kKeptTotal) {
      gKept -= n;
      return false;
    }
    bySize[n].push_back(b);
    bytes += n;
    return true;
  }

  ~Kept() {
    for (auto &[n, blocks] : bySize)
      for (const Block &b : blocks) {
        gKept -= n;
        release(b);
      }
  }
};

Account::Account() : kept(std::make_unique<Kept>()) {}
Account::~Account() = default;

namespace {

void raisePeak(std::atomic<uint64_t> &peak, uint64_t now) {
  uint64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}
thread_local const std::shared_ptr<Account> *tCurrent = nullptr;

/// What one live allocation was charged to, and how to free it underneath: kept in the
/// kHeaderBytes in front of the block, so an allocation and its free take no lock and no
/// table of their own (a compiled decoding step allocates its buffers every run).
struct Header {
  void *context; ///< The underlying allocation's context and deleter.
  c10::DeleterFnPtr deleter;
  std::shared_ptr<Account> account;
  uint64_t bytes;
};
/// A multiple of the CPU allocator's alignment (c10::gAlignment), so blocks stay as aligned.
constexpr size_t kHeaderBytes = 64;
static_assert(sizeof(Header) <= kHeaderBytes && kHeaderBytes % alignof(Header) == 0);

Header *headerOf(void *data) {
  return reinterpret_cast<Header *>(static_cast<char *>(data) - kHeaderBytes);
}

/// Charges \p n bytes to the server and to \p account (if any); throws OutOfMemoryError,
/// charging nothing, past the server's limit or the account's quota.
void chargeOrThrow(Account *account, uint64_t n) {
  uint64_t total = gHeld.fetch_add(n) + n;
  if (uint64_t limit = gLimit.load(); limit && total > limit) {
    gHeld -= n;
    if (account)
      ++account->refused;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "allocating ", sizeText(n),
                     " would take rgpu-opserver past its memory limit of ", sizeText(limit),
                     " (--memory-limit; ", sizeText(total - n), " are held by all sessions)");
  }
  if (account && account->quota) {
    uint64_t mine = account->held.fetch_add(n) + n;
    if (mine > account->quota) {
      account->held -= n;
      gHeld -= n;
      ++account->refused;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "allocating ", sizeText(n),
                       " would take this session past its memory quota of ",
                       sizeText(account->quota), " (--session-memory; it holds ",
                       sizeText(mine - n), ")");
    }
  } else if (account) {
    account->held += n;
  }
}

void creditBytes(Account *account, uint64_t n) {
  gHeld -= n;
  if (account)
    account->held -= n;
}

/// In front of the CPU allocator. Its DataPtrs are simple (context == data, so raw_allocate
/// works); what a block was charged to is in its header.
class AccountingAllocator final : public c10::Allocator {
public:
  explicit AccountingAllocator(c10::Allocator *base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    if (n == 0) // as c10's CPU allocator: no data, which raw_deallocate hands back as null
      return {nullptr, nullptr, &AccountingAllocator::free, c10::Device(c10::kCPU)};
    const std::shared_ptr<Account> *account = tCurrent;
    chargeOrThrow(account ? account->get() : nullptr, n);
    Block block{};
    if (!account || !(*account)->kept->take(n, block)) {
      c10::DataPtr inner;
      try {
        if (n <= SIZE_MAX - kHeaderBytes)
          inner = base_->allocate(n + kHeaderBytes);
      } catch (...) {
      }
      if (!inner) {
        // Named in the tensor's bytes, not the block's with its header.
        creditBytes(account ? account->get() : nullptr, n);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "rgpu-opserver can't allocate memory: ",
                         n, " bytes (", sizeText(n), ") were refused by the system");
      }
      block.data = static_cast<char *>(inner.get()) + kHeaderBytes;
      block.deleter = inner.get_deleter();
      block.context = inner.release_context();
    }
    if (account)
      raisePeak((*account)->peak, (*account)->owned());
    new (headerOf(block.data))
        Header{block.context, block.deleter, account ? *account : nullptr, n};
    return {block.data, block.data, &AccountingAllocator::free, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &AccountingAllocator::free; }

  void copy_data(void *dest, const void *src, std::size_t count) const override {
    base_->copy_data(dest, src, count);
  }

private:
  static void free(void *data) {
    if (!data) // raw_deallocate(nullptr), as oneDNN's buffers do
      return;
    Header *h = headerOf(data);
    std::shared_ptr<Account> account = std::move(h->account);
    const Block block{data, h->context, h->deleter};
    const uint64_t bytes = h->bytes;
    h->~Header();
    creditBytes(account.get(), bytes);
    if (!account || !account->kept->keep(bytes, block))
      release(block);
  }

  c10::Allocator *base_;
};

} // namespace

void install(uint64_t limit) {
  gLimit = limit;
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: tensors may be freed during exit.
    auto *accounting = new AccountingAllocator(c10::GetAllocator(c10::kCPU));
    c10::SetAllocator(c10::kCPU, accounting, /*priority=*/UINT8_MAX);
  });
}

void charge(Account *account, uint64_t bytes) {
  chargeOrThrow(account, bytes);
  if (account)
    raisePeak(account->peak, account->owned());
}
void credit(Account *account, uint64_t bytes) { creditBytes(account, bytes); }

void chargeFrames(Account *account, uint64_t bytes) {
  chargeOrThrow(account, bytes);
  if (account)
    account->frames += bytes;
}

void creditFrames(Account *account, uint64_t bytes) {
  creditBytes(account, bytes);
  if (account)
    account->frames -= bytes;
}

uint64_t limit() { return gLimit; }
uint64_t held() { return gHeld; }
uint64_t kept() { return gKept; }

Charge::Charge(const std::shared_ptr<Account> &account) : previous_(tCurrent) {
  tCurrent = &account;
}
Charge::~Charge() { tCurrent = previous_; }

Uncharged::Uncharged() : previous_(tCurrent) { tCurrent = nullptr; }
Uncharged::~Uncharged() { tCurrent = previous_; }

std::optional<uint64_t> parseSize(const std::string &text) {
  double value = 0;
  int used = 0;
  if (std::sscanf(text.c_str(), "%lf%n", &value, &used) != 1 || !(value >= 0) ||
      !std::isfinite(value))
    return std::nullopt;
  std::string unit = text.substr(used);
  while (!unit.empty() && unit.front() == ' ')
    unit.erase(0, 1);
  for (char &c : unit)
    c = char(std::tolower(static_cast<unsigned char>(c)));
  static const char *kUnits[] = {"", "k", "m", "g", "t"};
  for (int power = 0; power < 5; ++power) {
    std::string u = kUnits[power];
    if (unit == u || (power && (unit == u + "b" || unit == u + "ib"))) {
      double scaled = value * std::pow(1024.0, power);
      if (scaled >= 1.8e19)
        return std::nullopt;
      return uint64_t(scaled);
    }
  }
  if (unit == "b")
    return uint64_t(value);
  return std::nullopt;
}

std::string sizeText(uint64_t bytes) {
  static const char *kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char out[32];
  if (u == 0)
    std::snprintf(out, sizeof out, "%llu bytes", static_cast<unsigned long long>(bytes));
  else
    std::snprintf(out, sizeof out, v < 10 && v != std::floor(v) ? "%.1f %s" : "%.0f %s", v,
                  kUnits[u]);
  return out;
}

} // namespace rgpu::server::memory
