"""torch.compile(backend="rgpu"): dynamo and aot_autograd graphs run on the server, match CPU
eager, cost one wait per step, and ship exactly one forward and one backward graph."""

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from models import TinyGPT, gpt_batch  # noqa: E402


def new_graphs(known):
    return {g["hash"] for g in rgpu._C.metrics()["graphs"]} - known


def mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def gpt():
    return TinyGPT()


def batch(kind, step):
    if kind is mlp:
        g = torch.Generator().manual_seed(step)
        return (torch.randn(8, 16, generator=g),)
    return gpt_batch(step)


def loss_of(model, kind, args):
    out = model(*args)
    return out.square().mean() if kind is mlp else out


@pytest.mark.parametrize("kind", [mlp, gpt], ids=["mlp", "transformer"])
def test_forward_and_backward_match_cpu_at_one_wait_per_step(kind):
    torch.manual_seed(0)
    cpu = kind()
    dev = copy.deepcopy(cpu).to("rgpu")
    compiled = torch.compile(dev, backend="rgpu", dynamic=False)
    before_all = {g["hash"] for g in rgpu._C.metrics()["graphs"]}
    for step in range(4):
        args = batch(kind, step)
        cpu.zero_grad()
        dev.zero_grad()
        expected = loss_of(cpu, kind, args)
        expected.backward()
        before = rgpu.stats()
        loss = loss_of(compiled, kind, [a.to("rgpu") for a in args])
        loss.backward()
        value = loss.item()
        after = rgpu.stats()
        delta = {k: after[k] - before[k] for k in after}
        torch.testing.assert_close(value, expected.item(), rtol=1e-4, atol=1e-6)
        for p, q in zip(dev.parameters(), cpu.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
        if step > 0:
            assert delta["graphs_shipped"] == 0, delta
            assert delta["waits"] == 1, delta
    # One forward and one backward graph, shipped once; the user's own ops (the loss outside
    # the compiled module, the parameters' upload) are lazy graphs of their own.
    reasons = [g["reason"] for g in rgpu._C.metrics()["graphs"] if g["hash"] in new_graphs(before_all)]
    assert reasons.count("torch.compile forward graph") == 1, reasons
    assert reasons.count("torch.compile backward graph") == 1, reasons


def test_a_compiled_training_step_with_an_optimizer():
    torch.manual_seed(0)
    cpu = mlp()
    dev = copy.deepcopy(cpu).to("rgpu")
    compiled = torch.compile(dev, backend="rgpu", dynamic=False)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cpu, dev)]
    for step in range(4):
        (x,) = batch(mlp, step)
        losses = []
        for model, opt, xx in ((cpu, opts[0], x), (compiled, opts[1], x.to("rgpu"))):
            opt.zero_grad()
            loss = model(xx).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-6)
    for p, q in zip(dev.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_dynamic_shapes_ship_one_graph_per_region_over_five_shapes(train):
    torch.manual_seed(0)
    cpu = mlp()
    dev = copy.deepcopy(cpu).to("rgpu")
    compiled = torch.compile(dev, backend="rgpu", dynamic=True)
    known = {g["hash"] for g in rgpu._C.metrics()["graphs"]}
    for n in (3, 5, 9, 12, 7):
        x = torch.randn(n, 16)
        cpu.zero_grad()
        dev.zero_grad()
        with torch.set_grad_enabled(train):
            expected = cpu(x)
            out = compiled(x.to("rgpu"))
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
        if train:
            expected.square().mean().backward()
            out.square().mean().backward()
            for p, q in zip(dev.parameters(), cpu.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
    reasons = [g["reason"] for g in rgpu._C.metrics()["graphs"] if g["hash"] in new_graphs(known)]
    regions = ["forward", "backward"] if train else ["inference"]
    for region in regions:
        assert reasons.count(f"torch.compile {region} graph") == 1, reasons


def test_python_floats_under_dynamic_shapes_are_computed_on_the_server():
    # With dynamic=True dynamo makes a Python float an input of the graph and its math
    # (Hugging Face GPT-2's GELU: math.sqrt(2.0 / math.pi)) tensor ops, converted with
    # prims.convert_element_type, which the server runs as aten._to_copy.
    import math

    def f(x, c):
        return x * math.sqrt(2.0 / c) + torch.tanh(x) * c

    compiled = torch.compile(f, backend="rgpu", dynamic=True)
    known = {g["hash"] for g in rgpu._C.metrics()["graphs"]}
    for n, c in ((3, 3.5), (5, 2.5), (8, 1.5), (4, 0.75)):
        x = torch.randn(2, n, requires_grad=True)
        dx = x.detach().to("rgpu").requires_grad_()
        out = compiled(dx, c)
        expected = f(x, c)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(dx.grad.cpu(), x.grad, rtol=1e-5, atol=1e-6)
    reasons = [g["reason"] for g in rgpu._C.metrics()["graphs"] if g["hash"] in new_graphs(known)]
    for region in ("forward", "backward"):
        assert reasons.count(f"torch.compile {region} graph") == 1, reasons


def test_inference_under_no_grad():
    torch.manual_seed(0)
    cpu = mlp().eval()
    compiled = torch.compile(copy.deepcopy(cpu).to("rgpu"), backend="rgpu")
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x.to("rgpu")).cpu(), cpu(x), rtol=1e-4, atol=1e-5)


