"""Values that arrive without being asked: small outputs ride back with their run's reply, so a
read of them costs no wait once the reply is in; rgpu.on_ready delivers values as they arrive;
RGPU_MAX_INFLIGHT holds a client that outruns its server; rgpu.prefetch uploads ahead."""

import io
import os
import sys
import time

import pytest
import torch
import torch.nn as nn

import rgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from models import TinyGPT, gpt_batch, gpt_optimizer  # noqa: E402

R = "rgpu"


def delta(before):
    after = rgpu.stats()
    return {k: after[k] - before[k] for k in ("waits", "messages", "downloads", "throttled")}


def mlp_step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def mlp(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step, device):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g).to(device), torch.randn(16, 1, generator=g).to(device)


def cpu_losses(steps):
    model, opt = mlp("cpu")
    return [mlp_step(model, opt, *batch(s, "cpu")).item() for s in range(steps)]


@pytest.mark.parametrize("make", [
    lambda: torch.tensor(2.5),
    lambda: torch.tensor(-7, dtype=torch.int64),
    lambda: torch.tensor(True),
    lambda: torch.tensor(1.5, dtype=torch.bfloat16),
    lambda: torch.tensor(0.25, dtype=torch.float16),
    lambda: torch.tensor(1 - 2j, dtype=torch.complex64),
    lambda: torch.arange(4.0).reshape(2, 2).t(),   # a tiny transposed layout
    lambda: torch.zeros(0, 3),                     # empty
], ids=["f32", "i64", "bool", "bf16", "f16", "c64", "transposed", "empty"])
def test_a_small_output_is_read_without_a_wait_once_its_reply_is_in(make):
    a = make()
    expected = a * 3 if a.dtype != torch.bool else ~a
    out = a.to(R) * 3 if a.dtype != torch.bool else ~a.to(R)
    rgpu.mark_step()
    torch.rgpu.synchronize()  # its reply comes after the run's: the value is in
    before = rgpu.stats()
    got = out.cpu()
    assert delta(before)["waits"] == 0 and delta(before)["messages"] == 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.stride() == expected.stride() or got.numel() == 0
    assert got.numel() == 0 or out.cpu().data_ptr() != got.data_ptr()  # each read its own copy


def test_the_naive_loop_waits_at_most_once_per_step_and_sends_one_message():
    model, opt = mlp(R)
    expected = cpu_losses(8)
    for step in range(8):
        before = rgpu.stats()
        loss = mlp_step(model, opt, *batch(step, R))
        assert loss.item() == pytest.approx(expected[step], rel=1e-5, abs=1e-6)
        if step >= 2:  # one wait, or none if the reply was in before the read
            assert delta(before)["waits"] <= 1, step
            assert delta(before)["messages"] == 1, step  # no Download: the value rode back


def test_on_ready_delivers_every_loss_in_order_without_a_wait():
    model, opt = mlp(R)
    expected = cpu_losses(12)
    got = []
    before = None
    for step in range(12):
        if step == 2:
            before = rgpu.stats()
        loss = mlp_step(model, opt, *batch(step, R))
        rgpu.on_ready(lambda l, s=step: got.append((s, l.item())), loss)
    steady = delta(before)
    rgpu.flush()
    assert steady["waits"] == 0, steady
    assert [s for s, _ in got] == list(range(12))
    torch.testing.assert_close([v for _, v in got], expected, rtol=1e-5, atol=1e-6)


def gpt_loop(log, steps, warmup=10):
    """The small GPT trained `warmup` + `steps` steps, each step's loss handed to `log`; returns
    the client's counters over the `steps` steps after warm-up, the losses, and the model."""
    torch.manual_seed(0)
    model = TinyGPT().to(R)
    opt, sched = gpt_optimizer(model, steps=warmup + steps)
    batches = [gpt_batch(s) for s in range(4)]
    losses = []
    before = None
    for step in range(warmup + steps):
        if step == warmup:
            rgpu.flush()
            before = rgpu.stats()
        idx, tgt = (t.to(R) for t in batches[step % 4])
        opt.zero_grad()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        sched.step()
        log(loss, losses)
    after = rgpu.stats()
    return {k: after[k] - before[k] for k in after}, losses, model


