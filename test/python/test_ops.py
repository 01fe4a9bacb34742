"""Ops on rgpu tensors match CPU eager: the lazy trace is an implementation detail."""

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import same

import rgpu  # noqa: F401

R = "rgpu"


def both(fn, *tensors):
    """Runs fn on CPU tensors and on their rgpu copies; returns (rgpu result, cpu result)."""
    return fn(*[t.to(R) for t in tensors]), fn(*tensors)


def test_device_is_registered():
    x = torch.ones(2, device="rgpu")
    assert x.device == torch.device("rgpu", 0)
    assert x.is_rgpu
    assert torch.rgpu.is_available() and torch.rgpu.device_count() == 1
    assert torch.rgpu.current_device() == 0
    assert torch.float16 in torch.rgpu.get_amp_supported_dtype()
    assert torch.randn(2).rgpu().device.type == "rgpu"


def test_factories_match_cpu():
    same(torch.zeros(2, 3, device=R), torch.zeros(2, 3))
    same(torch.ones(4, dtype=torch.int64, device=R), torch.ones(4, dtype=torch.int64))
    same(torch.full((2, 2), 3.5, device=R), torch.full((2, 2), 3.5))
    same(torch.arange(10, device=R), torch.arange(10))
    same(torch.arange(0, 1, 0.25, device=R), torch.arange(0, 1, 0.25))
    same(torch.eye(3, device=R), torch.eye(3))
    same(torch.linspace(0, 1, 5, device=R), torch.linspace(0, 1, 5))
    same(torch.tensor([[1, 2], [3, 4]], device=R), torch.tensor([[1, 2], [3, 4]]))
    same(torch.zeros_like(torch.ones(3, device=R)), torch.zeros(3))


def test_elementwise_and_broadcasting():
    a, b = torch.randn(4, 5), torch.randn(5)
    for fn in [
        lambda x, y: x + y,
        lambda x, y: x * y - 2,
        lambda x, y: torch.where(x > 0, x, y),
        lambda x, y: (x / 3).exp().sin() + y.abs().sqrt(),
        lambda x, y: torch.maximum(x, y).clamp(-0.5, 0.5),
        lambda x, y: x.sigmoid() * y.tanh(),
        lambda x, y: torch.nn.functional.gelu(x) + y.pow(2),
        lambda x, y: 2.0 ** x + 1 / (y.abs() + 1),
    ]:
        same(*both(fn, a, b))


def test_reductions():
    x = torch.randn(3, 4, 5)
    for fn in [
        lambda t: t.sum(),
        lambda t: t.mean(dim=1),
        lambda t: t.amax(dim=(0, 2), keepdim=True),
        lambda t: t.var(dim=2, unbiased=True),
        lambda t: t.logsumexp(dim=-1),
        lambda t: t.softmax(dim=1),
        lambda t: t.argmax(dim=2),
        lambda t: t.cumsum(dim=0),
        lambda t: t.norm(),
        lambda t: torch.max(t, dim=1),
    ]:
        same(*both(fn, x))


def test_matmul_family():
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(2, 3, 4)
    same(*both(lambda x, y: x @ y, a, b))
    same(*both(lambda x, y: torch.addmm(torch.ones(5, device=x.device), x, y), a, b))
    same(*both(lambda x, y: torch.bmm(x, x.transpose(1, 2)), c, b))
    same(*both(lambda x, y: torch.einsum("bij,jk->bik", x, y), c, b))
    same(*both(lambda x, y: torch.nn.functional.linear(x, y.t()), a, b))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool, torch.bfloat16,
              torch.float16, torch.uint8, torch.complex64]
)
def test_dtypes_round_trip_and_compute(dtype):
    x = (torch.randn(6, 3) * 4)
    x = x.to(dtype) if not dtype.is_complex else torch.randn(6, 3, dtype=dtype)
    same(x.to(R), x)
    if dtype == torch.bool:
        same(*both(lambda t: t & ~t.roll(1, 0), x))
    else:
        same(*both(lambda t: t + t, x))
        same(*both(lambda t: t.sum(dim=0), x))


def test_dtype_conversions():
    x = torch.randn(4, 4) * 10
    same(*both(lambda t: t.to(torch.int32), x))
    same(*both(lambda t: t.to(torch.bfloat16).float(), x))
    same(*both(lambda t: t.half().double(), x))
    same(*both(lambda t: (t > 0).long() * 3, x))
    assert x.to(R).to(torch.float64).dtype == torch.float64


