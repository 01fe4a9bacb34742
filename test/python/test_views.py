"""Views, in-place ops and out= behave exactly as on CPU (functionalization underneath)."""

import torch
from conftest import same

import rgpu  # noqa: F401

R = "rgpu"


def run_both(fn, *tensors):
    """fn mutates its arguments; compares every argument and the result afterwards."""
    cpu = [t.clone() for t in tensors]
    dev = [t.to(R) for t in tensors]
    out_cpu = fn(*cpu)
    out_dev = fn(*dev)
    for d, c in zip(dev, cpu):
        same(d, c)
    if out_cpu is not None:
        same(out_dev, out_cpu)


def test_an_in_place_op_on_a_view_changes_the_base():
    def fn(x):
        v = x[1]
        v.add_(10)
        return v

    run_both(fn, torch.randn(3, 4))


def test_views_of_views_see_in_place_updates():
    def fn(x):
        a = x.view(4, 6)
        b = a[:, 1:5]
        c = b.t()
        c.mul_(2)
        x.add_(1)
        return c

    run_both(fn, torch.randn(24))


def test_in_place_on_a_strided_view_of_a_view():
    def fn(x):
        x[::2, 1::2].zero_()
        x.transpose(0, 1)[1].fill_(7)
        x.diagonal().add_(100)
        return x.sum()

    run_both(fn, torch.randn(6, 6))


def test_out_argument():
    def fn(a, b, out):
        torch.add(a, b, out=out)
        torch.mul(a[0], 2, out=out[0])
        return out

    run_both(fn, torch.randn(3, 4), torch.randn(3, 4), torch.empty(3, 4))


def test_out_argument_that_must_be_resized():
    def fn(a):
        out = torch.empty(0, device=a.device)
        torch.exp(a, out=out)
        return out

    run_both(fn, torch.randn(5))


def test_split_and_chunk_alias_their_base():
    def fn(x):
        a, b = x.split(2)
        c = x.chunk(3, dim=1)[2]
        a.add_(1)
        c.sub_(5)
        b.copy_(torch.ones_like(b))
        return torch.cat([a, b])

    run_both(fn, torch.randn(4, 6))


def test_expand_and_unbind():
    def fn(x):
        e = x[:1].expand(3, 4)
        parts = x.unbind(0)
        parts[2].neg_()
        return e * 1, parts

    run_both(fn, torch.randn(3, 4))


def test_in_place_chain_on_base_then_view_read():
    def fn(x):
        v = x.view(-1)
        x.relu_()
        x.masked_fill_(x > 0.5, 0.5)
        return v.clone()

    run_both(fn, torch.randn(4, 4))


def test_index_put_and_scatter_in_place():
    def fn(x, idx):
        x[idx] = 0
        x.scatter_add_(0, idx.unsqueeze(1).expand(-1, 3), torch.ones(2, 3, device=x.device))
        x.index_add_(0, idx, torch.full((2, 3), 2.0, device=x.device))
        return x

    run_both(fn, torch.randn(5, 3), torch.tensor([1, 3]))


def test_detach_and_data_share_values():
    def fn(x):
        d = x.detach()
        d.add_(1)
        x.data.mul_(2)
        return d

    run_both(fn, torch.randn(3))


def test_cpu_copy_into_and_out_of_rgpu():
    x = torch.randn(3, 4)
    r = torch.zeros(3, 4, device=R)
    r.copy_(x)
    same(r, x)
    r[0].copy_(torch.ones(4))
    x[0] = 1
    same(r, x)
    back = torch.empty(3, 4)
    back.copy_(r)
    torch.testing.assert_close(back, x)


def test_conjugate_and_negative_bits_are_kept_as_cpu_keeps_them():
    x = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])
    r = x.to("rgpu")
    cases = [lambda t: t.conj(), lambda t: torch._neg_view(t), lambda t: t[1:].conj(),
             lambda t: t.conj().conj(), lambda t: torch._neg_view(t.conj())]
    for k, make in enumerate(cases):
        cpu, dev = make(x), make(r)
        if k < 3:  # a view of a view reports its base's bits (the values are right regardless)
            assert (dev.is_conj(), dev.is_neg()) == (cpu.is_conj(), cpu.is_neg())
        same(dev, cpu)
        same(dev * 2, cpu * 2)
        same(dev.resolve_conj().resolve_neg(), cpu.resolve_conj().resolve_neg())
        assert not dev.resolve_conj().resolve_neg().is_conj()
    # Held across a graph cut, a conjugated slice keeps its bit and its values.
    y = r[1:].conj()
    rgpu.synchronize()
    same(y + 1, x[1:].conj() + 1)
    same(torch.view_as_real(r.conj().resolve_conj()), torch.view_as_real(x.conj().resolve_conj()))
    # CPU refuses view_as_real of a conjugated tensor; rgpu resolves it first.
    same(torch.view_as_real(r.conj()), torch.view_as_real(x.conj().resolve_conj()))
    same(torch.fft.hfft(r), torch.fft.hfft(x), rtol=1e-4, atol=1e-4)


