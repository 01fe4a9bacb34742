"""Records the seed corpora of the fuzz targets from real client traffic.

    .venv/bin/python test/fuzz/record_corpus.py [WORKLOAD ...]

Starts an rgpu-opserver, puts a recording relay in front of it and runs small real workloads
(training, views, dtypes, data-dependent ops, errors) through it. What each client sent is
kept byte for byte: corpus/stream/ holds whole connections (frame_fuzz, session_fuzz) and
corpus/frame/ single frames as `flags byte + payload` (graph_fuzz).
"""

import asyncio
import os
import struct
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OPSERVER = os.path.join(ROOT, "python", "rgpu", "bin", "rgpu-opserver")

WORKLOADS = {
    "mlp_sgd": """
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(d)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(3):
    loss = net(torch.randn(5, 4, device=d)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
print(loss.item())
""",
    "adam_embedding": """
emb = torch.nn.Embedding(10, 4).to(d); lin = torch.nn.Linear(4, 10).to(d)
opt = torch.optim.Adam(list(emb.parameters()) + list(lin.parameters()), lr=1e-2)
for _ in range(2):
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]], device=d)
    loss = torch.nn.functional.cross_entropy(lin(emb(idx)).flatten(0, 1), idx.flatten())
    opt.zero_grad(); loss.backward(); opt.step()
print(loss.item())
""",
    "views": """
x = torch.arange(12., device=d).reshape(3, 4)
y = x.t()[1:]; y += 1; z = x.as_strided((2, 2), (1, 4), 1)
w = x.unsqueeze(0).expand(2, 3, 4).contiguous(); x[0].mul_(2)
print(x.cpu(), y.cpu(), z.cpu(), w.sum().item(), x.view(-1)[::3].cpu())
""",
    "dtypes": """
a = torch.arange(6, device=d, dtype=torch.int32); b = a > 2
c = torch.randn(3, device=d, dtype=torch.bfloat16) * 2
z = torch.randn(3, device=d, dtype=torch.complex64).conj() * 1j
print(a.cpu(), b.cpu(), (a // 2).cpu(), c.float().cpu(), z.abs().cpu(), a.to(torch.float16).cpu())
""",
    "data_dependent": """
x = torch.randn(8, device=d)
print(x[x > 0].cpu(), torch.nonzero(x > 0).cpu(), x.tolist(), torch.unique(torch.tensor([3, 1, 3], device=d)).cpu())
""",
    "conv_norm": """
net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.GELU(approximate="tanh"), torch.nn.AdaptiveAvgPool2d(1)).to(d)
x = torch.randn(2, 2, 5, 5, device=d).to(memory_format=torch.channels_last)
net(x).sum().backward(); net.eval(); print(net(x).cpu(), torch.nn.functional.dropout(x, 0.5).sum().item())
""",
    "symbolic": """
cache = torch.zeros(1, 2, 0, 4, device=d)
for n in range(4):
    cache = torch.cat([cache, torch.randn(1, 2, 1, 4, device=d)], dim=2)
    print(cache[:, :, 1:].reshape(2, -1).sum().item())
""",
    "errors": """
torch.manual_seed(1)
try:
    (torch.randn(2, 3, device=d) @ torch.randn(2, 3, device=d)).cpu()
except Exception as e:
    print(type(e).__name__)
print(torch.div(torch.arange(5, device=d), 2, rounding_mode="floor").cpu(), torch.empty(3, device=d).cpu())
""",
    "memory": """
x = torch.ones(64, 64, device=d)
torch.rgpu.reset_peak_memory_stats()
print(torch.rgpu.memory_allocated(), torch.rgpu.max_memory_allocated(), torch.rgpu.mem_get_info())
torch.rgpu.empty_cache()
print(torch.rgpu.get_device_properties(), (x * 2).sum().item())
""",
    "random": """
g = torch.Generator(device=d).manual_seed(3)
a = torch.randn(4, generator=g, device=d); torch.manual_seed(5); b = torch.rand(4, device=d)
state = torch.rgpu.get_rng_state(); c = torch.nn.functional.dropout(a, 0.5)
torch.rgpu.set_rng_state(state); gs = g.get_state(); g2 = g.clone_state(); g.set_state(gs)
print((a + b + c).cpu(), torch.randperm(5, generator=g2, device=d).cpu(), g.initial_seed())
del g2
with torch.random.fork_rng(device_type="rgpu"):
    print(torch.nn.functional.dropout(a, 0.5).cpu())
print(torch.empty(3, device=d).normal_(generator=g).cpu())
""",
    "compressed_uploads": """
x = torch.randn(64, 64).to(d); t = torch.randint(0, 1000, (32, 64)).to(d)
h = torch.randn(40, 40).half().to(d); b = (torch.rand(90, 90) > 0.5).to(d)
print((x @ x).sum().item(), t.sum().item(), h.float().mean().item(), b.sum().item())
""",
    "files": """
torch.save({"w": torch.randn(4, 3, device=d), "n": 3}, rgpu.remote("f/a.pt"))
back = torch.load(rgpu.remote("f/a.pt"))
from safetensors.torch import save_file, load_file
save_file({"w": torch.arange(6.0, device=d)}, rgpu.remote("f/a.safetensors"))
print(load_file(rgpu.remote("f/a.safetensors"))["w"].sum().item(), back["w"].shape)
rgpu.remote("f/t.txt").write_bytes(bytes(range(64)))
arr = rgpu.data.RemoteArray("f/t.txt", torch.uint8)
print(arr[torch.tensor([1, 5, 63])].cpu(), arr[2:6].cpu(), rgpu.remote("f").ls())
rgpu.remote("f/t.txt").rm()
""",
    "content_uploads": """
w = torch.zeros(1 << 18)
a = w.to(d)
a.sum().item()
b = w.to(d)  # names bytes the store holds
print((a - b).abs().sum().item())
""",
    "cancel": """
import threading
net = torch.nn.Linear(8, 8).to(d); opt = torch.optim.AdamW(net.parameters(), lr=0.1)
for _ in range(2):
    net(torch.randn(4, 8, device=d)).square().mean().backward(); opt.step(); opt.zero_grad()
y = torch.randn(600, 600, device=d)
for _ in range(200):
    y = y @ (torch.eye(600, device=d) * 0.5)
net(torch.randn(4, 8, device=d)).square().mean().backward(); opt.step()
threading.Timer(0.3, rgpu.cancel).start()
try:
    print(y.sum().item())
except rgpu.Cancelled as e:
    print("cancelled")
print(net.weight.sum().item())
""",
}