def test_zero_dim_and_empty_tensors():
    s = torch.tensor(3.5)
    same(*both(lambda t: t * 2, s))
    assert torch.tensor(3.5, device=R).item() == 3.5
    e = torch.empty(0, 4)
    same(*both(lambda t: t + 1, e))
    same(*both(lambda t: t.sum(dim=0), e))
    same(*both(lambda t: torch.cat([t, t]), e))
    assert torch.randn(0, device=R).cpu().shape == (0,)


def test_non_contiguous_inputs():
    x = torch.randn(6, 8)
    same(*both(lambda t: t.t() * 2, x))
    same(*both(lambda t: t[:, ::2] + 1, x))
    same(*both(lambda t: t.t().contiguous(), x))
    same(x.t().to(R), x.t())
    same(x[1:, 2::3].to(R), x[1:, 2::3])


def test_channels_last_keeps_its_layout():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    r = x.to(R)
    same(r * 2, x * 2)
    out = (r * 2).cpu()
    assert out.is_contiguous(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(3, 4, 3)
    same(*both(lambda t: conv.to(t.device)(t), x), rtol=1e-4, atol=1e-5)


def test_scalar_sync_points():
    x = torch.tensor([1.5, -2.0, 3.0])
    r = x.to(R)
    assert r.sum().item() == pytest.approx(2.5)
    assert r.tolist() == x.tolist()
    assert bool((r > 0).any())
    assert int(r.argmax()) == 2
    assert float(r[0]) == 1.5
    assert "rgpu" in repr(r) and "1.5000" in repr(r)
    assert r.cpu().numpy().tolist() == x.tolist()


def test_random_ops_follow_torch_manual_seed():
    torch.manual_seed(7)
    a = torch.randn(5, device=R).cpu()
    torch.manual_seed(7)
    b = torch.randn(5, device=R).cpu()
    torch.manual_seed(8)
    c = torch.randn(5, device=R).cpu()
    assert torch.equal(a, b) and not torch.equal(a, c)
    d = torch.nn.functional.dropout(torch.ones(1000, device=R), 0.5).cpu()
    assert 300 < int((d == 0).sum()) < 700


def test_manual_seed_between_ops_reseeds_where_it_is_called():
    # Ops traced before torch.manual_seed draw before it, though nothing was synced in between.
    def draw(seed):
        torch.manual_seed(seed)
        return torch.randn(3, device=R).cpu()

    five, zero = draw(5), draw(0)
    torch.manual_seed(5)
    x = torch.randn(3, device=R)
    torch.manual_seed(0)
    y = torch.randn(3, device=R)
    assert torch.equal(x.cpu(), five) and torch.equal(y.cpu(), zero)


def test_random_ops_draw_in_the_order_they_were_called():
    # Two dropouts of one input (LoRA's q and v adapters) consumed in the other order: the
    # graph's walk from its outputs would draw the second mask first. The test server draws
    # from a CPU generator, so the values are CPU's.
    def draws(d):
        torch.manual_seed(0)
        x = torch.ones(3, 4, device=d)
        first, second = F.dropout(x, 0.5), F.dropout(x, 0.5)
        noise = torch.rand(3, device=d)
        out = [noise, second * 2, first * 3]
        del first, second  # what the cut returns is the noise, then what uses each mask
        return [t.cpu() for t in out]

    for got, want in zip(draws(R), draws("cpu")):
        assert torch.equal(got, want)


def test_random_ops_whose_results_are_unused_still_draw():
    # On CPU an unused draw advances the generator; a lazy graph would drop the node, and every
    # later draw would be shifted. Such a node is a result of its cut, released at once.
    def draws(d):
        torch.manual_seed(0)
        x = torch.ones(4, 4, device=d)
        torch.rand(3, device=d)  # in the middle of a trace
        F.dropout(x, 0.5)
        kept = torch.randn(5, device=d)
        torch.randint(0, 10, (7,), device=d)  # the last op before the read
        kept.sum().item()
        return [kept.cpu(), torch.rand(2, device=d).cpu()]

    rgpu.synchronize()
    before = rgpu.server_stats()["session"]["tensors"]
    for got, want in zip(draws(R), draws("cpu")):
        assert torch.equal(got, want)
    rgpu.synchronize()
    assert rgpu.server_stats()["session"]["tensors"] <= before  # nothing unheld stays


def test_rng_state_is_saved_and_restored_where_it_is_called():
    torch.manual_seed(11)
    assert torch.rgpu.initial_seed() == 11
    torch.rand(4, device=R).cpu()
    after_draw = torch.rgpu.get_rng_state()
    torch.manual_seed(11)
    drawn = torch.rand(4, device=R)  # traced, not yet run: the state is read after it draws
    state = torch.rgpu.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    assert torch.equal(state, after_draw)
    del drawn
    a = torch.randn(5, device=R)
    torch.rgpu.set_rng_state(state)
    b = torch.randn(5, device=R)
    assert torch.equal(a.cpu(), b.cpu())
    with torch.random.fork_rng(device_type="rgpu"):
        c = torch.randn(5, device=R).cpu()
    assert torch.equal(torch.randn(5, device=R).cpu(), c)
    assert len(torch.rgpu.get_rng_state_all()) == torch.rgpu.device_count()


def test_a_bad_rng_state_is_a_remote_error_and_the_session_goes_on():
    torch.manual_seed(1)
    expected = torch.randn(3, device=R).cpu()
    torch.rgpu.set_rng_state(torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(rgpu.RemoteError, match="size"):
        torch.randn(3, device=R).cpu()
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.rgpu.set_rng_state(torch.zeros(7))
    torch.manual_seed(1)
    assert torch.equal(torch.randn(3, device=R).cpu(), expected)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_and_fork_rng_save_the_device_state_without_waiting(reentrant):
    # torch.utils.checkpoint saves the device's RNG state in forward and around its
    # recomputation; read as bytes, that is a round trip each time. rgpu saves a snapshot on
    # the server instead, so a step waits only for the loss it reads.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.GELU())
        for _ in range(4)).to(R)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    waits = []
    for step in range(3):
        before = rgpu.stats()["waits"]
        x = torch.randn(4, 8, device=R, requires_grad=reentrant)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        loss = x.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        waits.append(rgpu.stats()["waits"] - before)
    assert max(waits[1:]) <= 1, waits  # the loss (none when it rode back with a reply)
    before = rgpu.stats()["waits"]
    torch.manual_seed(3)
    with torch.random.fork_rng(device_type="rgpu"):
        inside = torch.randn(3, device=R)
    after = torch.randn(3, device=R)
    assert rgpu.stats()["waits"] == before
    assert torch.equal(inside.cpu(), after.cpu())


def test_rgpu_generators_draw_as_cpu_generators_do():
    # torch.Generator(device="rgpu") is a generator of the session on the server (a CPU one on
    # the test server, so the draws are CPU's); seeding, states and clones act where called.
    def draws(d):
        g = torch.Generator(device=d)
        assert g.initial_seed() == torch.Generator().initial_seed()
        first = torch.randn(3, generator=g, device=d)
        g.manual_seed(42)
        out = [first, torch.randn(4, generator=g, device=d), torch.rand(3, generator=g, device=d),
               torch.empty(5, device=d).normal_(generator=g),
               torch.empty(5, device=d).uniform_(-1, 1, generator=g),
               torch.randperm(6, generator=g, device=d),
               torch.multinomial(torch.ones(5, device=d), 3, generator=g),
               torch.bernoulli(torch.full((6,), 0.5, device=d), generator=g)]
        state = g.get_state()
        out.append(torch.randn(3, generator=g, device=d))
        g.set_state(state)
        out.append(torch.randn(3, generator=g, device=d))
        twin = g.clone_state()
        out += [torch.randn(2, generator=g, device=d), torch.randn(2, generator=twin, device=d)]
        other = torch.Generator(device=d).manual_seed(42)  # independent of g and of the default
        torch.manual_seed(0)
        out += [torch.randn(4, generator=other, device=d), torch.randn(2, device=d)]
        assert g.initial_seed() == 42 and state.dtype == torch.uint8
        return [t.cpu() for t in out]

    for got, want in zip(draws(R), draws("cpu")):
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="generator of device cpu"):
        torch.randn(2, generator=torch.Generator(), device=R)


