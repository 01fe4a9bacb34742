"""The tracer computes output metas with ATen's C++ meta kernels where it binds one
(rgpu/client/MetaKernels.h), not with the Python ones `import torch` registers over them. The
results must have CPU eager's dtype, sizes, strides and values, on awkward inputs: broadcasting,
transposed and channels-last operands, 0-dim and empty tensors, Python scalars, and int, bool,
bf16 and complex dtypes. (The OpInfo sweeps check the C++ kernels against torch's Python ones.)"""

import pytest
import torch
import torch.nn.functional as F

import rgpu
from rgpu import _C

R = "rgpu"


def test_the_ops_models_use_are_bound():
    bound = set(_C._cpp_meta_ops())
    for op in ("add.Tensor", "mul.Tensor", "div.Tensor", "le.Tensor", "eq.Scalar", "cat",
               "bmm", "addmm", "mean.dim", "sum.dim_IntList", "_softmax", "gelu", "silu", "rsqrt",
               "masked_fill.Scalar", "arange.start", "_unsafe_view", "nll_loss_forward",
               "native_layer_norm"):
        assert "aten::" + op in bound, op
    assert len(bound) >= 100


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=gen(seed)).to(dtype)


def randint(*shape, high=5, dtype=torch.int64, seed=0):
    return torch.randint(-high, high, shape, generator=gen(seed)).to(dtype)


def agree(fn, *inputs):
    """fn on CPU and on rgpu: same dtypes, sizes, strides and values."""
    expected = fn(*inputs)
    actual = fn(*[x.to(R) if isinstance(x, torch.Tensor) else x for x in inputs])
    if isinstance(expected, torch.Tensor):
        expected, actual = (expected,), (actual,)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert (a.dtype, a.shape, a.stride()) == (e.dtype, e.shape, e.stride())
        torch.testing.assert_close(a.cpu(), e, equal_nan=True)


# Operands of elementwise ops, in the layouts that decide an output's strides.
LAYOUTS = {
    "contiguous": lambda dt: (randn(4, 5, dtype=dt), randn(4, 5, dtype=dt, seed=1)),
    "transposed": lambda dt: (randn(5, 4, dtype=dt).t(), randn(4, 5, dtype=dt, seed=1)),
    "broadcast": lambda dt: (randn(4, 1, dtype=dt), randn(1, 5, dtype=dt, seed=1)),
    "channels_last": lambda dt: (
        randn(2, 3, 4, 5, dtype=dt).contiguous(memory_format=torch.channels_last),
        randn(1, 3, 1, 1, dtype=dt, seed=1)),
    "zero_dim": lambda dt: (randn(dtype=dt), randn(3, 1, dtype=dt, seed=1)),
    "empty": lambda dt: (randn(0, 5, dtype=dt), randn(1, 5, dtype=dt, seed=1)),
}

BINARY = {
    "add_alpha": lambda a, b: torch.add(a, b, alpha=2),
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "pow": lambda a, b: torch.pow(a.abs(), b),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "remainder": torch.remainder,
    "atan2": torch.atan2,
    "le": torch.le,
    "ne": torch.ne,
    "lerp": lambda a, b: torch.lerp(a, b, 0.3),
    "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.5),
    "clamp_tensors": lambda a, b: torch.clamp(a, min=b),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", BINARY)
def test_binary_ops_follow_cpu_layouts(op, layout):
    agree(BINARY[op], *LAYOUTS[layout](torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.complex64, torch.int32, torch.bool])
def test_binary_ops_in_other_dtypes(dtype):
    a, b = (randint(4, 5, dtype=dtype), randint(1, 5, dtype=dtype, seed=1)) \
        if not dtype.is_floating_point and not dtype.is_complex else LAYOUTS["transposed"](dtype)
    if dtype != torch.bool:
        agree(torch.add, a, b)
        agree(torch.mul, a, b)
    agree(torch.eq, a, b)
    if not dtype.is_complex:
        agree(torch.maximum, a, b)
    if not dtype.is_floating_point and not dtype.is_complex:
        agree(torch.bitwise_and, a, b)
        agree(torch.bitwise_xor, a, b)
        agree(lambda x: ~x, a)
    if dtype == torch.int32:
        agree(torch.div, a, b.abs() + 1)  # true division of ints is float


def test_python_scalars_and_cpu_scalars_promote_as_on_cpu():
    i, f, h = randint(3, 4), randn(3, 4), randn(3, 4, dtype=torch.bfloat16)
    agree(lambda x: x * 2.5, i)               # int tensor, float scalar: float32
    agree(lambda x: x + 3, h)                 # bf16 stays bf16
    agree(lambda x: x / 2, i)
    agree(lambda x: x >= 1, f)
    agree(lambda x: torch.pow(2, x), f)
    agree(lambda x: x ** 2, i)
    agree(lambda x: x * torch.tensor(1.5, dtype=torch.float64), h)  # a 0-dim CPU tensor
    agree(lambda x, y: x + y, h, f)          # bf16 with float32: float32


UNARY = ["neg", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "erf", "floor",
         "round", "reciprocal", "sign", "expm1", "log1p"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64])
