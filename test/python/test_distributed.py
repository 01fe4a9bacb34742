"""torch.distributed on rgpu: the c10d backend "rgpu", whose collectives run on the servers.

Each rank is a client process of its own, started as torchrun starts them (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), against its own rgpu-opserver or, two sessions, the same one."""

import json
import os
import socket
import statistics
import subprocess
import sys
import time

import pytest
import torch
from conftest import Server, run_client

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")

COLLECTIVES = """
import json, torch, torch.distributed as dist, rgpu
dist.init_process_group("rgpu")
rank, size = dist.get_rank(), dist.get_world_size()
out = {}
t = torch.arange(4, dtype=torch.float32, device="rgpu") + 10 * rank
dist.all_reduce(t)
out["all_reduce"] = t.cpu().tolist()
m = torch.full((3,), float(rank + 1), device="rgpu")
dist.all_reduce(m, op=dist.ReduceOp.MAX)
out["max"] = m.cpu().tolist()
b = torch.full((2, 2), float(rank), device="rgpu")
dist.broadcast(b, src=1)
out["broadcast"] = b.cpu().tolist()
g = torch.empty(size * 2, device="rgpu")
dist.all_gather_into_tensor(g, torch.tensor([rank, rank + 0.5], device="rgpu"))
out["all_gather_into_tensor"] = g.cpu().tolist()
r = torch.empty(2, device="rgpu")
dist.reduce_scatter_tensor(r, torch.arange(size * 2, dtype=torch.float32, device="rgpu") * (rank + 1))
out["reduce_scatter_tensor"] = r.cpu().tolist()
parts = [torch.empty(3, device="rgpu") for _ in range(size)]
dist.all_gather(parts, torch.full((3,), float(rank), device="rgpu"))
out["all_gather"] = [p.cpu().tolist() for p in parts]
c = torch.ones(2) * (rank + 1)
dist.all_reduce(c)
out["cpu_tensor"] = c.tolist()
base = torch.arange(12, dtype=torch.float32, device="rgpu").view(3, 4) * (rank + 1)
dist.all_reduce(base.t()[1:3, ::2])  # in place into a non-contiguous view of a view
out["view"] = base.cpu().tolist()
a = torch.full((2,), float(rank + 1), device="rgpu")
try:
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    out["avg"] = a.cpu().tolist()
except Exception as e:
    out["avg"] = type(e).__name__
dist.barrier()
s = rgpu.stats()
out["uploads"], out["downloads"] = s["uploads"], s["downloads"]
print(json.dumps(out))
dist.destroy_process_group()
"""

DDP = """
import json, os, sys, time, torch, torch.distributed as dist, rgpu
sys.path.insert(0, EXAMPLES)
from models import TinyGPT, gpt_batch
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("rgpu")
rank, size = dist.get_rank(), dist.get_world_size()
if torch.rgpu.device_count() > 1:  # ranks sharing a server of several devices: one each
    torch.rgpu.set_device(int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)
model = DDP(TinyGPT(**SIZE).to("rgpu"), bucket_cap_mb=0.01)  # several buckets
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses, counts = [], []
for step in range(STEPS):
    idx, tgt = gpt_batch(step, batch=8)
    idx, tgt = idx[rank::size], tgt[rank::size]  # this rank's half of the global batch
    before = rgpu.stats()
    opt.zero_grad()
    if step % 5 == 4:
        with model.no_sync():  # accumulate locally, then a synced step on the same batch
            model(idx.to("rgpu"), tgt.to("rgpu")).backward()
    loss = model(idx.to("rgpu"), tgt.to("rgpu"))
    loss.backward()
    opt.step()
    losses.append(loss.item())
    after = rgpu.stats()
    counts.append({k: after[k] - before[k] for k in ("waits", "messages", "bytes_out", "bytes_in")})
params = [p.detach().cpu().tolist() for p in model.module.parameters()]
devices = sorted({str(p.device) for p in model.module.parameters()})
out = json.dumps({"losses": losses, "counts": counts, "params": params, "devices": devices})
if os.environ.get("RANKS_OUT"):  # torchrun's ranks share one stdout: a file each
    with open(os.path.join(os.environ["RANKS_OUT"], f"rank{rank}.json"), "w") as f:
        f.write(out)
else:
    print(out)
dist.destroy_process_group()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(code, addresses, timeout=300):
    """Runs `code` as len(addresses) ranks, rank k against the server at addresses[k] (named
    as torchrun users do: RGPU_OPSERVER lists the servers, LOCAL_RANK picks one); returns each
    rank's last stdout line, parsed."""
    port = free_port()
    procs = []
    for rank, address in enumerate(addresses):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(len(addresses)), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RGPU_OPSERVER=",".join(addresses))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.fixture