def test_many_rgpu_generators_come_and_go():
    # Each Generator object holds a generator on the server until it is collected; a loop
    # that makes one per call (diffusers' pipelines do) stays under the session's 4096.
    for i in range(5000):
        x = torch.randn(1, generator=torch.Generator(device=R).manual_seed(i), device=R)
        if i % 1000 == 999:
            x.cpu()
    assert torch.equal(x.cpu(), torch.randn(1, generator=torch.Generator().manual_seed(4999)))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_dropout_recomputes_the_forward_masks(reentrant):
    # torch.utils.checkpoint saves the device's RNG state and restores it to recompute the
    # forward in backward; without it, the recomputed dropout masks differ and the gradients
    # are silently wrong.
    from torch.utils.checkpoint import checkpoint

    def grads(use_checkpoint):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.GELU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)).to(R)
        x = torch.randn(4, 8, device=R, requires_grad=True)
        torch.manual_seed(1)
        out = checkpoint(m, x, use_reentrant=reentrant) if use_checkpoint else m(x)
        out.sum().backward()
        return [p.grad.cpu() for p in m.parameters()] + [x.grad.cpu()]

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want)


def test_batchnorm_in_eval_mode():
    import copy

    bn = torch.nn.BatchNorm2d(3).eval()
    bn.running_mean.uniform_()
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        same(copy.deepcopy(bn).to(R)(x.to(R)), bn(x))


