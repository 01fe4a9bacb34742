"""A dropped connection resumes the session with identical results; a restarted or hung server
is reported as a lost session, quickly; rgpu.reset() starts a new one. Every client runs in its
own process, behind a relay (relay.py) that cuts its connection."""

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

from conftest import REPO, Server, run_client
from relay import Relay

# Trains the small GPT, printing one JSON line per step (at each sync, the losses and random
# draws on the server since the last one, so RNG state is compared too) and finally a digest of
# every parameter.
GPT = textwrap.dedent("""
    import hashlib, json, sys, torch, rgpu
    sys.path.insert(0, {examples!r})
    from models import TinyGPT, gpt_batch, gpt_optimizer
    steps, every = {steps}, {every}
    torch.manual_seed(0)
    model = TinyGPT().to("rgpu")
    opt, sched = gpt_optimizer(model, steps)
    pending = []
    for step in range(steps):
        idx, tgt = gpt_batch(step)
        opt.zero_grad()
        loss = model(idx.to("rgpu"), tgt.to("rgpu"))
        loss.backward()
        opt.step()
        sched.step()
        if every == 0:  # logged as the values arrive, in the replies to later steps
            show = lambda l, r: print(json.dumps([[l.item(), r.tolist()]]), flush=True)
            rgpu.on_ready(show, loss, torch.rand(2, device="rgpu"))
            continue
        pending.append((loss.detach(), torch.rand(2, device="rgpu")))
        if (step + 1) % every == 0:   # one line per step: what this step's sync read, if any
            print(json.dumps([[l.item(), r.tolist()] for l, r in pending]), flush=True)
            pending = []
        else:
            print("[]", flush=True)
    rgpu.flush()
    # Cheap syncs that touch no parameter and no generator, until the test says that all its
    # cuts are done (a cut needs a connection in use to be noticed).
    import select
    while not select.select([sys.stdin], [], [], 0)[0]:
        torch.zeros(1, device="rgpu").sum().item()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    print(json.dumps({{"params": digest.hexdigest(), "reconnects": rgpu.stats()["reconnects"]}}))
""")


