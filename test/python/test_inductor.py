"""rgpu-opserver --compiler inductor: background compiles, the switch to compiled code, the
persistent cache, and shutdown in the middle of a compile. Each test starts its own server and
runs its client in its own process (inductor_client.py)."""

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import List

import pytest
from conftest import REPO, Server, run_client, wait_for_log

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inductor_client.py")


def last_json(server, code, timeout=900):
    """Runs client `code` against `server`; returns the JSON of its last line of output."""
    r = run_client(server.address, code, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr + "".join(server.log)
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(server, workload):
    """Runs inductor_client.py's `workload` ("NAME [ARG...]") against `server`."""
    argv = [CLIENT, *workload.split()]
    code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({CLIENT!r}, run_name='__main__')"
    return last_json(server, code)


def stats_on_new_server(tmp_path, code, *args):
    """Runs client `code`, which prints the server's stats last, against a fresh inductor
    server; returns those stats."""
    server = inductor_server(str(tmp_path), *args)
    try:
        return last_json(server, code, timeout=600)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("server-cache"))


def inductor_server(cache_dir, *args):
    return Server("--compiler", "inductor", "--cache-dir", cache_dir, *args)


def run_on_new_server(cache_dir, workload, *args):
    """Runs the client workload against a fresh inductor server; returns its output and log."""
    server = inductor_server(cache_dir, *args)
    try:
        return run(server, workload), "".join(server.log)
    finally:
        server.stop()


def test_lazy_training_switches_to_inductor_without_waiting_and_matches_cpu(cache_dir):
    # reduce-overhead compiles the same packages (the restarted default-mode server below loads
    # them) and, on a CPU server, runs them without CUDA graphs, saying why.
    out, log = run_on_new_server(cache_dir, "lazy-gpt", "--compile-after", "3",
                                 "--compile-mode", "reduce-overhead")
    assert "compiling with inductor in the background" in log
    assert "inductor compiled in" in log
    # The step that queued the compile came back while it was still running: no step waits.
    assert max(out["pending"][:6]) >= 1, out
    stats = out["stats"]
    assert stats["compiler"] == "inductor"
    assert stats["inductor_compiles"] >= 1 and stats["compile_failures"] == 0, stats
    assert stats["session"]["compiled_runs"] >= 2, stats
    assert any(g["executor"] == "inductor" for g in stats["session"]["graphs"]), stats
    assert {g["cuda_graph"] for g in stats["session"]["graphs"] if g["executor"] == "inductor"} \
        == {"not used: CUDA graphs need a CUDA device"}, stats


def test_a_restarted_server_loads_what_it_compiled_before(cache_dir):
    # The test above compiled into this cache, unless it ran in another test process.
    packages = os.path.join(cache_dir, "inductor")
    if not any(f.endswith(".pt2") for f in (os.listdir(packages) if os.path.isdir(packages)
                                            else [])):
        run_on_new_server(cache_dir, "lazy-gpt", "--compile-after", "3")
    out, log = run_on_new_server(cache_dir, "lazy-gpt", "--compile-after", "3")
    stats = out["stats"]
    assert stats["inductor_compiles"] == 0, stats
    assert stats["disk_cache_hits"] >= 1, stats
    assert stats["session"]["compiled_runs"] >= 2, stats
    assert "loaded from the cache" in log


def test_torch_compile_graphs_are_compiled_on_the_server_in_their_mode(tmp_path):
    # mode="reduce-overhead" reaches the server with each graph: on a CUDA server their compiled
    # runs replay as CUDA graphs; on this CPU server they run as packages, and say why.
    out, _ = run_on_new_server(str(tmp_path), "compiled-mlp reduce-overhead")
    stats = out["stats"]
    # The forward and backward graphs compile at their second run; later steps run them compiled.
    assert stats["inductor_compiles"] >= 2 and stats["compile_failures"] == 0, stats
    assert stats["session"]["compiled_runs"] >= 2 * 4, stats
    # The forward and backward; the eager ops around them (the loss) compile in the server's
    # mode, the default.
    said = [g["cuda_graph"] for g in stats["session"]["graphs"] if g["executor"] == "inductor"]
    assert said.count("not used: CUDA graphs need a CUDA device") == 2, stats["session"]
    assert set(said) == {"", "not used: CUDA graphs need a CUDA device"}, said
    assert stats["cuda_graph_replays"] == 0 and stats["cuda_graph_captures"] == 0, stats


