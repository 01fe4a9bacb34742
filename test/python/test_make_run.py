"""`make run`, the README's first command, as a new user sees it: no warnings, the server's log
never inside the progress bar's line, and the step time before and after the Inductor switch."""

import os
import re
import subprocess

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_make_run_output_is_tidy_and_shows_the_compiled_step_time():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    r = subprocess.run(["make", "run"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=1200)
    out = r.stdout
    assert r.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert not [line for line in lines if re.search(r"warn", line, re.I)], out[-3000:]
    bars = [line for line in lines if re.search(r"(training|compiled) \[", line)]
    assert bars, out[-3000:]
    assert not [line for line in bars if "rgpu-opserver" in line], out[-3000:]
    m = re.search(r"step time: ([\d.]+) ms before the switch to Inductor, ([\d.]+) ms after", out)
    assert m, out[-3000:]
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0