def test_an_on_ready_loop_flushes_in_one_wait_and_costs_no_more_than_reading_each_loss():
    # The small GPT written the documented way (on_ready each step, no prefetch), beside the
    # same loop reading each loss with .item().
    ready, got, model = gpt_loop(lambda l, out: rgpu.on_ready(lambda v: out.append(v.item()), l),
                                 steps=60)
    before = rgpu.stats()
    rgpu.flush()
    flush_waits = rgpu.stats()["waits"] - before["waits"]
    item, expected, item_model = gpt_loop(lambda l, out: out.append(l.item()), steps=60)
    assert got == expected  # the same losses, bit for bit, in order
    for a, b in zip(model.parameters(), item_model.parameters()):
        assert torch.equal(a.cpu(), b.cpu())
    assert ready["waits"] == 0, ready
    assert flush_waits <= 1, flush_waits  # one round trip for every value still pending
    assert ready["graphs_shipped"] == 0 and item["graphs_shipped"] == 0, (ready, item)
    # Bytes up per step: the same frames, give or take a release that timing puts in one
    # frame or the next (a few bytes a step either way).
    assert ready["bytes_out"] <= item["bytes_out"] * 1.03, (ready["bytes_out"], item["bytes_out"])


def test_a_tqdm_postfix_loop_does_not_wait():
    tqdm = pytest.importorskip("tqdm")
    model, opt = mlp(R)
    bar = tqdm.tqdm(range(10), file=io.StringIO(), mininterval=0)
    before = None
    for step in bar:
        if step == 2:
            before = rgpu.stats()
        loss = mlp_step(model, opt, *batch(step, R))
        rgpu.on_ready(lambda l: bar.set_postfix(loss=f"{l.item():.4f}"), loss)
    steady = delta(before)
    rgpu.flush()
    assert steady["waits"] == 0, steady
    assert "loss=" in bar.fp.getvalue()


def test_the_log_the_previous_loss_loop_reads_from_replies():
    model, opt = mlp(R)
    expected = cpu_losses(10)
    previous, got, per_step = None, [], []
    for step in range(10):
        before = rgpu.stats()
        loss = mlp_step(model, opt, *batch(step, R))
        if previous is not None:
            got.append(previous.item())
        previous = loss
        per_step.append(delta(before))
    torch.testing.assert_close(got, expected[:9], rtol=1e-5, atol=1e-6)
    # Reading the previous step's loss sends nothing: at most the wait for a reply in transit.
    assert all(s["messages"] == 1 and s["waits"] <= 1 for s in per_step[2:]), per_step


def test_on_ready_of_large_pending_and_cpu_values():
    big = torch.randn(300, 300)
    big_r = big.to(R)
    doubled = big_r * 2  # pending: its cut asks for it
    seen = []
    rgpu.on_ready(lambda a, b, c: seen.append((a, b, c)), big_r, doubled, 7)
    rgpu.on_ready(lambda a: seen.append(a), big_r.t())  # another layout of data already there
    rgpu.flush()
    assert len(seen) == 2
    a, b, c = seen[0]
    torch.testing.assert_close(a, big, rtol=0, atol=0)
    torch.testing.assert_close(b, big * 2, rtol=0, atol=0)
    assert c == 7
    torch.testing.assert_close(seen[1], big.t(), rtol=0, atol=0)


def test_a_failing_callback_raises_at_the_sync_point_and_is_not_run_again():
    calls = []

    def fail(v):
        calls.append(v)
        raise ValueError("callback failed")

    x = torch.tensor(1.0).to(R) + 1
    rgpu.mark_step()
    torch.rgpu.synchronize()
    with pytest.raises(ValueError, match="callback failed"):
        rgpu.on_ready(fail, x)
    rgpu.flush()
    assert len(calls) == 1


def test_an_error_in_a_run_nobody_waited_for_is_raised_at_the_next_read():
    x = torch.randn(4, 3).to(R)
    bad = torch.index_select(x, 0, torch.tensor([0, 9]).to(R)).sum()  # fails on the server
    rgpu.mark_step()
    ok = (x * 2).sum()
    rgpu.mark_step()
    while not rgpu._C.has_value(ok):  # the error came back in the reply to the failing run
        time.sleep(0.001)
    with pytest.raises(rgpu.RemoteError, match="index_select failed on the server at .*test_values"):
        ok.item()
    with pytest.raises(rgpu.RemoteError, match="index"):
        bad.item()  # poisoned: its value never came
    assert (torch.ones(2).to(R) * 3).sum().item() == 6.0  # the session goes on
    bad2 = torch.index_select(x, 0, torch.tensor([7]).to(R)).sum()  # noqa: F841 (kept alive)
    rgpu.mark_step()
    with pytest.raises(rgpu.RemoteError, match="index"):
        torch.rgpu.synchronize()  # as before: a sync raises what failed since the last one