def test_inference_mode_gives_the_tensors_cpu_gives():
    # A view of a normal tensor inside torch.inference_mode is a normal tensor; a view of an
    # inference tensor outside it is an inference tensor. Views of parameters (F.linear's
    # weight.t()) used to fail with "Cannot set version_counter for inference tensor".
    def probe(d):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).to(d).eval()
        x = torch.randn(2, 5, 16).to(d)
        w = torch.randn(4, 4).to(d).requires_grad_()
        values, flags = [], []
        with torch.inference_mode():
            y = layer(x)
            t, v, z = w.t(), x[0], x * 2
            part, _ = x.split(8, dim=-1)
            row = x.unbind(0)[1]
            x2 = x.clone()
            x2[0].mul_(3)
            values += [y, x2, part + 1, row * 1]
            flags += [y.is_inference(), t.is_inference(), t.requires_grad, v.is_inference(),
                      z.is_inference(), z.view(-1).is_inference(), part.is_inference(),
                      row.is_inference()]
        outside = z.view(-1)
        flags += [outside.is_inference()]
        values += [outside]
        try:
            z.add_(1)
            flags.append("no error")
        except RuntimeError as e:
            flags.append(str(e).split(".")[0])
        return values, flags

    (got, got_flags), (want, want_flags) = probe(R), probe("cpu")
    assert got_flags == want_flags
    for g, w in zip(got, want):
        same(g, w, rtol=1e-5, atol=1e-5)


def test_generation_under_inference_mode_matches_cpu():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from generation import LlamaStyle, generate

    out = []
    for d in ("cpu", R):
        torch.manual_seed(0)
        model = LlamaStyle().eval().to(d)
        prompt = torch.randint(0, 96, (2, 5)).to(d)
        with torch.inference_mode():
            out.append(generate(model, prompt, 8, cache="static").cpu())
    assert torch.equal(out[0], out[1])


def test_writes_through_expanded_views_fail_or_fill_as_on_cpu():
    # CPU refuses an in-place op on a tensor whose elements share memory (an expand()), save a
    # few fills. Functionalization would have summed the writes over the copies silently.
    import pytest

    for d in ("cpu", R):
        x = torch.ones(3, device=d)
        e = x.expand(2, 3)
        for write in (lambda: e.add_(1), lambda: e.mul_(torch.ones(2, 3, device=d)),
                      lambda: e.exp_(), lambda: e.copy_(torch.zeros(2, 3)),
                      lambda: e.clamp_(max=0.5), lambda: e.normal_()):
            with pytest.raises(RuntimeError, match="single memory location"):
                write()
        assert x.cpu().tolist() == [1.0, 1.0, 1.0], d
    for fill in (lambda t: t.fill_(5.0), lambda t: t.zero_(), lambda t: torch.fill_(t, 2.0),
                 lambda t: torch.nn.init.constant_(t, 3.0)):
        cpu, dev = torch.ones(3, 1), torch.ones(3, 1).to(R)
        fill(cpu.expand(3, 4))
        fill(dev.expand(3, 4))
        same(dev, cpu)
        cpu_row, dev_row = torch.ones(3), torch.ones(3).to(R)
        fill(cpu_row[None].expand(2, 3)[1:])  # a view of the expand
        fill(dev_row[None].expand(2, 3)[1:])
        same(dev_row, cpu_row)
    # A fill CPU accepts that rgpu cannot reproduce is refused, never answered otherwise.
    with pytest.raises(RuntimeError, match="share memory"):
        torch.ones(3, 3, device=R).expand(2, 3, 3).tril_()


def test_an_expand_of_a_sliced_view_reads_back():
    # The server lays such a value out as the client's meta says: its repeated elements are
    # copied once and expanded (a copy into a repeating layout is refused by ATen).
    def fn(x):
        e = x[1:].unsqueeze(0).expand(2, 3, 1)
        return x[1:].expand(3, 2), e, e * 2

    run_both(fn, torch.arange(4.0).reshape(4, 1))


def test_as_strided_in_a_graph_that_goes_symbolic():
    # Two sizes of one program make a symbolic graph; its as_strided view is checked against
    # each run's sizes, not the symbolic graph's blanks.
    for n in (4, 3, 5, 6):
        x = torch.arange(n * 3.0).reshape(n, 3)
        run_both(lambda t: (t + 1).as_strided((2,), (1,), 1) * 3, x)