def test_unary_ops(dtype):
    x = (randint(5, 3, dtype=dtype) if dtype == torch.int64 else randn(5, 3, dtype=dtype)).t()
    for name in UNARY:
        fn = getattr(torch, name)
        try:
            fn(x)
        except RuntimeError as e:  # CPU refuses the dtype: the server's run says why
            with pytest.raises(Exception) as refused:
                fn(x.to(R)).cpu()
            assert str(e).splitlines()[0] in str(refused.value)
            continue
        agree(fn, x)
    if dtype.is_floating_point:
        agree(F.silu, x)
        agree(lambda t: F.gelu(t, approximate="tanh"), x)
        agree(F.hardsigmoid, x)
        agree(lambda t: F.leaky_relu(t, 0.2), x)


def test_reductions():
    x = randn(3, 4, 5).transpose(0, 2)
    agree(lambda t: t.sum((0, 2), keepdim=True), x)
    agree(lambda t: t.sum(1, dtype=torch.float64), x)
    agree(lambda t: t.mean(-1), x)
    agree(lambda t: t.amax((0, 1)), x)
    agree(lambda t: t.amin(2, keepdim=True), x)
    agree(lambda t: t.argmax(), x)
    agree(lambda t: t.argmin(1, keepdim=True), x)
    agree(lambda t: t.max(1), x)
    agree(lambda t: t.min(0, keepdim=True), x)
    agree(lambda t: torch.cumsum(t, 1, dtype=torch.float64), x)
    agree(lambda t: t.topk(2, dim=0), x)
    agree(lambda t: (t > 0).any(), x)
    agree(lambda t: (t > 0).all(1), x)
    agree(lambda t: (t > 0).any((0, 2)), x)
    agree(lambda t: t.sum(0), randn(0, 3))
    agree(lambda t: t.sum(), randint(2, 3, dtype=torch.int32))  # int sums are int64
    agree(lambda t: torch.tril(t, 1), x)
    agree(lambda t: torch.triu(t, -1), randn(0, 4))


def test_cat():
    a, b = randn(2, 3), randn(4, 3, seed=1)
    agree(lambda x, y: torch.cat([x, y]), a, b)
    agree(lambda x, y: torch.cat([x.t(), y.t()], 1), a, b)
    agree(lambda x, y: torch.cat([x, y.to(torch.float64)]), a, b)   # promotes
    agree(lambda x, y: torch.cat([x, y, x.new_empty(0)]), a, b)     # the legacy empty 1-d tensor
    cl = randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    agree(lambda x: torch.cat([x, x], 1), cl)                       # keeps channels-last
    agree(lambda x, y: torch.cat([x, y], 0), randint(2, 3, dtype=torch.int32), a)


def test_matmul_family_and_softmax():
    a, b, c = randn(3, 4), randn(5, 4, seed=1).t(), randn(3, 5, seed=2)
    agree(torch.mm, a, b)
    agree(lambda x, y, z: torch.addmm(z, x, y, beta=0.5), a, b, c)
    p, q = randn(2, 3, 4), randn(2, 5, 4, seed=1).transpose(1, 2)
    agree(torch.bmm, p, q)
    agree(lambda x, y: torch.baddbmm(x.new_zeros(1, 3, 5), x, y), p, q)
    agree(lambda x, y: x @ y[0], p, q)  # 3d @ 2d: a folded mm and an _unsafe_view
    agree(lambda x: x.softmax(-1), randn(3, 5).t())
    agree(lambda x: x.log_softmax(0), randn(3, 5, dtype=torch.bfloat16))
    agree(lambda x: F.softmax(x, -1, dtype=torch.float32), randn(3, 5, dtype=torch.bfloat16))
    agree(lambda x, i: x.gather(1, i), randn(3, 5), torch.tensor([[0, 4], [1, 1], [3, 2]]))


