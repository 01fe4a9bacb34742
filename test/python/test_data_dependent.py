"""Ops whose output shape depends on data cut the graph and still match CPU."""

import pytest
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


def _waits(fn):
    before = rgpu.stats()["waits"]
    fn()
    return rgpu.stats()["waits"] - before


def test_a_mask_assignment_that_needs_no_count_waits_for_nothing():
    # A value of one element fills every masked place, however many: no count of the mask's
    # true elements is needed, so nothing waits for the server, and the result is the CPU's.
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    logits = torch.randn(3, 10)
    ints = torch.arange(-6, 6).reshape(3, 4)
    flags = torch.rand(4, 4) > 0.5
    halves = torch.randn(4, 4, dtype=torch.bfloat16)
    zs = torch.randn(4, 4, dtype=torch.complex64)

    def assign(x, logits, ints, flags, halves, zs, dev):
        x[x < 0] = 0.0
        x[x > 1] = torch.tensor(5.0)                    # a CPU 0-dim value
        x[(x.sum(1) > 1)] = 7                           # rows: a mask of the first dimension
        x[:, x[0] > 0.5] = -2.5                         # columns: a mask after a None
        x[x == 7] = torch.tensor([6.0], device=dev)     # one element of one dimension
        x.index_put_((x > 5,), torch.tensor(1.0, device=dev), accumulate=True)
        t = x.t()                                       # not contiguous
        t[t < -2] = -3
        v = x[2:]                                       # in place on a view of a view
        w = v[:, 1:]
        w[w == 0] = 9
        v, _ = torch.topk(logits, 3)                    # top-k sampling's filter
        logits[logits < v[:, [-1]]] = -float("Inf")
        ints[ints % 3 == 0] = 2.7                       # cast to int, as the CPU casts
        flags[flags] = False
        halves[halves > 0] = 0.5
        zs[zs.real > 0] = 1j
        x[torch.zeros(6, 5, dtype=torch.bool, device=dev)] = 100  # no true element

    cpu = [t.clone() for t in (x, logits, ints, flags, halves, zs)]
    on = [t.to(R) for t in cpu]
    assign(*cpu, "cpu")
    assert _waits(lambda: assign(*on, R)) == 0
    for a, b in zip(on, cpu):
        same(a, b)


def test_a_mask_assignment_that_needs_the_count_waits_once_and_errors_as_cpu_does():
    x = torch.randn(4, 4)
    r = x.to(R)
    n = int((x > 0).sum())
    assert _waits(lambda: r.__setitem__(r > 0, torch.arange(n, dtype=torch.float, device=R))) == 1
    x[x > 0] = torch.arange(n, dtype=torch.float)
    same(r, x)
    # torch's indexing reads a 0-dim mask as a bool (on CUDA too); this one the client knows
    # (it uploaded rz, and compares it itself: KnownValues.h), so it costs no wait.
    z = torch.tensor(3.0)
    rz = z.to(R)
    assert _waits(lambda: rz.__setitem__(rz > 0, 1.0)) == 0
    z[z > 0] = 1.0
    same(rz, z)
    for value in (torch.ones(3, 3), torch.ones(5, 5)):      # cannot broadcast to the count
        with pytest.raises(RuntimeError):
            x[x > 0] = value
        with pytest.raises(RuntimeError):
            r[r > 0] = value.to(R)
    with pytest.raises(IndexError):                          # a mask of other sizes
        x[torch.ones(3, dtype=torch.bool)] = 0.0
    with pytest.raises(IndexError):
        r[torch.ones(3, dtype=torch.bool, device=R)] = 0.0
    # A value of another dtype is cast as the CPU casts it, on the counting path.
    x.index_put_((x > 0,), torch.tensor(1.5, dtype=torch.float64))
    r.index_put_((r > 0,), torch.tensor(1.5, dtype=torch.float64, device=R))
    with pytest.raises(RuntimeError, match="without overflow"):
        x.index_put_((x > 0,), torch.tensor(1j))
    with pytest.raises(RuntimeError, match="without overflow"):
        r.index_put_((r > 0,), torch.tensor(1j, device=R))
    same(r, x)


def test_small_values_built_from_uploaded_data_are_read_without_a_wait_and_exactly():
    # The client computes integer and boolean results of data it uploaded itself, as it traces
    # them (KnownValues.h): reading them waits for nothing, and gives what the server computes.
    ids = torch.tensor([[5, 0, 7, 2], [0, 3, 3, 9]])
    r = ids.to(R)

    def small(t):
        return torch.tensor([3, 9], device=t.device)

    cases = [
        lambda t: (t < 0).any(),
        lambda t: torch.isin(t, small(t)).all(),
        lambda t: t[:, -1].sum(),
        lambda t: (t * 3 + 1).max(),
        lambda t: t.ne(0).long().cumsum(1),
        lambda t: torch.cat([t, t.flip(1)]).argmax(dim=1),
        lambda t: t.t().reshape(-1)[2:5],
        lambda t: torch.where(t > 2, t, torch.zeros_like(t)),
        lambda t: t.to(torch.int16).to(torch.float64),
        lambda t: torch.ones(2, 4, dtype=torch.long, device=t.device).sum() + t.numel(),
        lambda t: t.masked_fill(t == 3, -1),
    ]
    for f in cases:
        expected = f(ids)
        got = []
        assert _waits(lambda: got.append(f(r).cpu())) == 0, f
        assert torch.equal(got[0], expected) and got[0].dtype == expected.dtype
    # Float arithmetic is the server's to compute (a fused kernel may round otherwise).
    x = torch.tensor([0.1, 0.2, 0.3])
    rx = x.to(R)
    assert _waits(lambda: (rx * 3).sum().item()) == 1
    assert _waits(lambda: rx.to(torch.int32).cpu()) == 1  # a float's cast to an integer too
