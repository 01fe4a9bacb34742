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
