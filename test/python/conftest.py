"""Every Python test talks to a real rgpu-opserver, started here: on 127.0.0.1 on a free port
(with the token the server creates in this run's own config directory), or on a Unix socket."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Tests keep their traced graphs out of the user's cache (set before any test imports rgpu).
os.environ.setdefault("RGPU_CACHE_DIR", tempfile.mkdtemp(prefix="rgpu-test-graphs-"))
# The servers' token and default socket live in this run's directories, never the user's: TCP
# servers create the token there and clients find it there, as on a real host.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="rgpu-test-config-")
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="rgpu-test-run-")
# Inductor servers share one cache of Inductor's kernels for the whole run (--kernel-cache), as
# servers on one machine can: a graph one test compiled costs the next no kernel build. Each
# server keeps its own --cache-dir, so rgpu's packages are never shared between tests.
KERNEL_CACHE = os.environ.setdefault("RGPU_TEST_KERNEL_CACHE",
                                     tempfile.mkdtemp(prefix="rgpu-test-kernels-"))
# Clients and servers sleep at once while they wait instead of polling for a millisecond
# first: two tests at a time on two cores, a poll would take the core the awaited work needs.
# (test_server_cli.py polls on purpose, with --spin-us.)
os.environ["RGPU_SPIN_US"] = "0"
for _name in ("RGPU_TOKEN", "RGPU_TOKEN_FILE", "RGPU_OPSERVER"):
    os.environ.pop(_name, None)
# A run started in the background of a shell without job control ignores SIGINT, and so would
# every client the tests start (Python keeps an ignored SIGINT ignored): the tests of Ctrl-C
# need the clients to take it as a terminal's Ctrl-C is taken.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def opserver_path():
    found = shutil.which("rgpu-opserver", path=os.path.dirname(sys.executable))
    return found or os.path.join(REPO, "python", "rgpu", "bin", "rgpu-opserver")


class Server:
    """A running rgpu-opserver; `address` is host:port, or unix:PATH when started with
    `socket=PATH` (then it has no TCP listener unless args ask for one); `socket="default"`
    starts it with neither --socket nor --port, on its default socket."""

    def __init__(self, *args, socket=None, env=None, preexec_fn=None):
        # Tests pick the plan executor unless they test compiling: background Inductor compiles
        # would compete for this machine's cores with every other test.
        if "--compiler" not in args:
            args = ("--compiler", "plan", *args)
        if "--spin-us" not in args:
            args = (*args, "--spin-us", "0")
        if "inductor" in args and "--kernel-cache" not in args:
            args = (*args, "--kernel-cache", KERNEL_CACHE)
        if "--device" not in args and "--devices" not in args:
            args = ("--device", "cpu", *args)
        where = [] if socket == "default" else ["--socket", socket] if socket else ["--port", "0"]
        self.proc = subprocess.Popen(
            [opserver_path(), *where, *args],
            env=dict(os.environ, **(env or {})),
            preexec_fn=preexec_fn,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.log = []
        deadline = time.time() + 30
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"listening on ([\d.]+):(\d+)", line)
            u = re.search(r"listening on unix:(\S+?),", line)
            if m or u:
                self.address = f"{m.group(1)}:{m.group(2)}" if m else f"unix:{u.group(1)}"
                self.port = int(m.group(2)) if m else None
                # Keep reading its log: a full pipe would block the server's next log line.
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.proc.kill()
        raise RuntimeError("rgpu-opserver did not start:\n" + "".join(self.log))

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.alive():
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="session", autouse=True)
def server():
    s = Server()
    import rgpu

    rgpu.set_server(s.address)
    yield s
    s.stop()


@pytest.fixture
def fresh_server():
    s = Server()
    yield s
    s.stop()


def wait_for_log(server, text, timeout=60):
    """Waits until the server's log, read by another thread, has a line containing `text`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(text in line for line in server.log):
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the server log:\n" + "".join(server.log))


def run_client(address, code, env=None, timeout=120):
    """Runs `code` in a new Python process (its own rgpu session) against `address`."""
    full_env = dict(os.environ, RGPU_OPSERVER=address, **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def package_copy(tmp_path, build_py):
    """A copy of the rgpu package in tmp_path (links to its files) whose _build.py, where
    rgpu records the torch it was built against, is `build_py` (None: absent). Put tmp_path
    first on PYTHONPATH to import it."""
    package = os.path.join(REPO, "python", "rgpu")
    copy = os.path.join(str(tmp_path), "rgpu")
    os.mkdir(copy)
    for name in os.listdir(package):
        if name not in ("_build.py", "__pycache__"):
            os.symlink(os.path.realpath(os.path.join(package, name)), os.path.join(copy, name))
    if build_py is not None:
        with open(os.path.join(copy, "_build.py"), "w") as f:
            f.write(build_py)


def same(actual, expected, rtol=1e-5, atol=1e-6):
    """Asserts an rgpu result equals the CPU one: values, dtype, shape."""
    if isinstance(actual, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            same(a, e, rtol, atol)
        return
    if isinstance(actual, torch.Tensor):
        assert actual.device.type == "rgpu", actual.device
        actual = actual.cpu()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def train_losses(model, optimizer, loss_at, steps, scheduler=None):
    """Trains `model` where its parameters live; `loss_at(model, step, device)` gives a step's
    loss. Returns the losses, read with .item() each step."""
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        loss = loss_at(model, step, device)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses
