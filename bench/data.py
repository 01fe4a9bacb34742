"""Time to the first training step, and per checkpoint, with the weights crossing a slow link.

    python bench/data.py [--mbit 100] [--rtt-ms 20] [--layers 12]

A GPT-2-small-shaped model (124M parameters, 500 MB in float32) starts on the CPU of a client
process and trains one step on rgpu-opserver (--compiler plan) behind bench/relay.py; then it
saves a checkpoint. Each system runs twice, as two processes of one user would, each a fresh
client against the same server:

  before   RGPU_UPLOAD_STORE=0: every start uploads every weight; the checkpoint is a local
           torch.save, every weight downloaded
  after    uploads named by their digest (the second run finds them in the server's store);
           the checkpoint is torch.save to rgpu.remote(...), written on the server

Prints one JSON line per run and a table; writes bench/results/data.json.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from suite import Proc, opserver  # noqa: E402

CHILD = r"""
import json, os, sys, time, torch, rgpu
layers, remote = int(sys.argv[1]), sys.argv[2] == "after"
torch.manual_seed(0)
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(n_layer=layers))
ids = torch.randint(0, 50257, (1, 64))
start = time.perf_counter()
model.to("rgpu")
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
loss = model(ids.to("rgpu"), labels=ids.to("rgpu")).loss
loss.backward()
opt.step()
loss.item()
first_step = time.perf_counter() - start
sent = rgpu.stats()["bytes_out"]
start = time.perf_counter()
if remote:
    torch.save(model.state_dict(), rgpu.remote("bench/ckpt.pt"))
else:
    torch.save(model.state_dict(), os.path.join(sys.argv[3], "ckpt.pt"))
checkpoint = time.perf_counter() - start
s = rgpu.stats()
print(json.dumps({"first_step_s": first_step, "checkpoint_s": checkpoint,
                  "start_mb_sent": sent / 1e6, "checkpoint_mb_received": s["bytes_in"] / 1e6,
                  "mb_deduplicated": s["upload_bytes_deduplicated"] / 1e6}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbit", type=float, default=100)
    parser.add_argument("--rtt-ms", type=float, default=20)
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 layers (12: GPT-2 small)")
    parser.add_argument("--systems", default="before,after", help="of before, after")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="rgpu-bench-data-")
    server = Proc([opserver(), "--device", "cpu", "--port", "0", "--compiler", "plan",
                   "--cache-dir", os.path.join(work, "cache"), "--files-dir",
                   os.path.join(work, "files")], r"listening on ([\d.]+:\d+)")
    relay = Proc([sys.executable, os.path.join(HERE, "relay.py"), "--target", server.address,
                  "--rtt-ms", str(args.rtt_ms), "--mbit", str(args.mbit)],
                 r"relay listening on ([\d.]+:\d+)")
    rows = []
    try:
        for system in args.systems.split(","):
            for run in ("first", "second"):
                env = dict(os.environ, RGPU_OPSERVER=relay.address,
                           RGPU_UPLOAD_STORE="0" if system == "before" else "1")
                r = subprocess.run([sys.executable, "-c", CHILD, str(args.layers), system, work],
                                   env=env, capture_output=True, text=True, timeout=3600)
                if r.returncode:
                    raise SystemExit(r.stdout + r.stderr)
                row = {"system": system, "run": run, **json.loads(r.stdout.splitlines()[-1])}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        relay.stop()
        server.stop()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "data.json"), "w") as f:
        json.dump({"mbit": args.mbit, "rtt_ms": args.rtt_ms, "layers": args.layers,
                   "rows": rows}, f, indent=1)
    print(f"\nGPT-2 ({args.layers} layers) at {args.mbit:g} Mbit/s, {args.rtt_ms:g} ms round trip")
    print("| system | run | first step, s | MB sent | checkpoint, s | MB received |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['system']} | {r['run']} | {r['first_step_s']:.1f} | {r['start_mb_sent']:.1f} "
              f"| {r['checkpoint_s']:.1f} | {r['checkpoint_mb_received']:.1f} |")


if __name__ == "__main__":
    main()
