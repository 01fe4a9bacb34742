"""Bad input gets a clear, named error at the right place, and the session goes on."""

import os

import pytest
import torch
from conftest import run_client, same

import rgpu

R = "rgpu"
THIS_FILE = os.path.basename(__file__)


def lineno_of(marker):
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "lineno_of" not in line:
                return i
    raise AssertionError(marker)


def test_a_shape_error_raises_locally_with_torchs_message():
    a = torch.ones(2, 3, device=R)
    before = rgpu.stats()["waits"]
    # CPU eager's words: the checks are its meta functions'.
    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied \(2x3 and 2x3\)") as info:
        a @ a
    assert not isinstance(info.value, rgpu.RemoteError)
    with pytest.raises(RuntimeError, match=r"size of tensor a \(3\) must match the size of tensor b \(4\)"):
        a + torch.ones(4, device=R)
    assert rgpu.stats()["waits"] == before


def test_mixing_devices_raises_like_torch_but_cpu_scalars_are_fine():
    a = torch.ones(3, device=R)
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3)
    same(a + torch.tensor(2.0), torch.full((3,), 3.0))
    same(a * 2, torch.full((3,), 2.0))


def test_a_cpu_generator_given_to_an_rgpu_op_is_refused_at_the_call():
    g = torch.Generator()
    with pytest.raises(TypeError, match="generator of device cpu"):
        torch.randn(3, device=R, generator=g)
    same(torch.ones(2, device=R) + 1, torch.full((2,), 2.0))


def test_sparse_layouts_are_refused_at_the_call():
    with pytest.raises((NotImplementedError, TypeError), match="strided"):
        torch.ones(2, 2, device=R).to_sparse()
    # Sparse tensors made on rgpu directly, or by a sparse embedding's backward, name the op.
    with pytest.raises(NotImplementedError, match="_sparse_coo_tensor.*strided tensors only"):
        torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2,), device=R)
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(R)
    with pytest.raises(NotImplementedError, match="sparse=False"):
        embedding(torch.tensor([1, 2], device=R)).sum().backward()
    same(torch.ones(2, device=R) * 3, torch.full((2,), 3.0))


def test_a_failure_only_the_data_reveals_names_the_op_and_the_users_line():
    x = torch.randn(4, 3, device=R)
    bad = torch.tensor([0, 7]).to(R)
    y = x.index_select(0, bad)  # the failing line
    with pytest.raises(rgpu.RemoteError) as info:
        y.sum().item()
    message = str(info.value)
    assert "index_select" in message
    assert f"{THIS_FILE}:{lineno_of('# the failing line')}" in message
    assert isinstance(info.value, RuntimeError)
    # Reading the poisoned tensor again raises again; everything else goes on working.
    with pytest.raises(rgpu.RemoteError, match="index_select"):
        y.cpu()
    same(x.sum(dim=0) * 0 + 1, torch.ones(3))


def test_a_remote_failure_is_also_the_exception_cpu_eager_raises():
    # `except IndexError:` written for CPU catches the same failure found on the server.
    cases = [
        (IndexError, lambda d: torch.nn.functional.embedding(
            torch.tensor([12], device=d), torch.ones(10, 3, device=d))),
        (IndexError, lambda d: torch.nn.functional.cross_entropy(
            torch.ones(2, 3, device=d), torch.tensor([0, 5], device=d))),
        (torch.linalg.LinAlgError, lambda d: torch.linalg.cholesky_ex(
            -torch.eye(2, device=d), check_errors=True).L),
        (RuntimeError, lambda d: torch.multinomial(torch.tensor([-1.0, 2.0], device=d), 1)),
    ]
    for expected, fn in cases:
        with pytest.raises(expected) as on_cpu:
            fn("cpu")
        with pytest.raises(rgpu.RemoteError) as on_rgpu:
            fn(R).cpu()
        assert isinstance(on_rgpu.value, expected), (type(on_rgpu.value).__mro__, expected)
        assert type(on_cpu.value) in type(on_rgpu.value).__mro__
        assert str(on_cpu.value).splitlines()[0] in str(on_rgpu.value)


def test_the_users_line_is_found_in_generators_threads_and_code_run_again():
    import threading

    x = torch.randn(4, 3, device=R)
    bad = torch.tensor([0, 7]).to(R)

    def failing_line(make):
        with pytest.raises(rgpu.RemoteError) as info:
            make().sum().item()
        return str(info.value)

    def rows():
        yield x.index_select(0, bad)  # in a generator

    assert f"{THIS_FILE}:{lineno_of('# in a generator')}" in failing_line(lambda: next(rows()))

    def select(i):
        if i == 0:
            return x.index_select(0, bad)  # first branch
        return x.index_select(0, bad)  # second branch

    # The same code object, at two instructions: each names its own line, every time.
    for _ in range(2):
        assert f"{THIS_FILE}:{lineno_of('# first branch')}" in failing_line(lambda: select(0))
        assert f"{THIS_FILE}:{lineno_of('# second branch')}" in failing_line(lambda: select(1))

    messages = []
    worker = threading.Thread(target=lambda: messages.append(failing_line(lambda: select(1))))
    worker.start()
    worker.join()
    assert f"{THIS_FILE}:{lineno_of('# second branch')}" in messages[0]


