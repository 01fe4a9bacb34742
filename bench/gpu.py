"""The GPU benchmark: training steps on a CUDA rgpu-opserver (plan, Inductor, and Inductor with
--compile-mode reduce-overhead: CUDA graphs) against local CUDA eager and local torch.compile
(default and mode="reduce-overhead"), on the same machine, in one run.

    python bench/gpu.py [--json FILE] [--quick] [--workloads cnn,gpt2,gpt2-bf16] [--systems eager,...]

Workloads: `gpt2` (GPT-2-small shaped: 12 layers, 768 wide, 12 heads, vocabulary 50257,
batch 8 x 512, AdamW, .item() every step), `gpt2-bf16` (the same step under
`torch.autocast(..., dtype=torch.bfloat16)`, as it is trained in practice) and `cnn` (examples/models.py's SmallCNN with
BatchNorm, batch 512, SGD with momentum, .item() every step). Per workload and system: the
median step time, the server's execute time per step (rgpu: the host time its worker spent
queueing the step's kernels, not GPU time), the client's CPU time per step (of the thread that
runs the loop, and of the whole process, whose idle OpenMP threads spin), and the share of the
timed steps during which the GPU was busy (NVML's utilization, sampled every 20 ms).
Each system runs in its own process; the rgpu ones against a fresh server on a Unix socket.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
SYSTEMS = ("eager", "rgpu-plan", "compile", "rgpu-inductor", "compile-reduce-overhead",
           "rgpu-reduce-overhead")


def workload(name, device, quick):
    import torch
    import torch.nn.functional as F
    from models import SmallCNN, TinyGPT

    torch.manual_seed(0)
    if name in ("gpt2", "gpt2-bf16"):
        batch, context, vocab = (2, 256, 50257) if quick else (8, 512, 50257)
        model = TinyGPT(vocab=vocab, dim=768, heads=12, layers=12, context=context).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, vocab, (batch, context + 1), generator=g) for _ in range(4)]

        def inputs(step):
            b = batches[step % len(batches)]
            return b[:, :-1].to(device), b[:, 1:].to(device)

        def loss_of(m, x, y):
            return m(x, y)
    else:
        model = SmallCNN().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(512, 1, 16, 16, generator=g), torch.randint(0, 10, (512,), generator=g))
                   for _ in range(4)]

        def inputs(step):
            x, y = batches[step % len(batches)]
            return x.to(device), y.to(device)

        def loss_of(m, x, y):
            return F.cross_entropy(m(x), y)
    return model, opt, inputs, loss_of


class GpuBusy:
    """NVML's utilization (the share of each sample period in which a kernel ran), sampled
    every 20 ms while in use."""

    def __init__(self):
        self.samples, self.stop = [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML: no figure
            self.nvml = None

    def __enter__(self):
        def sample():
            while not self.stop.wait(0.02):
                self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        if self.nvml:
            self.thread = threading.Thread(target=sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()

    def share(self):
        return statistics.mean(self.samples) / 100 if self.samples else None


def child(name, system, quick):
    import torch

    remote = system.startswith("rgpu")
    if remote:
        import rgpu
    device = "rgpu" if remote else "cuda"
    model, opt, inputs, loss_of = workload(name, device, quick)
    run_model = (torch.compile(model) if system == "compile" else
                 torch.compile(model, mode="reduce-overhead")
                 if system == "compile-reduce-overhead" else model)
    warmup, steps = (3, 5) if quick else ((5, 20) if name.startswith("gpt2") else (10, 50))

    mixed = name.endswith("-bf16")

    def step(i):
        x, y = inputs(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mixed):
            loss = loss_of(run_model, x, y)
        loss.backward()
        opt.step()
        return loss.item()

    t0 = time.time()
    compile0 = rgpu.server_stats()["compile_ms"] if remote else 0
    for i in range(warmup):
        step(i)
    if system in ("rgpu-inductor", "rgpu-reduce-overhead"):  # compiled code, not the plan
        deadline = time.time() + 900
        while rgpu.server_stats()["compiles_pending"] and time.time() < deadline:
            step(0)
        step(0)
    warm_s = time.time() - t0
    server0 = rgpu.server_stats()["session"] if remote else None
    times, cpu0, thread0 = [], time.process_time(), time.thread_time()
    with GpuBusy() as busy:
        for i in range(steps):
            t = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t)
    out = {"step_ms": statistics.median(times) * 1e3, "mean_step_ms": statistics.mean(times) * 1e3,
           "client_thread_ms": (time.thread_time() - thread0) / steps * 1e3,
           "client_cpu_ms": (time.process_time() - cpu0) / steps * 1e3, "gpu_busy": busy.share(),
           "warmup_s": warm_s, "steps": steps}
    if remote:
        server1 = rgpu.server_stats()["session"]
        out["server_execute_ms"] = (server1["execute_ms"] - server0["execute_ms"]) / steps
        out["compiled_runs"] = server1["compiled_runs"] - server0["compiled_runs"]
        out["graph_runs"] = server1["graph_runs"] - server0["graph_runs"]
        out["server_compile_s"] = (rgpu.server_stats()["compile_ms"] - compile0) / 1e3
        out["cuda_graph_replays"] = rgpu.server_stats()["cuda_graph_replays"]
    print(json.dumps(out))


def opserver(system, tmp):
    """A CUDA server for rgpu-plan, rgpu-inductor or rgpu-reduce-overhead."""
    kind = system.split("-", 1)[1]
    sock = os.path.join(tmp, f"{kind}.sock")
    binary = os.path.join(REPO, "python", "rgpu", "bin", "rgpu-opserver")
    env = dict(os.environ, RGPU_PYTHON=sys.executable)
    how = (["--compiler", "plan"] if kind == "plan" else ["--compiler", "inductor"] +
           (["--compile-mode", "reduce-overhead"] if kind == "reduce-overhead" else []))
    proc = subprocess.Popen([binary, "--device", "cuda", *how, "--socket", sock,
                             "--compile-jobs", "4", "--cache-dir", os.path.join(tmp, "cache")],
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if re.search(r"listening on", line):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, "unix:" + sock
    raise RuntimeError("rgpu-opserver did not start")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--quick", action="store_true", help="smaller batches, fewer steps")
    ap.add_argument("--workloads", default="cnn,gpt2,gpt2-bf16")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args.quick)

    import torch

    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": {}}
    tmp = tempfile.mkdtemp(prefix="rgpu-gpu-bench-", dir=os.environ.get("XDG_RUNTIME_DIR"))
    os.chmod(tmp, 0o700)
    for name in args.workloads.split(","):
        for system in args.systems.split(","):
            env, server = dict(os.environ), None
            if system.startswith("rgpu"):
                server, env["RGPU_OPSERVER"] = opserver(system, tmp)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, system]
            r = subprocess.run(cmd + (["--quick"] if args.quick else []), env=env,
                               capture_output=True, text=True, timeout=1500)
            if server:
                server.kill()
                server.wait()
            key = f"{name}/{system}"
            if r.returncode:
                results["runs"][key] = {"error": (r.stderr or r.stdout)[-2000:]}
                print(f"{key}: failed\n{r.stderr[-2000:]}", flush=True)
            else:
                results["runs"][key] = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"{key}: {results['runs'][key]}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    print(table(results))


def table(results):
    def fmt(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    lines = [f"{results['device']}, torch {results['torch']}",
             f"{'workload/system':24} {'step ms':>9} {'vs eager':>9} {'vs compile':>10} "
             f"{'server ms':>9} {'client ms':>9} {'GPU busy':>8} {'compile s':>9}"]
    for key, r in results["runs"].items():
        name = key.split("/")[0]
        eager = results["runs"].get(f"{name}/eager", {}).get("step_ms")
        comp = results["runs"].get(f"{name}/compile", {}).get("step_ms")
        s = r.get("step_ms")
        # The server's compiles; local torch.compile's are in its warm-up steps.
        compile_s = r.get("server_compile_s", r.get("warmup_s") if key.endswith("/compile")
                          else None)
        lines.append(f"{key:24} {fmt(s, '9.2f')} {fmt(s / eager if s and eager else None, '9.2f')} "
                     f"{fmt(s / comp if s and comp else None, '10.2f')} "
                     f"{fmt(r.get('server_execute_ms'), '9.2f')} {fmt(r.get('client_thread_ms'), '9.2f')} "
                     f"{fmt(r.get('gpu_busy'), '8.0%')} {fmt(compile_s, '9.1f')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
