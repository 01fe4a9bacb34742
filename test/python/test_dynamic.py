"""Shapes that change every step: generation with a growing KV cache and training on batches of
varying size run as one symbolic graph per program, not one graph per shape, and match CPU."""

import json
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import Server, run_client

import rgpu

R = "rgpu"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from generation import GPT2Style, LlamaStyle, generate  # noqa: E402


def shipped_during(fn):
    before = rgpu.stats()
    out = fn()
    after = rgpu.stats()
    return out, {k: after[k] - before[k] for k in ("graphs_shipped", "waits", "graph_runs",
                                                    "symbolic_runs")}


@pytest.mark.parametrize("family", [GPT2Style, LlamaStyle])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_matches_cpu_and_ships_a_few_graphs(family, cache):
    torch.manual_seed(0)
    model = family().eval()
    prompt = torch.randint(0, model.vocab, (1, 7))
    expected = generate(model, prompt, 100, cache=cache)
    remote = family().eval()
    remote.load_state_dict(model.state_dict())
    remote.to(R)
    generate(remote, prompt.to(R), 3, cache=cache)  # the first call: its graphs are new
    tokens, counts = shipped_during(lambda: generate(remote, prompt.to(R), 100, cache=cache))
    assert torch.equal(tokens.cpu(), expected)
    assert counts["graphs_shipped"] <= 3, counts
    assert counts["waits"] <= 100 + 1, counts  # one stopping check per token, one download


def test_generation_with_dynamic_shapes_off_ships_a_graph_per_token():
    torch.manual_seed(0)
    model = GPT2Style().eval()
    prompt = torch.randint(0, model.vocab, (1, 5))
    expected = generate(model, prompt, 12, cache="dynamic")
    model.to(R)
    rgpu.set_dynamic(False)
    try:
        tokens, counts = shipped_during(lambda: generate(model, prompt.to(R), 12, cache="dynamic"))
    finally:
        rgpu.set_dynamic(True)
    assert torch.equal(tokens.cpu(), expected)
    assert counts["graphs_shipped"] >= 10 and counts["symbolic_runs"] == 0, counts