def test_flush_raises_for_a_value_that_failed():
    x = torch.randn(4, 3).to(R)
    bad = torch.index_select(x, 0, torch.tensor([5]).to(R)).sum()
    rgpu.on_ready(lambda v: None, bad)
    rgpu.mark_step()
    with pytest.raises(rgpu.RemoteError, match="index"):
        rgpu.flush()
    rgpu.flush()  # nothing left


def heavy_steps(n):
    w = torch.randn(400, 400).to(R)
    for _ in range(n):
        for _ in range(6):
            w = torch.tanh(w @ w) * 0.5
        rgpu.mark_step()
    return w


def test_max_inflight_holds_a_client_that_outruns_the_server():
    heavy_steps(1).cpu()  # defined, planned
    bound = rgpu._C._set_max_inflight(64)
    try:
        before = rgpu.stats()
        w = heavy_steps(8)
        free = delta(before)
        rgpu._C._set_max_inflight(1)
        before = rgpu.stats()
        w2 = heavy_steps(8)
        held = delta(before)
    finally:
        rgpu._C._set_max_inflight(bound)
    assert free["waits"] == 0 and free["throttled"] == 0, free
    # Held back: a wait for the oldest step's reply, counted apart from waits for values.
    assert held["waits"] == 0 and held["throttled"] >= 4, held
    assert torch.isfinite(w.cpu()).all() and torch.isfinite(w2.cpu()).all()


def test_prefetch_uploads_ahead_and_keeps_structure():
    loader = [(torch.full((2,), float(i)), {"y": torch.tensor(i)}) for i in range(5)]
    seen = []
    for x, d in rgpu.prefetch(loader, depth=2):
        assert x.device.type == "rgpu" and d["y"].device.type == "rgpu"
        seen.append((x.cpu().tolist(), d["y"].item()))
    assert seen == [([float(i)] * 2, i) for i in range(5)]
    with pytest.raises(ValueError):
        next(iter(rgpu.prefetch(loader, depth=0)))


def test_pinned_host_memory_is_pinned_for_rgpu_as_for_cuda():
    """Tensor.pin_memory() and DataLoader(pin_memory=True) ask the current accelerator (rgpu)
    for pinned memory; is_pinned() then answers as on CUDA, for views into it too."""
    x = torch.arange(12.0)
    p = x.pin_memory()
    assert p.is_pinned() and torch.equal(p, x)
    assert p[5:].is_pinned() and p.view(3, 4).t().is_pinned()
    assert not x.is_pinned() and not p.clone().is_pinned()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4,
                                         pin_memory=True)
    for i, (b,) in enumerate(loader):
        assert b.is_pinned()
        assert torch.equal(b.to(R, non_blocking=True).cpu(), x[4 * i:4 * i + 4])
    del p, b
    assert not torch.empty(64).is_pinned()  # freed blocks are forgotten


def test_dlpack_refuses_an_rgpu_tensor_and_takes_its_cpu_copy():
    import numpy as np

    x = torch.arange(6.0).to(R)
    with pytest.raises(BufferError, match="x.cpu"):
        torch.from_dlpack(x)
    with pytest.raises(BufferError):
        np.from_dlpack(x)
    with pytest.raises(RuntimeError, match="x.cpu"):
        torch.utils.dlpack.to_dlpack(x)  # was a capsule over no bytes
    assert torch.equal(torch.from_dlpack(x.cpu()), torch.arange(6.0))
    assert np.from_dlpack(x.cpu().pin_memory()).tolist() == list(range(6))


def test_a_steady_gpt_step_sends_under_a_kibibyte_besides_its_batch():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from models import TinyGPT, gpt_batch, gpt_optimizer

    torch.manual_seed(0)
    model = TinyGPT().to(R)
    opt, sched = gpt_optimizer(model, 10)
    batches = [tuple(t.to(R) for t in gpt_batch(s)) for s in range(6)]  # uploaded up front
    sent = []
    for idx, tgt in batches:
        before = rgpu.stats()["bytes_out"]
        opt.zero_grad()
        model(idx, tgt).backward()
        opt.step()
        sched.step()  # a new learning rate every step: changed scalars
        sent.append(rgpu.stats()["bytes_out"] - before)
    assert all(b <= 1024 for b in sent[2:]), sent


