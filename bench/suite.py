"""The benchmark suite: rgpu against local eager, local torch.compile and torch._lazy (LTC).

    python bench/suite.py [--quick] [--out bench/results]

Every (workload, system, rtt) runs in a process of its own, against real rgpu-opserver
processes on loopback (through bench/relay.py for rtt_ms > 0). A workload's processes are
started and warmed up one after another, then timed in interleaved rounds (6, or 3 with
--quick), each round in a rotated order, so that the machine's slow spells fall on every system
alike. Before a round, a process waits until its server has no compile pending; a round that a
compile overlapped anyway is counted. step_ms is the median of all timed steps (the mean for the pipelined -ready loops), with p10/p90;
`noise` in the JSON is the spread of cpu-eager's round medians, the machine's own. Each rgpu
run has `server_idle_share`: the share of its timed steps' time in which the server ran none of
its graphs (waiting for the client to trace, or for the link). `compile` compares the time to
compile the gpt and cnn steps from empty caches: torch.compile's forward and backward graphs on
the server against local torch.compile's (`compile_time_ratio`), and the eager rgpu step's
graphs, optimizer included, against the same (`step_compile_ratio`). Results:
OUT/latest.json, OUT/latest.png, and a table on stdout. Compare ratios within one run.

Systems:
  cpu-eager       local eager PyTorch on CPU
  cpu-compile     local torch.compile (Inductor) on CPU, compile time excluded
  rgpu-compile    torch.compile on rgpu tensors (in the compile figures only)
  ltc             torch._lazy with its TorchScript backend on CPU, mark_step() each step
  rgpu-plan       rgpu against rgpu-opserver --compiler plan
  rgpu-inductor   rgpu against rgpu-opserver --compiler inductor, after its compiles finished
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))

WORKLOADS = ["mlp", "mlp-ready", "cnn", "gpt", "gpt-ready", "infer", "gen", "gen-new"]
GEN_TOKENS = 16  # tokens per step of the gen workloads
LINK_MBIT = 100.0
PREROLL = 40  # untimed steps before each round of a -ready loop (see child)
# Timed steps of a round of a -ready loop, at least: a pipelined loop runs ahead of its server
# and link for a few steps and is then held, so a short round's mean says little about the pace
# it sustains (rounds of 5 steps gave 1.4 to 5.6 ms for the same link-bound MLP loop).
READY_ROUND = 40


# --------------------------------------------------------------------------------------------
# Workloads: each returns step(i) -> None, which runs one step and syncs (.item() or .cpu()).
# The -ready variants are the same training loops written the documented way for a remote
# device: batches uploaded ahead (rgpu.prefetch) and the loss logged through rgpu.on_ready
# instead of a .item() that waits; locally they are the plain loops.

def make_workload(name, device, system):
    import torch
    import torch.nn as nn

    from models import SmallCNN, TinyGPT, gpt_batch, gpt_optimizer

    torch.manual_seed(0)
    # Plain torch.compile: on rgpu tensors (rgpu-compile) it compiles on the server.
    wrap = (lambda m: torch.compile(m)) if system in ("cpu-compile", "rgpu-compile") \
        else (lambda m: m)
    if system == "ltc":
        import torch._lazy

        mark = torch._lazy.mark_step
    else:
        def mark():
            pass

    ready = name.endswith("-ready") and device == "rgpu"
    logged = []

    def feed(batches):
        """Batch i on the device: moved in the step, or uploaded ahead by rgpu.prefetch."""
        if not ready:
            return lambda i: tuple(t.to(device) for t in batches[i % len(batches)])
        import itertools

        import rgpu

        ahead = rgpu.prefetch(itertools.cycle(batches), depth=2)
        return lambda i: next(ahead)

    def log(loss):
        if ready:
            import rgpu

            rgpu.on_ready(lambda v: logged.append(v.item()), loss)
        else:
            logged.append(loss.item())

    def classifier(model, opt, batch, classes=10):
        fwd = wrap(model)
        batches = [(torch.randn(*batch), torch.randint(0, classes, batch[:1])) for _ in range(4)]
        take = feed(batches)

        def step(i):
            x, y = take(i)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(fwd(x), y)
            loss.backward()
            opt.step()
            mark()
            log(loss)
        return step

    if name in ("mlp", "mlp-ready"):
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512),
                              nn.Linear(512, 512), nn.GELU(), nn.LayerNorm(512),
                              nn.Linear(512, 10)).to(device)
        return classifier(model, torch.optim.AdamW(model.parameters(), lr=1e-3), (64, 256))

    if name == "cnn":
        model = SmallCNN().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return classifier(model, opt, (32, 1, 16, 16))

    if name in ("gpt", "gpt-ready"):
        model = TinyGPT().to(device)
        opt, sched = gpt_optimizer(model, steps=1000)
        fwd = wrap(model)
        take = feed([gpt_batch(s) for s in range(4)])

        def step(i):
            idx, tgt = take(i)
            opt.zero_grad()
            loss = fwd(idx, tgt)
            loss.backward()
            opt.step()
            sched.step()
            mark()
            log(loss)
        return step

    if name == "infer":
        model = TinyGPT().to(device).eval()
        head = wrap(lambda idx: model.head(model.ln(model.blocks(
            model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=idx.device))))))
        batches = [gpt_batch(s, batch=32)[0] for s in range(4)]

        def step(i):
            with torch.no_grad():
                out = head(batches[i % len(batches)].to(device)).argmax(-1)
                mark()
                out.cpu()
        return step

    if name in ("gen", "gen-new"):
        from generation import GPT2Style, generate

        # gen-new: each step's prompt is GEN_TOKENS + 1 tokens longer than the last, so every
        # token has lengths no earlier step had (as in a conversation that keeps growing).
        model = GPT2Style(context=1024).to(device).eval()
        grow = GEN_TOKENS + 1 if name == "gen-new" else 0
        tokens = torch.randint(0, model.vocab, (1, 1024 - GEN_TOKENS),
                               generator=torch.Generator().manual_seed(0))
        steps = iter(range(1000))  # warm-up steps count too: no length comes back

        def step(i):
            prompt = tokens[:, :8 + grow * next(steps)]
            with torch.no_grad():
                generate(model, prompt.to(device), GEN_TOKENS, cache="dynamic").cpu()
        return step

    raise SystemExit(f"unknown workload {name}")


def trace_cost(device, ops=3000, rounds=5):
    """Microseconds per op to record (rgpu, ltc) or run (cpu-eager) an elementwise chain, in
    the steady state: the median of `rounds` rounds of `ops` ops, each ended by a sync, after
    one such round to warm up (as every step of a training loop but its first)."""
    import torch

    x = torch.randn(64, 64).to(device)
    if device == "lazy":
        import torch._lazy

    def chain(n):
        nonlocal x
        start = time.perf_counter()
        for _ in range(n // 3):
            x = x * 1.0001
            x = x + 0.5
            x = torch.relu(x)
        elapsed = time.perf_counter() - start
        if device == "lazy":
            torch._lazy.mark_step()
        x.sum().item()
        return elapsed / n * 1e6

    # Warm-up: the first ops of a process import torch's Python meta kernels and decompositions,
    # and the first long trace grows the client's heap and caches.
    chain(30)
    chain(ops)
    return statistics.median(chain(ops) for _ in range(rounds))


def child(args):
    """Serves one (workload, system) in this process, warmed up: prints {"ready": ...}, then
    answers each line of stdin, `run N` (N timed steps) or `stats` (the counters of every timed
    step so far), with one JSON line."""
    import torch

    system = args.system
    device = {"cpu-eager": "cpu", "cpu-compile": "cpu", "ltc": "lazy"}.get(system, "rgpu")
    if device == "lazy":
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
    rgpu = None
    if device == "rgpu":
        import rgpu

    if args.workload == "trace":
        print(json.dumps({"trace_us_per_op": trace_cost(device)}))
        return

    def settle():
        """Waits for the server's background compiles (so that timed steps run compiled code and
        no compile competes with them for the CPU); returns the seconds waited."""
        start, deadline = time.time(), time.time() + 900
        while rgpu.server_stats()["compiles_pending"] and time.time() < deadline:
            time.sleep(0.5)
        return time.time() - start

    step = make_workload(args.workload, device, system)
    start_server = rgpu.server_stats() if rgpu else None
    warm_times = []
    for i in range(args.warmup):
        start = time.perf_counter()
        step(i)
        warm_times.append(time.perf_counter() - start)
    warm_wait = 0.0
    if system in ("rgpu-inductor", "rgpu-compile"):
        for _ in range(5):  # until warm-up steps queue no more compiles
            warm_wait += settle()
            for i in range(2):
                step(i)
            if not rgpu.server_stats()["compiles_pending"]:
                break
    print(json.dumps({"ready": True, "compile_wait_s": round(warm_wait, 2)}), flush=True)

    # Counters of the timed steps only: the stats calls between rounds are left out.
    keys = ("waits", "throttled", "messages", "bytes_out", "bytes_in", "graph_runs")
    totals = dict.fromkeys(keys + ("compiled_runs", "execute_ms", "wall_ms"), 0.0)
    timed, steady = 0, []
    for line in sys.stdin:
        words = line.split()
        if words[0] == "run":
            waited = settle() if rgpu else 0.0
            server_before = rgpu.server_stats() if rgpu else None
            preroll = PREROLL if args.workload.endswith("-ready") else 0
            # The waits above took in every reply: a pipelined loop first refills its steps in
            # flight, so that the timed steps show the steady state, not a client running ahead.
            for _ in range(preroll):
                step(timed)
            before = rgpu.stats() if rgpu else None
            times = []
            for _ in range(int(words[1])):
                start = time.perf_counter()
                step(timed)
                times.append((time.perf_counter() - start) * 1e3)
                timed += 1
            steady += times
            totals["wall_ms"] += sum(times)
            overlapped = False
            if rgpu:
                after = rgpu.stats()
                server = rgpu.server_stats()
                for k in keys:
                    totals[k] += after[k] - before[k]
                for k in ("compiled_runs", "execute_ms"):  # per step, the preroll's included
                    totals[k] += (server["session"][k] - server_before["session"][k]) * \
                        int(words[1]) / (int(words[1]) + preroll)
                overlapped = server["compiles_pending"] > 0 or \
                    server["inductor_compiles"] != server_before["inductor_compiles"]
            print(json.dumps({"times": times, "compile_wait_s": round(waited, 2),
                              "overlapped": overlapped}), flush=True)
        elif words[0] == "stats":
            out = {}
            if rgpu and timed:
                d = {k: v / timed for k, v in totals.items()}
                server = rgpu.server_stats()
                out.update(waits_per_step=d["waits"], throttled_per_step=d["throttled"],
                           messages_per_step=d["messages"],
                           bytes_up_per_step=d["bytes_out"], bytes_down_per_step=d["bytes_in"],
                           graph_runs_per_step=d["graph_runs"],
                           compiled_runs_per_step=d["compiled_runs"],
                           server_execute_ms_per_step=d["execute_ms"],
                           # The share of the timed steps' time the server ran none of this
                           # client's graphs (a CPU server runs a graph in its execute time).
                           server_idle_share=max(0.0, 1 - d["execute_ms"] / d["wall_ms"]),
                           compiles=server["inductor_compiles"] - start_server["inductor_compiles"],
                           cache_loads=server["disk_cache_hits"] - start_server["disk_cache_hits"])
            elif system == "cpu-compile":
                from torch._dynamo.utils import counters

                out["compiles"] = counters["stats"]["unique_graphs"]
            if args.cold and rgpu:  # the server's compiles, start to package loaded
                out["compile_s"] = (rgpu.server_stats()["compile_ms"]
                                    - start_server["compile_ms"]) / 1e3
            elif args.cold and steady:  # what the warm-up steps took beyond a steady step
                out["compile_s"] = sum(warm_times) - len(warm_times) * \
                    statistics.median(steady) / 1e3
            print(json.dumps(out), flush=True)


# --------------------------------------------------------------------------------------------
# The orchestrator.

class Proc:
    """A background process whose stderr is drained; `address` parsed from its first lines."""

    def __init__(self, cmd, pattern):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.address = None
        self.log = []
        for line in self.proc.stdout:
            self.log.append(line)
            m = re.search(pattern, line)
            if m:
                self.address = m.group(1)
                break
        if not self.address:
            raise SystemExit("could not start: " + " ".join(cmd) + "\n" + "".join(self.log))
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout],
                         daemon=True).start()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def opserver():
    return os.path.join(os.path.dirname(sys.executable), "rgpu-opserver")


class Child:
    """A `--child` process serving one (workload, system, rtt): started and warmed up, then asked
    for timed rounds. Its stderr goes to a file, so that it never blocks on a full pipe."""

    def __init__(self, workload, system, rtt, address, warmup, timeout, cold_cache=None):
        import tempfile

        self.workload, self.system, self.rtt, self.timeout = workload, system, rtt, timeout
        env = dict(os.environ)
        if address:
            env["RGPU_OPSERVER"] = address
        if cold_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = cold_cache
        self.stderr = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--workload", workload,
               "--system", system, "--warmup", str(warmup)] + (["--cold"] if cold_cache else [])
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)
        self.error = None
        self.times, self.round_ms, self.overlapped = [], [], 0  # of the timed rounds
        self.compile_wait_s = self.read().get("compile_wait_s", 0.0)

    def run_round(self, steps):
        out = self.ask(f"run {steps}")
        if "times" in out:
            self.times += out["times"]
            self.round_ms.append(statistics.median(out["times"]))
            self.compile_wait_s += out["compile_wait_s"]
            self.overlapped += out["overlapped"]

    def read(self):
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            self.stderr.seek(0)
            tail = self.stderr.read().strip().splitlines()[-3:]
            self.error = ((" | ".join(tail) or "exited") if ready
                          else f"no answer within {self.timeout} s")
            return {"error": self.error}
        return json.loads(line)

    def ask(self, command):
        if self.error:
            return {"error": self.error}
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited: read() says why
        return self.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def run_once(workload, system, address, timeout):
    """A child that measures and exits (the trace-cost runs)."""
    env = dict(os.environ, **({"RGPU_OPSERVER": address} if address else {}))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--workload", workload,
           "--system", system]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if r.returncode != 0:
        return {"error": " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])}
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(workload, runs, addresses, warmup, steps, rounds):
    """Measures every (system, rtt) of `workload` in `rounds` interleaved rounds of steps/rounds
    timed steps each, every round in a rotated order, so that the machine's slow spells fall on
    every system alike. Returns one result per (system, rtt)."""
    children = []
    for system, rtt in runs:
        print(f"  {workload:7} {system:14} rtt {rtt:>2} ms: warming up", flush=True)
        children.append(Child(workload, system, rtt, addresses.get((system, rtt)), warmup, 1200))
    per_round = max(1, steps // rounds)
    if workload.endswith("-ready"):
        per_round = max(per_round, READY_ROUND)
    for r in range(rounds):
        shift = r % len(children)
        for c in children[shift:] + children[:shift]:
            c.run_round(per_round)
    results = []
    for c in children:
        t = sorted(c.times)
        r = {"workload": workload, "system": c.system, "rtt_ms": c.rtt}
        if c.error:
            r["error"] = c.error
        else:
            # A pipelined loop's steps alternate between running ahead and waiting for the
            # server: its step time is the mean, what the loop sustains.
            median = statistics.fmean(t) if workload.endswith("-ready") else statistics.median(t)
            r.update(step_ms=median, p10_ms=t[len(t) // 10], p90_ms=t[(len(t) * 9) // 10],
                     round_ms=c.round_ms, compile_wait_s=round(c.compile_wait_s, 1),
                     rounds_overlapping_a_compile=c.overlapped)
            if workload.startswith("gen"):
                r["token_ms"] = median / GEN_TOKENS
            r.update(c.ask("stats"))
        c.stop()
        print(f"  {workload:7} {c.system:14} rtt {c.rtt:>2} ms: "
              + (f"{r['step_ms']:.2f} ms (p10-p90 {r['p10_ms']:.2f}-{r['p90_ms']:.2f})"
                 if "step_ms" in r else r["error"]), flush=True)
        results.append(r)
    return results


# One rank of the DDP workload: the gpt workload's model under DistributedDataParallel, this
# rank's share of a global batch of 32, `.item()` every step (the naive loop).
DDP_RANK = """
import json, statistics, sys, time, torch, torch.distributed as dist, rgpu
sys.path.insert(0, EXAMPLES)
from models import TinyGPT, gpt_batch
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("rgpu")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(TinyGPT().to("rgpu"))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
times = []
for step in range(WARMUP + STEPS):
    if step == WARMUP:
        before = rgpu.stats()
    start = time.perf_counter()
    idx, tgt = gpt_batch(step, batch=32)
    loss = model(idx[rank::size].to("rgpu"), tgt[rank::size].to("rgpu"))
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss.item()
    times.append(time.perf_counter() - start)
