"""A cut whose trace has the shape of an earlier one is replayed: it runs as that cut resolved,
without building its graph. Checked here against the full path, cut by cut (every replay is
also resolved in full and must agree in graph, symbols, handles, scalars and lines), on the
programs whose cuts repeat: a training loop, generation with a growing KV cache, batches of
varying shape, and a graph the server was told to forget."""

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rgpu
from rgpu import _C

R = "rgpu"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from generation import GPT2Style, LlamaStyle, generate  # noqa: E402


@pytest.fixture(autouse=True)
def check_replays():
    _C._check_replays(True)
    yield
    _C._check_replays(False)


def test_training_steps_replay_and_match_cpu():
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    remote = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    remote.load_state_dict(cpu.state_dict())
    remote.to(R)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cpu, remote)]
    sched = torch.optim.lr_scheduler.StepLR(opts[1], step_size=2, gamma=0.5)
    sched_cpu = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 2, generator=g)
        losses = []
        for model, opt, s, dev in ((cpu, opts[0], sched_cpu, "cpu"), (remote, opts[1], sched, R)):
            loss = F.mse_loss(model(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.step()
            losses.append(loss.item())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        if step == 1:
            replayed = rgpu.stats()["cuts_replayed"]
    assert rgpu.stats()["cuts_replayed"] - replayed >= 4  # a step's cuts replay from the third on
    for a, b in zip(cpu.parameters(), remote.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", [GPT2Style, LlamaStyle])
def test_generation_replays_the_symbolic_graph_token_by_token(family):
    torch.manual_seed(0)
    model = family().eval()
    prompt = torch.randint(0, model.vocab, (2, 5))
    expected = generate(model, prompt, 24)
    remote = family().eval()
    remote.load_state_dict(model.state_dict())
    remote.to(R)
    generate(remote, prompt.to(R), 4)
    before = rgpu.stats()
    tokens = generate(remote, prompt.to(R), 24)
    after = rgpu.stats()
    assert torch.equal(tokens.cpu(), expected)
    assert after["symbolic_runs"] - before["symbolic_runs"] >= 20
    assert after["cuts_replayed"] - before["cuts_replayed"] >= 20


def test_shapes_that_come_back_replay_as_themselves_and_as_symbols():
    w = torch.randn(6, 6)
    rw = w.to(R)
    before = rgpu.stats()["cuts_replayed"]
    for n in (3, 4, 3, 7, 4, 3, 9, 9):
        x = torch.randn(n, 6)
        got = (x.to(R) @ rw).relu().sum(0)
        torch.testing.assert_close(got.cpu(), (x @ w).relu().sum(0))
    assert rgpu.stats()["cuts_replayed"] - before >= 4


def test_scalars_replay_by_value_and_an_input_read_twice_stays_one_input():
    x = torch.randn(4, 3)
    y = torch.randn(4, 3)
    rx, ry = x.to(R), y.to(R)
    for v in (1.5, float("nan"), -2.0, 0.0):
        torch.testing.assert_close((rx * v + rx).cpu(), x * v + x, equal_nan=True)
        torch.testing.assert_close((rx * v + ry).cpu(), x * v + y, equal_nan=True)
