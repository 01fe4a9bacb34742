"""Trains a small GPT on device="rgpu" against a local rgpu-opserver (what `make run` does).

Starts rgpu-opserver on 127.0.0.1 (CUDA if this machine has it, else CPU), trains for a few
dozen steps with a progress bar, prints the loss curve and rgpu's counters, and stops the
server. With RGPU_OPSERVER already set, it uses that server instead of starting one.
"""

import os
import re
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import TinyGPT, gpt_batch, gpt_optimizer  # noqa: E402

STEPS = int(os.environ.get("STEPS", 60))


def start_server():
    binary = os.path.join(os.path.dirname(sys.executable), "rgpu-opserver")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    proc = subprocess.Popen([binary, "--device", device, "--port", "0"], stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        m = re.search(r"listening on ([\d.]+:\d+)", line)
        if m:
            # Keep passing the server's log on, so that its pipe never fills up.
            threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("rgpu-opserver did not start")


def sparkline(values, width=60):
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    step = max(1, len(values) // width)
    picked = values[::step]
    return "".join(bars[int((v - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for v in picked)


def main():
    proc = None
    if not os.environ.get("RGPU_OPSERVER"):
        proc, address = start_server()
        os.environ["RGPU_OPSERVER"] = address
    import rgpu

    try:
        torch.manual_seed(0)
        model = TinyGPT().to("rgpu")
        opt, sched = gpt_optimizer(model, STEPS)
        losses = []
        start = time.time()
        for step in range(STEPS):
            idx, tgt = gpt_batch(step)
            opt.zero_grad()
            loss = model(idx.to("rgpu"), tgt.to("rgpu"))
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            done = (step + 1) * 30 // STEPS
            print(f"\rtraining [{'#' * done}{'.' * (30 - done)}] step {step + 1}/{STEPS} "
                  f"loss {losses[-1]:.4f}", end="", flush=True)
        elapsed = time.time() - start
        print(f"\n\nloss {losses[0]:.3f} -> {losses[-1]:.3f}  {sparkline(losses)}")
        print(f"{STEPS} steps in {elapsed:.1f} s ({1000 * elapsed / STEPS:.1f} ms/step)\n")
        stats = rgpu.stats()
        print("rgpu.stats():")
        for k, v in stats.items():
            print(f"  {k:15} {v:>10}   ({v / STEPS:.1f} per step)")
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