def test_ops_answering_python_values():
    x = torch.randn(3, 4)
    r = x.to(R)
    assert torch.equal(r, r.clone()) and not torch.equal(r, r + 1)
    assert torch.allclose(r, r + 1e-9) and not torch.allclose(r, r + 1)
    assert r.is_nonzero() if r.numel() == 1 else True
    assert torch.is_same_size(r, r * 2)


def test_layouts_follow_cpu_eager():
    x = torch.randn(4, 6)
    r = x.to(R)
    for fn in [lambda t: t.t(), lambda t: t.t() * 2, lambda t: t[:, 1:3], lambda t: t.unsqueeze(1),
               lambda t: t.t().contiguous(), lambda t: t.view(2, 12).t() + 0]:
        assert fn(r).stride() == fn(x).stride()
        assert fn(r).is_contiguous() == fn(x).is_contiguous()
    assert r.t().cpu().stride() == x.t().stride()
    assert (r.t() * 2).cpu().stride() == (x.t() * 2).stride()


def test_meta_kernels_that_resize_in_place_give_the_right_shape_every_time():
    # linalg_solve_triangular's meta kernel resizes its result in place; a memo of in-place
    # meta checks once skipped the resize and left the previous call's shape.
    A = torch.randn(3, 3).triu() + 3 * torch.eye(3)
    B = torch.randn(3, 1)
    for unit in (True, False, True):
        expected = torch.linalg.solve_triangular(A, B, upper=True, unitriangular=unit)
        actual = torch.linalg.solve_triangular(A.to("rgpu"), B.to("rgpu"), upper=True, unitriangular=unit)
        same(actual, expected, rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, 4)
    for dims in ((0, 1), (1, 2), (0, 2)):
        same(x.to("rgpu").transpose_(*dims), x.clone().transpose_(*dims))


def test_a_one_gib_tensor_round_trips_exactly():
    # Uploads and downloads of more than one Cap'n Proto blob (512 MiB) travel in chunks.
    x = torch.arange(1 << 28, dtype=torch.int32)  # 1 GiB
    r = x.to("rgpu")
    back = r.cpu()
    assert torch.equal(back, x)
    del back
    y = (r + 1).cpu()  # a result computed on the server, read in chunks
    assert y[0].item() == 1 and y[-1].item() == (1 << 28) and torch.equal(y[12345:12350], x[12345:12350] + 1)


def test_python_numbers_and_cpu_scalar_tensors_as_operands_keep_their_values_and_dtypes():
    # Python numbers arrive as wrapped 0-dim CPU tensors (double, int64, bool, complex) and are
    # read without a dispatch; other 0-dim CPU tensors, and ones with math bits, take item().
    base = torch.tensor([[1.5, -2.0, 3.25], [0.5, 4.0, -1.0]])
    storage = torch.tensor([7.0, -3.5, 2.0])
    scalars = [2.5, -3, True, 1 + 2j, 2**40, 1e-300,
               torch.tensor(0.75), torch.tensor(3, dtype=torch.int32),
               torch.tensor(2.5, dtype=torch.float16), torch.tensor(False),
               torch.tensor(1 - 1j, dtype=torch.complex64).conj(),
               torch._neg_view(torch.tensor(-2.0)),
               storage[1], storage[2:][0]]  # 0-dim views at a storage offset
    for x in (base, base.to(torch.int64), base > 0):
        for s in scalars:
            for fn in (lambda a: a * s, lambda a: a + s, lambda a: torch.mul(s, a)):
                try:
                    expected = fn(x)
                except RuntimeError:
                    with pytest.raises(RuntimeError):
                        fn(x.to(R)).cpu()
                    continue
                same(fn(x.to(R)), expected, rtol=0, atol=0)


