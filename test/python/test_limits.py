"""Every session's memory and graphs are bounded, and so are the server's caches: a session past
its quota gets an rgpu.RemoteError naming it and goes on, one beside it is unaffected, and a
server whose caches are smaller than a model's graphs trains it with the same losses."""

import json
import os
import resource
import subprocess
import sys
import textwrap

import torch
from conftest import Server, opserver_path, run_client

# A training loop run in its own process beside the session under test; prints its losses
# and the CPU's.
TRAIN = textwrap.dedent("""
    import torch, rgpu
    torch.manual_seed(0)
    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range({steps}):
            x = torch.randn(64, 16, generator=g).to(device)
            y = x.sum(1, keepdim=True).sin()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    cpu, remote = train("cpu"), train("rgpu")
    print(cpu == remote or max(abs(a - b) / abs(a) for a, b in zip(cpu, remote)) < 1e-5)
""")


def train_beside(address, steps):
    return subprocess.Popen([sys.executable, "-c", TRAIN.format(steps=steps)],
                            env=dict(os.environ, RGPU_OPSERVER=address),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_session_past_its_quota_gets_a_remote_error_and_trains_on():
    server = Server("--session-memory", "64MiB")
    try:
        beside = train_beside(server.address, 200)
        r = run_client(server.address, textwrap.dedent("""
            import torch, rgpu
            for make in (lambda: torch.ones(32, 1024, 1024, device="rgpu"),   # a kernel's output
                         lambda: torch.ones(24, 1024, 1024).to("rgpu")):      # an upload
                try:
                    print(make().sum().item())
                except rgpu.RemoteError as e:
                    print("refused:", e)
            stats = rgpu.server_stats()["session"]
            print("refused", stats["allocations_refused"], "quota", stats["memory_quota"],
                  "peak", stats["memory_peak"])
        """) + TRAIN.format(steps=10))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert "refused: aten::ones failed on the server at <string>:4: allocating 128 MiB would "
        "take this session past its memory quota of 64 MiB (--session-memory" in lines[0], lines
        assert lines[1].startswith("refused: upload of 96 MiB for handle"), lines
        assert "past its memory quota of 64 MiB (--session-memory" in lines[1], lines
        assert lines[2].split()[:4] == ["refused", "2", "quota", str(64 << 20)], lines
        assert int(lines[2].split()[5]) <= 64 << 20
        assert lines[3] == "True", lines  # trained on, the same losses as the CPU
        out, err = beside.communicate(timeout=120)
        assert beside.returncode == 0 and out.strip() == "True", err
        assert server.alive()
    finally:
        server.stop()


def test_the_servers_limit_counts_every_session():
    server = Server("--memory-limit", "160MiB")
    try:
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, torch, rgpu\n"
             "x = torch.ones(25, 1024, 1024, device='rgpu'); print(x.sum().item(), flush=True)\n"
             "sys.stdin.read()"],
            env=dict(os.environ, RGPU_OPSERVER=server.address),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == str(float(25 << 20))
        r = run_client(server.address, textwrap.dedent("""
            import torch, rgpu
            try:
                print(torch.ones(16, 1024, 1024, device="rgpu").sum().item())
            except rgpu.RemoteError as e:
                print(e)
            print(torch.ones(3, device="rgpu").sum().item())
            stats = rgpu.server_stats()
            print(stats["memory_limit"], stats["session_memories"][0])
        """))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert "past its memory limit of 160 MiB (--memory-limit; 100 MiB are held" in lines[0], lines
        assert lines[1] == "3.0"
        limit, largest = map(int, lines[2].split())
        assert limit == 160 << 20 and largest >= 100 << 20
        holder.stdin.close()
        holder.wait(timeout=30)
    finally:
        server.stop()


def test_the_allocator_running_out_is_a_remote_error_too():
    # No limit of rgpu's: the process's address space runs out first.
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    server = Server("--memory-limit", "0", preexec_fn=limit)
    try:
        r = run_client(server.address, textwrap.dedent("""
            import torch, rgpu
            try:
                print(torch.ones(1 << 32, device="rgpu").sum().item())
            except rgpu.RemoteError as e:
                print(e)
            print(torch.ones(3, device="rgpu").sum().item())
        """))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("aten::ones failed on the server at <string>:4:"), lines
        assert "allocate" in lines[0] and "17179869184 bytes" in lines[0], lines
        assert lines[1] == "3.0"
        assert server.alive()
    finally:
        server.stop()


