"""A client for test_inductor.py, run in its own process against a server given by RGPU_OPSERVER.

    python inductor_client.py lazy-gpt|compiled-mlp [MODE]

Trains on rgpu and on CPU, checks that they match (rtol 1e-4), waits on the way for the
server's compiles to finish so that later steps run compiled code, and prints one JSON line:
the server's counters and, per step, how many compiles were pending after it.
"""

import copy
import json
import os
import sys
import time

import torch
import torch.nn as nn

import rgpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from models import TinyGPT, gpt_batch, gpt_optimizer  # noqa: E402

COMPILE_TIMEOUT = 600


def wait_for_compiles():
    deadline = time.time() + COMPILE_TIMEOUT
    while rgpu.server_stats()["compiles_pending"]:
        if time.time() > deadline:
            raise SystemExit("compiles did not finish")
        time.sleep(0.5)


def lazy_gpt(steps=8, wait_after=5):
    def train(device):
        torch.manual_seed(0)
        model = TinyGPT().to(device)
        opt, sched = gpt_optimizer(model, steps)
        losses, pending = [], []
        for step in range(steps):
            idx, tgt = gpt_batch(step)
            opt.zero_grad()
            loss = model(idx.to(device), tgt.to(device))
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            if device == "rgpu":
                pending.append(rgpu.server_stats()["compiles_pending"])
                if step == wait_after:
                    wait_for_compiles()
        return losses, model, pending

    cpu_losses, cpu_model, _ = train("cpu")
    losses, model, pending = train("rgpu")
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-4, atol=1e-5)
    # Fused kernels round differently, and Adam's update divides by the gradients' own scale,
    # so a parameter whose gradient is near zero can move by a step's worth: ~lr * 1e-2.
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-3, atol=1e-3)
    return pending


def compiled_mlp(mode=None, steps=6, wait_after=1):
    """torch.compile(backend="rgpu", mode=mode)."""
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    dev = torch.compile(copy.deepcopy(cpu).to("rgpu"), backend="rgpu", dynamic=False, mode=mode)
    pending = []
    for step in range(steps):
        x = torch.randn(8, 16)
        values = []
        for model, xx in ((cpu, x), (dev, x.to("rgpu"))):
            model.zero_grad()
            loss = model(xx).square().mean()
            loss.backward()
            values.append(loss.item())
        torch.testing.assert_close(values[1], values[0], rtol=1e-4, atol=1e-6)
        pending.append(rgpu.server_stats()["compiles_pending"])
        if step == wait_after:
            wait_for_compiles()
        for p, q in zip(dev.parameters(), cpu.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
    return pending


def main():
    pending = {"lazy-gpt": lazy_gpt, "compiled-mlp": compiled_mlp}[sys.argv[1]](*sys.argv[2:])
    stats = rgpu.server_stats()
    print(json.dumps({"pending": pending, "stats": stats}))


if __name__ == "__main__":
    main()
