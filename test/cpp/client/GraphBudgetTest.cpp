#include "GraphBudget.h"

#include <gtest/gtest.h>

using rgpu::client::GraphBudget;
using rgpu::ir::Hash256;

namespace {
Hash256 hashOf(uint8_t k) {
  Hash256 h{};
  h.w[0] = k;
  return h;
}
} // namespace

TEST(GraphBudget, AGraphIsHeldOnceAdmitted) {
  GraphBudget budget;
  EXPECT_FALSE(budget.holds(hashOf(1)));
  EXPECT_FALSE(budget.touch(hashOf(1)));
  EXPECT_TRUE(budget.admit(hashOf(1), 100, 1000).empty());
  EXPECT_TRUE(budget.holds(hashOf(1)));
  EXPECT_TRUE(budget.touch(hashOf(1)));
  EXPECT_EQ(budget.bytes(), 100u);
}

TEST(GraphBudget, TheLeastRecentlyRunGraphsAreForgottenToMakeRoom) {
  GraphBudget budget;
  budget.admit(hashOf(1), 400, 1000);
  budget.admit(hashOf(2), 400, 1000);
  budget.touch(hashOf(1)); // 2 is now the least recently run
  std::vector<Hash256> forgotten = budget.admit(hashOf(3), 400, 1000);
  ASSERT_EQ(forgotten.size(), 1u);
  EXPECT_EQ(forgotten[0], hashOf(2));
  EXPECT_TRUE(budget.holds(hashOf(1)));
  EXPECT_FALSE(budget.holds(hashOf(2)));
  EXPECT_EQ(budget.bytes(), 800u);
}

TEST(GraphBudget, AGraphLargerThanTheBudgetIsAdmittedAlone) {
  GraphBudget budget;
  budget.admit(hashOf(1), 10, 100);
  budget.admit(hashOf(2), 10, 100);
  std::vector<Hash256> forgotten = budget.admit(hashOf(3), 500, 100);
  EXPECT_EQ(forgotten.size(), 2u);
  EXPECT_EQ(budget.size(), 1u);
  EXPECT_TRUE(budget.holds(hashOf(3)));
}

TEST(GraphBudget, ABudgetOfZeroIsNoLimit) {
  GraphBudget budget;
  for (uint8_t k = 0; k < 10; ++k)
    EXPECT_TRUE(budget.admit(hashOf(k), uint64_t(1) << 40, 0).empty());
  EXPECT_EQ(budget.size(), 10u);
  budget.clear();
  EXPECT_EQ(budget.size(), 0u);
  EXPECT_EQ(budget.bytes(), 0u);
}