def test_masked_fill():
    x = randn(5, 4).t()
    mask = randn(4, 5, seed=1) > 0
    agree(lambda t, m: t.masked_fill(m, float("-inf")), x, mask)
    agree(lambda t, m: t.masked_fill(m, torch.tensor(2.0)), x, mask)
    agree(lambda t, m: t.masked_fill(m[0], 0), x, mask)                 # a broadcast mask
    agree(lambda t, m: t[0].masked_fill(m, 1), x, mask)                 # a mask larger than self
    agree(lambda t, m: t.masked_fill(m, 7), randint(4, 5, dtype=torch.int32), mask)
    for bad in (lambda t: t.masked_fill(t, 0),                       # a float mask
                lambda t: t.masked_fill(t > 0, torch.ones(2))):      # a value that is not 0-dim
        with pytest.raises(RuntimeError):
            bad(x)
        with pytest.raises(RuntimeError):
            bad(x.to(R))


def test_slice_and_select_scatter():
    # A static KV cache's write: functionalization applies it as a slice_scatter (or, for an
    # index, a select_scatter) of the whole cache, every step at a new position.
    cache, row = randn(1, 2, 6, 3), randn(1, 2, 1, 3, seed=1)
    for pos in (0, 3, 5):
        agree(lambda c, r: torch.slice_scatter(c, r, 2, pos, pos + 1), cache, row)
        agree(lambda c, r: torch.select_scatter(c, r[:, :, 0], 2, pos), cache, row)
    agree(lambda c, r: torch.slice_scatter(c, r.expand(1, 2, 3, 3), 2, 0, 6, 2), cache, row)
    agree(lambda c, r: torch.slice_scatter(c, r, 2, -1), cache, row)  # the last position
    agree(lambda c, r: torch.slice_scatter(c, r[:, :, :0], 2, 2, 2), cache, row)  # empty
    agree(lambda c, r: torch.slice_scatter(c.transpose(1, 3), r.transpose(1, 3), 2, 1, 2),
          cache, row)  # a transposed cache keeps its layout, as CPU's clone does
    agree(lambda c, r: torch.slice_scatter(c.expand(2, 2, 6, 3), r.expand(2, 2, 1, 3), 2, 4, 5),
          cache, row)  # an expanded one comes out contiguous
    agree(lambda c, r: torch.select_scatter(c[0, 0], r[0, 0, 0].to(torch.int64), 0, 1),
          randint(1, 2, 6, 3), row)
    for bad in (lambda c, r: torch.slice_scatter(c, r, 2, 0, 2),   # src too small
                lambda c, r: torch.select_scatter(c, r, 2, 0)):    # src of the wrong rank
        with pytest.raises(RuntimeError, match="expected src to have a size equal"):
            bad(cache, row)
        with pytest.raises(RuntimeError, match="expected src to have a size equal"):
            bad(cache.to(R), row.to(R))
    assert {"aten::slice_scatter", "aten::select_scatter"} <= set(_C._cpp_meta_ops())


def test_arange():
    for args, kwargs in [((7,), {}), ((2, 9), {}), ((2.5, 9), {}), ((9, 2, -2), {}),
                         ((0, 1, 0.125), {}), ((5,), {"dtype": torch.float32}),
                         ((3, 11), {"dtype": torch.int32}), ((0,), {}), ((True,), {})]:
        e = torch.arange(*args, **kwargs)
        a = torch.arange(*args, **kwargs, device=R)
        assert (a.dtype, a.shape) == (e.dtype, e.shape), (args, kwargs)
        torch.testing.assert_close(a.cpu(), e)
    with pytest.raises(RuntimeError):
        torch.arange(0, 5, 0, device=R)