def test_shutdown_during_a_compile_leaves_no_partial_artifact(tmp_path):
    server = inductor_server(str(tmp_path), "--compile-after", "1")
    code = (
        "import torch, rgpu\n"
        "x = torch.randn(64, 64, device='rgpu')\n"
        "for _ in range(2):\n"
        "    (x @ x).relu().sum().item()\n"
    )
    try:
        r = run_client(server.address, code)
        assert r.returncode == 0, r.stderr
        wait_for_log(server, "compiling with inductor in the background")
        time.sleep(2)  # well into the compile
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
    leftovers = sorted(os.listdir(tmp_path / "inductor"))
    assert not [f for f in leftovers if ".tmp" in f or f.endswith(".pt2")], leftovers


def recording_python(tmp_path):
    """An RGPU_PYTHON that writes down the descriptors the compile worker inherits, and with
    which `import rgpu` fails."""
    fds, script = tmp_path / "fds", tmp_path / "python"
    script.write_text(
        "#!/bin/sh\n"
        f"ls -l /proc/$$/fd >> {fds}\n"
        f"exec {sys.executable} -c 'import runpy, sys; sys.modules[\"rgpu\"] = None; "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name=\"__main__\")' \"$@\"\n")
    script.chmod(0o755)
    return str(script), fds


def test_the_compile_worker_inherits_no_descriptors_and_never_imports_the_client(tmp_path,
                                                                               monkeypatch):
    python, fds = recording_python(tmp_path)
    monkeypatch.setenv("RGPU_PYTHON", python)
    out, log = run_on_new_server(str(tmp_path / "cache"), "compiled-mlp")
    stats = out["stats"]
    assert stats["inductor_compiles"] >= 2 and stats["compile_failures"] == 0, (stats, log)
    # The worker is started once and kept warm: its stdin and stdout are the one socket the
    # server talks to it on; besides that only its log and what the recording shell itself
    # holds: no client socket, no listener, no pipe, no file of the server's.
    fd_targets = dict(line.split(" -> ") for line in fds.read_text().splitlines() if " -> " in line)
    fd_targets = {where.split()[-1]: target for where, target in fd_targets.items()}
    assert fd_targets["0"].startswith("socket:"), fd_targets
    allowed = {"/dev/null", str(fds), python, fd_targets["0"]}
    assert all(t in allowed or t.endswith(".log") for t in fd_targets.values()), fd_targets
    # One worker started for every compile (`ls -l` begins each listing with "total").
    assert fds.read_text().count("total ") == 1, fds.read_text()


@pytest.mark.parametrize("limit, said", [
    (("--compile-timeout", "1"), "ran past its deadline of 1 s"),
    (("--compile-memory-mib", "256"), "stays on the plan executor"),
])
def test_a_compile_that_hits_a_limit_leaves_its_graph_on_the_plan(tmp_path, limit, said):
    out, log = run_on_new_server(str(tmp_path), "lazy-gpt", "--compile-after", "1", *limit)
    assert said in log, log
    stats = out["stats"]
    assert stats["inductor_compiles"] == 0 and stats["session"]["compiled_runs"] == 0, stats


