"""Ops whose output shape depends on data cut the graph and still match CPU."""

import torch
from conftest import same

import rgpu

R = "rgpu"


def test_nonzero_masked_select_and_boolean_indexing():
    x = torch.randn(5, 6)
    r = x.to(R)
    same(torch.nonzero(r > 0), torch.nonzero(x > 0))
    same(torch.masked_select(r, r > 0.5), torch.masked_select(x, x > 0.5))
    same(r[r > 0], x[x > 0])
    same(r[(r > 0).any(dim=1)], x[(x > 0).any(dim=1)])
    same(torch.argwhere(r < 0), torch.argwhere(x < 0))


def test_unique_and_its_counts():
    x = torch.tensor([3, 1, 2, 3, 3, 1, 7])
    r = x.to(R)
    same(torch.unique(r), torch.unique(x))
    same(torch.unique(r, return_counts=True), torch.unique(x, return_counts=True))
    same(torch.unique_consecutive(r), torch.unique_consecutive(x))


def test_results_of_a_data_dependent_op_keep_tracing():
    x = torch.randn(10)
    r = x.to(R)
    pos = r[r > 0]
    same(pos * 2 + pos.sum(), x[x > 0] * 2 + x[x > 0].sum())


def test_boolean_mask_assignment():
    x = torch.randn(4, 4)
    r = x.to(R)
    r[r < 0] = 0
    x[x < 0] = 0
    same(r, x)