def gpt(address, steps, every, relay=None, cuts=0):
    """Runs GPT against `address`; with `relay`, cuts its connection `cuts` times at random
    moments spread over the first 90% of the steps. Returns the per-step values, the final
    line and the client's log."""
    code = GPT.format(examples=os.path.join(REPO, "examples"), steps=steps, every=every)
    proc = subprocess.Popen([sys.executable, "-c", code],
                            env=dict(os.environ, RGPU_OPSERVER=address), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rng = random.Random(7)
    timers, values = [], []
    for i in range(steps):
        values.append(json.loads(proc.stdout.readline()))
        while relay and len(timers) < min(cuts, (i + 1) * cuts // (steps * 9 // 10)):
            timers.append(threading.Timer(rng.uniform(0.0, 0.05), relay.cut_one))
            timers[-1].start()
    for t in timers:
        t.join()
    proc.stdin.write("done\n")
    proc.stdin.flush()
    end = json.loads(proc.stdout.readline())
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    return [v for line in values for v in line], end, err


def test_training_through_fifty_cuts_is_bit_identical(server):
    relay = Relay(("127.0.0.1", server.port))
    try:
        # .item() every step, syncs only every 25 steps, and rgpu.on_ready, which never waits:
        # replies in flight when the connection drops come again or are read again.
        for every in (1, 25, 0):
            calm, calm_end, _ = gpt(server.address, 300, every)
            cut, cut_end, log = gpt(relay.address, 300, every, relay, cuts=50)
            assert cut == calm  # every loss and random draw, bit for bit
            assert cut_end["params"] == calm_end["params"]
            assert relay.cuts == 50
            assert calm_end["reconnects"] == 0 and cut_end["reconnects"] == 50, log
            assert log.count("resumed the session on rgpu-opserver") == 50
            relay.cuts = 0
    finally:
        relay.close()


def test_a_cut_in_the_middle_of_an_upload_and_of_a_download_loses_nothing(server):
    relay = Relay(("127.0.0.1", server.port))
    try:
        # The first 10 MiB up and the first 10 MiB down end in the middle of a 64 MiB tensor.
        relay.cut_after("up", 10 << 20)
        relay.cut_after("down", 10 << 20)
        r = run_client(relay.address, textwrap.dedent("""
            import os, torch, rgpu
            # Bytes no earlier upload had, which the server's upload store cannot supply: they
            # all cross the link, with their digest.
            g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
            cpu = torch.randn(16 << 20, generator=g)            # 64 MiB
            x = cpu.to("rgpu")
            back = (x * 2).cpu()
            print(torch.equal(back, cpu * 2), (x.sum() == cpu.sum()).item(),
                  rgpu.stats()["reconnects"])
        """))
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["True", "True", "2"], r.stdout + r.stderr
        assert relay.cuts == 2
    finally:
        relay.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_server_is_a_lost_session_at_once_and_reset_starts_again():
    port = free_port()
    first = Server("--port", str(port))
    client = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time, torch, rgpu
        x = torch.ones(4, device="rgpu")
        print(x.sum().item(), flush=True)
        sys.stdin.readline()                 # the server is restarted meanwhile
        start = time.time()
        try:
            (x * 2).sum().item()
        except rgpu.SessionLost as e:
            print(time.time() - start, "|", e, flush=True)
        try:
            (x + 1).sum().item()
        except rgpu.SessionLost as e:
            print("still |", e, flush=True)
        rgpu.reset()
        try:
            x + 1
        except rgpu.SessionLost as e:
            print("old |", e, flush=True)
        y = torch.arange(4., device="rgpu")
        print((y * y).sum().item(), flush=True)
    """)], env=dict(os.environ, RGPU_OPSERVER=f"127.0.0.1:{port}"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = None
    try:
        assert client.stdout.readline().strip() == "4.0"
        first.proc.kill()
        first.proc.wait()
        second = Server("--port", str(port))
        client.stdin.write("go\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=60)
        lines = out.splitlines()
        took, message = lines[0].split(" | ")
        assert float(took) < 2.0, lines
        assert "restarted: it is a new server process" in message, message
        assert "Tensors on the server are gone; call rgpu.reset()" in message
        assert lines[1].startswith("still | rgpu session lost")
        assert lines[2] == ("old | this tensor belonged to an rgpu session that was lost; "
                            "rgpu.reset() started a new one, and the tensor's value is gone: "
                            "create it again"), lines
        assert lines[3] == "14.0", out + err
    finally:
        client.kill()
        first.stop()
        if second:
            second.stop()


def test_a_hung_server_is_a_lost_session_after_the_reconnect_budget(fresh_server):
    client = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time, torch, rgpu
        x = torch.ones(4, device="rgpu")
        print(x.sum().item(), flush=True)
        sys.stdin.readline()                 # the server is stopped meanwhile
        y = x * 2                            # traced before the clock starts
        start = time.time()
        try:
            y.sum().item()
        except rgpu.SessionLost as e:
            print(time.time() - start, "|", e, flush=True)
    """)], env=dict(os.environ, RGPU_OPSERVER=fresh_server.address, RGPU_RECONNECT_SECONDS="3"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "4.0"
        os.kill(fresh_server.proc.pid, signal.SIGSTOP)
        client.stdin.write("go\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=30)
        took, message = out.splitlines()[0].split(" | ")
        assert 3.0 <= float(took) <= 5.0, out + err
        assert "could not be reached again within 3 s (RGPU_RECONNECT_SECONDS" in message, message
    finally:
        os.kill(fresh_server.proc.pid, signal.SIGCONT)
        client.kill()


def test_a_session_past_its_grace_is_dropped_and_its_memory_freed():
    server = Server("--session-grace", "2")
    try:
        # One client ends normally (its session goes at once); one is killed holding 64 MiB.
        r = run_client(server.address, "import torch, rgpu\nprint(torch.ones(4, device='rgpu').sum().item())")
        assert r.returncode == 0 and r.stdout.strip() == "4.0", r.stderr
        killed = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import sys, torch, rgpu
            x = torch.ones(16 << 20, device="rgpu")
            print(x.sum().item(), flush=True)
            sys.stdin.readline()
        """)], env=dict(os.environ, RGPU_OPSERVER=server.address),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert killed.stdout.readline().strip() == str(float(16 << 20))
        # The client that samples has imported torch (seconds, longer than the grace on a busy
        # machine) before the other is killed.
        sampler = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import json, sys, time, rgpu
            print("ready", flush=True)
            sys.stdin.readline()
            samples = []
            for _ in range(24):
                s = rgpu.server_stats()
                samples.append([s["sessions_parked"], s["sessions_expired"], s["memory_held"]])
                time.sleep(0.25)
            print(json.dumps(samples))
        """)], env=dict(os.environ, RGPU_OPSERVER=server.address),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert sampler.stdout.readline().strip() == "ready"
        killed.kill()
        killed.wait()
        out, err = sampler.communicate("go\n", timeout=60)
        assert sampler.returncode == 0, err
        samples = json.loads(out)
        parked, expired, held = samples[0]
        assert parked == 1 and expired == 0 and held >= 64 << 20, samples
        parked, expired, held = samples[-1]
        assert parked == 0 and expired == 1 and held < 1 << 20, samples
        assert any("not resumed within 2 s (--session-grace)" in line for line in server.log)
    finally:
        server.stop()