def _histc_as_cuda_counts(x, bins, lo, hi):
    """CUDA's histc of integers, written out: bounds as integers, the data's own when equal."""
    values = x.flatten().tolist()
    lo, hi = int(lo), int(hi)
    if lo == hi and values:
        lo, hi = min(values), max(values)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    counts = [0] * bins
    for v in values:
        if lo <= v <= hi:
            counts[min((v - lo) * bins // (hi - lo), bins - 1)] += 1
    return torch.tensor(counts, dtype=x.dtype)


def test_histc_counts_integer_tensors_as_cuda_does():
    # Hugging Face's mixture-of-experts layers count tokens per expert with histc of integers
    # off the CPU; CPU's kernel refuses integers, so a CPU server counts them as CUDA does.
    x = torch.tensor([0, 0, 1, 3, 3, 3, 7, 9, 12, -2])
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        t = x.clamp_min(0).to(dtype) if dtype == torch.uint8 else x.to(dtype)
        for bins, lo, hi in [(4, 0, 3), (3, 0, 10), (5, 0, 0), (2, 3, 3), (7, -2.5, 12.9), (1, 0, 1)]:
            got = torch.histc(t.to(R), bins=bins, min=lo, max=hi)
            same(got, _histc_as_cuda_counts(t, bins, lo, hi), rtol=0, atol=0)
    # With bounds that fit, the counts are those of CPU's kernel on the same values as floats.
    experts = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(0))
    got = torch.histc(experts.to(torch.int32).to(R), bins=8, min=0, max=7)
    same(got, torch.histc(experts.float(), bins=8, min=0, max=7).to(torch.int32), rtol=0, atol=0)
    same(torch.histc(torch.tensor([], dtype=torch.int64).to(R), bins=3),
         torch.zeros(3, dtype=torch.int64), rtol=0, atol=0)
    for dtype in (torch.float32, torch.float64):  # floats run CPU's own kernel
        f = torch.randn(50, dtype=dtype)
        same(*both(lambda t: torch.histc(t, bins=6, min=-1, max=1), f))
    with pytest.raises(RuntimeError, match="max must be larger than min"):
        torch.histc(x.to(R), bins=3, min=5, max=1).cpu()
    with pytest.raises(RuntimeError, match="bins must be > 0"):
        torch.histc(x.to(R), bins=0, min=0, max=1).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_mm_runs_every_float_dtype_its_kernels_run_with_gradients(dtype):
    # torch's meta kernel admits bfloat16 only (CUDA's fast path); the CPU and CUDA kernels run
    # float32 and float16 too, and transformers calls it so for mixture-of-experts layers.
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 3, 9, 16], dtype=torch.int32)  # an empty group too
    cases = [((16, 8), (4, 8, 8), offs), ((4, 5, 8), (4, 8, 16), None), ((8, 16), (16, 8), offs)]
    for sa, sb, o in cases:
        a = torch.randn(*sa, generator=g).to(dtype).requires_grad_()
        b = torch.randn(*sb, generator=g).to(dtype).requires_grad_()
        ra, rb = a.detach().to(R).requires_grad_(), b.detach().to(R).requires_grad_()
        out = torch._grouped_mm(a, b, offs=o)
        rout = torch._grouped_mm(ra, rb, offs=None if o is None else o.to(R))
        assert rout.dtype == out.dtype and rout.shape == out.shape
        same(rout, out, rtol=0, atol=0)
        w = torch.randn(out.shape, generator=g).to(dtype)
        (out * w).sum().backward()
        (rout * w.to(R)).sum().backward()
        same(ra.grad, a.grad, rtol=0, atol=0)
        same(rb.grad, b.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="Float32, BFloat16 or Float16"):
        torch._grouped_mm(torch.ones(4, 8, dtype=torch.float64, device=R),
                          torch.ones(2, 8, 8, dtype=torch.float64, device=R),
                          offs=torch.tensor([2, 4], dtype=torch.int32, device=R))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_dot_product_attention_runs_cpus_kernel_on_a_cpu_server(dtype):
    # The kernel choice follows the server's device: a CPU server runs CPU's fused kernel, so
    # outputs, strides and gradients are CPU eager's bit for bit (the math kernel's differ by
    # rounding, by 0.1 in bfloat16 gradients).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g).to(dtype)
    kv = [torch.randn(2, 2, 7, 8, generator=g).to(dtype) for _ in range(2)]
    mask = torch.randn(5, 7, generator=g) > 0
    cases = [dict(is_causal=True, enable_gqa=True), dict(attn_mask=mask, enable_gqa=True),
             dict(attn_mask=mask.to(dtype), scale=0.3, enable_gqa=True)]
    for backend, kw in itertools.product([None, SDPBackend.MATH], cases):
        outs = []
        for d in ("cpu", R):
            args = [t.detach().to(d, copy=True).requires_grad_() for t in (q, *kv)]
            kw_d = {k: v.to(d) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(*args, **kw_d)
                out.backward(torch.ones_like(out))
            outs.append([out, *(a.grad for a in args)])
        for r, c in zip(*reversed(outs)):
            assert r.stride() == c.stride()
            same(r, c, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_forward_and_backward_match_cpu(mode):
    # CPU's kernel shapes its auxiliary outputs (offset2bag, bag_size, max_indices) otherwise
    # than CUDA's, whose shapes the meta kernel promises; the backward reads them.
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 3, generator=g)
    indices = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 0])
    for last, padding_idx, weighted, offsets in itertools.product(
            [False, True], [None, 0], [False, True], [[0, 4, 4, 7], [0, 3]]):
        if weighted and mode != "sum":
            continue
        offsets = torch.tensor(offsets + ([10] if last else []))
        per_sample = torch.rand(10, generator=g) if weighted else None
        results = []
        for device in ("cpu", R):
            w = weight.clone().to(device).requires_grad_()

            def bag():
                return F.embedding_bag(
                    indices.to(device), w, offsets.to(device), mode=mode,
                    include_last_offset=last, padding_idx=padding_idx,
                    per_sample_weights=None if per_sample is None else per_sample.to(device))
            y = bag()
            (y * torch.arange(y.numel(), device=device).view(y.shape)).sum().backward()
            with torch.no_grad():  # the forward-only kernel
                results.append((y, w.grad, bag()))
        for actual, expected in zip(results[1], results[0]):
            same(actual, expected.detach())


