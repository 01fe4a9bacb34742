"""Autograd and training on rgpu match CPU eager, step for step, at one wait per step."""

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
from conftest import same

import rgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from models import SmallCNN, TinyGPT, gpt_batch, gpt_optimizer  # noqa: E402

R = "rgpu"


def twins(module):
    torch.manual_seed(0)
    cpu = module()
    dev = copy.deepcopy(cpu).to(R)
    return cpu, dev


def assert_params_match(dev, cpu, atol=1e-5):
    for (name, p), (_, q) in zip(dev.named_parameters(), cpu.named_parameters()):
        same(p, q, rtol=1e-5, atol=atol)
        if q.grad is not None:
            same(p.grad, q.grad, rtol=1e-4, atol=atol)
    for (name, b), (_, c) in zip(dev.named_buffers(), cpu.named_buffers()):
        same(b, c, rtol=1e-5, atol=atol)


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: nn.Linear(5, 3), (4, 5)),
        (lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 2, 5, 5)),
        (lambda: nn.LayerNorm(6), (3, 6)),
        (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
        (lambda: nn.BatchNorm1d(4), (8, 4)),
    ],
)
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_module_gradients_and_optimizer_steps_match_cpu(make, shape, optim):
    cpu, dev = twins(make)
    cpu.train()
    dev.train()

    def opt_for(m):
        if optim == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(m.parameters(), lr=0.01, foreach=True)

    oc, od = opt_for(cpu), opt_for(dev)
    for step in range(3):
        x = torch.randn(*shape)
        for m, o, inp in ((cpu, oc, x), (dev, od, x.to(R))):
            o.zero_grad()
            loss = (m(inp) ** 2).mean()
            loss.backward()
            o.step()
    assert_params_match(dev, cpu)


def test_input_gradients():
    x = torch.randn(3, 4, requires_grad=True)
    xr = x.detach().to(R).requires_grad_()
    (x.sin() * x).sum().backward()
    (xr.sin() * xr).sum().backward()
    same(xr.grad, x.grad)


def train_cnn(device, steps=20):
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 1, 16, 16, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def train_gpt(device, steps=20, item_every_step=True):
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    opt, sched = gpt_optimizer(model, steps)
    losses, per_step = [], []
    for step in range(steps):
        idx, tgt = gpt_batch(step)
        before = rgpu.stats()
        opt.zero_grad()
        loss = model(idx.to(device), tgt.to(device))
        loss.backward()
        opt.step()
        sched.step()
        if item_every_step:
            losses.append(loss.item())
        after = rgpu.stats()
        per_step.append({k: after[k] - before[k] for k in after})
    return losses, model, per_step


def test_cnn_with_batchnorm_trains_like_cpu():
    cpu_losses, cpu_model = train_cnn("cpu")
    dev_losses, dev_model = train_cnn(R)
    torch.testing.assert_close(dev_losses, cpu_losses, rtol=1e-4, atol=1e-5)
    assert_params_match(dev_model, cpu_model, atol=1e-4)


def test_gpt_trains_like_cpu_at_one_wait_per_step():
    cpu_losses, cpu_model, _ = train_gpt("cpu")
    dev_losses, dev_model, per_step = train_gpt(R)
    torch.testing.assert_close(dev_losses, cpu_losses, rtol=1e-4, atol=1e-5)
    assert cpu_losses[-1] < cpu_losses[0]
    assert_params_match(dev_model, cpu_model, atol=1e-4)
    for s in per_step[3:]:
        up = s["bytes_out"] - 2 * (8 * 16 * 8) - 2 * 64  # the batch's two int64 uploads + headers
        # One wait, at .item(); none if the step's reply, which carries the loss, was already in.
        assert s["waits"] <= 1, s
        assert s["messages"] <= 2, s
        assert up <= 2048, s
        assert s["graphs_shipped"] == 0, s


def test_gpt_without_item_never_waits_unless_the_server_falls_behind():
    # Only RGPU_MAX_INFLIGHT makes such a loop wait: for the server, when it is that many steps
    # behind the client.
    bound = rgpu._C._set_max_inflight(64)
    try:
        _, _, per_step = train_gpt(R, steps=13, item_every_step=False)
    finally:
        rgpu._C._set_max_inflight(bound)
    assert sum(s["waits"] for s in per_step[3:]) == 0, per_step
    assert all(s["graphs_shipped"] == 0 for s in per_step[3:]), per_step
    # Two frames a step: the forward, sent when the backward starts, and the rest.
    assert all(s["messages"] == 2 for s in per_step[3:]), per_step


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_the_forward_is_sent_when_the_backward_starts(how):
    # The server runs the forward while the client traces the backward: at the start of the
    # backward the pending forward (over RGPU_STREAM_CUT ops) is cut and sent, without a wait;
    # the gradients are those of CPU eager.
    cpu, dev = twins(TinyGPT)
    idx, tgt = gpt_batch(0)
    grads = {}
    for model, device in ((cpu, "cpu"), (dev, R)):
        loss = model(idx.to(device), tgt.to(device))
        before = rgpu.stats()
        if how == "backward":
            loss.backward()
            got = [p.grad for p in model.parameters()]
        else:
            got = torch.autograd.grad(loss, list(model.parameters()))
        after = rgpu.stats()
        grads[device] = got
        if device == R:
            assert after["graph_runs"] - before["graph_runs"] == 1, (before, after)
            assert after["messages"] - before["messages"] == 1, (before, after)
            assert after["waits"] == before["waits"]
    for g, want in zip(grads[R], grads["cpu"]):
        same(g, want, rtol=1e-4, atol=1e-5)


