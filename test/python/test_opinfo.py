"""The OpInfo sweep as a test: rgpu must keep at least the pass rate recorded in docs/opinfo.md."""

import os
import re
import subprocess
import sys

# The rate measured when docs/opinfo.md was last updated, less a small margin for noise in
# which sample inputs OpInfo generates.
MIN_PASS_RATE = float(os.environ.get("RGPU_OPINFO_MIN_RATE", "95"))


def test_opinfo_float32_pass_rate(server):
    script = os.path.join(os.path.dirname(__file__), "opinfo_sweep.py")
    r = subprocess.run(
        [sys.executable, script, "--limit-samples", "2"],
        env=dict(os.environ, RGPU_OPSERVER=server.address),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(r.stdout[-4000:])
    m = re.search(r"opinfo \(.*\): (\d+)/(\d+) ops pass \(([\d.]+)%\)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    assert float(m.group(3)) >= MIN_PASS_RATE, r.stdout[-4000:]
