"""rgpu on a CUDA server: training matches local CUDA eager, Inductor-compiled CUDA code matches
the plan, out of memory is an error the session survives, a device-side assert ends the server
cleanly, and torch.rgpu's memory functions agree with torch.cuda's. Skipped without CUDA; run
on a GPU machine by tools/device/check.sh."""

import json
import os
import time

import pytest
import torch
from conftest import Server, run_client

import rgpu

from test_training import train_cnn, train_gpt  # the same loops, on CPU there

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def cuda_server(server):
    """This module's tests talk to a CUDA server (plan executor); the others' server is back after."""
    # Tensors past the host's memory are allowed: the out-of-memory test asks for more than
    # the GPU has, and the GPU may have more than the host.
    s = Server("--device", "cuda", "--max-tensor-mib", str(1 << 24))
    rgpu.set_server(s.address)
    rgpu.reset()
    yield s
    rgpu.set_server(server.address)
    rgpu.reset()
    s.stop()


def assert_params_match(a, b):
    # CUDA's atomics (embedding and index backward, some cuDNN algorithms) make gradients differ
    # in their last bits from run to run, even between two local runs, and Adam's step is about
    # lr whatever a gradient's size, so a near-zero gradient's last bits can move a parameter
    # by a fraction of lr (1e-2). The losses are held to rtol 1e-4.
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-3, atol=1e-3)
    for p, q in zip(a.buffers(), b.buffers()):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-3, atol=1e-3)


def test_the_server_runs_on_cuda():
    assert torch.rgpu.get_device_properties().type == "cuda"


def test_gpt_trains_like_local_cuda_eager():
    local, local_model, _ = train_gpt("cuda")
    remote, remote_model, _ = train_gpt("rgpu")
    torch.testing.assert_close(remote, local, rtol=1e-4, atol=1e-5)
    assert local[-1] < local[0]
    assert_params_match(remote_model, local_model)


def test_cnn_with_batchnorm_trains_like_local_cuda_eager():
    local, local_model = train_cnn("cuda")
    remote, remote_model = train_cnn("rgpu")
    torch.testing.assert_close(remote, local, rtol=1e-4, atol=1e-5)
    assert_params_match(remote_model, local_model)


def test_uploads_and_downloads_of_every_layout_round_trip():
    base = torch.randn(6, 5, 4, 3)
    cases = [base, base.transpose(0, 2), base[:, 1:4:2], base.to(memory_format=torch.channels_last),
             torch.tensor(3.5), torch.empty(0, 4), torch.arange(24).view(4, 6).t(),
             (base > 0), base.to(torch.bfloat16), torch.randn(3, 4, dtype=torch.complex64).conj()]
    for t in cases:
        r = t.to("rgpu")
        torch.testing.assert_close(r.cpu(), t.resolve_conj(), rtol=0, atol=0)
        torch.testing.assert_close((r * 2).cpu(), (t * 2).resolve_conj(), rtol=0, atol=0)
    big = torch.randn(64, 1024, 1024)  # 256 MiB: chunked both ways
    assert torch.equal(big.to("rgpu").cpu(), big)


def test_memory_functions_agree_with_torch_cuda():
    props, local = torch.rgpu.get_device_properties(), torch.cuda.get_device_properties(0)
    assert props.name == local.name == torch.rgpu.get_device_name()
    assert (props.major, props.minor) == (local.major, local.minor)
    assert props.multi_processor_count == local.multi_processor_count
    free, total = torch.rgpu.mem_get_info()
    assert total == torch.cuda.mem_get_info()[1] == props.total_memory
    assert 0 < free <= total

    torch.rgpu.reset_peak_memory_stats()
    before = torch.rgpu.memory_allocated()
    x = torch.ones(256, 1024, 1024, device="rgpu")  # 1 GiB
    held = torch.rgpu.memory_allocated()
    assert held - before == x.numel() * 4
    assert torch.rgpu.max_memory_allocated() >= held
    assert torch.rgpu.memory_reserved() >= held
    assert torch.rgpu.mem_get_info()[0] < free
    del x
    assert torch.rgpu.memory_allocated() == before
    assert torch.rgpu.max_memory_allocated() >= before + 2**30
    torch.rgpu.empty_cache()
    assert torch.rgpu.memory_reserved() < 2**30 + before
    torch.rgpu.reset_peak_memory_stats()
    assert torch.rgpu.max_memory_allocated() == torch.rgpu.memory_allocated()


def test_out_of_memory_is_a_remote_error_and_the_session_goes_on():
    x = torch.randn(1000, device="rgpu")
    reserved = torch.rgpu.memory_reserved()
    huge = torch.empty(1 << 40, device="rgpu")  # 4 TiB
    with pytest.raises(rgpu.RemoteError) as info:
        (huge + 1).sum().item()
    message = str(info.value)
    assert "out of memory" in message and "Tried to allocate" in message, message
    assert "test_cuda.py" in message, message  # the user's line
    # The session lives on, and the cache holds no more than before.
    torch.testing.assert_close((x * 2).cpu(), x.cpu() * 2)
    assert torch.rgpu.memory_reserved() <= reserved + (64 << 20)