@torch.library.custom_op("rgpu_test::chunked_scale", mutates_args=())
def _chunked_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(x)  # filled a slice at a time, as chunked kernels do
    for i in range(0, x.shape[0], 2):
        out[i:i + 2] = x[i:i + 2] * scale
    return out


_chunked_scale.register_autograd(lambda ctx, grad: (grad * ctx.scale, None),
                                 setup_context=lambda ctx, inputs, output: setattr(ctx, "scale", inputs[1]))


@torch.library.custom_op("rgpu_test::shifted_pair", mutates_args=())
def _shifted_pair(x: torch.Tensor) -> list[torch.Tensor]:
    shifted = torch.zeros_like(x)
    shifted[1:] = x[:-1]
    return [shifted, x.clone()]


@torch.library.custom_op("rgpu_test::shifted_with_cpu_kernel", mutates_args=())
def _shifted_with_cpu_kernel(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[1:] = x[:-1]
    return out


@_shifted_with_cpu_kernel.register_kernel("cpu")
def _(x):  # a CPU kernel of its own: other devices still run the composite one
    return torch.cat([torch.zeros_like(x[:1]), x[:-1]])


@torch.library.custom_op("rgpu_test::cpu_only", mutates_args=(), device_types="cpu")
def _cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_custom_ops_with_composite_kernels_write_into_their_buffers_as_on_cpu():
    # A composite kernel runs after functionalization for a device without a kernel of its
    # own; there, `out[i:j] = y` would leave `out` as it was. rgpu runs it with
    # functionalization on, so the writes land, gradients too.
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    xc, xr = x.clone().requires_grad_(), x.to(R).requires_grad_()
    expected, actual = _chunked_scale(xc, 2.5), _chunked_scale(xr, 2.5)
    same(actual, expected.detach())
    (expected * expected).sum().backward()
    (actual * actual).sum().backward()
    same(xr.grad, xc.grad)
    same(_shifted_pair(x.to(R)), _shifted_pair(x))
    same(_shifted_with_cpu_kernel(x.to(R)), _shifted_with_cpu_kernel(x))
    with pytest.raises(NotImplementedError, match="rgpu_test::cpu_only.*other devices only"):
        _cpu_only(x.to(R))


def test_an_op_defined_after_rgpu_tensors_exist_never_answers_wrongly():
    x = torch.arange(6.0).to(R)  # rgpu is in use before the op exists
    lib = torch.library.Library("rgpu_test_late", "DEF")
    lib.define("halves(Tensor x) -> Tensor")

    def halves(t):
        out = torch.zeros_like(t)
        out[: t.shape[0] // 2] = t[: t.shape[0] // 2]
        return out
    lib.impl("halves", halves, "CompositeExplicitAutograd")
    # rgpu learns of the op at its next traced op, which here is inside the op's first call.
    with pytest.raises(RuntimeError, match="writes into a view made inside a composite kernel"):
        torch.ops.rgpu_test_late.halves(x)
    same(torch.ops.rgpu_test_late.halves(x), halves(x.cpu()))
    y = torch.arange(4.0).to(R)
    lib.define("halves2(Tensor x) -> Tensor")  # an op defined with a traced op before its call
    lib.impl("halves2", halves, "CompositeExplicitAutograd")
    same(torch.ops.rgpu_test_late.halves2(y * 1), halves(y.cpu()))


def test_transformers_grouped_mm_fallback_op_matches_cpu():
    pytest.importorskip("transformers")
    from transformers.integrations import moe  # noqa: F401 - defines the op
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 8, generator=g), torch.randn(3, 8, 6, generator=g)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    results = []
    for device in ("cpu", R):
        xi, wi = x.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
        y = torch.ops.transformers.grouped_mm_fallback(xi, wi, offs.to(device))
        (y * y).sum().backward()
        results.append((y.detach(), xi.grad, wi.grad))
    same(results[1], results[0])


def _traced(fn):
    """fn()'s result and how many ops rgpu traced for it."""
    before = rgpu.stats()["ops_traced"]
    out = fn()
    return out, rgpu.stats()["ops_traced"] - before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.complex64])
