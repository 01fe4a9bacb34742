"""Ctrl-C and rgpu.cancel() during a wait for the server: the wait ends at once, the server stops
the session's runs at its next kernel, a run is all or nothing (what it updated in place keeps
its value from before), what it was computing raises rgpu.Cancelled, and the session goes on.
In a script, from another thread, and in a real Jupyter kernel."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest


# A model that has trained three steps (its optimizer has state), then a step whose graph also
# carries ~20 s of server work: 400 chained matmuls. SNAPSHOT is what the parameters and the
# optimizer state hold before that step, bit for bit.
SETUP = """
import copy, json, os, sys, threading, time
import torch, rgpu
R = "rgpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
cpu_model = copy.deepcopy(model)
model.to(R)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
x = torch.randn(16, 32)
for _ in range(3):
    loss = model(x.to(R)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss.item()
def snapshot():
    state = [t.cpu() for s in opt.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
    return [v.cpu() for v in model.state_dict().values()] + state
before = snapshot()
big = torch.randn(1200, 1200, device=R)
w = torch.randn(1200, 1200, device=R) / 35
loss = model(x.to(R)).square().mean()
loss.backward()
y = big
for _ in range(400):
    y = y @ w
opt.step()
opt.zero_grad()
"""

# After the interrupt: the server is idle soon, the cancelled run is counted, the model reads
# as before the step, the long result raises rgpu.Cancelled, and new work is right.
CHECK = """
start = time.time()
rgpu.synchronize()
idle_s = time.time() - start
after = snapshot()
unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
try:
    y.sum().item()
    cancelled = None
except rgpu.Cancelled as e:
    cancelled = str(e)
cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
out_ok = torch.equal(model(x.to(R)).cpu(), cpu_model(x))
print(json.dumps({"idle_s": idle_s, "unchanged": unchanged, "cancelled": cancelled,
                  "runs_cancelled": rgpu.server_stats()["session"]["runs_cancelled"],
                  "out_ok": out_ok, "arange": (torch.arange(4., device=R) * 2).tolist()}),
      flush=True)
"""

SCRIPT = SETUP + """
print("ready", flush=True)
try:
    y.sum().item()
    print(json.dumps({"finished": True}), flush=True)
    sys.exit(0)
except KeyboardInterrupt as e:
    print(json.dumps({"raised_at": time.time(), "message": str(e)}), flush=True)
""" + CHECK


def check_after(result):
    assert result["idle_s"] < 1.0, result
    assert result["unchanged"], "the interrupted step changed the parameters or optimizer state"
    assert result["cancelled"] and "cancelled" in result["cancelled"], result
    assert result["runs_cancelled"] >= 1, result
    assert result["out_ok"], "the model computes differently from CPU after the interrupt"
    assert result["arange"] == [0.0, 2.0, 4.0, 6.0]


def test_ctrl_c_in_a_script_ends_the_wait_and_the_server_run(server):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env=dict(os.environ, RGPU_OPSERVER=server.address))
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        time.sleep(1.0)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        interrupted = json.loads(proc.stdout.readline())
        assert "raised_at" in interrupted, "the long graph finished before the interrupt"
        assert interrupted["raised_at"] - sent < 1.0, interrupted["raised_at"] - sent
        assert "interrupted" in interrupted["message"], interrupted
        check_after(json.loads(proc.stdout.readline()))
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        proc.kill()


def test_rgpu_cancel_from_another_thread_raises_cancelled(server):
    code = SETUP + """
timer = threading.Timer(1.0, rgpu.cancel)
timer.start()
start = time.time()
try:
    y.sum().item()
    print(json.dumps({"finished": True}), flush=True)
except rgpu.Cancelled as e:
    print(json.dumps({"after_s": time.time() - start, "message": str(e)}), flush=True)
""" + CHECK
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, RGPU_OPSERVER=server.address))
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = (json.loads(line) for line in r.stdout.splitlines()[:2])
    assert "after_s" in first, "the long graph finished before rgpu.cancel()"
    assert first["after_s"] < 2.0, first
    check_after(second)


def test_a_cancel_stops_only_earlier_frames_and_the_session_keeps_its_state(server):
    # Work sent without waiting, then rgpu.cancel() with nothing waiting: what was sent stops,
    # later work runs, and tensors that were already computed are untouched.
    code = """
import torch, rgpu, json
R = "rgpu"
kept = torch.arange(6., device=R).reshape(2, 3)
kept.cpu()
y = torch.randn(1200, 1200, device=R)
w = torch.randn(1200, 1200, device=R) / 35
for _ in range(400):
    y = y @ w
rgpu.mark_step()
rgpu.cancel()
try:
    y.sum().item()
    outcome = "finished"
except rgpu.Cancelled:
    outcome = "cancelled"
z = (kept * 2).sum().item()
print(json.dumps([outcome, z, kept.tolist()]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, RGPU_OPSERVER=server.address))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == ["cancelled", 30.0, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]]


def test_a_jupyter_kernel_interrupt_stops_the_cell_and_the_next_cell_works(server, tmp_path):
    jupyter_client = pytest.importorskip("jupyter_client")
    pytest.importorskip("ipykernel")
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env=dict(os.environ, RGPU_OPSERVER=server.address,
                             JUPYTER_RUNTIME_DIR=str(tmp_path)), cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)

        def run(code, timeout=120):
            """Runs a cell; its stdout, and its error's name if it raised."""
            msg_id = kc.execute(code)
            out, error = [], None
            while True:
                msg = kc.get_iopub_msg(timeout=timeout)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    out.append(content["text"])
                elif kind == "error":
                    error = (content["ename"], time.time())
                elif kind == "status" and content["execution_state"] == "idle":
                    return "".join(out), error

        out, error = run(SETUP)
        assert error is None, out
        # (stop_on_error=False: the kernel would drop the cells sent soon after the error)
        msg_id = kc.execute("y.sum().item()", stop_on_error=False)
        time.sleep(1.0)
        sent = time.time()
        km.interrupt_kernel()
        error = None
        while error is None:
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "error":
                error = (msg["content"]["ename"], time.time())
        assert error[0] == "KeyboardInterrupt", error
        assert error[1] - sent < 1.0, error[1] - sent
        out, error = run(CHECK)
        assert error is None, out
        assert out.strip(), "the cell printed nothing"
        check_after(json.loads(out.strip().splitlines()[-1]))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