# Settings of a workload's client besides the defaults.
ENV = {"compressed_uploads": {"RGPU_COMPRESS": "1"},
       "content_uploads": {"RGPU_COMPRESS": "1"}}  # a MiB of zeros, a few bytes on the wire


async def relay(target, listen, record, ready):
    """Accepts connections on the Unix socket `listen`, forwards both ways to the one at
    `target`, and records what each client sends. (Over TCP everything after the Hello is
    sealed: a Unix socket carries the frames themselves.)"""

    async def handle(reader, writer):
        up_r, up_w = await asyncio.open_unix_connection(target)
        sent = bytearray()
        record.append(sent)

        async def pump(src, dst, keep):
            try:
                while data := await src.read(1 << 16):
                    if keep is not None:
                        keep.extend(data)
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w, sent), pump(up_r, writer, None))

    server = await asyncio.start_unix_server(handle, listen)
    ready.append(listen)
    async with server:
        await server.serve_forever()


def frames(stream):
    """The frames of a recorded connection, as (flags, payload)."""
    at = 0
    while at + 16 <= len(stream):
        magic, flags, length = struct.unpack_from("<IIQ", stream, at)
        if magic != 0x55504752 or at + 16 + length > len(stream):
            return
        yield flags, bytes(stream[at + 16:at + 16 + length])
        at += 16 + length


def main():
    # The server's socket and the relay's each live in a private directory of this run.
    target = os.path.join(tempfile.mkdtemp(prefix="rgpu-corpus-server-"), "opserver.sock")
    listen = os.path.join(tempfile.mkdtemp(prefix="rgpu-corpus-relay-"), "relay.sock")
    work = tempfile.mkdtemp(prefix="rgpu-corpus-data-")
    server = subprocess.Popen([OPSERVER, "--device", "cpu", "--socket", target,
                               "--compiler", "plan", "--files-dir", os.path.join(work, "files"),
                               "--cache-dir", os.path.join(work, "cache")],
                              stderr=subprocess.PIPE, text=True)
    for line in server.stderr:
        if "listening on unix:" in line:
            break
    threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
    record, ready = [], []
    loop = asyncio.new_event_loop()
    threading.Thread(target=lambda: loop.run_until_complete(relay(target, listen, record, ready)),
                     daemon=True).start()
    while not ready:
        pass
    os.makedirs(os.path.join(HERE, "corpus", "stream"), exist_ok=True)
    os.makedirs(os.path.join(HERE, "corpus", "frame"), exist_ok=True)
    env = dict(os.environ, RGPU_OPSERVER=f"unix:{ready[0]}", RGPU_CACHE_DIR="off")
    try:
        for name in sys.argv[1:] or WORKLOADS:
            body = WORKLOADS[name]
            before = len(record)
            code = "import torch, rgpu\nd = 'rgpu'\ntorch.manual_seed(0)\n" + body
            r = subprocess.run([sys.executable, "-c", code], env=dict(env, **ENV.get(name, {})),
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                sys.exit(f"{name} failed:\n{r.stderr}")
            streams = record[before:]
            for k, stream in enumerate(streams):
                with open(os.path.join(HERE, "corpus", "stream", f"{name}-{k}"), "wb") as f:
                    f.write(stream)
                for n, (flags, payload) in enumerate(frames(stream)):
                    if len(payload) <= 1 << 16:
                        path = os.path.join(HERE, "corpus", "frame", f"{name}-{k}-{n}")
                        with open(path, "wb") as f:
                            f.write(bytes([flags]) + payload)
            print(f"{name}: {sum(len(s) for s in streams)} bytes in {len(streams)} connection(s)")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
