"""What sealing a TCP session's frames costs a training step: bench/suite.py's small GPT
(`gpt`, `.item()` every step, and `gpt-ready`, pipelined) against one rgpu-opserver (plan
executor), by its Unix socket (plaintext) and by TCP (sealed, rgpu/net/Seal.h), in interleaved
rounds of one run. The TCP figure also carries TCP's loopback costs against a Unix socket's,
so the difference bounds what sealing costs from above.

    .venv/bin/python bench/sealed.py [--steps 240] [--rounds 8]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    socket_path = os.path.join(tempfile.mkdtemp(prefix="rgpu-sealed-"), "opserver.sock")
    server = subprocess.Popen([suite.opserver(), "--device", "cpu", "--compiler", "plan",
                               "--port", "0", "--socket", socket_path],
                              stderr=subprocess.PIPE, text=True)
    tcp = None
    for line in server.stderr:
        if m := re.search(r"listening on ([\d.]+:\d+)", line):
            tcp = m.group(1)
            break
    try:
        for workload in ("gpt", "gpt-ready"):
            # measure() keys its children by (system, rtt): rtt 0 is TCP, 1 the Unix socket.
            results = suite.measure(workload, [("rgpu-plan", 0), ("rgpu-plan", 1)],
                                    {("rgpu-plan", 0): tcp,
                                     ("rgpu-plan", 1): "unix:" + socket_path},
                                    3, args.steps, args.rounds)
            sealed, plain = (r["step_ms"] for r in results)
            per_step = (results[0].get("bytes_up_per_step", 0) +
                        results[0].get("bytes_down_per_step", 0))
            print(f"{workload}: tcp sealed {sealed:.3f} ms, unix plaintext {plain:.3f} ms a "
                  f"step: {sealed / plain:.3f}x ({per_step / 1024:.1f} KiB a step each way "
                  f"together)", flush=True)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
