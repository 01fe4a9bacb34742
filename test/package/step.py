"""Run with the Python of a venv that has rgpu installed by pip: starts that venv's rgpu-opserver,
checks it with `rgpu-run --check`, trains a few steps of a small model on it, and compares every
loss with CPU eager. The rgpu imported must be the installed one, not a checkout's."""

import os
import subprocess
import sys
import sysconfig
import tempfile

import torch

bin_dir = os.path.dirname(sys.executable)
with tempfile.TemporaryDirectory() as tmp:
    os.chmod(tmp, 0o700)
    socket_path = os.path.join(tmp, "s.sock")
    server = subprocess.Popen([os.path.join(bin_dir, "rgpu-opserver"), "--device", "cpu",
                               "--compiler", "plan", "--socket", socket_path],
                              stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:
            if "listening on" in line:
                break
        else:
            sys.exit("rgpu-opserver did not start")
        os.environ["RGPU_OPSERVER"] = f"unix:{socket_path}"
        check = subprocess.run([os.path.join(bin_dir, "rgpu-run"), "--check"],
                               capture_output=True, text=True)
        print(check.stdout, end="")
        assert check.returncode == 0, check.stdout + check.stderr

        import rgpu

        site = sysconfig.get_paths()["platlib"]
        assert rgpu.__file__.startswith(site), f"imported {rgpu.__file__}, not from {site}"

        def train(device):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 1)).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            data = torch.randn(4, 32, 8, generator=torch.Generator().manual_seed(1))
            losses = []
            for x in data:
                loss = model(x.to(device)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses

        got, want = train("rgpu"), train("cpu")
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5), (got, want)
        print(f"trained on rgpu from {os.path.dirname(rgpu.__file__)}: losses match CPU eager")
    finally:
        server.terminate()
        server.wait()
