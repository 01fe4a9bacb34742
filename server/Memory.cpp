#include "Memory.h"

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <mutex>
#include <unordered_map>

namespace rgpu::server::memory {
namespace {

std::atomic<uint64_t> gLimit{0}, gHeld{0}, gPeak{0};

void raisePeak(std::atomic<uint64_t> &peak, uint64_t now) {
  uint64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}
thread_local const std::shared_ptr<Account> *tCurrent = nullptr;

/// What one live allocation was charged to, and how to free it underneath.
struct Record {
  void *context;
  c10::DeleterFnPtr deleter;
  std::shared_ptr<Account> account;
  uint64_t bytes;
};

/// In front of the CPU allocator. Its DataPtrs are simple (context == data, so raw_allocate
/// works); the records live in a table keyed by the data pointer.
class AccountingAllocator final : public c10::Allocator {
public:
  explicit AccountingAllocator(c10::Allocator *base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    const std::shared_ptr<Account> *account = tCurrent;
    uint64_t total = gHeld.fetch_add(n) + n;
    if (uint64_t limit = gLimit.load(); limit && total > limit) {
      gHeld -= n;
      if (account)
        ++(*account)->refused;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "allocating ", sizeText(n),
                       " would take rgpu-opserver past its memory limit of ", sizeText(limit),
                       " (--memory-limit; ", sizeText(total - n), " are held by all sessions)");
    }
    if (account && (*account)->quota) {
      Account &a = **account;
      uint64_t mine = a.held.fetch_add(n) + n;
      if (mine > a.quota) {
        a.held -= n;
        gHeld -= n;
        ++a.refused;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "allocating ", sizeText(n),
                         " would take this session past its memory quota of ",
                         sizeText(a.quota), " (--session-memory; it holds ",
                         sizeText(mine - n), ")");
      }
    } else if (account) {
      (*account)->held += n;
    }
    c10::DataPtr inner;
    try {
      inner = base_->allocate(n);
    } catch (...) {
      credit(account ? account->get() : nullptr, n);
      throw;
    }
    void *data = inner.get();
    if (!data) { // zero bytes
      credit(account ? account->get() : nullptr, n);
      return inner;
    }
    raisePeak(gPeak, gHeld.load());
    if (account)
      raisePeak((*account)->peak, (*account)->held.load());
    c10::Device device = inner.device();
    c10::DeleterFnPtr deleter = inner.get_deleter();
    void *context = inner.release_context();
    {
      std::lock_guard<std::mutex> lock(mu_);
      records_[data] = {context, deleter, account ? *account : nullptr, n};
    }
    return {data, data, &AccountingAllocator::free, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &AccountingAllocator::free; }

  void copy_data(void *dest, const void *src, std::size_t count) const override {
    base_->copy_data(dest, src, count);
  }

  static AccountingAllocator *&instance() {
    static AccountingAllocator *self = nullptr;
    return self;
  }

private:
  static void credit(Account *account, uint64_t n) {
    gHeld -= n;
    if (account)
      account->held -= n;
  }

  static void free(void *data) {
    AccountingAllocator *self = instance();
    Record r;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->records_.find(data);
      if (it == self->records_.end())
        return; // not ours: cannot happen, and freeing it would be worse than a leak
      r = std::move(it->second);
      self->records_.erase(it);
    }
    credit(r.account.get(), r.bytes);
    if (r.deleter)
      r.deleter(r.context);
  }

  c10::Allocator *base_;
  std::mutex mu_;
  std::unordered_map<void *, Record> records_;
};

} // namespace

void install(uint64_t limit) {
  gLimit = limit;
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: tensors may be freed during exit.
    auto *accounting = new AccountingAllocator(c10::GetAllocator(c10::kCPU));
    AccountingAllocator::instance() = accounting;
    c10::SetAllocator(c10::kCPU, accounting, /*priority=*/UINT8_MAX);
  });
}

uint64_t limit() { return gLimit; }
uint64_t held() { return gHeld; }
uint64_t peak() { return gPeak; }
void resetPeak() { gPeak = gHeld.load(); }

Charge::Charge(const std::shared_ptr<Account> &account) : previous_(tCurrent) {
  tCurrent = &account;
}
Charge::~Charge() { tCurrent = previous_; }

bool parseSize(const std::string &text, uint64_t &bytes) {
  double value = 0;
  int used = 0;
  if (std::sscanf(text.c_str(), "%lf%n", &value, &used) != 1 || !(value >= 0) ||
      !std::isfinite(value))
    return false;
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
        return false;
      bytes = uint64_t(scaled);
      return true;
    }
  }
  if (unit == "b") {
    bytes = uint64_t(value);
    return true;
  }
  return false;
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