def test_a_small_forward_is_not_cut_at_the_backward():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(R)
    loss = model(torch.randn(4, 8).to(R)).sum()
    before = rgpu.stats()
    loss.backward()
    assert rgpu.stats()["graph_runs"] == before["graph_runs"]  # under RGPU_STREAM_CUT ops


def test_a_loop_that_never_syncs_is_cut_at_the_node_cap():
    torch.rgpu.synchronize()  # connected, nothing pending
    before = rgpu.stats()
    x = torch.zeros(4, device=R)
    for _ in range(25000):
        x = x + 1
    mid = rgpu.stats()
    assert mid["graph_runs"] > before["graph_runs"]
    assert mid["waits"] == before["waits"]
    same(x, torch.full((4,), 25000.0))


def test_freed_tensors_are_released_without_extra_messages():
    xs = [torch.randn(8, device=R) * i for i in range(100)]
    torch.rgpu.synchronize()
    before = rgpu.stats()
    del xs
    torch.rgpu.synchronize()
    after = rgpu.stats()
    assert after["messages"] - before["messages"] == 1
    assert after["live_tensors"] < before["live_tensors"] - 90


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "adagrad"])
def test_fused_optimizers_match_cpu_and_an_lr_schedule_ships_no_new_graph(kind):
    def make(params):
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, fused=True)
        if kind == "adam":
            return torch.optim.Adam(params, lr=1e-2, fused=True, weight_decay=0.1)
        if kind == "sgd":
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)
        return torch.optim.Adagrad(params, lr=1e-2, fused=True)

    cpu, dev = twins(lambda: nn.Linear(4, 3))
    runs = []
    for m, device in ((cpu, "cpu"), (dev, R)):
        opt = make(m.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        shipped = []
        for step in range(5):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            loss = (m(x.to(device)) ** 2).mean()
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            loss.item()
            shipped.append(rgpu.stats()["graphs_shipped"])
        runs.append(shipped)
    assert_params_match(dev, cpu)
    assert runs[1][-1] == runs[1][2], runs[1]  # later steps reuse the graphs of the first ones


def test_torch_func_transforms_match_cpu():
    """torch.func's transforms run on rgpu tensors as on CPU: vmap (with in_dims, chunks,
    indexing and in-place ops inside), grad, jacrev/jacfwd, hessian, vjp/jvp, and per-sample
    gradients and model ensembling through functional_call."""
    from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state, vjp, vmap

    g = torch.Generator().manual_seed(0)
    w, x, v = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g), torch.randn(3, generator=g)
    labels = torch.tensor([0, 1, 1, 0])
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(3, 8), nn.GELU(), nn.Linear(8, 2))
    ensemble = [nn.Linear(3, 2) for _ in range(3)]

    def per_sample_grads(d):
        m = copy.deepcopy(mlp).to(d)
        params = {k: p.detach() for k, p in m.named_parameters()}

        def loss(p, xi, yi):
            return nn.functional.cross_entropy(functional_call(m, p, (xi,)), yi)
        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x.to(d).unsqueeze(1),
                                                       labels.to(d).unsqueeze(1))

    def ensembled(d):
        params, buffers = stack_module_state([copy.deepcopy(m).to(d) for m in ensemble])
        base = nn.Linear(3, 2).to("meta")
        return vmap(lambda p, b, xi: functional_call(base, (p, b), (xi,)),
                    in_dims=(0, 0, None))(params, buffers, x.to(d))

    cases = {
        "vmap": lambda d: vmap(lambda xi, wi: (wi @ xi).relu(), in_dims=(0, None))(x.to(d), w.to(d)),
        "vmap chunks": lambda d: vmap(lambda xi: xi.softmax(-1), chunk_size=3)(x.to(d)),
        "vmap index": lambda d: vmap(lambda xi, i: xi[i])(x.to(d), torch.tensor([0, 2, 1, 0]).to(d)),
        "vmap in-place": lambda d: vmap(lambda xi: xi.clone().mul_(2).add_(1))(x.to(d)),
        "grad": lambda d: grad(lambda t: (t.sin() ** 2).sum())(v.to(d)),
        "jacrev": lambda d: jacrev(lambda t: (w.to(d) @ t).tanh())(v.to(d)),
        "jacfwd": lambda d: jacfwd(lambda t: (w.to(d) @ t).tanh())(v.to(d)),
        "hessian": lambda d: hessian(lambda t: (t.exp() * t).sum())(v.to(d)),
        "vjp": lambda d: vjp(lambda t: t.sin() * 2, v.to(d))[1](torch.ones(3).to(d)),
        "jvp": lambda d: jvp(lambda t: t.sin() * 2, (v.to(d),), (torch.ones(3).to(d),)),
        "per-sample grads": lambda d: list(per_sample_grads(d).values()),
        "ensemble": ensembled,
    }
    for name, f in cases.items():
        expected, actual = f("cpu"), f(R)
        same(list(actual) if isinstance(actual, tuple) else actual,
             list(expected) if isinstance(expected, tuple) else expected, rtol=1e-4, atol=1e-5)
