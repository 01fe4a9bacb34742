"""rgpu-trace-dump, rgpu-run, metrics, logging and the recompile warning."""

import os
import subprocess
import sys

from conftest import package_copy, run_client

BIN = os.path.dirname(sys.executable)
TRACE_DUMP = os.path.join(BIN, "rgpu-trace-dump")
RUN = os.path.join(BIN, "rgpu-run")

MLP = """
import torch, rgpu
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to('rgpu')
torch.rgpu.synchronize()
with torch.no_grad():
    for batch in BATCHES:
        print(mlp(torch.randn(batch, 16).to('rgpu')).sum().item())
"""


def dump(cache, *args):
    return subprocess.run([TRACE_DUMP, "--cache", str(cache), *args], capture_output=True, text=True)


def test_trace_dump_lists_shows_and_diffs_a_shape_change(server, tmp_path):
    cache = tmp_path / "graphs"
    r = run_client(server.address, MLP.replace("BATCHES", "[8, 8, 12]"),
                   env={"RGPU_CACHE_DIR": str(cache), "RGPU_DYNAMIC": "0"})
    assert r.returncode == 0, r.stderr
    listing = dump(cache, "list")
    assert listing.returncode == 0, listing.stderr
    # One graph materialises the parameters at the synchronize; the forward cuts two more.
    lines = [line for line in listing.stdout.strip().splitlines() if "cut at <string>:8" in line]
    assert len(lines) == 2, listing.stdout
    hashes = [line.split()[0] for line in lines]
    assert sorted(int(line.split("runs ")[1].split()[0]) for line in lines) == [1, 2]

    shown = dump(cache, "show", hashes[0])
    # Under no_grad, linear is traced whole.
    assert "aten::linear" in shown.stdout and "aten::relu" in shown.stdout, shown.stdout
    dot = dump(cache, "show", hashes[1][:8], "--format", "dot")
    assert dot.stdout.startswith("digraph rgpu {") and "aten::linear" in dot.stdout

    diff = dump(cache, "diff", hashes[0][:10], hashes[1][:10])
    text = diff.stdout
    assert ("f32[8,16] vs f32[12,16]" in text) or ("f32[12,16] vs f32[8,16]" in text), text
    assert "only tensor shapes differ" in text