def test_composite_ops_without_grad_are_traced_whole_and_match_cpu(dtype):
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    w, b, x3 = rand(6, 5), rand(6), rand(2, 3, 5)
    cases = [
        (lambda x, w, b: F.linear(x, w, b), (x3, w, b)),
        (lambda x, w: F.linear(x, w), (rand(5), w)),
        (lambda x, w: F.linear(x, w), (rand(2, 2, 3, 5), w)),
        (lambda x, w, b: F.linear(x.transpose(0, 1), w, b), (x3, w, b)),  # non-contiguous
        (lambda x, y: x @ y, (rand(5), rand(5))),
        (lambda x, y: x @ y, (rand(4, 5), rand(5))),
        (lambda x, y: x @ y, (rand(5), rand(5, 3))),
        (lambda x, y: x @ y, (rand(2, 1, 4, 5), rand(3, 5, 2))),  # broadcast batches
        (lambda x, y: x @ y.mT, (x3, rand(2, 4, 5))),
        (lambda x, y: torch.matmul(x, y), (rand(0, 5), rand(5, 3))),  # empty
        (lambda x, w, b: F.bilinear(x, x, w, b), (rand(3, 5), rand(2, 5, 5), rand(2))),
    ]
    if not dtype.is_complex:
        cases += [
            (lambda x, w, b: F.layer_norm(x, (5,), w, b), (x3, rand(5), rand(5))),
            (lambda x: F.layer_norm(x, (3, 5)), (x3,)),
            (lambda x, w, b: F.group_norm(x, 2, w, b), (rand(2, 4, 3, 3), rand(4), rand(4))),
        ]
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for fn, args in cases:
        expected = fn(*args)
        on = [a.to(R) for a in args]
        with torch.no_grad():
            actual, ops = _traced(lambda: fn(*on))
        same(actual, expected, **tol)
        # One op for the composite, plus the transposes the case makes itself.
        assert ops <= 2, ops
        # The result is a tensor of its own, as on CPU: writing into it leaves the inputs alone.
        with torch.no_grad():
            actual.zero_()
        for a, t in zip(args, on):
            same(t, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_repeat_interleave_by_an_integer_without_grad_matches_cpu(dtype):
    # Under no_grad its composite runs below functionalization, its views traced bare.
    x = torch.randn(2, 3, 4, 5).mul(3).to(dtype)
    cases = [
        lambda t: t.repeat_interleave(2, dim=1),
        lambda t: t.repeat_interleave(3, dim=-1),
        lambda t: t.repeat_interleave(2),  # flattened
        lambda t: t.transpose(1, 2).repeat_interleave(2, dim=1),  # non-contiguous
        lambda t: t[:, :, 1].repeat_interleave(1, dim=0),  # a view, once
        lambda t: t[:, :0].repeat_interleave(4, dim=2),  # empty
        lambda t: t[0, 0, 0, 0].repeat_interleave(3),  # 0-dim
        lambda t: t.repeat_interleave(0, dim=3),  # no repeats
        lambda t: t.repeat_interleave(2, dim=1).repeat_interleave(2, dim=0),
        lambda t: torch.repeat_interleave(t, 2, dim=2, output_size=8),
    ]
    for fn in cases:
        expected = fn(x)
        on = x.to(R)
        with torch.no_grad():
            actual = fn(on)
        same(actual, expected)
        assert actual.stride() == expected.stride()
        # Its own tensor: writes into the result and into the input do not reach each other.
        with torch.no_grad():
            actual.zero_()
            on.add_(1) if dtype != torch.bool else on.logical_not_()
        same(on, x + 1 if dtype != torch.bool else ~x)
        same(actual, torch.zeros_like(expected))
    with torch.inference_mode():
        same(x.to(R).repeat_interleave(2, dim=1), x.repeat_interleave(2, dim=1))
    # A tensor of counts still sizes the result from data, and autograd still differentiates.
    counts = torch.tensor([1, 0, 2])
    with torch.no_grad():
        same(x.to(R).repeat_interleave(counts.to(R), dim=1), x.repeat_interleave(counts, dim=1))
    if dtype.is_floating_point:
        grads = []
        for device in ("cpu", R):
            t = x.detach().to(device).requires_grad_()
            (t.repeat_interleave(2, dim=1) * 2).sum().backward()
            grads.append(t.grad.cpu())
        torch.testing.assert_close(grads[1], grads[0])


def test_composite_ops_that_autograd_records_still_decompose_and_differentiate():
    x, w, b = torch.randn(2, 3, 5), torch.randn(6, 5), torch.randn(6)
    grads = []
    for device in ("cpu", R):
        xs, ws, bs = (t.to(device).detach().requires_grad_() for t in (x, w, b))
        y = F.layer_norm(F.linear(xs, ws, bs) @ ws, (5,))
        y.pow(2).sum().backward()
        grads.append([t.grad.cpu() for t in (xs, ws, bs)])
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    # Grad mode on without anything requiring grad is the no_grad case.
    out, ops = _traced(lambda: F.linear(x.to(R), w.to(R), b.to(R)))
    assert ops == 1 and not out.requires_grad


def test_composite_ops_carry_forward_mode_tangents_without_grad():
    import torch.autograd.forward_ad as fwAD
    x, w, tx = torch.randn(3, 5), torch.randn(4, 5), torch.randn(3, 5)
    results = []
    for device in ("cpu", R):
        with torch.no_grad(), fwAD.dual_level():
            dual = fwAD.make_dual(x.to(device), tx.to(device))
            out = fwAD.unpack_dual(F.linear(dual, w.to(device)) @ w.to(device))
            results.append((out.primal.cpu(), out.tangent.cpu()))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e)
    # torch.func.jvp too, which runs at its own level.
    fn = lambda t: torch.matmul(t, w.to(t.device).t())  # noqa: E731
    _, expected = torch.func.jvp(fn, (x,), (tx,))
    _, actual = torch.func.jvp(fn, (x.to(R),), (tx.to(R),))
    same(actual, expected)


def test_composite_ops_in_inference_mode_and_under_vmap():
    x, w = torch.randn(4, 3, 5), torch.randn(6, 5)
    with torch.inference_mode():
        same(F.linear(x.to(R), w.to(R)) @ w.to(R), F.linear(x, w) @ w)
    with torch.no_grad():
        same(torch.vmap(lambda t: F.linear(t, w.to(R)))(x.to(R)), torch.vmap(lambda t: F.linear(t, w))(x))