@pytest.mark.parametrize("f", [
    lambda x: x.conj() * 1,
    lambda x: x.conj().imag,
    lambda x: torch._neg_view(x) + 0,
    lambda x: x[1:].conj(),
    lambda x: x.expand(2, 2)[0] * 1j,
], ids=["conj-mul", "conj-imag", "neg-view", "slice-conj", "expanded"])
def test_values_of_math_bit_and_view_results_match_cpu(f):
    a = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    expected, out = f(a), f(a.to(R))
    rgpu.mark_step()
    torch.rgpu.synchronize()
    got = out.cpu()
    torch.testing.assert_close(got.resolve_conj().resolve_neg(),
                               expected.resolve_conj().resolve_neg(), rtol=0, atol=0)


def remembered(before):
    return rgpu.stats()["reads_remembered"] - before["reads_remembered"]


def test_a_read_of_the_same_ops_on_the_same_data_is_remembered_not_waited_for():
    mask_cpu = torch.tensor([[True, True, False] * 4, [True, True, True] * 4])
    # Made by float arithmetic on the server, which the client leaves to it, and of more bytes
    # than ride back with a run's reply: a value the client does not know (an uploaded mask,
    # or one whose bytes came back, it would: KnownValues.h).
    mask = (mask_cpu.to(R).float() * 1.0) > 0.5
    x_cpu = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    x = x_cpu.to(R)
    rgpu.synchronize()
    before, first = rgpu.stats(), bool(mask.all())
    assert delta(before)["waits"] == 1 and remembered(before) == 0
    for _ in range(3):  # Hugging Face reads a mask that does not change at every token
        before = rgpu.stats()
        assert bool(mask.all()) == first == bool(mask_cpu.all())
        assert delta(before)["waits"] == 0 and remembered(before) == 1
    # Writes make new data: the read after one waits for the new value.
    mask[0, 2::3] = True
    mask_cpu[0, 2::3] = True
    before = rgpu.stats()
    assert bool(mask.all()) and delta(before)["waits"] == 1 and remembered(before) == 0
    # A Python scalar's value is part of what is remembered; so is each op's every argument.
    for s in (1.0, 2.0, 2.0, -3):
        assert (x * s).sum(1).cpu().tolist() == (x_cpu * s).sum(1).tolist()
        assert (x * s).sum(0).cpu().tolist() == (x_cpu * s).sum(0).tolist()
    x[1].mul_(10)
    x_cpu[1].mul_(10)
    before = rgpu.stats()
    assert (x * 2.0).sum(1).cpu().tolist() == (x_cpu * 2.0).sum(1).tolist()
    assert remembered(before) == 0
    # What a read returns is the caller's: changing it changes no later read.
    got = (x * 2.0).sum(1).cpu()
    got.add_(100)
    assert (x * 2.0).sum(1).cpu().tolist() == (x_cpu * 2.0).sum(1).tolist()


def test_random_draws_and_large_values_are_read_from_the_server_every_time():
    g = torch.Generator(device=R).manual_seed(0)
    before = rgpu.stats()
    draws = [torch.rand(4, device=R, generator=g).sum().item() for _ in range(3)]
    assert len(set(draws)) == 3 and remembered(before) == 0
    big = torch.arange(1000.0).to(R)
    before = rgpu.stats()
    for _ in range(2):
        assert torch.equal((big * 2).cpu(), torch.arange(1000.0) * 2)
    assert remembered(before) == 0 and delta(before)["waits"] == 2


def test_an_encoder_decoder_generates_with_one_wait_per_token():
    """T5's generate asks whether the encoder's attention mask is all ones before every
    token; the answer does not change, so only the stopping check waits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_layers=2,
                                   num_heads=4, decoder_start_token_id=0, dropout_rate=0.0)
    cpu = transformers.T5ForConditionalGeneration(config).eval()
    dev = transformers.T5ForConditionalGeneration(config).eval()
    dev.load_state_dict(cpu.state_dict())
    dev.to(R)
    ids = torch.randint(2, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = cpu.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        for _ in range(2):
            before = rgpu.stats()
            got = dev.generate(ids.to(R), attention_mask=torch.ones_like(ids).to(R), **kw)
            assert got.cpu().tolist() == want.tolist()
    assert delta(before)["waits"] <= 12 + 3, delta(before)


def test_a_small_value_read_once_is_read_again_without_a_wait():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    y = x.to(R) * 3  # 48 bytes: more than rides back with its run's reply
    z = (x.to(R) ** 2).sum(1, keepdim=True).expand(3, 40).contiguous()  # 480 bytes: not kept
    before = rgpu.stats()
    for _ in range(3):
        got = y.cpu()
        assert torch.equal(got, x * 3)
        got.add_(1)  # the caller's copy
        assert y[1, 2].item() == (x * 3)[1, 2].item()
    assert delta(before)["waits"] == 1  # y's bytes once; its element is then known here
    before = rgpu.stats()
    for _ in range(2):
        torch.testing.assert_close(z.cpu(), (x ** 2).sum(1, keepdim=True).expand(3, 40))
    assert delta(before)["waits"] == 2


UPLOADS = """
import torch, rgpu
for _ in range(5):  # waits, whose round trips tell RGPU_COMPRESS=auto what link this is
    torch.ones(1, device="rgpu").sum().item()
