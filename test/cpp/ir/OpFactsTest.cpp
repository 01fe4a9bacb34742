#include "rgpu/ir/Graph.h"
#include "rgpu/ir/OpFacts.h"

#include <gtest/gtest.h>

using namespace rgpu::ir;

TEST(OpFacts, ABaseNamesFactsHoldForEveryOverload) {
  EXPECT_TRUE(opFacts("aten::nonzero").has(OpFact::DataDependent));
  EXPECT_TRUE(opFacts("aten::repeat_interleave.Tensor").has(OpFact::DataDependent));
  EXPECT_TRUE(opFacts("aten::copy").has(OpFact::CrossesDevices));
  EXPECT_FALSE(opFacts("aten::add.Tensor").has(OpFact::DataDependent));
  EXPECT_TRUE(opFacts("aten::relu").empty());
}

TEST(OpFacts, AnOverloadsFactsHoldForThatOverloadOnly) {
  EXPECT_TRUE(opFacts("aten::slice_copy.Tensor").has(OpFact::RegionView));
  EXPECT_FALSE(opFacts("aten::slice_copy").has(OpFact::RegionView));
  // ".default" names the overload without a name.
  EXPECT_TRUE(opFacts("aten::view_copy").has(OpFact::RunsAsReshape));
  EXPECT_FALSE(opFacts("aten::view_copy.dtype").has(OpFact::RunsAsReshape));
  EXPECT_TRUE(opFacts("aten::repeat_interleave.self_int").has(OpFact::CompositeWithoutGrad));
  EXPECT_FALSE(opFacts("aten::repeat_interleave.Tensor").has(OpFact::CompositeWithoutGrad));
}

TEST(OpFacts, FamiliesMatchByPrefix) {
  EXPECT_TRUE(opFacts("aten::empty_strided").has(OpFact::Uninitialized));
  EXPECT_TRUE(opFacts("aten::new_empty.default").has(OpFact::Factory));
  EXPECT_FALSE(opFacts("aten::zeros_like").has(OpFact::Uninitialized));
  EXPECT_TRUE(opFacts("aten::_unsafe_index.Tensor").has(OpFact::UncheckedOnceCompiled));
  // Past leading underscores: `_to_sparse` is `to_sparse`'s family.
  EXPECT_TRUE(opFacts("aten::_to_sparse_csr").has(OpFact::OtherLayout));
  EXPECT_FALSE(opFacts("_c10d_functional::empty").has(OpFact::Uninitialized));
}

TEST(OpFacts, RefusalsAndStringArgumentsAreListedWithTheirReasonsAndValues) {
  EXPECT_EQ(refusal("aten::from_file"), "reads a file on the server");
  EXPECT_TRUE(refusal("aten::add").empty());
  const auto *modes = allowedStrings("aten::div", "rounding_mode");
  ASSERT_NE(modes, nullptr);
  EXPECT_EQ(modes->size(), 2u);
  EXPECT_NE(allowedStrings("aten::fft_rfft2", "norm"), nullptr);
  EXPECT_EQ(allowedStrings("aten::einsum", "equation"), nullptr);
  EXPECT_TRUE(compiledAsConstant("aten::addmm", "beta"));
  EXPECT_FALSE(compiledAsConstant("aten::addmm", "self"));
}

TEST(OpFacts, SpecialOpsAndListedOps) {
  EXPECT_EQ(specialOp("aten::_local_scalar_dense"), SpecialOp::ReadScalar);
  EXPECT_EQ(specialOp("aten::add"), SpecialOp::None);
  auto whole = opsWith(OpFact::RecordedWhole);
  EXPECT_NE(std::find(whole.begin(), whole.end(), "aten::linear.default"), whole.end());
}

TEST(OpFacts, DtypesHaveOneRowEach) {
  EXPECT_STREQ(dtype::torchName(dtype::BFloat16), "bfloat16");
  EXPECT_EQ(dtype::name(dtype::Float), "f32");
  EXPECT_EQ(dtype::itemSize(dtype::ComplexDouble), 16u);
  EXPECT_FALSE(dtype::isValid(12)); // qint8
  EXPECT_EQ(dtype::torchName(12), nullptr);
  EXPECT_EQ(dtype::name(dtype::Undefined), "undefined");
}

TEST(TensorMeta, IsContiguousAsTorchSays) {
  TensorMeta m = TensorMeta::contiguous(dtype::Float, {2, 1, 3});
  EXPECT_TRUE(m.isContiguous());
  m.strides[1] = 7; // a size-1 dimension's stride does not matter
  EXPECT_TRUE(m.isContiguous());
  m.strides = {1, 2, 2};
  EXPECT_FALSE(m.isContiguous());
  TensorMeta empty = TensorMeta::contiguous(dtype::Float, {0, 4});
  empty.strides = {9, 9};
  EXPECT_TRUE(empty.isContiguous());
}