def test_sizes_take_units_and_bad_ones_are_named():
    r = subprocess.run([opserver_path(), "--session-memory", "8 parsecs"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert "--session-memory needs a size such as 8GiB, 512MiB or 64k, not '8 parsecs'" in r.stderr


# A small transformer-like MLP whose training step is a graph of a few hundred nodes, trained
# with AdamW; every third step has another batch size, so two such graphs alternate.
BLOCKS = textwrap.dedent("""
    import json, torch, rgpu

    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.up = torch.nn.Linear(width, 4 * width)
            self.down = torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    def losses(device, steps=12):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[Block(16) for _ in range(4)], torch.nn.Linear(16, 1))
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(2)
        out = []
        for step in range(steps):
            x = torch.randn(8 if step % 3 else 4, 16, generator=g).to(device)
            loss = (model(x) - x[:, :1]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    cpu = losses("cpu")
    remote = losses("rgpu")
    print(json.dumps({"cpu": cpu, "rgpu": remote, "client": rgpu.stats(),
                      "server": rgpu.server_stats()}))
""")


def test_graphs_past_the_budget_are_forgotten_and_defined_again_with_the_same_losses():
    # The two step graphs fit the session's budget one at a time, not together, and the plan
    # cache holds less than one of them. (With dynamic shapes the batch sizes 8 and 4 would run
    # as one symbolic graph.)
    server = Server("--graph-memory", "300k", "--plan-cache", "64k")
    try:
        r = run_client(server.address, BLOCKS, env={"RGPU_DYNAMIC": "0"})
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        torch.testing.assert_close(torch.tensor(out["rgpu"]), torch.tensor(out["cpu"]), rtol=1e-5, atol=1e-6)
        session = out["server"]["session"]
        assert session["graph_budget"] == 300 << 10
        assert 0 < session["graph_bytes"] <= 300 << 10
        assert session["graphs_forgotten"] >= 6
        assert out["client"]["graphs_forgotten"] == session["graphs_forgotten"]
        assert out["server"]["plan_evictions"] > 0
        assert not any("refused" in line for line in server.log), server.log
    finally:
        server.stop()


def test_cpu_stand_ins_stay_inside_the_session_quota():
    # A CPU server computes CUDA-only kernels itself (server/StandIns.cpp); what they allocate
    # is charged like any kernel's output, and a bad argument is the kernel's own error.
    server = Server("--session-memory", "64MiB")
    try:
        beside = train_beside(server.address, 100)
        r = run_client(server.address, textwrap.dedent("""
            import torch, rgpu
            x = torch.randint(0, 4, (64,), dtype=torch.int32).to("rgpu")
            for bins in (1 << 28, 0, 4):  # 2 GiB of counts, none, four
                try:
                    print(torch.histc(x, bins=bins, min=0, max=3).sum().item())
                except (rgpu.RemoteError, RuntimeError) as e:
                    print("refused:", str(e).splitlines()[0])
        """) + TRAIN.format(steps=10))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("refused: aten::histc failed on the server"), lines
        assert "memory quota of 64 MiB" in lines[0], lines
        assert lines[1].startswith("refused:") and "bins must be > 0" in lines[1], lines
        assert lines[2:] == ["64", "True"], lines  # the session goes on, and trains
        out, err = beside.communicate(timeout=120)
        assert beside.returncode == 0 and out.strip() == "True", err
        assert server.alive()
    finally:
        server.stop()


def test_a_session_past_its_handle_limit_gets_a_remote_error_naming_it():
    # Each tensor a session holds on the server is a handle: at most --max-handles of them.
    server = Server("--max-handles", "1000")
    try:
        r = run_client(server.address, textwrap.dedent("""
            import torch, rgpu
            kept = [torch.ones(1, device="rgpu") * k for k in range(1200)]
            try:
                print(sum(t.item() for t in kept))
            except rgpu.RemoteError as e:
                print("refused:", e)
            del kept
            rgpu.synchronize()  # the releases go (a frame binds its outputs before it releases)
            print(torch.arange(4, device="rgpu").sum().item())
            print(rgpu.server_stats()["session"]["tensors"] < 1000)
        """))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("refused:"), lines
        assert "1000 tensor handles, the most a session may (--max-handles)" in lines[0], lines
        assert lines[1:] == ["6", "True"], lines
    finally:
        server.stop()