def test_from_file_is_refused_and_reads_nothing(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x01" * 64)
    before = rgpu.stats()["bytes_in"]
    with pytest.raises(rgpu.RemoteError, match="from_file"):
        torch.from_file(str(secret), size=16, dtype=torch.float32, device=R)
    assert rgpu.stats()["bytes_in"] - before < 1024
    same(torch.ones(1, device=R), torch.ones(1))


def test_a_refused_connection_says_how_to_start_the_server():
    r = run_client("127.0.0.1:1", "import torch, rgpu\ntorch.ones(1, device='rgpu').item()")
    assert r.returncode != 0
    assert "SessionLost" in r.stderr and "rgpu-opserver" in r.stderr, r.stderr


def test_a_killed_server_becomes_session_lost_after_the_reconnect_budget(fresh_server):
    # Nothing answers on its port any more: the client tries to resume for
    # RGPU_RECONNECT_SECONDS, then the session is lost.
    code = f"""
import os, signal, time, torch, rgpu
x = torch.ones(4, device='rgpu')
assert x.sum().item() == 4
os.kill({fresh_server.proc.pid}, signal.SIGKILL)
time.sleep(0.2)
start = time.time()
try:
    (x * 2).sum().item()
    print('no error')
except rgpu.SessionLost as e:
    print('lost after', time.time() - start, e)
try:
    torch.ones(1, device='rgpu').item()
except rgpu.SessionLost:
    print('still lost')
"""
    r = run_client(fresh_server.address, code, env={"RGPU_RECONNECT_SECONDS": "2"}, timeout=30)
    assert "lost after" in r.stdout, r.stdout + r.stderr
    assert 2 <= float(r.stdout.split("lost after")[1].split()[0]) < 4.5
    assert "could not be reached again within 2 s (RGPU_RECONNECT_SECONDS" in r.stdout
    assert "still lost" in r.stdout


TRAIN = """
import os, sys, torch, rgpu
sys.path.insert(0, {examples!r})
from models import SmallCNN, TinyGPT, gpt_batch, gpt_optimizer
torch.manual_seed(0)
kind = {kind!r}
if kind == 'gpt':
    model = TinyGPT().to('rgpu')
    opt, _ = gpt_optimizer(model)
else:
    model = SmallCNN().to('rgpu')
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
losses = []
for step in range(8):
    opt.zero_grad()
    if kind == 'gpt':
        idx, tgt = gpt_batch(step)
        loss = model(idx.to('rgpu'), tgt.to('rgpu'))
    else:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 1, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x.to('rgpu')), y.to('rgpu'))
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(repr(losses))
"""


def test_two_clients_training_at_once_get_their_solo_results(server):
    import subprocess
    import sys

    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    codes = [TRAIN.format(examples=examples, kind=k) for k in ("gpt", "cnn")]
    solo = [run_client(server.address, c).stdout for c in codes]
    env = dict(os.environ, RGPU_OPSERVER=server.address)
    procs = [subprocess.Popen([sys.executable, "-c", c], env=env, stdout=subprocess.PIPE, text=True) for c in codes]
    together = [p.communicate(timeout=300)[0] for p in procs]
    assert all(s.strip().startswith("[") for s in solo), solo
    assert together == solo


def test_in_place_broadcast_errors_survive_the_memo_of_passed_checks():
    x = torch.zeros(3, device="rgpu")
    for _ in range(2):
        x.add_(torch.ones(3, device="rgpu"))  # the same signature passes, then is remembered
    with pytest.raises(RuntimeError, match="broadcast"):
        x.add_(torch.ones(2, 3, device="rgpu"))
    with pytest.raises(RuntimeError, match="broadcast"):
        x.add_(torch.ones(2, 3, device="rgpu"))
    assert x.cpu().tolist() == [2.0, 2.0, 2.0]


def test_remembered_in_place_checks_run_no_python_and_keep_eager_results():
    import sys

    def step(params, grads, weight, alpha):
        torch._foreach_add_(params, grads, alpha=alpha)
        params[0].lerp_(grads[0], weight)
        params[1].clamp_(min=-alpha)

    cpu = [torch.randn(4, 3), torch.randn(5)]
    grads = [torch.randn(4, 3), torch.randn(5)]
    on = [p.to("rgpu") for p in cpu]
    on_grads = [g.to("rgpu") for g in grads]
    step(on, on_grads, 0.5, 0.25)  # the first signature runs torch's Python meta kernels
    calls = []

    def profile(frame, event, arg):  # every Python function called, but the loop's own
        if event == "call" and frame.f_code is not step.__code__:
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        for weight, alpha in ((0.1, 0.75), (0.9, 2.0)):  # new values, the same signature
            step(on, on_grads, weight, alpha)
    finally:
        sys.setprofile(None)
    assert calls == []
    for weight, alpha in ((0.5, 0.25), (0.1, 0.75), (0.9, 2.0)):
        step(cpu, grads, weight, alpha)
    for a, b in zip(on, cpu):
        torch.testing.assert_close(a.cpu(), b)
    with pytest.raises(RuntimeError, match="broadcast|shape"):
        on[1].lerp_(torch.ones(2, 5, device="rgpu"), 0.5)


def test_ctrl_c_during_a_long_wait_raises_keyboardinterrupt(server):
    # A wait of over a second is logged when it ends; the log call ran Python's SIGINT handler
    # and swallowed its KeyboardInterrupt, so Ctrl-C during a long step was lost.
    script = r"""
import os, signal, threading, time, torch, rgpu
x = torch.randn(1500, 1500, device='rgpu')
y = x
for _ in range(120):
    y = (y @ x).tanh()
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    y.sum().item()
    time.sleep(0.5)  # a lost interrupt would not come back
    print('not interrupted')
except KeyboardInterrupt:
    print('interrupted')
print((torch.ones(3, device='rgpu') * 2).sum().item())
"""
    r = run_client(server.address, script)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["interrupted", "6.0"], (r.stdout, r.stderr)
    assert "Exception ignored" not in r.stderr, r.stderr