def two_servers():
    servers = [Server(), Server()]
    yield servers
    for s in servers:
        s.stop()


def test_collectives_across_two_servers_match_their_definitions(two_servers):
    a, b = run_ranks(COLLECTIVES, [s.address for s in two_servers])
    for rank, out in enumerate((a, b)):
        assert out["all_reduce"] == [10.0, 12.0, 14.0, 16.0]
        assert out["max"] == [2.0] * 3
        assert out["broadcast"] == [[1.0, 1.0], [1.0, 1.0]]
        assert out["all_gather_into_tensor"] == [0.0, 0.5, 1.0, 1.5]
        # sum over ranks of arange(4) * (rank + 1) = arange(4) * 3, scattered in halves
        assert out["reduce_scatter_tensor"] == [[0.0, 3.0], [6.0, 9.0]][rank]
        assert out["all_gather"] == [[0.0] * 3, [1.0] * 3]
        assert out["cpu_tensor"] == [3.0, 3.0]
        want = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
        want.t()[1:3, ::2] *= 3 / (rank + 1)  # the view now holds the sum over both ranks
        assert out["view"] == want.tolist()
        assert out["avg"] == [1.5, 1.5], out["avg"]  # the mean, not the sum


def ddp_runs(addresses, steps=20, size=None):
    code = (DDP.replace("EXAMPLES", repr(EXAMPLES)).replace("STEPS", str(steps))
            .replace("SIZE", repr(size or {})))
    return run_ranks(code, addresses)


def single_process_reference(steps=20):
    """The same training on CPU in one process, on the global batch (what DDP must equal)."""
    sys.path.insert(0, EXAMPLES)
    from models import TinyGPT, gpt_batch

    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        idx, tgt = gpt_batch(step, batch=8)
        halves = [(idx[r::2], tgt[r::2]) for r in range(2)]
        opt.zero_grad()
        if step % 5 == 4:  # the no_sync pass: each rank keeps its own half's gradient, and
            # the next synced backward averages the ranks' accumulated gradients
            (sum(model(i, t) for i, t in halves) / 2).backward()
        # DDP averages the ranks' gradients: the mean of the two halves' losses.
        per_rank = [model(i, t) for i, t in halves]
        (sum(per_rank) / 2).backward()
        opt.step()
        losses.append([v.item() for v in per_rank])
    return losses, [p.detach() for p in model.parameters()]


def check_ddp(outs, steps=20):
    losses, params = single_process_reference(steps)
    for rank, out in enumerate(outs):
        got = torch.tensor(out["losses"])
        want = torch.tensor([l[rank] for l in losses])
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (rank, got, want)
        # Parameters after 20 AdamW steps: the steps are normalized, so a gradient's last-bit
        # rounding (a matmul that MKL splits differently when the machine is busy) can move a
        # parameter with a tiny gradient by far more than the gradient differs. Bit-equal in
        # a quiet run; a gradient that skips an all-reduce moves parameters by ~lr (1e-2).
        for p, q in zip(out["params"], params):
            diff = (torch.tensor(p) - q).abs().max().item()
            assert torch.allclose(torch.tensor(p), q, rtol=1e-4, atol=1e-4), (rank, diff)
        steady = out["counts"][6:]
        # At most the wait at .item(), and none when the loss's reply is in by then: the
        # forward, which computes it, is sent when the backward starts (a second time in the
        # steps that accumulate a no_sync backward first), and the rest at the optimizer step.
        assert all(c["waits"] <= 1 for c in steady), out["counts"]
        assert all(c["messages"] <= 3 for c in steady), out["counts"]
    return outs


