"""Who gets a session: the owner over the Unix socket, holders of the token over TCP, nobody
else; and what an unauthenticated flood costs the server."""

import os
import resource
import select
import socket
import stat
import struct
import subprocess
import sys
import time

import pytest

from conftest import Server, run_client, wait_for_log
from relay import Relay

TINY = "import torch, rgpu\nprint(torch.arange(4., device='rgpu').pow(2).sum().item())"


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return -1


def test_the_default_unix_socket_needs_no_flags_and_no_token(tmp_path):
    server = Server(socket="default")
    try:
        assert server.address == "unix:" + os.path.join(os.environ["XDG_RUNTIME_DIR"], "rgpu",
                                                        "opserver.sock")
        sock_dir = os.path.dirname(server.address[5:])
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700
        # No RGPU_OPSERVER and no token anywhere: the client finds the socket by itself.
        env = {k: v for k, v in os.environ.items() if k != "RGPU_OPSERVER"}
        env["XDG_CONFIG_HOME"] = str(tmp_path / "no-config")
        r = subprocess.run([sys.executable, "-c", TINY], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "14.0", r.stderr
        # A second server cannot take over a live socket.
        second = subprocess.run([os.path.join(os.path.dirname(sys.executable), "rgpu-opserver"),
                                 "--device", "cpu", "--compiler", "plan"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "another rgpu-opserver is listening" in second.stderr
    finally:
        server.stop()


def test_tcp_needs_the_token_and_says_which_one_it_used(tmp_path):
    server = Server()  # TCP: its token is in this run's XDG_CONFIG_HOME, where clients look
    try:
        token_file = os.path.join(os.environ["XDG_CONFIG_HOME"], "rgpu", "token")
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        deadline = time.time() + 10  # the log line may follow the "listening" one
        while not any(token_file in line and "fingerprint" in line for line in server.log):
            assert time.time() < deadline, server.log
            time.sleep(0.05)
        token = open(token_file).read().strip()

        r = run_client(server.address, TINY)  # the default token file
        assert r.returncode == 0 and r.stdout.strip() == "14.0", r.stderr
        r = run_client(server.address, TINY, env={"RGPU_TOKEN": token,
                                                  "XDG_CONFIG_HOME": str(tmp_path)})
        assert r.returncode == 0 and r.stdout.strip() == "14.0", r.stderr

        r = run_client(server.address, TINY, env={"XDG_CONFIG_HOME": str(tmp_path)})
        assert r.returncode != 0 and "rgpu.AuthenticationError" in r.stderr
        assert "needs a token" in r.stderr and "RGPU_TOKEN" in r.stderr, r.stderr

        r = run_client(server.address, TINY, env={"RGPU_TOKEN": "not-the-token-at-all"})
        assert r.returncode != 0 and "rgpu.AuthenticationError" in r.stderr
        assert "not this server's" in r.stderr and "the client used RGPU_TOKEN" in r.stderr
        assert "fingerprint" in r.stderr, r.stderr

        other = tmp_path / "token"
        other.write_text("another-token-of-32-characters!!\n")
        other.chmod(0o644)
        r = run_client(server.address, TINY, env={"RGPU_TOKEN_FILE": str(other)})
        assert r.returncode != 0 and "can be read by other users" in r.stderr, r.stderr
        other.chmod(0o600)
        r = run_client(server.address, TINY, env={"RGPU_TOKEN_FILE": str(other)})
        assert r.returncode != 0 and f"RGPU_TOKEN_FILE={other}" in r.stderr, r.stderr
        assert server.alive()
    finally:
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_on_the_unix_socket_is_refused(tmp_path):
    path = tmp_path / "sock" / "opserver.sock"
    server = Server(socket=str(path))
    try:
        # Open the way a careless admin might; the uid check still holds.
        os.chmod(tmp_path, 0o755)
        os.chmod(path.parent, 0o755)
        os.chmod(path, 0o777)
        cache = tmp_path / "cache"
        cache.mkdir()
        os.chown(cache, 65534, 65534)

        def as_nobody():
            os.setgid(65534)
            os.setuid(65534)

        try:
            r = subprocess.run([sys.executable, "-c", TINY], preexec_fn=as_nobody,
                               env=dict(os.environ, RGPU_OPSERVER=server.address,
                                        HOME=str(cache), RGPU_CACHE_DIR=str(cache)),
                               capture_output=True, text=True, timeout=120)
        except PermissionError:
            pytest.skip("this Python cannot be run by uid 65534")
        assert r.returncode != 0 and "rgpu.AuthenticationError" in r.stderr, r.stderr
        assert "serves only its own user" in r.stderr and "uid 65534" in r.stderr, r.stderr
        r = run_client(server.address, TINY)
        assert r.returncode == 0 and r.stdout.strip() == "14.0", r.stderr
    finally:
        server.stop()


def test_a_large_header_before_authentication_is_refused_at_once():
    server = Server()
    try:
        before = rss_mib(server.proc.pid)
        peer = socket.create_connection(("127.0.0.1", server.port))
        peer.settimeout(10)
        header = b"RGPU" + (0).to_bytes(4, "little") + (1 << 30).to_bytes(8, "little")
        peer.sendall(header)
        start = time.time()
        while peer.recv(4096):  # the challenge, then the close
            pass
        assert time.time() - start < 2
        assert rss_mib(server.proc.pid) - before < 16
        wait_for_log(server, "before its Hello was accepted", timeout=10)
    finally:
        server.stop()


def test_two_thousand_idle_connections_cost_little_and_time_out():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2200:
        pytest.skip("needs 2200 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2200), hard))
    server = Server("--hello-timeout", "4")
    idle = []
    try:
        before = rss_mib(server.proc.pid)
        # In bursts of 200, each accepted (its challenge arrives) before the next: a burst the
        # kernel's accept queue cannot hold leaves connections the server never sees, which
        # would linger here until the kernel gives up on them, not by the server's doing.
        for _ in range(10):
            burst = []
            for _ in range(200):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", server.port))
                burst.append(s)
            idle += burst
            poll = select.poll()
            for s in burst:
                poll.register(s, select.POLLIN)
            heard, deadline = set(), time.time() + 10
            while len(heard) < len(burst) and time.time() < deadline:
                heard.update(fd for fd, _ in poll.poll(200))
            assert len(heard) == len(burst), f"{len(burst) - len(heard)} never accepted"
        # A real client beside them is served before the hello timeout, which is what it would
        # wait if it queued behind the idle ones (timed inside the client, whose torch import
        # is not the server's doing).
        r = run_client(server.address,
                       "import time, torch, rgpu\nt = time.time()\n"
                       "v = torch.arange(4., device='rgpu').pow(2).sum().item()\n"
                       "print(v, time.time() - t)")
        assert r.returncode == 0, r.stderr
        value, seconds = r.stdout.split()
        assert value == "14.0" and float(seconds) < 4.0, r.stdout
        grown = rss_mib(server.proc.pid) - before
        print(f"server RSS grew {grown:.1f} MiB with 2000 idle connections")
        assert grown < 64
        # Every idle one is closed: by the timeout, or earlier to stay within --max-pending.
        deadline = time.time() + 15
        open_ = set(idle)
        while open_ and time.time() < deadline:
            for s in list(open_):
                try:
                    while True:
                        if not s.recv(65536):
                            open_.discard(s)
                            break
                except BlockingIOError:
                    pass
                except OSError:
                    open_.discard(s)
            time.sleep(0.2)
        assert not open_, f"{len(open_)} idle connections still open"
        assert server.alive()
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_twenty_thousand_connections_that_say_almost_nothing_leave_a_tcp_server_serving():
    # Connect, send 8 bytes, close, 20,000 times, at the TCP port (FaultTest does it at the
    # Unix socket, and at the rendezvous store's port): a client training beside is served
    # throughout.
    from test_limits import train_beside

    server = Server()
    try:
        beside = train_beside(server.address, 100)
        made = 0
        for _ in range(20000):
            s = socket.socket()
            # Closed with a reset: 20,000 closes would otherwise leave as many of this
            # machine's ports in TIME_WAIT, slowing every connect.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            try:
                s.connect(("127.0.0.1", server.port))
                s.send(b"RGPU\0\0\0\0")
                made += 1
            except OSError:
                pass  # the listen backlog was full for a moment
            s.close()
        assert made > 18000, made
        out, err = beside.communicate(timeout=120)
        assert beside.returncode == 0 and out.strip() == "True", err
        assert server.alive()
    finally:
        server.stop()


def test_rgpu_run_host_reaches_the_servers_own_socket(tmp_path):
    """rgpu-run --host end to end, with an ssh stand-in on PATH that runs the remote command
    locally and forwards the local socket to the remote one, as `ssh -L a.sock:b.sock` does."""
    server = Server(socket="default")
    fake = tmp_path / "ssh"
    fake.write_text(f"#!{sys.executable}\n" + r'''
import os, socket, sys, threading
args, i, forward = sys.argv[1:], 0, None
rest = []
while i < len(args):
    if args[i] in ("-o", "-p", "-i"):
        i += 2
        continue
    if args[i] == "-L":
        forward = args[i + 1].split(":")
        i += 2
        continue
    if args[i] == "-N":
        i += 1
        continue
    rest.append(args[i])
    i += 1
if forward is None:
    os.execvp("sh", ["sh", "-c", " ".join(rest[1:])])
local, remote = forward
listener = socket.socket(socket.AF_UNIX)
listener.bind(local)
listener.listen()
def pipe(a, b):
    while data := a.recv(65536):
        b.sendall(data)
    b.shutdown(socket.SHUT_WR)
while True:
    c, _ = listener.accept()
    r = socket.socket(socket.AF_UNIX)
    r.connect(remote)
    threading.Thread(target=pipe, args=(c, r), daemon=True).start()
    threading.Thread(target=pipe, args=(r, c), daemon=True).start()
''')
    fake.chmod(0o755)
    try:
        env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
        env.pop("XDG_CONFIG_HOME")  # no token on this side: none is needed
        r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "rgpu-run"),
                            "--host", "me@gpu-host", "--", sys.executable, "-c",
                            "import os; print(os.environ['RGPU_OPSERVER'])\n" + TINY],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        where, value = r.stdout.split()
        assert where.startswith("unix:") and value == "14.0"
        assert not os.path.exists(where[5:])  # the tunnel's socket is gone with it
    finally:
        server.stop()


class Mangler(Relay):
    """A TCP relay that reads the client's sealed stream record by record (past the plaintext
    Hello frame and the stream's 24-byte header) and does `how` to record `at` once: "flip" a
    bit in it, "replay" it (sends it twice) or "swap" it with the record after it. With `how`
    None it only keeps what it forwards, both ways, in `seen`."""

    def __init__(self, target, how=None, at=3):
        self.how, self.at = how, at
        self.seen = []
        self.done = False
        super().__init__(target)

    def _units(self, buf, state):
        """Splits off the complete units at the front of `buf`: the Hello frame, the stream
        header, then records; returns them."""
        out = []
        while True:
            stage = state.setdefault("stage", 0)
            if stage == 0:  # the Hello frame: 16-byte header, then its payload
                if len(buf) < 16:
                    break
                size = 16 + int.from_bytes(buf[8:16], "little")
            elif stage == 1:
                size = 24
            else:
                if len(buf) < 4:
                    break
                size = 4 + int.from_bytes(buf[:4], "little")
            if len(buf) < size:
                break
            out.append((stage, bytes(buf[:size])))
            del buf[:size]
            state["stage"] = min(stage + 1, 2)
        return out

    def rewrite(self, direction, data, state):
        self.seen.append(data)
        if direction != "up" or not self.how:
            return data
        buf = state.setdefault("buf", bytearray())
        buf += data
        out = b""
        for stage, unit in self._units(buf, state):
            if stage == 2:
                state["records"] = state.get("records", 0) + 1
                if state["records"] == self.at and not self.done:
                    if self.how == "flip":
                        unit = unit[:-1] + bytes([unit[-1] ^ 1])
                        self.done = True
                    elif self.how == "replay":
                        unit = unit + unit
                        self.done = True
                    else:  # swap: held until the record after it has gone
                        state["held"] = unit
                        continue
                elif state.get("held") is not None:
                    unit, state["held"] = unit + state["held"], None
                    self.done = True
            out += unit
        return out


@pytest.mark.parametrize("how", ["flip", "replay", "swap"])
def test_frames_after_the_hello_are_sealed_and_a_tampered_one_ends_the_connection(how):
    # Over TCP everything after the Hello is sealed under keys of that Hello: a record changed,
    # replayed or reordered on the way does not open, the server says so and ends that
    # connection, and the client's session resumes on a new one (new keys), computing right.
    server = Server()
    try:
        mangler = Mangler(("127.0.0.1", server.port), how)
        # A 3 MiB upload goes as several records in a row (at most 1 MiB each): record 3 is
        # one of them, so a swap never waits for a record that is not coming.
        code = ("import torch, rgpu\n"
                "torch.manual_seed(0)\n"
                "x = torch.randn(768 * 1024)\n"
                "total = 0.0\n"
                "for k in range(3):\n"
                "    total += ((x + k).to('rgpu') * 1.5).sum().item()\n"
                "want = sum(((x + k) * 1.5).sum().item() for k in range(3))\n"
                "print(total == want, rgpu.server_stats()['resumes'])\n")
        # Uploads named by their digest would first ask the server which it holds, alone, in
        # one record that a swap would hold back for good: here every upload sends its bytes.
        r = run_client(mangler.address, code, env={"RGPU_UPLOAD_STORE": "0"}, timeout=120)
        assert r.returncode == 0, r.stderr
        assert mangler.done
        same, resumes = r.stdout.split()
        assert same == "True" and int(resumes) >= 1, r.stdout
        wait_for_log(server, "does not open")
        assert any("does not open: it was tampered with, replayed, reordered" in line
                   or "no peer seals" in line for line in server.log), server.log
    finally:
        server.stop()


def test_a_sealed_session_carries_no_plaintext_after_its_hello():
    # What a passive observer of the link sees after the Hello: no frame magic, no tensor bytes.
    server = Server()
    try:
        relay = Mangler(("127.0.0.1", server.port))  # only watches
        marker = 0x5A17C0DE
        code = ("import torch, rgpu\n"
                f"x = torch.full((1024,), {marker}, dtype=torch.int64).to('rgpu')\n"
                "print(int((x + 1).sum().item()))\n")
        r = run_client(relay.address, code, timeout=120)
        assert r.returncode == 0, r.stderr
        assert int(r.stdout) == (marker + 1) * 1024
        stream = b"".join(relay.seen)
        assert marker.to_bytes(8, "little") * 4 not in stream
        assert stream.count(b"RGPU") <= 3, stream.count(b"RGPU")  # challenge, Hello, its reply
    finally:
        server.stop()


def test_each_token_in_the_tokens_dir_is_a_principal_who_sees_only_its_own_sessions(tmp_path):
    # alice and bob hold tokens of their own; the default token file is a third principal.
    tokens = tmp_path / "tokens"
    tokens.mkdir(mode=0o700)
    for name in ("alice", "bob"):
        path = tokens / name
        path.write_text(os.urandom(32).hex() + "\n")
        path.chmod(0o600)
    server = Server("--tokens-dir", str(tokens))
    try:
        wait_for_log(server, "2 more principal(s) from")
        hold = ("import sys, time, torch, rgpu\n"
                "x = torch.ones(4 << 20, device='rgpu')\n"  # 16 MiB
                "print(x.sum().item(), flush=True)\n"
                "sys.stdin.readline()\n")
        env = dict(os.environ, RGPU_OPSERVER=server.address,
                   RGPU_TOKEN_FILE=str(tokens / "bob"))
        bob = subprocess.Popen([sys.executable, "-c", hold], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert bob.stdout.readline().strip() == str(float(4 << 20)), bob.stderr.read()
            look = ("import torch, rgpu\n"
                    "torch.rgpu.reset_peak_memory_stats()\n"
                    "y = torch.ones(1024, device='rgpu')\n"
                    "y.sum().item()\n"
                    "stats = rgpu.server_stats()\n"
                    "print(max(stats['session_memories']), torch.rgpu.max_memory_allocated())\n")
            r = run_client(server.address, look, env={"RGPU_TOKEN_FILE": str(tokens / "alice")})
            assert r.returncode == 0, r.stderr
            biggest, peak = map(int, r.stdout.split())
            assert biggest < 1 << 20 and peak < 1 << 20, r.stdout  # not bob's 16 MiB
            r = run_client(server.address, look)  # the default token: neither of them
            assert r.returncode == 0, r.stderr
            assert int(r.stdout.split()[0]) < 1 << 20, r.stdout
        finally:
            bob.communicate("\n", timeout=60)
        assert bob.returncode == 0
        # A token file others can read is refused at start, naming it.
        (tokens / "carol").write_text(os.urandom(32).hex())
        (tokens / "carol").chmod(0o644)
        started = subprocess.run([os.path.join(os.path.dirname(sys.executable), "rgpu-opserver"),
                                  "--device", "cpu", "--compiler", "plan", "--port", "0",
                                  "--tokens-dir", str(tokens)],
                                 capture_output=True, text=True, timeout=60)
        assert started.returncode != 0 and "carol" in started.stderr, started.stderr
    finally:
        server.stop()
