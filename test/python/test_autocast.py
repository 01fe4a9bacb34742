"""torch.autocast("rgpu") casts as CUDA does; mixed-precision training matches CPU autocast."""

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import same

import rgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from models import TinyGPT, gpt_batch  # noqa: E402

R = "rgpu"


def test_the_default_autocast_dtype_is_float16_as_for_cuda():
    assert torch.get_autocast_dtype(R) == torch.float16
    with torch.autocast(R, dtype=torch.bfloat16):
        assert torch.get_autocast_dtype(R) == torch.bfloat16
        assert torch.is_autocast_enabled(R)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmuls_run_in_lower_precision_and_softmax_norms_and_losses_in_float32(dtype):
    torch.manual_seed(0)
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    ln = nn.LayerNorm(5).to(R)
    with torch.autocast(R, dtype=dtype):
        ar, br = a.to(R), b.to(R)
        mm = ar @ br
        lin = F.linear(ar, br.t())
        sm = mm.softmax(-1)
        normed = ln(mm)
        loss = F.mse_loss(mm, torch.zeros_like(mm))
        summed = mm.sum()
        promoted = torch.addcmul(mm, ar[:, :5], br[:4])
        elementwise = mm + 1
    assert mm.dtype == lin.dtype == elementwise.dtype == dtype
    assert sm.dtype == normed.dtype == loss.dtype == summed.dtype == torch.float32
    assert promoted.dtype == torch.float32
    same(mm, (a.to(dtype) @ b.to(dtype)), rtol=0, atol=0)
    same(sm, (a.to(dtype) @ b.to(dtype)).float().softmax(-1), rtol=1e-5, atol=1e-6)


def test_out_variants_are_not_cast():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    out = torch.empty(3, 2, device=R)
    with torch.autocast(R, dtype=torch.bfloat16):
        torch.mm(a.to(R), b.to(R), out=out)
    assert out.dtype == torch.float32
    same(out, a @ b, rtol=1e-5, atol=1e-5)


def test_binary_cross_entropy_is_refused_with_cudas_message():
    p, t = torch.rand(4).to(R), torch.rand(4).to(R)
    with torch.autocast(R):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, t)
        F.binary_cross_entropy_with_logits(p, t)  # the safe form works


def test_autocast_off_inside_changes_nothing():
    a = torch.randn(2, 2).to(R)
    with torch.autocast(R, dtype=torch.bfloat16):
        with torch.autocast(R, enabled=False):
            assert (a @ a).dtype == torch.float32


def autocast_training(device, dtype, scaler_on, steps=6, fused=False):
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**14, enabled=scaler_on)
    losses, scales, waits = [], [], []
    for step in range(steps):
        idx, targets = gpt_batch(step)
        before = rgpu.stats()["waits"]
        with torch.autocast(device, dtype=dtype):
            loss = model(idx.to(device), targets.to(device))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        waits.append(rgpu.stats()["waits"] - before)
        if scaler_on:
            scales.append(scaler._scale.item())
    return losses, scales, waits


def test_bf16_autocast_training_matches_cpu_autocast():
    cpu, _, _ = autocast_training("cpu", torch.bfloat16, False)
    dev, _, _ = autocast_training(R, torch.bfloat16, False)
    torch.testing.assert_close(dev, cpu, rtol=2e-2, atol=2e-2)


def test_fp16_autocast_with_grad_scaler_matches_cpu_and_makes_the_same_skip_decisions():
    cpu, cpu_scales, _ = autocast_training("cpu", torch.float16, True)
    dev, dev_scales, _ = autocast_training(R, torch.float16, True)
    torch.testing.assert_close(dev, cpu, rtol=2e-2, atol=2e-2)
    assert dev_scales == cpu_scales  # the scale halves exactly where CPU found infs


def test_a_scaled_step_with_a_fused_optimizer_costs_no_extra_wait():
    cpu, cpu_scales, _ = autocast_training("cpu", torch.float16, True, fused=True)
    losses, scales, waits = autocast_training(R, torch.float16, True, fused=True)
    torch.testing.assert_close(losses, cpu, rtol=2e-2, atol=2e-2)
    assert scales == cpu_scales
    # loss.item() is the only wait of a step (the test reads the scale after counting), and
    # none when the step's reply, which carries the loss, came in before the read.
    assert all(w <= 1 for w in waits[2:]), waits


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_a_cnn_with_batch_norm_trains_under_bf16_autocast_like_cpu(channels_last):
    # Autocast leaves batch norm to a bf16 input with float32 parameters; its backward on a
    # CPU server takes the saved statistics in float32, as CPU's forward made them.
    def train(device):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.Conv2d(8, 8, 3, stride=2), nn.BatchNorm2d(8, affine=False),
                            nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
        net = net.to(device, memory_format=torch.channels_last if channels_last else
                     torch.contiguous_format)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x = torch.randn(4, 3, 12, 12, generator=gen)
            y = torch.randint(0, 5, (4,), generator=gen)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = F.cross_entropy(net(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [t.cpu().float() for t in net.state_dict().values()]

    cpu_losses, cpu_state = train("cpu")
    dev_losses, dev_state = train(R)
    torch.testing.assert_close(dev_losses, cpu_losses, rtol=2e-2, atol=2e-2)
    for a, b in zip(dev_state, cpu_state):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