@torch.library.custom_op("rgputest::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_raises_at_compile_time_naming_it():
    f = torch.compile(lambda x: twice(x) + 1, backend="rgpu")
    with pytest.raises(Exception, match="rgputest::twice") as info:
        f(torch.ones(3, device="rgpu"))
    chain, e = [], info.value
    while e is not None:
        chain.append(type(e))
        e = e.__cause__ or e.__context__
    assert rgpu.UnsupportedOpError in chain, chain


def raised_chain(info):
    chain, e = [], info.value
    while e is not None:
        chain.append(type(e))
        e = e.__cause__ or e.__context__
    return chain


def test_a_custom_op_called_through_torch_ops_raises_naming_it():
    f = torch.compile(lambda x: torch.ops.rgputest.twice(x) + 1, backend="rgpu")
    with pytest.raises(Exception, match="rgputest::twice") as info:
        f(torch.ones(3, device="rgpu"))
    assert rgpu.UnsupportedOpError in raised_chain(info)


class NanoGPT(nn.Module):
    """A GPT written as nanoGPT's model.py writes one: fused qkv projection, causal
    scaled_dot_product_attention, a GELU MLP, pre-norm blocks, tied embedding and head."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=2, context=16):
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(ln_1=nn.LayerNorm(dim), c_attn=nn.Linear(dim, 3 * dim),
                               c_proj=nn.Linear(dim, dim), ln_2=nn.LayerNorm(dim),
                               c_fc=nn.Linear(dim, 4 * dim), mlp_proj=nn.Linear(4 * dim, dim)))
            for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            q, k, v = blk["c_attn"](blk["ln_1"](x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["c_proj"](y.transpose(1, 2).contiguous().view(b, t, -1))
            x = x + blk["mlp_proj"](F.gelu(blk["c_fc"](blk["ln_2"](x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1)


def test_plain_torch_compile_trains_a_nanogpt_style_model_like_eager_rgpu():
    # nanoGPT's --compile=True: `model = torch.compile(model)`, no backend named. On rgpu
    # tensors that compiles through the rgpu backend (the server's Inductor).
    torch.manual_seed(0)
    eager = NanoGPT().to("rgpu")
    plain = copy.deepcopy(eager)
    compiled = torch.compile(plain)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (eager, plain)]
    for step in range(10):
        x, y = (t.to("rgpu") for t in gpt_batch(step))
        losses, waits = [], []
        for model, opt in ((eager, opts[0]), (compiled, opts[1])):
            before = rgpu.stats()["waits"]
            opt.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            waits.append(rgpu.stats()["waits"] - before)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        if step > 0:
            assert waits[1] <= 1, (step, waits)  # 0 when its reply came unasked
    for p, q in zip(plain.parameters(), eager.parameters()):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-5, atol=1e-6)
    reasons = [g["reason"] for g in rgpu._C.metrics()["graphs"]]
    assert "torch.compile forward graph" in reasons and "torch.compile backward graph" in reasons


def test_plain_torch_compile_of_functions_and_decorators_runs_on_the_server():
    @torch.compile
    def f(x):
        return x.sin() + 1

    @torch.compile(dynamic=False)
    def g(x):
        return (x * 2).cos()

    x = torch.randn(5)
    torch.testing.assert_close(f(x.to("rgpu")).cpu(), x.sin() + 1)
    torch.testing.assert_close(g(x.to("rgpu")).cpu(), (x * 2).cos())
    # A mode goes with the graph to the server (test_inductor.py), which compiles in it.
    h = torch.compile(lambda x: x.exp(), mode="max-autotune")
    torch.testing.assert_close(h(x.to("rgpu")).cpu(), x.exp())


def test_backend_inductor_written_out_on_rgpu_tensors_says_what_to_write():
    f = torch.compile(lambda x: x.sin() + 1, backend="inductor")
    with pytest.raises(Exception, match="leave backend out") as info:
        f(torch.ones(3, device="rgpu"))
    assert rgpu.UnsupportedOpError in raised_chain(info)


def test_compile_backend_options():
    torch.manual_seed(0)
    cpu = mlp()
    backend = rgpu.compile_backend(compiler="plan")
    compiled = torch.compile(copy.deepcopy(cpu).to("rgpu"), backend=backend)
    x = torch.randn(4, 16)
    torch.testing.assert_close(compiled(x.to("rgpu")).cpu(), cpu(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="compiler"):
        rgpu.compile_backend(compiler="tvm")
    with pytest.raises(ValueError, match="mode must be one of"):
        rgpu.compile_backend(mode="fastest")
    with pytest.raises(ValueError, match="never compiles"):
        rgpu.compile_backend(mode="reduce-overhead", compiler="plan")