def warm_workers(server):
    """The pids of `server`'s warm compile workers (its children running --serve)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if parent == server.proc.pid and b"--serve" in argv:
            pids.append(int(pid))
    return pids


# Compiles one graph per unary op named on stdin, a line each, waiting for each compile.
EACH_OP = (
    "import json, sys, time, torch, rgpu\n"
    "x = torch.randn(4, 8)\n"
    "for line in sys.stdin:\n"
    "    f = getattr(torch, line.strip())\n"
    "    for _ in range(2):\n"
    "        assert torch.allclose(f(x.to('rgpu') * 3).cpu(), f(x * 3), atol=1e-6)\n"
    "    while rgpu.server_stats()['compiles_pending']:\n"
    "        time.sleep(0.2)\n"
    "    print(json.dumps(rgpu.server_stats()), flush=True)\n")


def test_a_warm_worker_that_dies_is_started_again(tmp_path):
    # The worker imports torch once and compiles each job in a child of its own (one worker
    # serves every compile: the descriptors test). Killed between compiles, it is started again
    # for the next one, which compiles like the first.
    server = inductor_server(str(tmp_path), "--compile-after", "1")
    client = subprocess.Popen([sys.executable, "-c", EACH_OP], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, RGPU_OPSERVER=server.address))
    try:
        def compiled(op):
            client.stdin.write(f"{op}\n")
            client.stdin.flush()
            return json.loads(client.stdout.readline())
        assert compiled("cos")["inductor_compiles"] == 1
        (worker,) = warm_workers(server)  # it stays after its compile
        os.kill(worker, signal.SIGKILL)
        stats = compiled("sin")
        assert stats["inductor_compiles"] == 2 and stats["compile_failures"] == 0, stats
        assert warm_workers(server) not in ([], [worker]), warm_workers(server)
    finally:
        client.kill()
        server.stop()


def test_graphs_with_unchecked_indexing_stay_on_the_plan(tmp_path):
    # _unsafe_index checks its indices in eager mode; compiled, by its contract, it does not.
    code = (
        "import json, torch, rgpu\n"
        "x = torch.arange(12.).reshape(3, 4).to('rgpu')\n"
        "i = torch.tensor([2, 0]).to('rgpu')\n"
        "for _ in range(3):\n"
        "    r = torch.ops.aten._unsafe_index(x * 2, [i]).cpu()\n"
        "    assert torch.equal(r, (torch.arange(12.).reshape(3, 4) * 2)[[2, 0]]), r\n"
        "print(json.dumps(rgpu.server_stats()))\n")
    stats = stats_on_new_server(tmp_path, code, "--compile-after", "1")
    assert stats["inductor_compiles"] == 0 and stats["compiles_pending"] == 0, stats
    assert all(g["executor"] == "plan" for g in stats["session"]["graphs"]), stats


@pytest.mark.parametrize("expr", ["(t > 0).all(-1, keepdim=True) & (k != 3)",
                                  "(t > 1).scatter(1, (t > 2).long(), k != 3)",
                                  "torch.nn.functional.pad(t, (0, 1), value=1.5 + (k == 3))"],
                         ids=["bool-flag", "bool-scatter", "pad-value"])
def test_scalars_inductor_cannot_take_as_symbols_are_compiled_as_constants(tmp_path, expr):
    # `mask & flag` with a Python bool (Hugging Face's stopping criteria): export cannot branch
    # on the bool's unbacked symbol; a scatter's bool value: Inductor's lowering takes only a
    # constant. A pad's fill value: the lowering makes it a Python number. Each slot is
    # compiled as a constant; a run with another value runs on the plan.
    code = (
        "import json, time, torch, rgpu\n"
        "x = torch.tensor([[1., 2.], [3., 0.]])\n"
        f"f = lambda t, k: {expr}\n"
        "for k in range(4):\n"
        "    r = f(x.to('rgpu'), k).cpu()\n"
        "    assert torch.equal(r, f(x, k)), (k, r)\n"
        "    while rgpu.server_stats()['compiles_pending']:\n"
        "        time.sleep(0.2)\n"
        "print(json.dumps(rgpu.server_stats()))\n")
    stats = stats_on_new_server(tmp_path, code, "--compile-after", "1")
    assert stats["inductor_compiles"] >= 1 and stats["compile_failures"] == 0, stats
    assert stats["session"]["compiled_runs"] >= 1, stats


def test_small_compiled_runs_take_one_thread_and_give_the_team_back(tmp_path):
    # A compiled run of a small graph runs on one thread (one-row matmuls woke MKL's second
    # thread); the pool thread's OpenMP and MKL team sizes are restored after it. One worker,
    # so the same thread runs both graphs: the large matmul (MKL splits its 4096-long
    # reduction between threads) must round as CPU eager's does, on the plan or compiled.
    code = (
        "import json, time, torch, rgpu\n"
        "torch.manual_seed(0)\n"
        "a, w, x, big = torch.randn(1, 64), torch.randn(64, 64), torch.randn(1, 4096), torch.randn(4096, 64)\n"
        "ar, wr, xr, bigr = (t.to('rgpu') for t in (a, w, x, big))\n"
        "for step in range(4):\n"
        "    small = (ar @ wr).relu().cpu()\n"
        "    assert torch.allclose(small, (a @ w).relu(), rtol=1e-5, atol=1e-5), step\n"
        "    r = (xr @ bigr).cpu()\n"
        "    assert torch.equal(r, x @ big), (step, (r - x @ big).abs().max())\n"
        "    while rgpu.server_stats()['compiles_pending']:\n"
        "        time.sleep(0.2)\n"
        "print(json.dumps(rgpu.server_stats()))\n")
    stats = stats_on_new_server(tmp_path, code, "--compile-after", "1", "--workers", "1")
    assert stats["inductor_compiles"] >= 2 and stats["compile_failures"] == 0, stats
    assert stats["session"]["compiled_runs"] >= 4, stats


def test_compiled_runs_take_each_runs_scalars_from_sessions_at_once(tmp_path):
    # A compiled graph keeps the tensors its scalar arguments are passed in and refills them
    # every run: every run must see its own values (float and int slots), also while another
    # session runs the same compiled graph with other values. A stale or borrowed value is
    # far off; rounding (a fused multiply-add) is not.
    code = (
        "import json, sys, time, torch, rgpu\n"
        "x, n = torch.linspace(-2, 2, 12).reshape(3, 4), torch.arange(12).reshape(3, 4)\n"
        "f = lambda t, m, a, k: ((t * a + k).sum(1), m * k - 3 * k)\n"
        "xr, nr = x.to('rgpu'), n.to('rgpu')\n"
        "sign = int(sys.argv[1])\n"
        "for step in range(60):\n"
        "    a, k = sign * (0.5 + step), sign * (7 * step - 20)\n"
        "    got, want = [r.cpu() for r in f(xr, nr, a, k)], f(x, n, a, k)\n"
        "    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-4), (step, got, want)\n"
        "    assert torch.equal(got[1], want[1]), (step, got, want)\n"
        "    if step == 2:\n"
        "        while rgpu.server_stats()['compiles_pending']:\n"
        "            time.sleep(0.2)\n"
        "print(json.dumps(rgpu.server_stats()))\n")
    server = inductor_server(str(tmp_path), "--compile-after", "1")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(
                lambda sign: run_client(server.address, code.replace("sys.argv[1]", repr(sign)),
                                        timeout=600), ["1", "-1"]))
        for r in results:
            assert r.returncode == 0, r.stdout + r.stderr + "".join(server.log)
        stats = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    finally:
        server.stop()
    assert all(s["compile_failures"] == 0 for s in stats), stats
    assert all(s["session"]["compiled_runs"] >= 40 for s in stats), stats


def test_the_inductor_compiler_needs_a_python():
    # The native program, started without the rgpu-opserver command that names the Python.
    native = os.path.join(REPO, "python", "rgpu", "bin", "rgpu-opserver")
    env = {k: v for k, v in os.environ.items() if k != "RGPU_PYTHON"}
    r = subprocess.run([native, "--compiler", "inductor", "--port", "0"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "RGPU_PYTHON" in r.stderr


def test_caches_smaller_than_the_compiled_graphs_evict_and_train_the_same(tmp_path):
    # Four compiled graphs and room for one in memory: each load unloads the one run least
    # recently, which reloads from the cache directory when it is hot again. Each client checks
    # its losses and gradients against the CPU's.
    server = inductor_server(str(tmp_path), "--compiled-cache", "1")
    try:
        first = run(server, "compiled-mlp")["stats"]
        assert first["compiled_evictions"] >= 1, first
        again = run(server, "compiled-mlp")["stats"]
        assert again["disk_cache_hits"] >= 1, again
        assert again["compile_failures"] == 0, again
    finally:
        server.stop()
    log = "".join(server.log)
    assert "inductor package unloaded, the least recently run past --compiled-cache" in log
    packages = lambda: [f for f in os.listdir(tmp_path / "inductor") if f.endswith(".pt2")]
    assert len(packages()) >= 2
    # A server given less room on disk deletes the least recently used packages as it starts
    # (here all of them: none fits in one byte).
    server = inductor_server(str(tmp_path), "--disk-cache", "1")
    try:
        wait_for_log(server, "the least recently used package past --disk-cache")
        assert packages() == []
    finally:
        server.stop()


# Steps of a static cache written by slice, by index_copy_ and with its old value read besides
# the write (those named by `KINDS`, else all three), on rgpu and on CPU; prints each kind's
# compiled runs and writes in place.
CACHE_WRITES = (
    "import json, time, torch, rgpu\n"
    "def steps(device, how):\n"
    "    torch.manual_seed(0)\n"
    "    cache = torch.zeros(2, 40, 8, device=device)\n"
    "    w, x = torch.randn(8, 8).to(device), torch.randn(2, 1, 8).to(device)\n"
    "    seen, values = torch.zeros(1, 0, device=device), []\n"
    "    for i in range(30):\n"
    "        k = torch.tanh(x @ w)\n"
    "        seen = torch.cat([seen, x[:1, :, 0]], 1)  # grows by one, as generated ids do\n"
    "        n = seen.shape[1]\n"
    "        old = cache.sum() if how == 'read-old' else 0\n"
    "        if how == 'index':\n"
    "            cache.index_copy_(1, torch.tensor([n - 1], device=device), k)\n"
    "        else:\n"
    "            cache[:, n - 1:n] = k\n"
    "        att = torch.softmax(cache @ x.transpose(1, 2), 1)\n"
    "        x = (att * cache).sum(1, keepdim=True) + old\n"
    "        values.append(x.sum().item())\n"
    "        if device == 'rgpu' and i in (4, 8):\n"
    "            while rgpu.server_stats()['compiles_pending']:\n"
    "                time.sleep(0.2)\n"
    "    return values, cache.cpu()\n"
    "out = {}\n"
    "for how in globals().get('KINDS', ('slice', 'index', 'read-old')):\n"
    "    before = rgpu.server_stats()['session']\n"
    "    (got, gc), (want, wc) = steps('rgpu', how), steps('cpu', how)\n"
    "    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-4), (got, want)\n"
    "    assert torch.allclose(gc, wc, rtol=1e-4, atol=1e-6)\n"
    "    after = rgpu.server_stats()['session']\n"
    "    out[how] = {k: after[k] - before[k] for k in ('compiled_runs', 'writes_in_place')}\n"
    "print(json.dumps(out))\n")


def test_compiled_cache_writes_go_into_the_released_cache_and_match_cpu(tmp_path):
    # A static KV cache's update (`cache[:, n - 1:n] = k`, or HF's index_copy_) makes a whole
    # new cache each step; compiled code writes the row into the old cache's buffer when the
    # client has let it go. Every step's value and the final caches must match the CPU's, also
    # where the old cache is read besides the write (no write in place there: a rerun of a
    # failed compiled run on the plan would read the new row).
    code = CACHE_WRITES
    out = stats_on_new_server(tmp_path, code, "--compile-after", "2")
    for how in ("slice", "index", "read-old"):
        assert out[how]["compiled_runs"] >= 15, out
    assert out["slice"]["writes_in_place"] >= 10 and out["index"]["writes_in_place"] >= 10, out
    assert out["read-old"]["writes_in_place"] == 0, out


def test_every_dtype_the_policy_admits_reaches_the_compile_worker_as_its_torch_dtype():
    # The worker names dtypes, layouts and memory formats through rgpu_compile_job, which reads
    # the op-facts table; TorchScript gives the number torch itself uses for each.
    sys.path.insert(0, os.path.join(REPO, "python", "rgpu", "bin"))
    import rgpu_compile_job
    import torch

    @torch.jit.script
    def number(x: torch.Tensor) -> int:
        return x.dtype

    @torch.jit.script
    def memory_formats() -> List[int]:
        return [torch.contiguous_format, torch.preserve_format, torch.channels_last,
                torch.channels_last_3d]

    admitted = rgpu_compile_job.valid_dtypes()
    assert {27, 28, 29, 23, 24, 44, 15, 8} <= set(admitted)  # unsigned, float8, bf16, complex32
    for n in admitted:
        dtype = getattr(torch, rgpu_compile_job.dtype_name(n))
        assert number(torch.empty(0, dtype=dtype)) == n, (n, dtype)
    for n in set(range(64)) - set(admitted):
        assert rgpu_compile_job.dtype_name(n) is None, n
    assert rgpu_compile_job.layout_name(0) == "strided" and rgpu_compile_job.layout_name(1) is None
    for n, value in enumerate(memory_formats()):
        assert value == n and rgpu_compile_job.memory_format_name(n) is not None
    assert rgpu_compile_job.memory_format_name(len(memory_formats())) is None
    assert rgpu_compile_job.compiled_as_constant("aten::constant_pad_nd", "value")
    assert rgpu_compile_job.compiled_as_constant("aten::addmm", "beta")
    assert not rgpu_compile_job.compiled_as_constant("aten::add", "other")


def test_a_spec_naming_writes_the_graph_cannot_have_is_compiled_again(tmp_path):
    # The server checks a package's writes against its graph before it loads it: a .spec that
    # names an output or input the graph lacks is refused, and the graph compiled again.
    sys.path.insert(0, os.path.join(REPO, "python", "rgpu", "bin"))
    import rgpu_compile_job
    code = "KINDS = ('slice',)\n" + CACHE_WRITES  # a package that writes in place
    stats_on_new_server(tmp_path, code, "--compile-after", "2")
    specs = [os.path.join(tmp_path, "inductor", f) for f in os.listdir(tmp_path / "inductor")
             if f.endswith(".pt2.spec")]
    assert specs
    for spec in specs:
        rgpu_compile_job.write_ok(spec, [], 1, writes=[(99, 0)])
    server = inductor_server(str(tmp_path), "--compile-after", "2")
    try:
        out = last_json(server, code, timeout=600)
        log = "".join(server.log)
    finally:
        server.stop()
    assert "names writes the graph cannot have; compiling it again" in log, log
    assert out["slice"]["writes_in_place"] >= 10, out


FORGED = (
    "import json, sys, time, torch, rgpu\n"
    "width = int(sys.argv[1])\n"
    "for step in range(5):\n"
    "    x = torch.randn(8, width)\n"
    "    got = (x.to('rgpu') * 2 + 1).sin().cpu()\n"
    "    assert torch.allclose(got, (x * 2 + 1).sin(), rtol=1e-6, atol=1e-6), step\n"
    "    while rgpu.server_stats()['compiles_pending']:\n"
    "        time.sleep(0.2)\n"
    "session = rgpu.server_stats()['session']\n"
    "print(json.dumps({'hashes': [g['hash'] for g in session['graphs']],\n"
    "                  'compiled_runs': session['compiled_runs']}))\n")


def test_a_package_put_under_another_graphs_name_is_refused_and_that_graph_compiled(tmp_path):
    # A package is found by its graph's digest, but runs only for the graph it records: the
    # package of a graph on [8, 64] inputs, renamed to the digest of the same ops on [8, 8]
    # (what a forged hash would make the server find), is refused at load; the [8, 8] graph is
    # compiled for itself and computes what the CPU does.
    def run_width(width, *args):
        server = inductor_server(str(tmp_path), *args)
        try:
            code = f"import sys; sys.argv = ['forged', '{width}']\n" + FORGED
            return last_json(server, code, timeout=600), "".join(server.log)
        finally:
            server.stop()

    inductor = tmp_path / "inductor"
    run_width(64, "--compile-after", "2")
    packages = [f for f in os.listdir(inductor) if f.endswith(".pt2")]
    assert len(packages) == 1, packages
    stem_a = packages[0][:-len(".pt2")]
    digest_a, key = stem_a.split("-")
    assert len(digest_a) == 64
    out, _ = run_width(8, "--compile-after", "1000")
    (digest_b,) = out["hashes"]
    assert digest_b != digest_a
    for ext in (".pt2", ".pt2.spec", ".pt2.graph"):
        shutil.copy(inductor / (stem_a + ext), inductor / f"{digest_b}-{key}{ext}")
    out, log = run_width(8, "--compile-after", "2")
    assert "records another graph (or none); compiling it again" in log, log
    assert "inductor compiled in" in log, log
    assert out["compiled_runs"] >= 1, out