def test_fill_diagonal_of_views_and_polygamma_in_place_match_cpu():
    # torch fills a diagonal through an as_strided() of the tensor, which functionalization
    # refuses on a view; polygamma_ has no functionalization kernel at all.
    def fn(x):
        x.t().fill_diagonal_(0.5)
        x[1:].fill_diagonal_(-1.0)
        x[:, 1:].polygamma_(1)
        x.fill_diagonal_(7.0, wrap=True)
        return x

    run_both(fn, torch.arange(1.0, 22.0).reshape(7, 3) * 0.1)
    run_both(lambda c: c[:, :, :].fill_diagonal_(2.0), torch.zeros(3, 3, 3))


def test_in_place_ops_keep_their_tensors_layout():
    # The functional forms of masked_fill_, cumsum_, tril_ return contiguous results on the
    # CPU; the in-place ops keep their tensor's strides, and so does rgpu.
    ops = [lambda t: t.masked_fill_(t > 0.5, 0.0), lambda t: t.cumsum_(0), lambda t: t.cumprod_(1),
           lambda t: t.tril_(), lambda t: t.triu_(1), lambda t: t.add_(1),
           lambda t: t.copy_(torch.ones(t.shape))]
    for op in ops:
        for view in (lambda x: x.t(), lambda x: x[:, ::2], lambda x: x.t()[1:], lambda x: x):
            cpu_base = torch.arange(12.0).reshape(4, 3) * 0.1
            dev_base = cpu_base.to(R)
            cpu, dev = view(cpu_base), view(dev_base)
            op(cpu)
            op(dev)
            assert dev.stride() == cpu.stride() and dev.is_contiguous() == cpu.is_contiguous()
            same(dev, cpu)
            same(dev_base, cpu_base)


def test_out_and_in_place_ops_refuse_a_result_their_dtype_cannot_hold_as_on_cpu():
    # Functionalization would convert the result to the out tensor's dtype silently.
    import pytest

    for d in ("cpu", R):
        ints = torch.tensor([1, 2], device=d)
        with pytest.raises(RuntimeError, match="cast"):
            torch.add(ints, 1.5, out=ints)
        flags = torch.tensor([True, False], device=d)
        with pytest.raises(RuntimeError, match="cast"):
            torch.mul(flags, 2, out=flags)
        # In-place ops too: torch's Python meta kernels do not check, functionalization casts.
        with pytest.raises(RuntimeError, match="cast"):
            flags.mul_(2)
        with pytest.raises(RuntimeError, match="cast"):
            ints.mul_(1.5)
        assert ints.cpu().tolist() == [1, 2] and flags.cpu().tolist() == [True, False]
    # Safe casts and resizes go on as on the CPU.
    run_both(lambda f, i: torch.add(i, 1, out=f), torch.zeros(2), torch.tensor([1, 2]))
    run_both(lambda e: torch.mul(torch.ones(3, device=e.device), 2, out=e), torch.empty(0))


def test_a_view_written_then_dropped_costs_one_traced_op_less_and_stays_right():
    # A cache write (`c[:, :, i:i + 1] = k`) leaves its view behind the storage instead of
    # slicing it again at once from the updated base; a view that is used again regenerates.
    def writes(c, k):
        for i in range(3):
            c[:, :, i:i + 1] = k * i
        v = c[:, :, 4:6]
        v.copy_(k.expand(2, 3, 2, 4))   # v written, then read, then its base written under it
        first = v * 1
        c[:, :, 5:6] = -k
        return torch.cat([t.flatten() for t in (first, v * 2, c[:, :, 2:6].sum(2), c[0:1])])

    run_both(writes, torch.zeros(2, 3, 8, 4), torch.randn(2, 3, 1, 4))
    # Every layout still matches the CPU's after the write, which a copy from the CPU changes.
    for src in (torch.ones(4, 2), torch.ones(4, 2).to(R)):
        cpu_base, dev_base = torch.zeros(6, 4), torch.zeros(6, 4).to(R)
        cpu, dev = cpu_base.t()[:, 1:3], dev_base.t()[:, 1:3]
        cpu.copy_(src.cpu())
        dev.copy_(src)
        assert dev.stride() == cpu.stride()
        same(dev, cpu)
        same(dev_base, cpu_base)

    c, k = torch.zeros(1, 2, 16, 4, device=R), torch.ones(1, 2, 1, 4, device=R)
    (c * 1).cpu()
    before = rgpu.stats()["ops_traced"]
    c[:, :, 3:4] = k
    # The slice, the copy; the slice_scatter that applies the write comes with the next read.
    assert rgpu.stats()["ops_traced"] - before == 2
    assert (c * 1).sum().item() == 8