torch.manual_seed(0)
cases = [torch.randn(64, 256), torch.randn(64, 256).bfloat16(), torch.randn(40, 50).half(),
         torch.randn(128, 64, dtype=torch.float64), torch.randint(0, 50257, (16, 256)),
         torch.randint(-9, 9, (70, 70), dtype=torch.int32), torch.rand(100, 100) > 0.5,
         torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8),
         torch.randn(300, 70, dtype=torch.complex64),
         torch.randn(64, 256)[:, ::2],                                      # strided
         torch.randn(8, 16, 32, 32).to(memory_format=torch.channels_last),
         torch.arange(10001, dtype=torch.float32)[1:],                      # an offset view
         torch.zeros(0, 5), torch.tensor(3.0)]
for x in cases:
    y = x.to("rgpu")
    assert y.dtype == x.dtype and y.shape == x.shape, (y.dtype, y.shape)
    assert torch.equal(y.cpu(), x), x.dtype
    assert torch.equal((y * 1).cpu(), x * 1), x.dtype
# Training on compressed batches, uploaded ahead: CPU's losses.
def losses(device, batches):
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out
data = [(torch.randn(64, 256), torch.randint(0, 10, (64,))) for _ in range(5)]
# (CPU's own kernels round the same losses differently from run to run in the last bits.)
torch.testing.assert_close(losses("rgpu", rgpu.prefetch(data)), losses("cpu", data),
                           rtol=1e-5, atol=0)
print("saved", rgpu.stats()["upload_bytes_saved"])
"""


def saved(r):
    assert r.returncode == 0, r.stdout + r.stderr
    return int(r.stdout.split("saved")[-1])


def test_uploads_compressed_by_byte_plane_arrive_exactly(server):
    """RGPU_COMPRESS=1: every upload of 4 KiB or more travels compressed by byte plane where
    that saves a sixteenth of it; values and layouts arrive exactly, training matches CPU's."""
    from conftest import run_client

    on = saved(run_client(server.address, UPLOADS, env={"RGPU_COMPRESS": "1"}))
    # float32 noise saves about a sixth (its exponent plane), int64 token ids three quarters.
    assert on > 100_000, on
    assert saved(run_client(server.address, UPLOADS, env={"RGPU_COMPRESS": "0"})) == 0


def test_uploads_are_compressed_on_a_slow_link_only(server):
    """By default uploads are compressed where the link's fastest exchange (a Hello, or a wait
    for a reply) took 2 ms or more: there the link, not the client's CPU, is what is short."""
    import os
    import subprocess
    import sys

    from conftest import REPO, run_client

    assert saved(run_client(server.address, UPLOADS)) == 0  # loopback
    relay = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "bench", "relay.py"), "--target",
         f"127.0.0.1:{server.port}", "--rtt-ms", "10", "--mbit", "0"],
        stdout=subprocess.PIPE, text=True)
    try:
        address = relay.stdout.readline().split()[-1]
        assert saved(run_client(address, UPLOADS)) > 100_000
    finally:
        relay.kill()
        relay.wait()


def test_a_compressed_upload_of_several_chunks_arrives_exactly(server):
    """A tensor past one upload chunk (64 MiB) is compressed chunk by chunk; each decodes at its
    offset, the last one shorter."""
    from conftest import run_client

    code = """
import torch, rgpu
x = torch.randn(20_000_000)                # 80 MB: two chunks, float32 noise
i = torch.randint(0, 100, (9_000_000,))    # 72 MB of int64: two chunks, mostly zero planes
for t in (x, i):
    assert torch.equal(t.to("rgpu").cpu(), t), t.dtype
print("saved", rgpu.stats()["upload_bytes_saved"])
"""
    # Both compress: noise by its exponent plane (~1/6), the int64s by their zero planes.
    assert saved(run_client(server.address, code, env={"RGPU_COMPRESS": "1"})) > 60_000_000
