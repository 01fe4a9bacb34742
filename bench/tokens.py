"""Per-token latency of greedy generation against CPU eager: the inference figure of the
symbolic-shapes work (bench/README.md, "Per generated token").

    python bench/tokens.py [--tokens 100] [--rounds 7] [--models gpt2,llama]
                           [--caches dynamic,static]

For each model and KV cache of examples/generation.py (2 layers, width 64, context 256), three
processes stay warm: cpu-eager, rgpu-plan and rgpu-inductor, the last two against
rgpu-opserver processes on loopback that this script starts (the Inductor one with a fresh
cache, its compiles finished before timing). A round asks each process in turn for three calls
of `tokens` new tokens from an 8-token prompt and keeps the median; the time is the median
over the rounds, and the ratio the median of each round's ratio to CPU eager's in that round
(with their range), so a slow spell of the machine falls on both sides of a ratio. Also
reported: the time spent in the stopping check's `.item()` (cutting the graph, sending it,
waiting for the reply), per token. Tokens are checked against CPU eager's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from suite import Proc, opserver  # noqa: E402


def child(args):
    """Serves rounds on stdin: prints per-token ms and the stopping check's share."""
    import torch
    from generation import Cache, GPT2Style, LlamaStyle

    device = "rgpu" if args.system.startswith("rgpu") else "cpu"
    if device == "rgpu":
        import rgpu
    torch.manual_seed(0)
    model = (GPT2Style if args.model == "gpt2" else LlamaStyle)(context=256).eval().to(device)
    prompt = torch.randint(0, model.vocab, (1, 8)).to(device)

    @torch.no_grad()
    def generate():
        kv = Cache(args.cache, len(model.blocks), 1, model.kv_heads, model.head_dim,
                   model.context, model.tok.weight)
        ids, step = prompt, prompt
        done = torch.zeros(1, dtype=torch.bool, device=device)
        check = 0.0
        for _ in range(args.tokens):  # examples/generation.py's loop, with the check timed
            logits = model(step, kv)
            step = logits[:, -1].argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, step], dim=1)
            done = done | (step.squeeze(1) == -1)
            start = time.perf_counter()
            if done.all().item():
                break
            check += time.perf_counter() - start
        return ids.cpu(), check

    tokens, _ = generate()
    for _ in range(2):
        generate()
    if device == "rgpu":
        while rgpu.server_stats()["compiles_pending"]:
            time.sleep(0.5)
        generate()
    print(json.dumps({"tokens": tokens.tolist()}), flush=True)
    for _ in sys.stdin:
        calls = []
        for _ in range(3):
            start = time.perf_counter()
            _, check = generate()
            calls.append((time.perf_counter() - start, check))
        total, check = sorted(calls)[1]
        print(json.dumps({"token_ms": total / args.tokens * 1e3,
                          "check_ms": check / args.tokens * 1e3}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100, help="new tokens per call")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--models", default="gpt2,llama", help="gpt2 and/or llama")
    parser.add_argument("--caches", default="dynamic,static", help="dynamic and/or static")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    with tempfile.TemporaryDirectory() as cache_dir:
        servers = {
            "rgpu-plan": Proc([opserver(), "--device", "cpu", "--port", "0", "--compiler",
                               "plan"], r"listening on ([\d.]+:\d+)"),
            "rgpu-inductor": Proc([opserver(), "--device", "cpu", "--port", "0", "--compiler",
                                   "inductor", "--cache-dir", cache_dir],
                                  r"listening on ([\d.]+:\d+)"),
        }
        try:
            print(f"{args.tokens} tokens a call; ms a token (x CPU eager in the same round, "
                  "median [range] over rounds), of which the stopping check; median of",
                  args.rounds, "rounds")
            for model in args.models.split(","):
                for cache in args.caches.split(","):
                    measure(args, model, cache, servers)
        finally:
            for s in servers.values():
                s.stop()


def measure(args, model, cache, servers):
    systems = ["cpu-eager", "rgpu-plan", "rgpu-inductor"]
    procs = {}
    for system in systems:  # one after another: the Inductor one compiles while warming up
        env = dict(os.environ)
        if system in servers:
            env["RGPU_OPSERVER"] = servers[system].address
        procs[system] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", "--system", system,
             "--model", model, "--cache", cache, "--tokens", str(args.tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = procs[system].stdout.readline()
        if not line:
            raise SystemExit(f"{system} ({model}, {cache} cache) failed")
        tokens = json.loads(line)["tokens"]
        if system == "cpu-eager":
            expected = tokens
        elif tokens != expected:
            raise SystemExit(f"{system} ({model}, {cache} cache): tokens differ from CPU eager's")
    rounds = {s: [] for s in systems}
    for _ in range(args.rounds):
        for system in systems:
            procs[system].stdin.write("round\n")
            procs[system].stdin.flush()
            rounds[system].append(json.loads(procs[system].stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    cells = []
    for system in systems:
        t = statistics.median(r["token_ms"] for r in rounds[system])
        check = statistics.median(r["check_ms"] for r in rounds[system])
        # Each round's ratio to CPU eager's in the same round, seconds apart: a slow spell of
        # the machine that spans a round falls on both sides of its ratio.
        ratios = sorted(r["token_ms"] / e["token_ms"]
                        for r, e in zip(rounds[system], rounds["cpu-eager"]))
        cells.append(f"{system} {t:.3f} ({statistics.median(ratios):.2f}x "
                     f"[{ratios[0]:.2f}-{ratios[-1]:.2f}], check {check:.3f})")
    print(f"{model:5} {cache:7}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