def test_inductor_on_cuda_matches_the_plan(tmp_path):
    code = """
import json, os, sys, time, torch, rgpu
sys.path.insert(0, {examples!r})
from models import TinyGPT, gpt_batch, gpt_optimizer
torch.manual_seed(0)
model = TinyGPT().to("rgpu")
opt, sched = gpt_optimizer(model, 12)
losses = []
for step in range(12):
    idx, tgt = gpt_batch(step)
    opt.zero_grad()
    loss = model(idx.to("rgpu"), tgt.to("rgpu"))
    loss.backward()
    opt.step()
    sched.step()
    losses.append(loss.item())
    if step == 3:
        deadline = time.time() + 600
        while rgpu.server_stats()["compiles_pending"] and time.time() < deadline:
            time.sleep(0.5)
print(json.dumps({{"losses": losses, "stats": rgpu.server_stats()}}))
""".format(examples=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
    results = {}
    for compiler in ("plan", "inductor"):
        s = Server("--device", "cuda", "--compiler", compiler, "--compile-after", "2",
                   "--cache-dir", str(tmp_path / "cache"))
        try:
            r = run_client(s.address, code, timeout=900)
            assert r.returncode == 0, r.stdout + r.stderr + "".join(s.log)
            results[compiler] = __import__("json").loads(r.stdout.strip().splitlines()[-1])
        finally:
            s.stop()
    stats = results["inductor"]["stats"]
    assert stats["compile_failures"] == 0 and stats["session"]["compiled_runs"] >= 8, stats
    torch.testing.assert_close(results["inductor"]["losses"], results["plan"]["losses"],
                               rtol=1e-4, atol=1e-5)


def test_reduce_overhead_replays_cuda_graphs_and_trains_like_local_cuda(tmp_path):
    # torch.compile(mode="reduce-overhead") regions (the forward writes BatchNorm's running
    # statistics, inputs of the graph) and, by the server's --compile-mode, the eager loss and
    # optimizer graphs (SGD's constant lr: the same scalars every step) replay as CUDA graphs.
    code = """
import json, sys, time, torch, rgpu
import torch.nn.functional as F
sys.path.insert(0, {examples!r})
from models import SmallCNN
def train(device):
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = torch.compile(model, backend="rgpu", mode="reduce-overhead") if device == "rgpu" else model
    losses = []
    for step in range(12):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 1, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(run(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if device == "rgpu" and step == 2:
            deadline = time.time() + 600
            while rgpu.server_stats()["compiles_pending"] and time.time() < deadline:
                time.sleep(0.5)
    return losses, [t.detach().cpu() for t in (*model.parameters(), *model.buffers())]
local, local_state = train("cuda")
remote, remote_state = train("rgpu")
diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(local_state, remote_state))
print(json.dumps({{"local": local, "remote": remote, "diff": diff, "stats": rgpu.server_stats()}}))
""".format(examples=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
    s = Server("--device", "cuda", "--compiler", "inductor", "--compile-mode", "reduce-overhead",
               "--cache-dir", str(tmp_path / "cache"))
    try:
        r = run_client(s.address, code, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr + "".join(s.log)
        out = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        s.stop()
    torch.testing.assert_close(out["remote"], out["local"], rtol=1e-4, atol=1e-5)
    assert out["diff"] < 1e-3, out["diff"]
    stats = out["stats"]
    said = [g["cuda_graph"] for g in stats["session"]["graphs"] if g["executor"] == "inductor"]
    assert said.count("replayed") >= 2 and stats["cuda_graph_replays"] >= 8, stats
    assert not any("failed" in w for w in said), said


def test_a_device_side_assert_ends_the_server_cleanly_for_a_restart():
    s = Server("--device", "cuda")
    try:
        code = """
import torch, rgpu
x = torch.randn(8, device="rgpu")
i = torch.tensor([100]).to("rgpu")
try:
    print(x[i].cpu())
except (rgpu.RemoteError, rgpu.SessionLost) as e:
    print("ERROR", type(e).__name__, e)
"""
        r = run_client(s.address, code, timeout=120)
        assert "ERROR" in r.stdout, r.stdout + r.stderr
        assert "device-side assert" in r.stdout or "lost" in r.stdout, r.stdout
        deadline = time.time() + 30
        while s.alive() and time.time() < deadline:
            time.sleep(0.1)
        assert s.proc.wait() == 75, "".join(s.log)
        assert any("restart" in line for line in s.log), "".join(s.log)
    finally:
        s.stop()


def test_two_names_for_one_gpu_compute_and_copy_on_the_server():
    """`--devices cuda:0,cuda:0` (one GPU on the check machine): rgpu:0 and rgpu:1 compute like
    local CUDA, and a copy between them moves no byte through the client."""
    s = Server("--devices", "cuda:0,cuda:0")
    try:
        r = run_client(s.address, """
import json, torch, rgpu
a = torch.randn(64, 64)
x, y = a.to("rgpu:0"), a.to("rgpu:1")
before = rgpu.stats()
z = (x @ x).relu().to("rgpu:1") + y
w = torch.empty(64, 64, device="rgpu:0"); w.copy_(z)
rgpu.synchronize()
after = rgpu.stats()
want = (a.cuda() @ a.cuda()).relu() + a.cuda()
print(json.dumps({"devices": [str(z.device), str(w.device)],
                  "close": torch.allclose(w.cpu(), want.cpu(), rtol=1e-4, atol=1e-4),
                  "moved": after["uploads"] - before["uploads"] + after["downloads"] - before["downloads"]}))
""")
    finally:
        s.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"devices": ["rgpu:1", "rgpu:0"], "close": True, "moved": 0}
