"""Trains a small GPT on device="rgpu" against a local rgpu-opserver (what `make run` does).

Starts rgpu-opserver on 127.0.0.1 (CUDA if this machine has it, else CPU), trains for a few
dozen steps with a progress bar, prints the loss curve and rgpu's counters, and stops the
server. With the Inductor compiler (the default), it then waits for the server's compile of the
training step, visibly, and trains on to show the compiled step time. With RGPU_OPSERVER already
set, it uses that server instead of starting one.
"""

import os
import re
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import TinyGPT, gpt_batch, gpt_optimizer  # noqa: E402

STEPS = int(os.environ.get("STEPS", 60))
COMPILED_STEPS = 20  # trained after the server's Inductor compile, to show the compiled speed


class Console:
    """The progress bar on one line, and the server's log on lines of their own above it: a
    server line never lands inside the bar's line."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bar = ""  # the bar's text while one is shown
        self.tty = sys.stdout.isatty()

    def note(self, text):
        with self.lock:
            if self.bar:
                sys.stdout.write("\r\033[K" if self.tty else "\n")
            sys.stdout.write(text.rstrip("\n") + "\n")
            if self.bar and self.tty:
                sys.stdout.write(self.bar)
            elif self.bar:
                self.bar = ""  # on a pipe, the bar goes on on a new line
            sys.stdout.flush()

    def draw(self, text):
        with self.lock:
            sys.stdout.write(("\r" if self.bar else "") + text)
            sys.stdout.flush()
            self.bar = text

    def end(self):
        with self.lock:
            if self.bar:
                sys.stdout.write("\n")
                sys.stdout.flush()
            self.bar = ""


def start_server(console):
    binary = os.path.join(os.path.dirname(sys.executable), "rgpu-opserver")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    proc = subprocess.Popen([binary, "--device", device, "--port", "0"], stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        console.note(line)
        m = re.search(r"listening on ([\d.]+:\d+)", line)
        if m:
            # Keep passing the server's log on, so that its pipe never fills up.
            threading.Thread(target=lambda: [console.note(x) for x in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("rgpu-opserver did not start")


def sparkline(values, width=60):
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    step = max(1, len(values) // width)
    picked = values[::step]
    return "".join(bars[int((v - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for v in picked)


def wait_for_compiles(console, rgpu):
    """Waits, visibly, until the server has compiled what it started compiling; returns seconds."""
    start = time.time()
    while rgpu.server_stats()["compiles_pending"]:
        console.draw(f"waiting for Inductor to compile the training step ... {time.time() - start:.0f} s")
        time.sleep(0.5)
    console.end()
    return time.time() - start


def main():
    console = Console()
    proc = None
    if not os.environ.get("RGPU_OPSERVER"):
        proc, address = start_server(console)
        os.environ["RGPU_OPSERVER"] = address
    import rgpu

    try:
        torch.manual_seed(0)
        model = TinyGPT().to("rgpu")
        opt, sched = gpt_optimizer(model, STEPS + COMPILED_STEPS)
        losses, times = [], []

        def train(steps, label):
            for i in range(steps):
                start = time.perf_counter()
                idx, tgt = gpt_batch(len(losses))
                opt.zero_grad()
                loss = model(idx.to("rgpu"), tgt.to("rgpu"))
                loss.backward()
                opt.step()
                sched.step()
                losses.append(loss.item())
                times.append(time.perf_counter() - start)
                done = (i + 1) * 30 // steps
                console.draw(f"{label} [{'#' * done}{'.' * (30 - done)}] step {len(losses)} "
                             f"loss {losses[-1]:.4f}")
            console.end()
            return 1000 * statistics.median(times[-steps:][steps // 10:])

        before = train(STEPS, "training")
        counters = rgpu.stats()  # of the training steps; the wait below has its own
        server = rgpu.server_stats()
        print(f"\n{STEPS} steps at {before:.1f} ms/step (median), "
              f"{server['session']['compiled_runs']} of them compiled")
        if server["compiler"] == "inductor":
            waited = wait_for_compiles(console, rgpu)
            print(f"compiled after {waited:.0f} s more; training on with the compiled step")
            start = rgpu.stats()
            after = train(COMPILED_STEPS, "compiled")
            end = rgpu.stats()
            for k in end:
                counters[k] = end[k] if k == "live_tensors" else counters[k] + end[k] - start[k]
            print(f"\nstep time: {before:.1f} ms before the switch to Inductor, {after:.1f} ms "
                  f"after ({before / after:.2f}x)")
        total = len(losses)
        print(f"\nloss {losses[0]:.3f} -> {losses[-1]:.3f}  {sparkline(losses)}\n")
        print("rgpu.stats() over the training steps:")
        for k, v in counters.items():
            print(f"  {k:15} {v:>10}   ({v / total:.1f} per step)")
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