def test_ddp_on_two_servers_matches_one_process_on_the_global_batch(two_servers):
    outs = check_ddp(ddp_runs([s.address for s in two_servers]))
    # What crosses a client per step does not grow with the model: no gradients.
    for out in outs:
        steady = [c for k, c in enumerate(out["counts"]) if k >= 6 and k % 5 != 4]
        assert max(c["bytes_out"] for c in steady) < 4096, out["counts"]
        assert max(c["bytes_in"] for c in steady) < 1024, out["counts"]


def test_what_crosses_a_client_in_a_ddp_step_does_not_grow_with_the_model(two_servers):
    addresses = [s.address for s in two_servers]
    small = ddp_runs(addresses, steps=12)
    large = ddp_runs(addresses, steps=12, size={"dim": 128})  # 14x the parameters, as many
    for a, b in zip(small, large):  # once every graph has shipped (the no_sync one at step 4)
        for key in ("bytes_out", "bytes_in"):
            steady = [statistics.median(c[key] for c in out["counts"][5:]) for out in (a, b)]
            # Packed frames vary by a few bytes with the values they carry (handles, scalars);
            # 14x the parameters would add kilobytes if anything grew with them.
            assert abs(steady[0] - steady[1]) <= 32, (key, a["counts"], b["counts"])


def test_ddp_with_two_ranks_on_one_server(fresh_server):
    check_ddp(ddp_runs([fresh_server.address] * 2))


@pytest.fixture
def two_devices():
    """A server of two devices, rgpu:0 and rgpu:1, for ranks that share it."""
    server = Server("--devices", "cpu,cpu")
    yield server
    server.stop()