def test_layer_norm():
    w, b = randn(5, seed=1), randn(5, seed=2)
    agree(lambda x, w, b: F.layer_norm(x, (5,), w, b), randn(3, 4, 5), w, b)
    agree(lambda x: F.layer_norm(x, (4, 5)), randn(5, 4, 3).transpose(0, 2))  # not contiguous
    agree(lambda x, w, b: F.layer_norm(x, (5,), w, b),
          randn(5, 2, 5, dtype=torch.bfloat16).transpose(0, 1), w, b)  # bf16 with float32 affine
    agree(lambda x: F.layer_norm(x, (5,)), randn(0, 5))
    # The statistics: what the meta kernel promises (float32 for bf16), CPU's values.
    x = randn(3, 5, dtype=torch.bfloat16)
    _, mean, rstd = torch.native_layer_norm(x.to(R), [5], None, None, 1e-5)
    _, cpu_mean, cpu_rstd = torch.native_layer_norm(x, [5], None, None, 1e-5)
    assert (mean.dtype, mean.shape, rstd.shape) == (torch.float32, (3, 1), (3, 1))
    torch.testing.assert_close(mean.cpu(), cpu_mean.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(rstd.cpu(), cpu_rstd.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="Given normalized_shape"):
        F.layer_norm(randn(3, 4).to(R), (5,))



def test_convolutions_keep_channels_last_as_cpu_and_cuda_do():
    # torch's meta kernel leaves every result contiguous; the kernels give channels-last when
    # the input or the weight is, and a channels-last model must stay so on rgpu.
    cl, cl3 = torch.channels_last, torch.channels_last_3d
    x, w = randn(2, 3, 8, 8), randn(4, 3, 3, 3, seed=1)
    for xf in (torch.contiguous_format, cl):
        for wf in (torch.contiguous_format, cl):
            xi, wi = x.contiguous(memory_format=xf), w.contiguous(memory_format=wf)
            agree(lambda a, b: F.conv2d(a, b, padding=1), xi, wi)
            agree(lambda a, b, c: F.conv2d(a, b, c, stride=2), xi, wi, randn(4, seed=2))
            agree(lambda a, b: F.conv_transpose2d(a, b, stride=2, output_padding=1),
                  xi, randn(3, 4, 3, 3, seed=3).contiguous(memory_format=wf))
    agree(lambda a, b: F.conv2d(a, b, groups=3), x.contiguous(memory_format=cl), randn(6, 1, 3, 3))
    agree(F.conv2d, randn(2, 3, 1, 1).contiguous(memory_format=cl), randn(4, 3, 1, 1))  # ambiguous
    agree(F.conv2d, x[:, :, ::2, 1:], w)  # strided, neither layout
    agree(F.conv3d, randn(2, 3, 4, 5, 5).contiguous(memory_format=cl3), randn(4, 3, 3, 3, 3))
    agree(F.conv3d, randn(2, 3, 4, 5, 5), randn(4, 3, 3, 3, 3).contiguous(memory_format=cl3))
    agree(F.conv1d, randn(2, 3, 9), randn(4, 3, 3))
    agree(F.conv2d, x.to(torch.float64).contiguous(memory_format=cl), w.to(torch.float64))
    for fn, args in [(F.conv2d, (randn(2, 5, 8, 8), w)),
                     (F.conv_transpose2d, (randn(2, 5, 5, 5), randn(3, 4, 3, 3))),
                     (F.conv2d, (x, w, randn(5)))]:
        with pytest.raises(RuntimeError) as cpu:
            fn(*args)
        with pytest.raises(RuntimeError) as rgpu_error:
            fn(*[a.to(R) for a in args])
        assert str(rgpu_error.value) == str(cpu.value)  # CPU's message, before the server

def test_losses_and_backward_ops_through_autograd():
    torch.manual_seed(0)
    x = randn(6, 7)
    target = torch.tensor([0, 3, 6, 1, 1, 2])
    w = randn(7, 7, seed=3)

    def step(dev):
        xs = x.to(dev).requires_grad_()
        ws = w.to(dev).requires_grad_()
        h = xs @ ws
        h = F.layer_norm(h, (7,))
        loss = F.cross_entropy(F.gelu(h) + torch.tanh(h) + torch.sigmoid(h) + F.silu(h) +
                               F.relu(h), target.to(dev))
        loss = loss + F.mse_loss(h.softmax(-1), torch.zeros(6, 7, device=dev))
        loss.backward()
        return loss.detach().cpu(), xs.grad.cpu(), ws.grad.cpu()

    for a, e in zip(step(R), step("cpu")):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_shape_errors_are_torchs():
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(torch.ones(2, 3, device=R), torch.ones(4, 2, device=R))
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.cat([torch.ones(2, 3, device=R), torch.ones(2, 4, device=R)])
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.ones(2, 3, device=R) + torch.ones(4, device=R)
    assert rgpu.stats()["live_tensors"] >= 0  # the session goes on
    torch.testing.assert_close((torch.ones(2, device=R) * 3).cpu(), torch.full((2,), 3.0))