def test_trace_dump_shows_symbols_and_diffs_what_was_generalized(server, tmp_path):
    cache = tmp_path / "graphs"
    r = run_client(server.address, MLP.replace("BATCHES", "[8, 12, 5]"), env={"RGPU_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stderr
    lines = [line for line in dump(cache, "list").stdout.splitlines() if "cut at <string>:8" in line]
    assert len(lines) == 2, lines  # batch 8, then one graph over the batch size s0
    hashes = [line.split()[0] for line in lines]
    shown = [dump(cache, "show", h).stdout for h in hashes]
    symbolic = [s for s in shown if "f32[s0,16]" in s]
    assert len(symbolic) == 1 and "aten::linear(%6, %3, %4) : f32[s0,4]" in symbolic[0], shown
    text = dump(cache, "diff", hashes[0], hashes[1]).stdout
    assert "size symbols: " in text and ("f32[s0,16] vs f32[8,16]" in text or
                                         "f32[8,16] vs f32[s0,16]" in text), text


def test_backward_ops_are_put_on_the_line_that_called_backward(server, tmp_path):
    # Autograd runs the backward on a thread of its own, where no user code runs: its ops
    # (and their errors) name the line that called backward().
    cache = tmp_path / "graphs"
    code = ("import torch, rgpu\n"
            "x = torch.randn(4, 3, device='rgpu', requires_grad=True)\n"
            "y = (x.sin() * 2).sum()\n"
            "y.backward()\n"
            "print(x.grad.sum().item())\n")
    r = run_client(server.address, code, env={"RGPU_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stderr
    graph = dump(cache, "list").stdout.split()[0]
    shown = dump(cache, "show", graph).stdout
    cos = [line for line in shown.splitlines() if "aten::cos" in line]
    assert len(cos) == 1 and cos[0].endswith("# <string>:4"), shown


def test_trace_dump_errors_are_one_line(tmp_path):
    empty = dump(tmp_path, "list")
    assert empty.returncode != 0 and "no graphs" in empty.stderr
    (tmp_path / ("ab" * 32 + ".rgraph")).write_bytes(b"not a graph at all!!!!!!")
    corrupt = dump(tmp_path, "show", "abab")
    assert corrupt.returncode != 0
    assert len(corrupt.stderr.strip().splitlines()) == 1 and "corrupt" in corrupt.stderr or "not a graph" in corrupt.stderr
    unknown = dump(tmp_path, "show", "ffff")
    assert unknown.returncode != 0 and "no graph matches 'ffff'" in unknown.stderr
    usage = dump(tmp_path)
    assert usage.returncode == 2


def test_recompile_warning_fires_for_changing_shapes_only(server, tmp_path):
    env = {"RGPU_CACHE_DIR": "off", "RGPU_DYNAMIC": "0"}
    varying = run_client(server.address, MLP.replace("BATCHES", "range(4, 12)"), env=env)
    assert "differ only in tensor shapes" in varying.stderr, varying.stderr
    assert "<string>:8 has cut" in varying.stderr and " vs f32[" in varying.stderr
    steady = run_client(server.address, MLP.replace("BATCHES", "[8] * 8"), env=env)
    assert "differ only in tensor shapes" not in steady.stderr, steady.stderr
    # With dynamic shapes (the default) the site goes symbolic instead, and says so once.
    dynamic = run_client(server.address, MLP.replace("BATCHES", "range(4, 12)"),
                         env={"RGPU_CACHE_DIR": "off", "RGPU_LOG": "info"})
    assert "differ only in tensor shapes" not in dynamic.stderr, dynamic.stderr
    assert dynamic.stderr.count("now runs as one graph over 1 size symbol") == 1, dynamic.stderr


def test_debug_log_shows_cuts_definitions_and_waits(server):
    r = run_client(server.address, MLP.replace("BATCHES", "[8]"), env={"RGPU_LOG": "debug", "RGPU_CACHE_DIR": "off"})
    assert "cut (read of a value)" in r.stderr, r.stderr
    assert "define graph" in r.stderr and "wait at <string>:" in r.stderr


def test_metrics_report_names_graphs_sites_and_recompiles(server):
    code = MLP.replace("BATCHES", "[8, 8, 12]") + "\nprint(rgpu.metrics_report())"
    r = run_client(server.address, code, env={"RGPU_CACHE_DIR": "off", "RGPU_DYNAMIC": "0"})
    assert r.returncode == 0, r.stderr
    for part in ("client counters:", "server counters:", "plan_builds", "graphs (3):", "exec ms/run",
                 "sync sites", "recompiles", "f32[8,16] vs f32[12,16]"):
        assert part in r.stdout, r.stdout


def test_server_stats_counts_this_sessions_runs(server):
    code = MLP.replace("BATCHES", "[8, 8]") + "\nimport json; print(json.dumps(rgpu.server_stats()))"
    r = run_client(server.address, code, env={"RGPU_CACHE_DIR": "off"})
    assert r.returncode == 0, r.stderr
    import json

    st = json.loads(r.stdout.strip().splitlines()[-1])
    assert st["plan_builds"] >= 1 and st["graphs_cached"] >= 2 and st["sessions"] >= 1
    assert st["session"]["graph_runs"] == 3  # the parameters, then two forwards of one graph
    assert sorted(g["runs"] for g in st["session"]["graphs"]) == [1, 2]
    assert all(g["execute_ms"] > 0 for g in st["session"]["graphs"])


def rgpu_run(*args, env=None):
    return subprocess.run([RUN, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_rgpu_run_passes_the_server_and_the_exit_status(server):
    code = "import os, sys; print(os.environ['RGPU_OPSERVER']); sys.exit(7)"
    r = rgpu_run("--server", server.address, "--", sys.executable, "-c", code)
    assert r.returncode == 7 and r.stdout.strip() == server.address
    trains = rgpu_run("--server", server.address, "--", sys.executable, "-c",
                      "import torch, rgpu; print(torch.ones(3, device='rgpu').sum().item())")
    assert trains.returncode == 0 and trains.stdout.strip() == "3.0", trains.stderr


def test_rgpu_run_takes_the_command_without_a_double_dash(server):
    r = rgpu_run("--server", server.address, sys.executable, "-c",
                 "import os, sys; print(os.environ['RGPU_OPSERVER']); sys.exit(3)")
    assert r.returncode == 3 and r.stdout.strip() == server.address, r.stderr


def test_rgpu_opserver_set_after_import_is_read_when_the_session_opens(server):
    code = ("import os, torch, rgpu\n"
            f"os.environ['RGPU_OPSERVER'] = '{server.address}'\n"
            "print(torch.ones(2, device='rgpu').sum().item())")
    env = dict(os.environ, RGPU_OPSERVER="127.0.0.1:1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr


def test_rgpu_run_usage_errors():
    assert rgpu_run("--server", "127.0.0.1:1").returncode == 2
    assert rgpu_run("--", "true").returncode == 2
    assert rgpu_run("--server", "127.0.0.1:1", "--", "/no/such/program").returncode == 127


def test_rgpu_run_check_against_a_running_server(server):
    r = rgpu_run("--server", server.address, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    import torch

    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"client: torch {torch.__version__}"), r.stdout
    assert f"server: {server.address}: rgpu protocol 13, torch {torch.__version__.split('+')[0]}" in r.stdout
    assert "device cpu (" in r.stdout and "compiler plan" in r.stdout, r.stdout
    assert lines[-1] == "ok: this client can use that server", r.stdout
    # RGPU_OPSERVER, as a program run by rgpu-run would use it.
    env = dict(os.environ, RGPU_OPSERVER=server.address)
    r = subprocess.run([RUN, "--check"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and f"server: {server.address}" in r.stdout, r.stdout + r.stderr


def test_rgpu_run_check_against_a_stopped_server(fresh_server):
    address = fresh_server.address
    fresh_server.stop()
    r = rgpu_run("--server", address, "--check")
    assert r.returncode == 1, r.stdout
    assert f"server: {address}: cannot reach rgpu-opserver at {address}" in r.stdout, r.stdout
    assert "Start one with" in r.stdout, r.stdout


def test_rgpu_run_check_with_rgpu_built_for_another_torch(server, tmp_path):
    package_copy(tmp_path, 'TORCH_VERSION = "2.99.0"\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([RUN, "--server", server.address, "--check"], capture_output=True,
                       text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 1, r.stdout
    assert "cannot import rgpu: rgpu was built against torch 2.99.0" in r.stdout, r.stdout
    assert "rebuild" in r.stdout, r.stdout


class OtherRelease:
    """A server of another rgpu release, for as long as it takes to answer a Hello: it sends the
    reply such a server sends (encoded from text with the `capnp` tool, framed as rgpu-opserver
    frames it), then closes."""

    def __init__(self, path, protocol, torch_version):
        import socket
        import struct
        import threading

        schema = os.path.join(os.path.dirname(__file__), "..", "..", "lib", "wire", "rgpu.capnp")
        text = (f'(ackSeq = 0, results = [(hello = (protocol = {protocol}, torchVersion = '
                f'"{torch_version}", device = "cpu", compiler = "plan", instance = "12345678"))])')
        body = subprocess.run(["capnp", "encode", schema, "ServerFrame"], input=text.encode(),
                              capture_output=True, check=True).stdout
        self.reply = struct.pack("<IIQ", 0x55504752, 0, len(body)) + body
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen()
        self.address = f"unix:{path}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            conn, _ = self.listener.accept()
            with conn:
                conn.recv(65536)  # the client's Hello
                conn.sendall(self.reply)


def test_rgpu_run_check_against_a_server_of_another_release(tmp_path):
    import torch

    ours = torch.__version__.split("+")[0]
    server = OtherRelease(tmp_path / "s.sock", protocol=99, torch_version=ours)
    r = rgpu_run("--server", server.address, "--check")
    assert r.returncode == 1, r.stdout
    assert f"server: {server.address}: version mismatch: rgpu protocol 13 here, 99 on the server" \
        in r.stdout, r.stdout
    assert "fix: install the same torch release and the same rgpu on both sides" in r.stdout

    other = OtherRelease(tmp_path / "t.sock", protocol=8, torch_version="2.9.1")
    r = rgpu_run("--server", other.address, "--check")
    assert r.returncode == 1, r.stdout
    assert f"version mismatch: this client runs torch {ours}, rgpu-opserver at " \
        f"{other.address} runs torch 2.9.1" in r.stdout, r.stdout
    assert "fix: " in r.stdout, r.stdout


def test_rgpu_run_builds_the_ssh_tunnel_command(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    import rgpu_cli

    assert rgpu_cli.ssh_command("me@gpu", 5555, 9720, ssh_port=2222, identity="~/.ssh/k") == [
        "ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "~/.ssh/k", "-N", "-o",
        "ExitOnForwardFailure=yes", "-o", "StreamLocalBindUnlink=yes",
        "-L", "127.0.0.1:5555:127.0.0.1:9720", "me@gpu"]
    # The default: a private local socket forwarded to the server's own socket.
    assert rgpu_cli.ssh_command("gpu", "/tmp/d/l.sock", "/run/user/7/rgpu/opserver.sock")[-2:] == [
        "/tmp/d/l.sock:/run/user/7/rgpu/opserver.sock", "gpu"]
    # An ssh that fails at once: the tunnel never comes up, and ssh's message is passed on.
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\necho 'ssh: Could not resolve hostname nowhere' >&2\nexit 255\n")
    fake.chmod(0o755)
    r = rgpu_run("--host", "nowhere", "--", "true", env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert r.returncode == 1
    assert "cannot reach nowhere with ssh" in r.stderr and "Could not resolve hostname" in r.stderr
