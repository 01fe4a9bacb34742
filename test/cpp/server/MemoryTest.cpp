// The accounting allocator's blocks kept for reuse: per session, bounded, freed with the session.
#include "Memory.h"

#include <c10/core/Allocator.h>
#include <gtest/gtest.h>

#include <vector>

using namespace rgpu::server;

namespace {
c10::DataPtr allocateFor(const std::shared_ptr<memory::Account> &account, size_t bytes) {
  memory::Charge charge(account);
  return c10::GetAllocator(c10::kCPU)->allocate(bytes);
}
} // namespace

TEST(Memory, ASessionReusesTheBlocksItFreedAndNoOtherSessionDoes) {
  memory::install(0);
  auto mine = std::make_shared<memory::Account>(), other = std::make_shared<memory::Account>();
  const uint64_t keptBefore = memory::kept();
  void *block;
  {
    c10::DataPtr p = allocateFor(mine, 4096);
    block = p.get();
    static_cast<char *>(block)[0] = 42;
  }
  EXPECT_EQ(mine->held, 0u);
  EXPECT_EQ(memory::kept(), keptBefore + 4096);

  c10::DataPtr theirs = allocateFor(other, 4096);
  EXPECT_NE(theirs.get(), block);
  c10::DataPtr again = allocateFor(mine, 4096);
  EXPECT_EQ(again.get(), block);
  EXPECT_EQ(static_cast<char *>(again.get())[0], 42); // the session's own bytes, as it left them
  EXPECT_EQ(mine->held, 4096u);
  EXPECT_EQ(memory::kept(), keptBefore);

  // A session's account ends with its last tensor: the blocks it kept go back.
  again.clear();
  theirs.clear();
  EXPECT_EQ(memory::kept(), keptBefore + 8192);
  mine.reset();
  other.reset();
  EXPECT_EQ(memory::kept(), keptBefore);
}

TEST(Memory, ASessionKeepsABoundedNumberOfBytes) {
  memory::install(0);
  auto account = std::make_shared<memory::Account>();
  const uint64_t keptBefore = memory::kept();
  std::vector<c10::DataPtr> blocks;
  for (int i = 0; i < 64; ++i)
    blocks.push_back(allocateFor(account, 1 << 20));
  blocks.clear();
  EXPECT_LE(memory::kept() - keptBefore, uint64_t(32) << 20);
  EXPECT_GT(memory::kept() - keptBefore, 0u);
  account.reset();
  EXPECT_EQ(memory::kept(), keptBefore);
}

TEST(Memory, RawBlocksAndEmptyAllocationsGoBackWhole) {
  // oneDNN allocates through raw_allocate and hands back null pointers too; an allocation of
  // no bytes has no data, as with c10's own CPU allocator. Each charge is credited back.
  memory::install(0);
  auto account = std::make_shared<memory::Account>();
  c10::Allocator *allocator = c10::GetAllocator(c10::kCPU);
  {
    memory::Charge charge(account);
    void *raw = allocator->raw_allocate(100);
    ASSERT_NE(raw, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(raw) % 64, 0u); // as aligned as c10's blocks
    EXPECT_EQ(account->held, 100u);
    allocator->raw_deallocate(raw);
    allocator->raw_deallocate(nullptr);
    c10::DataPtr empty = allocator->allocate(0);
    EXPECT_EQ(empty.get(), nullptr);
  }
  EXPECT_EQ(account->held, 0u);
  // Uncharged: the server's total counts it, no session does.
  const uint64_t held = memory::held();
  {
    memory::Charge charge(account);
    memory::Uncharged uncharged;
    c10::DataPtr p = allocator->allocate(256);
    EXPECT_EQ(account->held, 0u);
    EXPECT_EQ(memory::held(), held + 256);
  }
  EXPECT_EQ(memory::held(), held);
}