def test_torchrun_under_rgpu_run_spreads_ranks_over_one_servers_devices(tmp_path, two_devices):
    """The README's recipe: rgpu-run points the job at one server, torchrun starts the ranks,
    and each rank takes the device of its local rank."""
    script = tmp_path / "train.py"
    script.write_text(DDP.replace("EXAMPLES", repr(EXAMPLES)).replace("STEPS", "6")
                      .replace("SIZE", "{}"))
    bin_dir = os.path.dirname(sys.executable)
    r = subprocess.run([os.path.join(bin_dir, "rgpu-run"), "--server", two_devices.address, "--",
                        os.path.join(bin_dir, "torchrun"), "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(script)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, RANKS_OUT=str(tmp_path)))
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert sorted(out["devices"] for out in outs) == [["rgpu:0"], ["rgpu:1"]]
    losses, _ = single_process_reference(6)
    for out in outs:
        rank = int(out["devices"][0][-1])  # one node: the local rank is the rank
        assert torch.allclose(torch.tensor(out["losses"]), torch.tensor([l[rank] for l in losses]),
                              rtol=1e-5, atol=1e-6)


def test_a_backend_per_device_type_takes_rgpu_for_rgpu_tensors(two_devices):
    code = """
import json, torch, torch.distributed as dist, rgpu
dist.init_process_group("cpu:gloo,rgpu:rgpu")
rank = dist.get_rank()
torch.rgpu.set_device(rank)
t = torch.ones(3, device="rgpu") * (rank + 1)
dist.all_reduce(t)
c = torch.ones(2) * (rank + 1)
dist.all_reduce(c)
print(json.dumps({"rgpu": t.cpu().tolist(), "device": str(t.device), "cpu": c.tolist()}))
dist.destroy_process_group()
"""
    outs = run_ranks(code, [two_devices.address] * 2)
    assert outs == [{"rgpu": [3.0] * 3, "device": f"rgpu:{r}", "cpu": [3.0] * 2} for r in (0, 1)]


def test_ddp_with_two_ranks_on_two_devices_of_one_server(two_devices):
    outs = check_ddp(ddp_runs([two_devices.address] * 2))
    assert [out["devices"] for out in outs] == [["rgpu:0"], ["rgpu:1"]]


LONG_RUN = """
import sys, datetime, torch, torch.distributed as dist, rgpu
dist.init_process_group("rgpu", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
w = torch.ones(64, device="rgpu")
for step in range(100000):
    g = w * (rank + 1)
    dist.all_reduce(g)
    w = w - 1e-3 * g
    print(step, w.sum().item(), flush=True)
"""


def test_a_rank_whose_server_dies_makes_every_rank_fail_not_hang(two_servers):
    port = free_port()
    procs = []
    for rank, server in enumerate(two_servers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RGPU_OPSERVER=server.address,
                   RGPU_RECONNECT_SECONDS="2")
        procs.append(subprocess.Popen([sys.executable, "-c", LONG_RUN], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:  # both are training
        for _ in range(3):
            assert p.stdout.readline(), p.stderr.read()
    two_servers[1].stop()
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=120)  # within the group's timeout, never a hang
        assert p.returncode != 0
        # The exception's line ("[rank0]: rgpu.SessionLost: ..."); its message may go on over
        # more lines (Gloo's own errors hold newlines).
        lines = [line.split("]: ", 1)[-1] for line in err.strip().splitlines()]
        errors.append(next((line for line in reversed(lines) if line.startswith("rgpu.")),
                           lines[-1]))
    assert errors[1].startswith("rgpu.SessionLost"), errors
    # The surviving rank's server saw its peer go: Gloo's error, naming the collective.
    assert errors[0].startswith(("rgpu.RemoteError", "rgpu.SessionLost")), errors
    assert "_c10d_functional" in errors[0] or "SessionLost" in errors[0], errors


HOLD_A_GROUP = """
import torch, torch.distributed as dist, rgpu
dist.init_process_group("rgpu", rank=0, world_size=1, init_method="tcp://127.0.0.1:PORT")
print(dist.distributed_c10d._get_default_group()._group, flush=True)
input()
"""


def test_a_session_cannot_use_another_sessions_group(fresh_server):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_GROUP.replace("PORT", str(free_port()))],
                              env=dict(os.environ, RGPU_OPSERVER=fresh_server.address),
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        name = holder.stdout.readline().strip()
        assert name.startswith("rgpu-"), holder.stderr.read()
        # Another session names that group in a graph of its own.
        r = run_client(fresh_server.address, f"""
import torch, rgpu
import torch.distributed._functional_collectives  # the ops' meta kernels, for the client
t = torch.ones(4, device="rgpu")
f = torch.ops._c10d_functional
try:
    f.wait_tensor(f.all_reduce(t, "sum", {name!r})).cpu()
except rgpu.RemoteError as e:
    print("refused:", e)
""")
        assert r.returncode == 0, r.stderr
        assert "refused:" in r.stdout and "which this session has not joined" in r.stdout, r.stdout
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0


MISMATCH = """
import datetime, json, torch, torch.distributed as dist, rgpu
dist.init_process_group("rgpu", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
t = torch.ones(4 if rank == 0 else 8, device="rgpu")
try:
    dist.all_reduce(t)
    t.cpu()
    error = None
except rgpu.RemoteError as e:
    error = str(e)
# The group goes on after the refused collective.
ok = torch.full((2,), float(rank + 1), device="rgpu")
dist.all_reduce(ok)
print(json.dumps({"error": error, "after": ok.cpu().tolist()}))
"""


def test_collectives_that_differ_between_ranks_fail_on_every_rank_and_the_servers_live(two_servers):
    outs = run_ranks(MISMATCH, [s.address for s in two_servers])
    for out in outs:
        assert "Detected mismatch between collectives on ranks" in out["error"], out
        assert out["after"] == [3.0, 3.0]
    assert all(s.alive() for s in two_servers)


GROUP_LIMITS = """
import rgpu
from rgpu import _C
def join(store, prefix, rank, size):
    try:
        return _C.join_group(store, prefix, rank, size, 2000)
    except rgpu.RemoteError as e:
        return "refused: " + str(e)
print(join("", "a", 0, 1))                    # no store hosted yet
address = _C.host_store()
print(join("", "b", 0, 10**6))                # too many ranks
print(join("", "c", 3, 2))                    # a rank outside the group
print(join("", "d" * 1000, 0, 1))             # a key prefix past the bound
print(join("127.0.0.1:99999", "e", 0, 1))     # not an address a HostStore gave
forged = address[:address.index("#") + 1] + "0" * 64
print(join(forged, "f", 0, 1))                 # the store, without its secret
names = [join("", f"g{k}", 0, 1) for k in range(16)]
print(all(n.startswith("rgpu-") for n in names), len(set(names)))
print(join("", "h", 0, 1))                    # a 17th group
"""


def test_a_sessions_groups_are_bounded_and_a_client_beside_trains_on(fresh_server):
    from test_limits import train_beside

    beside = train_beside(fresh_server.address, 100)
    r = run_client(fresh_server.address, GROUP_LIMITS)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "hosts no rendezvous store" in lines[0], lines
    assert "groups have 1 to 4096 ranks" in lines[1] and "rank 3 of a group of 2" in lines[2]
    assert "key prefix of more than 256 bytes" in lines[3], lines
    assert "is not an address a HostStore gave" in lines[4], lines
    assert "the address's secret is not this store's" in lines[5], lines
    assert lines[6] == "True 16", lines
    assert "at most 16 process groups" in lines[7], lines
    out, err = beside.communicate(timeout=120)
    assert beside.returncode == 0 and out.strip() == "True", err
    assert fresh_server.alive()


def listening_addresses(pid):
    """The local addresses of every TCP socket process `pid` listens on, as "a.b.c.d:port"."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    host, port = cols[1].split(":")
                    if table == "tcp":
                        host = ".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0))
                    out.append(f"{host}:{int(port, 16)}")
    return out


def connects(address, timeout=1.0):
    """Whether a TCP connection to "host:port" is made within `timeout` seconds."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except OSError:
        return False


def test_the_store_and_gloo_listen_only_where_the_operator_said(two_servers):
    # With --bind 127.0.0.1 (the tests' servers), the rendezvous store and every Gloo listener
    # a job opens are on 127.0.0.1 too: nothing of the server listens on other interfaces. Once
    # the group is set up, its Gloo listeners take no new connection from anyone, and the
    # group's own go on.
    code = ("import json, sys, torch, torch.distributed as dist, rgpu\n"
            "dist.init_process_group('rgpu')\n"
            "t = torch.ones(2, device='rgpu')\n"
            "dist.all_reduce(t)\n"
            "print(t.tolist(), flush=True)\n"
            "sys.stdin.readline()\n"
            "dist.all_reduce(t)\n"
            "print(json.dumps(t.tolist()))\n")
    port = free_port()
    procs = []
    addresses = [s.address for s in two_servers]
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RGPU_OPSERVER=",".join(addresses))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "[2.0, 2.0]", p.stderr.read()[-3000:]
        for server in two_servers:
            listening = listening_addresses(server.proc.pid)
            assert len(listening) >= 3, listening  # its own port, two Gloo's (and a store)
            assert all(a.startswith("127.0.0.1:") for a in listening), listening
            others = [a for a in listening if a != server.address]
            closed = [a for a in others if not connects(a)]
            assert len(closed) >= 2 and len(others) - len(closed) <= 1, (others, closed)
    finally:
        for p in procs:  # both ranks go on at once: the all-reduce needs them both
            p.stdin.write("\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all(json.loads(out.strip().splitlines()[-1]) == [4.0, 4.0] for out, _ in outs), outs


GLOO_FLOOD = """
import sys, rgpu
from rgpu import _C
print(_C.host_store(), flush=True)
try:
    _C.join_group('', 'flooded', 0, 2, 120000)   # its other rank never comes
except rgpu.RemoteError as e:
    print('refused:', e, flush=True)
"""


def test_a_flood_of_connections_to_a_waiting_gloo_listener_leaves_the_server_serving(tmp_path):
    # While a join waits, its Gloo listener takes connections from anyone, and Gloo keeps each
    # one. A server with 1024 descriptors is flooded through it: before it runs out, the
    # listener stops taking connections (Gloo, failing to accept, would end the process),
    # and the server and a client beside it go on.
    import resource

    def few_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    server = Server("--bind", "127.0.0.1", preexec_fn=few_descriptors)
    joiner = subprocess.Popen([sys.executable, "-c", GLOO_FLOOD], text=True,
                              env=dict(os.environ, RGPU_OPSERVER=server.address),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    held = []
    try:
        store = joiner.stdout.readline().strip().split("#")[0]
        assert store.startswith("127.0.0.1:"), joiner.stderr.read()
        deadline = time.time() + 30
        gloo = []
        while len(gloo) < 1 and time.time() < deadline:
            gloo = [a for a in listening_addresses(server.proc.pid)
                    if a not in (server.address, store)]
            time.sleep(0.1)
        assert gloo, listening_addresses(server.proc.pid)
        host, port = gloo[0].rsplit(":", 1)
        refused = 0
        # The kernel completes connections into the listener's backlog until the server closes
        # it, later on a loaded machine: past 1024 descriptors, keep going until refused.
        for _ in range(6000):
            s = socket.socket()
            s.settimeout(0.3)
            try:
                s.connect((host, int(port)))
                s.sendall(b"RGPU\0\0\0\0")
                held.append(s)  # kept open: each one Gloo accepted holds a descriptor
                refused = 0
            except OSError:
                s.close()
                refused += 1
                if refused >= 5:
                    break
        assert refused >= 5, "the listener never stopped taking connections"
        time.sleep(0.5)
        assert server.alive(), "".join(server.log[-20:])
        assert any("takes no new connections" in line for line in server.log), server.log[-20:]
        r = run_client(server.address, "import torch, rgpu\n"
                                       "print((torch.arange(4., device='rgpu') * 2).tolist())\n")
        assert r.returncode == 0 and r.stdout.strip() == "[0.0, 2.0, 4.0, 6.0]", r.stderr
    finally:
        for s in held:
            s.close()
        joiner.kill()
        joiner.wait()
        server.stop()


def server_threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_joins_wait_off_the_worker_pool_and_end_when_their_client_leaves(fresh_server):
    # Four sessions each join a group of two whose other rank never comes: the joins wait on
    # threads of their own (the server has 4 workers, which they once held for the whole
    # timeout), a fifth of the same principal is refused, a bystander's round trips stay
    # quick, and a join whose client leaves ends with it.
    stuck = ("import sys, rgpu\n"
             "from rgpu import _C\n"
             "_C.host_store()\n"
             "print('joining', flush=True)\n"
             "try:\n"
             "    _C.join_group('', 'never', 0, 2, 60000)\n"
             "except rgpu.RemoteError as e:\n"
             "    print('refused:', e, flush=True)\n")
    env = dict(os.environ, RGPU_OPSERVER=fresh_server.address)
    joiners = [subprocess.Popen([sys.executable, "-c", stuck], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for _ in range(4)]
    try:
        for p in joiners:
            assert p.stdout.readline().strip() == "joining", p.stderr.read()
        time.sleep(1)
        during = server_threads(fresh_server.proc.pid)
        fifth = run_client(fresh_server.address, stuck, timeout=60)
        assert "joins or resumes of this principal are waiting already" in fifth.stdout, (
            fifth.stdout + fifth.stderr)
        quick = ("import time, torch, rgpu\n"
                 "x = torch.ones(3, device='rgpu')\n"
                 "worst = 0\n"
                 "for _ in range(20):\n"
                 "    start = time.monotonic()\n"
                 "    (x * 2).sum().item()\n"
                 "    worst = max(worst, time.monotonic() - start)\n"
                 "print(worst)\n")
        r = run_client(fresh_server.address, quick, timeout=60)
        assert r.returncode == 0, r.stderr
        assert float(r.stdout) < 1.0, r.stdout
    finally:
        for p in joiners:
            p.kill()
            p.wait()
    # Each join's thread (and the Gloo device it made) ends within a second of its client.
    deadline = time.time() + 10
    while server_threads(fresh_server.proc.pid) > during - 4 and time.time() < deadline:
        time.sleep(0.1)
    assert server_threads(fresh_server.proc.pid) <= during - 4, (during,)
    assert fresh_server.alive()
