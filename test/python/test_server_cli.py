"""rgpu-opserver's command line: useful help, clear refusals, non-zero exits."""

import os
import subprocess
import sys

import torch
from conftest import Server, opserver_path, run_client


def run(*args):
    return subprocess.run([opserver_path(), *args], capture_output=True, text=True, timeout=60)


def test_help_explains_every_flag():
    r = run("--help")
    assert r.returncode == 0
    for flag in ("--device", "--port", "--bind", "--compiler", "--max-frame-mib",
                 "--max-tensor-mib", "--compile-timeout", "--refused-ops", "--max-connections",
                 "--memory-limit", "--session-memory", "--graph-memory", "--plan-cache",
                 "--compiled-cache", "--disk-cache", "--compile-queue", "--spin-us"):
        assert flag in r.stdout


def test_the_readme_lists_every_flag_the_help_explains():
    import re

    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", run("--help").stdout, re.M))
    assert len(flags) > 20
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")) as f:
        readme = f.read()
    assert sorted(f for f in flags if f"`{f}" not in readme) == []


def test_a_taken_port_is_an_error(server):
    r = run("--device", "cpu", "--port", str(server.port))
    assert r.returncode != 0
    assert "cannot listen" in r.stderr and r.stderr.startswith("rgpu-opserver:")


def test_an_unusable_device_is_an_error():
    if torch.cuda.is_available():
        return
    r = run("--device", "cuda", "--port", "0")
    assert r.returncode != 0
    assert "no usable CUDA device" in r.stderr


def test_device_lists_that_cannot_be_served_are_errors():
    for devices, says in (("cpu,tpu", "unknown device 'tpu'"), ("cpu,", "unknown device ''"),
                          ("cuda:x", "unknown device 'cuda:x'"),
                          (",".join(["cpu"] * 65), "1 to 64 devices")):
        r = run("--devices", devices, "--port", "0")
        assert r.returncode == 2 and says in r.stderr, (devices, r.stderr)


def test_workers_that_sleep_at_once_and_workers_that_poll_serve_alike():
    # Small and large runs, interleaved, against CPU eager.
    code = """
import torch, rgpu
g = torch.Generator().manual_seed(0)
for n in (4, 100_000, 3, 2_000_000, 5):
    x = torch.randn(n, generator=g)
    for got, want in (((x.to("rgpu") * 2).sum().item(), (x * 2).sum().item()),
                      ((x.to("rgpu") @ x.to("rgpu")).item(), (x @ x).item())):
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (n, got, want)
print("ok")
"""
    for spin in ("0", "1000"):
        server = Server("--spin-us", spin)
        try:
            r = run_client(server.address, code)
            assert r.returncode == 0 and "ok" in r.stdout, r.stderr
        finally:
            server.stop()
    r = run("--spin-us", "soon")
    assert r.returncode == 2 and "--spin-us" in r.stderr, r.stderr


def test_unknown_options_are_errors():
    r = run("--frobnicate")
    assert r.returncode == 2 and "--help" in r.stderr
    r = run("--compile-mode", "fastest")  # torch.compile's modes only
    assert r.returncode == 2 and "max-autotune-no-cudagraphs, not 'fastest'" in r.stderr, r.stderr


def test_docs_list_every_op_the_server_refuses():
    r = run("--refused-ops")
    assert r.returncode == 0, r.stderr
    by_rule = ("mutates its inputs", "returns a non-tensor value", "returns no tensor")
    refused = {line.split(": ", 1)[0] for line in r.stdout.splitlines()
               if not any(rule in line for rule in by_rule)}
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "refused-ops.md")) as f:
        listed = {line.split("`")[1] for line in f if line.startswith("- `")}
    assert refused == listed, (sorted(refused - listed), sorted(listed - refused))
    # Nothing a model needs is among them.
    assert not {"aten::addmm", "aten::convolution", "aten::_softmax", "aten::view_copy",
                "aten::as_strided_copy", "aten::_fused_adam", "aten::gelu"} & refused


def test_a_connection_past_the_limit_is_refused_clearly_and_the_others_go_on():
    server = Server("--max-connections", "1")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch, rgpu\n"
         "x = torch.ones(2, device='rgpu'); print(x.sum().item(), flush=True)\n"
         "sys.stdin.readline()\n"
         "print((x * 3).sum().item(), flush=True)\n"],
        env=dict(os.environ, RGPU_OPSERVER=server.address), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "2.0"
        r = run_client(server.address, "import torch, rgpu\nprint(torch.ones(2, device='rgpu').sum().item())")
        assert r.returncode != 0
        assert "rgpu.SessionLost" in r.stderr and "its limit of 1 sessions" in r.stderr, r.stderr
        out, _ = holder.communicate("\n", timeout=60)  # the session being served is unaffected
        assert out.strip() == "6.0"
        r = run_client(server.address, "import torch, rgpu\nprint(torch.ones(2, device='rgpu').sum().item())")
        assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr
    finally:
        holder.kill()
        server.stop()


def test_a_connection_that_never_says_hello_is_closed_by_the_timeout():
    import socket
    import time
    server = Server("--hello-timeout", "1")
    try:
        silent = socket.create_connection(("127.0.0.1", server.port))
        silent.settimeout(10)
        start = time.time()
        got = b""
        while chunk := silent.recv(4096):  # the challenge, then the close
            got += chunk
        assert got[:4] == b"RGPU" and len(got) < 200
        assert time.time() - start < 5
        r = run_client(server.address, "import torch, rgpu\nprint(torch.ones(2, device='rgpu').sum().item())")
        assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr
        assert any("not authenticated within 1" in line for line in server.log), server.log
    finally:
        server.stop()