after = rgpu.stats()
per_step = {k: (after[k] - before[k]) / STEPS for k in ("bytes_out", "bytes_in", "messages", "waits")}
print(json.dumps(dict(step_ms=1000 * statistics.median(times[WARMUP:]), **per_step)))
dist.destroy_process_group()
"""


def compile_benchmark():
    """The time to compile a training step, each system from empty caches (Inductor's and
    rgpu's), on the same machine one after the other. The same graphs: local torch.compile
    (cpu-compile) against torch.compile on rgpu tensors (rgpu-compile), whose forward and
    backward the server compiles (it compiles nothing else: --compile-after is out of reach);
    both leave the optimizer eager. And the eager rgpu step: the server compiling the step's
    graphs, optimizer included (rgpu-inductor; graphs that run once are not compiled), against
    the same local figure. Returns {workload: figures}."""
    import tempfile

    out = {}
    for workload in ("gpt", "cnn"):
        figures = {}
        with tempfile.TemporaryDirectory(prefix="rgpu-bench-compile-") as tmp:
            for system, server_args in (("cpu-compile", None),
                                        ("rgpu-compile", ["--compile-after", "1000000"]),
                                        ("rgpu-inductor", [])):
                server = None if server_args is None else Proc(
                    [opserver(), "--device", "cpu", "--port", "0", "--compiler", "inductor",
                     "--cache-dir", os.path.join(tmp, system, "server"),
                     "--kernel-cache", os.path.join(tmp, system, "kernels"), *server_args],
                    r"listening on ([\d.]+:\d+)")
                try:
                    print(f"  compile {workload:4} {system}", flush=True)
                    c = Child(workload, system, 0, server and server.address, 3, 1800,
                              cold_cache=os.path.join(tmp, system, "client"))
                    c.run_round(5)
                    stats = c.ask("stats")
                    c.stop()
                    figures[system] = (stats.get("compile_s", c.error), stats.get("compiles"))
                finally:
                    if server:
                        server.stop()
        (local, _), (same, same_n), (step, step_n) = (
            figures["cpu-compile"], figures["rgpu-compile"], figures["rgpu-inductor"])

        def ratio(remote):
            ok = isinstance(local, float) and isinstance(remote, float) and local > 0
            return remote / local if ok else None
        out[workload] = {"local_compile_s": local, "server_compile_s": same,
                         "server_compiles": same_n, "compile_time_ratio": ratio(same),
                         "step_compile_s": step, "step_compiles": step_n,
                         "step_compile_ratio": ratio(step)}
        print(f"  compile {workload:4}: local {local} s; the same graphs on the server {same} s; "
              f"the eager step's on the server {step} s", flush=True)
    return out


def ddp_benchmark(quick):
    """Data-parallel training over torch.distributed: 1 rank against 2 ranks, each rank a client
    process with a server of its own (rgpu-opserver --compiler plan), on the same global batch.
    Returns per world size the median step time of rank 0 and what crossed its client."""
    warmup, steps = (3, 10) if quick else (5, 30)
    code = (DDP_RANK.replace("EXAMPLES", repr(os.path.join(REPO, "examples")))
            .replace("WARMUP", str(warmup)).replace("STEPS", str(steps)))
    out = {}
    for size in (1, 2):
        servers = [Proc([opserver(), "--device", "cpu", "--port", "0", "--compiler", "plan"],
                        r"listening on ([\d.]+:\d+)") for _ in range(size)]
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ranks = [subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(size),
                                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                    RGPU_OPSERVER=servers[r].address))
                for r in range(size)]
            reports = [p.communicate(timeout=600) for p in ranks]
            if any(p.returncode for p in ranks):
                out[f"ranks{size}"] = {"error": reports[0][1].strip()[-500:]}
                continue
            out[f"ranks{size}"] = json.loads(reports[0][0].strip().splitlines()[-1])
        finally:
            for s in servers:
                s.stop()
    return out


def micro_benchmarks(build, server_address, quick):
    """Runs the Google Benchmark binaries; returns {benchmark: {"us": time, "per_item_ns": ...}}."""
    out = {}
    env = dict(os.environ, RGPU_OPSERVER=server_address)
    for name in ("rgpu_ir_bench", "rgpu_trace_bench", "rgpu_plan_bench"):
        binary = os.path.join(build, "bench", name)
        if not os.path.exists(binary):
            continue
        cmd = [binary, "--benchmark_format=json"] + (["--benchmark_min_time=0.2"] if quick else [])
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            out[name] = {"error": r.stderr.strip().splitlines()[-1:]}
            continue
        for b in json.loads(r.stdout)["benchmarks"]:
            entry = {"us": b["real_time"] if b["time_unit"] == "us" else b["real_time"] / 1e3}
            if "items_per_second" in b:
                entry["per_item_ns"] = 1e9 / b["items_per_second"]
            if "bytes" in b:
                entry["bytes"] = b["bytes"]
            out[b["name"]] = entry
    return out


def plan_runs(quick):
    runs = []
    for w in WORKLOADS:
        runs.append((w, "cpu-eager", 0))
        gen = w.startswith("gen")
        ready = w.endswith("-ready")  # only rgpu has a network to hide
        if not gen and not ready:  # LTC's masked_fill fails on gen: "Input tensor is not a lazy tensor"
            runs.append((w, "ltc", 0))
        if (not quick and not gen or w in ("mlp", "gpt")) and not ready:
            runs.append((w, "cpu-compile", 0))
        if ready and quick:
            runs += [(w, "rgpu-inductor", rtt) for rtt in (0, 20)]
            continue
        for rtt in ((0, 20, 50) if not quick else (0, 20)):
            runs += [(w, "rgpu-plan", rtt), (w, "rgpu-inductor", rtt)]
    return runs


def noise(runs):
    """How noisy the run was, per workload: the spread of cpu-eager's round medians, (max - min)
    / median. Local eager does the same work every round, so its spread is the machine's."""
    out = {}
    for r in runs:
        if r["system"] == "cpu-eager" and r.get("round_ms"):
            m = r["round_ms"]
            out[r["workload"]] = round((max(m) - min(m)) / statistics.median(m), 3)
    return out


def latency_ratios(runs):
    """{(workload, system): {rtt: step_ms at rtt / step_ms at loopback}} for rgpu's runs."""
    local = {(r["workload"], r["system"]): r["step_ms"] for r in runs
             if r["rtt_ms"] == 0 and "step_ms" in r}
    out = {}
    for r in runs:
        key = (r["workload"], r["system"])
        if r["rtt_ms"] and "step_ms" in r and key in local:
            out.setdefault(key, {})[r["rtt_ms"]] = r["step_ms"] / local[key]
    return out


def table(results):
    lines = []
    base = {(r["workload"]): r["step_ms"] for r in results["runs"]
            if r["system"] == "cpu-eager" and "step_ms" in r}
    ltc = {(r["workload"]): r["step_ms"] for r in results["runs"]
           if r["system"] == "ltc" and "step_ms" in r}
    head = (f"{'workload':8} {'system':14} {'rtt':>4} {'step ms':>8} {'p10-p90':>13} {'/eager':>7} "
            f"{'/ltc':>6} {'waits':>5} {'thrtl':>5} {'msgs':>5} {'B up':>7} {'idle':>5} "
            f"{'compiles':>8}")
    lines.append(head)
    lines.append("-" * len(head))
    for r in results["runs"]:
        if "step_ms" not in r:
            lines.append(f"{r['workload']:8} {r['system']:14} {r['rtt_ms']:>4} "
                         f"error: {r.get('error', '?')[:80]}")
            continue
        w = r["workload"]
        fmt = lambda v, f: (format(v, f) if v is not None else "-")  # noqa: E731
        lines.append(
            f"{w:8} {r['system']:14} {r['rtt_ms']:>4} {r['step_ms']:8.2f} "
            f"{r['p10_ms']:6.2f}-{r['p90_ms']:<6.2f} "
            f"{fmt(r['step_ms'] / base[w] if w in base else None, '7.2f')} "
            f"{fmt(r['step_ms'] / ltc[w] if w in ltc else None, '6.2f')} "
            f"{fmt(r.get('waits_per_step'), '5.1f')} {fmt(r.get('throttled_per_step'), '5.1f')} "
            f"{fmt(r.get('messages_per_step'), '5.1f')} "
            f"{fmt(r.get('bytes_up_per_step'), '7.0f')} "
            f"{fmt(r.get('server_idle_share'), '5.0%')} {fmt(r.get('compiles'), '8d')}")
    link = latency_ratios(results["runs"])
    if link:
        lines.append("")
        lines.append("step time at a round trip of 20 / 50 ms over the same loop at loopback:")
        lines += [f"  {w:9} {system:14} " + ", ".join(f"{rtt} ms {v:.2f}x" for rtt, v in by.items())
                  for (w, system), by in link.items()]
    for w in ("gen", "gen-new"):
        gen = [r for r in results["runs"] if r["workload"] == w and "token_ms" in r]
        if gen:
            lines.append("")
            lines.append(f"{w}, ms per token ({GEN_TOKENS} a step): " + ", ".join(
                f"{r['system']}{'@' + str(r['rtt_ms']) + 'ms' if r['rtt_ms'] else ''} "
                f"{r['token_ms']:.2f}" for r in gen))
    if results.get("noise"):
        lines.append("")
        lines.append("noise, (max - min) / median of cpu-eager's round medians: " + ", ".join(
            f"{w} {v:.0%}" for w, v in results["noise"].items()))
    overlapping = [f"{r['workload']}/{r['system']}@{r['rtt_ms']}" for r in results["runs"]
                   if r.get("rounds_overlapping_a_compile")]
    if overlapping:
        lines.append("rounds that overlapped a server compile: " + ", ".join(overlapping))
    t = results.get("trace_us_per_op", {})
    if t:
        lines.append("")
        spread = results.get("trace_spread", {})
        lines.append("trace cost per op (us, median of interleaved rounds, spread): " + ", ".join(
            f"{k} {v:.2f} ({spread.get(k, 0):.0%})" for k, v in t.items()))
        if "rgpu" in t and "ltc" in t:
            lines.append(f"rgpu / ltc trace cost per op: {t['rgpu'] / t['ltc']:.2f}x")
    for name, m in results.get("micro", {}).items():
        if "us" in m:
            extra = f", {m['per_item_ns']:.0f} ns per item" if "per_item_ns" in m else ""
            lines.append(f"{name:28} {m['us']:10.1f} us{extra}")
    ddp = results.get("ddp", {})
    if "step_ms" in ddp.get("ranks1", {}) and "step_ms" in ddp.get("ranks2", {}):
        one, two = ddp["ranks1"], ddp["ranks2"]
        lines.append("")
        lines.append(f"ddp (gpt, global batch 32): 1 rank {one['step_ms']:.1f} ms, 2 ranks "
                     f"{two['step_ms']:.1f} ms a step ({two['step_ms'] / one['step_ms']:.2f}x); "
                     f"a rank's client per step: {two['bytes_out']:.0f} B out, "
                     f"{two['bytes_in']:.0f} B in, {two['messages']:.1f} messages, "
                     f"{two['waits']:.1f} waits")
    for w, c in results.get("compile", {}).items():
        if c.get("compile_time_ratio") is not None:
            lines.append(f"compile {w}: the same graphs, server {c['server_compile_s']:.1f} s "
                         f"({c['server_compiles']} graphs) against local torch.compile "
                         f"{c['local_compile_s']:.1f} s: {c['compile_time_ratio']:.2f}x")
        if c.get("step_compile_ratio") is not None:
            lines.append(f"compile {w}: the eager rgpu step, server {c['step_compile_s']:.1f} s "
                         f"({c['step_compiles']} graphs, optimizer included): "
                         f"{c['step_compile_ratio']:.2f}x")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if "step_ms" in r]
    labels = []
    for r in runs:
        label = r["system"] + (f"@{r['rtt_ms']}ms" if r["rtt_ms"] else "")
        if label not in labels:
            labels.append(label)
    fig, axes = plt.subplots(1, 3, figsize=(21, 5.5))
    width = 0.8 / max(1, len(labels))
    for k, label in enumerate(labels):
        xs, ys = [], []
        for i, w in enumerate(WORKLOADS):
            for r in runs:
                if r["workload"] == w and r["system"] + (f"@{r['rtt_ms']}ms" if r["rtt_ms"] else "") == label:
                    xs.append(i + k * width)
                    ys.append(r["step_ms"])
        axes[0].bar(xs, ys, width, label=label)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(WORKLOADS))], WORKLOADS)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("step time, ms (median, log scale)")
    axes[0].set_title("Step time per system and workload")
    axes[0].legend(fontsize=7, ncol=2)
    rgpu_runs = [r for r in runs if r["system"].startswith("rgpu") and r["rtt_ms"] == 0]
    names = [f"{r['workload']}\n{r['system'][5:]}" for r in rgpu_runs]
    xs = range(len(rgpu_runs))
    axes[1].bar([x - 0.2 for x in xs], [r["messages_per_step"] for r in rgpu_runs], 0.4,
                label="messages per step")
    axes[1].bar([x + 0.2 for x in xs], [r["bytes_up_per_step"] for r in rgpu_runs], 0.4,
                label="bytes up per step")
    axes[1].set_xticks(list(xs), names, fontsize=7)
    axes[1].set_yscale("log")
    axes[1].set_title("rgpu traffic per step (the earlier per-op design: ~7,000 msgs, 3.5 MB)")
    axes[1].legend(fontsize=8)
    for w in ("mlp", "mlp-ready", "gpt", "gpt-ready"):
        for system in ("rgpu-plan", "rgpu-inductor"):
            pts = sorted((r["rtt_ms"], r["step_ms"]) for r in runs
                         if r["workload"] == w and r["system"] == system)
            if len(pts) > 1:
                axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                             linestyle="-" if w.endswith("-ready") else "--",
                             label=f"{w} {system[5:]}")
    axes[2].set_xlabel("round trip, ms (bench/relay.py, 100 Mbit/s)")
    axes[2].set_ylabel("step time, ms")
    axes[2].set_title("Naive loops (.item() each step, dashed) and documented ones\n"
                      "(rgpu.on_ready + rgpu.prefetch, solid)")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"rgpu benchmark, torch {results['torch']}, {results['machine']['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps, rounds and relays")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--workloads", help="only these workloads, comma-separated (of "
                        + ", ".join(WORKLOADS) + "), and none of the other sections")
    parser.add_argument("--build", default=os.path.join(REPO, "build"),
                        help="the CMake build directory with the micro-benchmarks")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    import torch

    os.makedirs(args.out, exist_ok=True)
    warmup, steps, rounds = (3, 12, 3) if args.quick else (5, 30, 6)
    cache = os.path.join(args.out, "server-cache")
    started = time.time()
    servers = {
        "rgpu-plan": Proc([opserver(), "--device", "cpu", "--port", "0", "--compiler", "plan"],
                          r"listening on ([\d.]+:\d+)"),
        "rgpu-inductor": Proc([opserver(), "--device", "cpu", "--port", "0", "--compiler",
                               "inductor", "--cache-dir", cache], r"listening on ([\d.]+:\d+)"),
    }
    relays = {}
    runs = plan_runs(args.quick)
    only = args.workloads.split(",") if args.workloads else None
    if only:
        unknown = set(only) - set(WORKLOADS)
        if unknown:
            parser.error("unknown workloads: " + ", ".join(sorted(unknown)))
        runs = [r for r in runs if r[0] in only]
    for _, system, rtt in runs:
        if rtt and (system, rtt) not in relays:
            relays[(system, rtt)] = Proc(
                [sys.executable, os.path.join(HERE, "relay.py"), "--target",
                 servers[system].address, "--rtt-ms", str(rtt), "--mbit", str(LINK_MBIT)],
                r"relay listening on ([\d.]+:\d+)")
    results = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "torch": torch.__version__,
        "settings": {"warmup_steps": warmup, "timed_steps": steps, "rounds": rounds,
                     "quick": args.quick,
                     "link_mbit": LINK_MBIT, "relay": "bench/relay.py, delay rtt/2 each way"},
        "runs": [],
    }
    addresses = {}
    for _, system, rtt in runs:
        if system.startswith("rgpu"):
            addresses[(system, rtt)] = relays[(system, rtt)].address if rtt \
                else servers[system].address
    try:
        for workload in only or WORKLOADS:
            mine = [(system, rtt) for w, system, rtt in runs if w == workload]
            results["runs"] += measure(workload, mine, addresses, warmup, steps, rounds)
        results["noise"] = noise(results["runs"])
        if not only:  # the other sections
            # Interleaved rounds, as the steps are measured: a slow spell of the machine falls on
            # every system alike. Each figure is the median of its rounds; `trace_spread` is
            # (max - min) / median.
            samples = {}
            for _ in range(3 if args.quick else 5):
                for system in ("rgpu-plan", "ltc", "cpu-eager"):
                    r = run_once("trace", system, servers["rgpu-plan"].address, timeout=300)
                    if "trace_us_per_op" in r:
                        name = "rgpu" if system == "rgpu-plan" else system
                        samples.setdefault(name, []).append(r["trace_us_per_op"])
            results["trace_us_per_op"] = {k: statistics.median(v) for k, v in samples.items()}
            results["trace_spread"] = {k: (max(v) - min(v)) / statistics.median(v)
                                       for k, v in samples.items()}
            results["micro"] = micro_benchmarks(args.build, servers["rgpu-plan"].address,
                                                args.quick)
            results["ddp"] = ddp_benchmark(args.quick)
            results["compile"] = compile_benchmark()
    finally:
        for p in list(relays.values()) + list(servers.values()):
            p.stop()
    finish(results, args, started)


def finish(results, args, started):
    """Writes the results and prints their table."""
    results["seconds"] = round(time.time() - started, 1)
    with open(os.path.join(args.out, "latest.json"), "w") as f:
        json.dump(results, f, indent=1)
    try:
        plot(results, os.path.join(args.out, "latest.png"))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print()
    print(table(results))
    print(f"\n{len(results['runs'])} runs in {results['seconds']} s; "
          f"{os.path.join(args.out, 'latest.json')}, latest.png")


if __name__ == "__main__":
    main()