class Tagger(nn.Module):
    """Embeds a [batch, time] sequence, mixes it with attention and classifies every token."""

    def __init__(self, vocab=50, dim=32, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = self.norm(h + a)
        return self.out(h)


def bucketed_batches():
    g = torch.Generator().manual_seed(3)
    for epoch in range(2):
        for batch, time_ in ((32, 64), (32, 128), (17, 96)):
            yield (torch.randint(0, 50, (batch, time_), generator=g),
                   torch.randint(0, 5, (batch, time_), generator=g))


def train(model, device):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(bucketed_batches()):
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 2:
            warm = rgpu.stats()["graphs_shipped"] if device == R else 0
    return losses, warm


def test_training_on_batches_of_varying_shape_reuses_the_symbolic_graphs():
    torch.manual_seed(0)
    cpu = Tagger()
    remote = Tagger()
    remote.load_state_dict(cpu.state_dict())
    expected, _ = train(cpu, "cpu")
    losses, warm = train(remote.to(R), R)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    # After the first epoch (three shapes), the second ships nothing new.
    assert rgpu.stats()["graphs_shipped"] - warm == 0


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "observed"])
def test_mark_dynamic_makes_the_first_graph_the_symbolic_one(declared):
    torch.manual_seed(0)
    hidden = 48 if declared else 44  # graphs of their own, whichever test runs first
    cpu = nn.Sequential(nn.Linear(12, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    remote = nn.Sequential(nn.Linear(12, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    remote.load_state_dict(cpu.state_dict())
    remote.to(R)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cpu, remote)]
    g = torch.Generator().manual_seed(1)
    shipped = []
    for n in (24, 40, 17, 33):
        x, y = torch.randn(n, 12, generator=g), torch.randn(n, 3, generator=g)
        rx, ry = x.to(R), y.to(R)
        if declared:
            rgpu.mark_dynamic(rx, 0)
            rgpu.mark_dynamic(ry, [0])
        losses = []
        for model, opt, xx, yy in ((cpu, opts[0], x, y), (remote, opts[1], rx, ry)):
            opt.zero_grad()
            loss = F.mse_loss(model(xx), yy)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        shipped.append(rgpu.stats()["graphs_shipped"])
    # The first step's graph is its own (it also reads the parameters' upload). Declared: the
    # second step's graph is already the symbolic one, which the third reuses; observed: the
    # second runs as itself and the third ships the symbolic graph.
    assert shipped[2] - shipped[1] == (0 if declared else 1), shipped
    assert shipped[3] == shipped[2], shipped


def test_mark_dynamic_refuses_what_it_cannot_declare():
    x = torch.ones(3, 4).to(R)
    with pytest.raises(IndexError, match="out of range"):
        rgpu.mark_dynamic(x, 2)
    with pytest.raises(ValueError, match="not data on the server yet"):
        rgpu.mark_dynamic(x * 2, 0)
    with pytest.raises(ValueError, match="not an rgpu tensor"):
        rgpu.mark_dynamic(torch.ones(3), 0)


INDUCTOR_TRAINING = """
import json, time, torch, rgpu
import torch.nn.functional as F

def batches():
    g = torch.Generator().manual_seed(3)
    for epoch in range(3):
        for batch, time_ in ((32, 64), (32, 128), (17, 96)):
            yield (torch.randint(0, 50, (batch, time_), generator=g),
                   torch.randint(0, 5, (batch, time_), generator=g))

def train(device, wait=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 5)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step, (x, y) in enumerate(batches()):
        loss = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if wait and step == 3:
            wait()
    return losses

def wait_for_compiles():
    deadline = time.time() + 600
    while rgpu.server_stats()["compiles_pending"] and time.time() < deadline:
        time.sleep(0.5)

print(json.dumps({"cpu": train("cpu"), "rgpu": train("rgpu", wait_for_compiles),
                  "server": rgpu.server_stats()}))
"""


def on_inductor_server(cache, compile_after, code):
    """Runs `code` against a fresh Inductor server; returns the JSON of its last line."""
    server = Server("--compiler", "inductor", "--cache-dir", str(cache), "--compile-after",
                    str(compile_after))
    try:
        r = run_client(server.address, code, timeout=900)
        assert r.returncode == 0, r.stderr + "".join(server.log)
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        server.stop()


def test_inductor_compiles_a_symbolic_graph_once_for_every_shape(tmp_path):
    # The step graph goes symbolic in the first epoch; the server compiles it once (at its
    # second run), and the next six steps, over three shapes, run that one package.
    out = on_inductor_server(tmp_path, 2, INDUCTOR_TRAINING)
    torch.testing.assert_close(torch.tensor(out["rgpu"]), torch.tensor(out["cpu"]), rtol=1e-4, atol=1e-5)
    stats = out["server"]
    assert stats["inductor_compiles"] == 1 and stats["compile_failures"] == 0, stats
    assert stats["compiled_runs"] >= 5, stats


INDUCTOR_GENERATION = """
import json, sys, time, torch, rgpu
sys.path.insert(0, {examples!r})
from generation import {model}, generate
torch.manual_seed(0)
model = {model}(layers=1).eval()
prompt = torch.randint(0, model.vocab, (1, 6))
expected = generate(model, prompt, 12)
model.to("rgpu")
first = generate(model, prompt.to("rgpu"), 12).cpu()
deadline = time.time() + 600
while rgpu.server_stats()["compiles_pending"] and time.time() < deadline:
    time.sleep(0.5)
before = rgpu.server_stats()["session"]["compiled_runs"]
second = generate(model, prompt.to("rgpu"), 12).cpu()
print(json.dumps({{"same": torch.equal(first, expected) and torch.equal(second, expected),
                   "compiled_runs": rgpu.server_stats()["session"]["compiled_runs"] - before,
                   "server": rgpu.server_stats()}}))
"""


@pytest.mark.parametrize("model", ["GPT2Style", "LlamaStyle"])
def test_inductor_compiles_the_decoding_step_once_with_its_sizes_tied(tmp_path, model):
    # The decoding step's cache length and its mask's length are two symbols to the client;
    # export finds the mask one longer and the package holds for that tie, which the server
    # checks per run. Only the symbolic step runs often enough (3 times) to be compiled.
    # Llama's rotary positions come from an arange of the cache's length, a Python int: its
    # package relates that scalar to the cache's size symbol.
    out = on_inductor_server(tmp_path, 3, INDUCTOR_GENERATION.format(
        model=model, examples=os.path.join(os.path.dirname(__file__), "..", "..", "examples")))
    assert out["same"]
    stats = out["server"]
    assert stats["inductor_compiles"] == 1 and stats["compile_failures"] == 0, stats
    assert out["compiled_runs"] == 10, out  # tokens 3..12 of the second call


def test_a_symbolic_graph_is_checked_like_a_static_one_on_the_server():
    # A size that takes a value past the server's limit on one tensor fails there, naming the
    # op, although the same graph ran at smaller sizes; the session goes on.
    server = Server("--max-tensor-mib", "1")
    try:
        r = run_client(server.address,
                       "import torch, rgpu\n"
                       "for n in (4, 5, 6, 1000, 7):\n"
                       "    x = torch.ones(n, device='rgpu')\n"
                       "    try:\n"
                       "        print(n, (x.repeat(n) * 2).sum().item())\n"
                       "    except rgpu.RemoteError as e:\n"
                       "        print(n, 'error', str(e).splitlines()[0])\n"
                       "print(rgpu.stats()['graphs_generalized'], rgpu.stats()['symbolic_runs'])\n")
    finally:
        server.stop()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[:3] == ["4 32.0", "5 50.0", "6 72.0"] and lines[4] == "7 98.0", lines
    assert lines[3].startswith("1000 error") and "aten::repeat" in lines[3], lines
    generalized, runs = lines[-1].split()
    assert int(generalized) == 1 and int(runs) >= 3, lines
