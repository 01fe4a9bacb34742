"""Data by the GPU: uploads named by their content, and the server's files area (rgpu.remote,
rgpu.data), against real servers, compared with what the same code does on the CPU."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import Server, run_client, wait_for_log


@pytest.fixture(scope="module")
def files_server(tmp_path_factory):
    """A TCP server with a files area and an upload store, and principals alice and bob."""
    root = tmp_path_factory.mktemp("files-server")
    tokens = root / "tokens"
    tokens.mkdir(mode=0o700)
    for name in ("alice", "bob"):
        (tokens / name).write_text(os.urandom(32).hex() + "\n")
        (tokens / name).chmod(0o600)
    server = Server("--tokens-dir", str(tokens), "--files-dir", str(root / "files"),
                    "--files-quota", "64MiB", "--cache-dir", str(root / "cache"),
                    "--store-size", "256MiB")
    wait_for_log(server, "files area")
    server.files = root / "files"
    server.tokens = tokens
    yield server
    server.stop()


def as_(server, who):
    return {"RGPU_TOKEN_FILE": str(server.tokens / who)}


def client(server, who, code, timeout=240, env=None):
    r = run_client(server.address, "import torch, rgpu\n" + code,
                   env=dict(as_(server, who), **(env or {})), timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


STATE = """
torch.manual_seed(0)
state = {f"w{i}": torch.randn(1 << 18) for i in range(8)}  # 8 MiB in 1 MiB tensors
state["small"] = torch.randn(100)
"""


def test_a_second_upload_of_the_same_weights_by_the_same_principal_sends_digests(files_server):
    move = STATE + """
before = rgpu.stats()
on = {k: v.to("rgpu") for k, v in state.items()}
total = float(sum(v.sum() for v in on.values()).item())
after = rgpu.stats()
print(after["bytes_out"] - before["bytes_out"], after["upload_bytes_deduplicated"], total)
"""
    plain = {"RGPU_COMPRESS": "0"}  # bytes as they are, on a loaded machine too
    first = client(files_server, "alice", move, env=plain).split()
    second = client(files_server, "alice", move, env=plain).split()
    other = client(files_server, "bob", move, env=plain).split()
    size = 8 << 20
    assert int(first[0]) > size and int(first[1]) == 0, first
    assert int(second[0]) < size // 100 and int(second[1]) == size, second  # under 1%
    assert int(other[0]) > size and int(other[1]) == 0, other  # bob's store is his own
    assert first[2] == second[2] == other[2]


def test_torch_save_to_a_remote_path_sends_the_pickle_and_loads_back_bit_identical(files_server,
                                                                                    tmp_path):
    os.chdir(tmp_path)
    out = client(files_server, "alice", """
import pickle
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
model.to("rgpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 256, device="rgpu")).pow(2).mean().backward()
    opt.step()
ckpt = {"model": model.state_dict(), "opt": opt.state_dict(), "step": 3,
        "tied": [model[0].weight, model[0].weight]}
torch.rgpu.synchronize()
before = rgpu.stats()["bytes_out"]
torch.save(ckpt, rgpu.remote("runs/a/ckpt.pt"))
sent = rgpu.stats()["bytes_out"] - before
pickled = len(pickle.dumps({k: v for k, v in ckpt.items() if k == "step"}))
back = torch.load(rgpu.remote("runs/a/ckpt.pt"))
assert back["step"] == 3
for k, v in ckpt["model"].items():
    assert back["model"][k].device.type == "rgpu"
    assert torch.equal(back["model"][k].cpu(), v.cpu()), k
for i, s in ckpt["opt"]["state"].items():
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(back["opt"]["state"][i][k].cpu(), s[k].cpu()), (i, k)
assert back["opt"]["param_groups"] == ckpt["opt"]["param_groups"]
assert back["tied"][0] is back["tied"][1]
# a file saved on the CPU with views of one storage: they stay views of one tensor
base = torch.arange(12.0)
torch.save({"base": base, "view": base[2:8].view(2, 3), "t": base.view(3, 4).t()}, "views.pt")
rgpu.remote("views.pt").upload("views.pt")
v = torch.load(rgpu.remote("views.pt"))
assert torch.equal(v["view"].cpu(), base[2:8].view(2, 3)) and torch.equal(v["t"].cpu(), base.view(3, 4).t())
v["base"].add_(1)
assert torch.equal(v["view"].cpu(), base[2:8].view(2, 3) + 1)
assert torch.equal(v["t"].cpu(), base.view(3, 4).t() + 1)
on_cpu = torch.load(rgpu.remote("runs/a/ckpt.pt"), map_location="cpu")
assert on_cpu["model"]["0.weight"].device.type == "cpu"
assert torch.equal(on_cpu["model"]["0.weight"], ckpt["model"]["0.weight"].cpu())
print(sent)
""")
    assert int(out) < 64 << 10, out
    # The server host reads it with plain torch.load (the storages are tagged with its device).
    plain = torch.load(files_server.files / "alice" / "runs" / "a" / "ckpt.pt", weights_only=True)
    assert plain["step"] == 3 and plain["model"]["0.weight"].shape == (512, 256)
    assert plain["model"]["0.weight"].device.type == "cpu"


def test_safetensors_files_are_written_and_read_on_the_server(files_server):
    client(files_server, "alice", """
from safetensors.torch import load_file, save_file
torch.manual_seed(0)
tensors = {"a": torch.randn(64, 32), "b": torch.arange(10, dtype=torch.int64),
           "c": torch.randn(3, 5).to(torch.bfloat16), "t": torch.randn(32, 64).t(),
           "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 4)}
on = {k: v.to("rgpu") for k, v in tensors.items()}
torch.rgpu.synchronize()
before = rgpu.stats()["bytes_out"]
save_file(on, rgpu.remote("st/x.safetensors"), metadata={"format": "pt"})
assert rgpu.stats()["bytes_out"] - before < 4096
back = load_file(rgpu.remote("st/x.safetensors"))
for k, v in tensors.items():
    assert back[k].device.type == "rgpu", k
    assert back[k].dtype == v.dtype and torch.equal(back[k].cpu(), v), k
from safetensors import safe_open
with safe_open(rgpu.remote("st/x.safetensors"), framework="pt") as f:
    assert f.keys() == sorted(tensors) and f.metadata() == {"format": "pt"}
    assert torch.equal(f.get_tensor("b").cpu(), tensors["b"])
    part = f.get_slice("a")
    assert part.get_shape() == [64, 32] and part.get_dtype() == "F32"
    assert torch.equal(part[8:24].cpu(), tensors["a"][8:24])  # only those rows are read
    assert torch.equal(part[3:5, 2:].cpu(), tensors["a"][3:5, 2:])
    assert torch.equal(part[:, 7].cpu(), tensors["a"][:, 7])
""")
    from safetensors.torch import load_file, safe_open

    local = load_file(files_server.files / "alice" / "st" / "x.safetensors")
    torch.manual_seed(0)
    assert torch.equal(local["a"], torch.randn(64, 32))
    with safe_open(str(files_server.files / "alice" / "st" / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_hugging_face_model_directory_round_trips_on_the_server(files_server):
    pytest.importorskip("transformers")
    client(files_server, "alice", """
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64)
torch.manual_seed(0)
model = GPT2LMHeadModel(config).eval()
ids = torch.randint(0, 512, (2, 16))
with torch.no_grad():
    want = model(ids).logits
model.to("rgpu")
torch.rgpu.synchronize()
before = rgpu.stats()["bytes_out"]
model.save_pretrained(rgpu.remote("models/tiny"))
assert rgpu.stats()["bytes_out"] - before < 64 << 10
names = {e.name for e in rgpu.remote("models/tiny").ls()}
assert {"config.json", "model.safetensors", "generation_config.json"} <= names, names
for load in (GPT2LMHeadModel.from_pretrained, AutoModelForCausalLM.from_pretrained):
    before = rgpu.stats()["bytes_in"]
    back = load(rgpu.remote("models/tiny"), device_map="rgpu")
    assert rgpu.stats()["bytes_in"] - before < 64 << 10
    assert back.lm_head.weight is back.transformer.wte.weight
    assert next(back.parameters()).device.type == "rgpu"
    with torch.no_grad():
        got = back(ids.to("rgpu")).logits.cpu()
    assert torch.equal(got, want), (got - want).abs().max()
""")
    # a tokenizer's files go there and come back as any small files do
    client(files_server, "alice", """
import json, os, tempfile
from transformers import AutoTokenizer, GPT2Tokenizer
d = tempfile.mkdtemp()
json.dump({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}, open(os.path.join(d, "vocab.json"), "w"))
open(os.path.join(d, "merges.txt"), "w").write("#version: 0.2\\na b\\n")
tok = GPT2Tokenizer(os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt"))
tok.save_pretrained(rgpu.remote("models/tiny"))
back = AutoTokenizer.from_pretrained(rgpu.remote("models/tiny"))
assert back("abab a")["input_ids"] == tok("abab a")["input_ids"], back("abab a")
""")
    # and transformers reads it on the server host as any model directory
    from transformers import GPT2LMHeadModel

    GPT2LMHeadModel.from_pretrained(files_server.files / "alice" / "models" / "tiny")


NANOGPT = """
import numpy as np, os, sys
block, batch = 32, 4
def get_batch(data, gen, device):
    ix = torch.randint(len(data) - block, (batch,), generator=gen)
    if isinstance(data, np.memmap):
        x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        return x.to(device), y.to(device)
    window = ix[:, None] + torch.arange(block)
    return data[window].long(), data[window + 1].long()
def train(data, device, steps=6):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(1000, 32).to(device)
    head = torch.nn.Linear(32, 1000).to(device)
    opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)
    losses, sent = [], []
    for step in range(steps):
        before = rgpu.stats()["bytes_out"]
        x, y = get_batch(data, gen, device)
        loss = torch.nn.functional.cross_entropy(head(emb(x)).flatten(0, 1), y.flatten())
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
        sent.append(rgpu.stats()["bytes_out"] - before)
    return losses, sent
"""


def test_a_nanogpt_loop_on_a_remote_array_sends_only_indices_and_trains_as_locally(files_server,
                                                                                    tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, size=20000, dtype=np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    out = client(files_server, "alice", NANOGPT + f"""
rgpu.remote("data/train.bin").upload({str(path)!r})
local, _ = train(np.memmap({str(path)!r}, dtype=np.uint16, mode="r"), "cpu")
data = rgpu.data.RemoteArray("data/train.bin", np.uint16)
assert len(data) == 20000 and data.dtype == torch.uint16
assert torch.equal(data[5:9].cpu(), torch.from_numpy(np.fromfile({str(path)!r}, np.uint16)[5:9].astype(np.int64)).to(torch.uint16))
remote, sent = train(data, "rgpu")
print(local == remote, max(sent[2:]), local, remote, sent)
""")
    same, per_step = out.split()[:2]
    assert same == "True", out
    # the indices (2 x 4 x 32 int64) and the step's own frames, never the batch's tokens again
    assert float(per_step) < 2 * 4 * 32 * 8 + 2048, out


def test_remote_array_indexing_matches_numpy(files_server, tmp_path):
    array = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
    path = tmp_path / "rows.bin"
    array.tofile(path)
    client(files_server, "alice", f"""
import numpy as np
rgpu.remote("data/rows.bin").upload({str(path)!r})
a = np.fromfile({str(path)!r}, np.float32).reshape(6, 5)
r = rgpu.data.RemoteArray("data/rows.bin", torch.float32, (6, 5))
assert torch.equal(r[2].cpu(), torch.from_numpy(a[2]))
assert torch.equal(r[-1].cpu(), torch.from_numpy(a[-1]))
assert torch.equal(r[1:4].cpu(), torch.from_numpy(a[1:4]))
assert torch.equal(r[::2].cpu(), torch.from_numpy(a[::2]))
idx = torch.tensor([[0, 5], [-1, 2]])
assert torch.equal(r[idx].cpu(), torch.from_numpy(a[idx.numpy()]))
assert torch.equal(r[idx.to("rgpu")].cpu(), torch.from_numpy(a[idx.numpy()]))
assert r[torch.zeros(0, dtype=torch.int64)].shape == (0, 5)
try:
    r[torch.tensor([6])].cpu()
except IndexError as e:
    assert "out of bounds" in str(e), e
else:
    raise AssertionError("an index past the rows read something")
try:
    rgpu.data.RemoteArray("data/rows.bin", torch.float32, (7, 5))
except ValueError as e:
    assert "too few" in str(e)
else:
    raise AssertionError("an array larger than its file was made")
""")


def test_small_files_shards_and_uploads(files_server, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 << 20))
    client(files_server, "alice", f"""
import numpy as np, io, os
from safetensors.torch import save_file
from rgpu.remote import RemotePath
d = rgpu.remote("misc")
with (d / "conf.json").open("w") as f:
    f.write('{{"a": 1}}')
assert (d / "conf.json").read_text() == '{{"a": 1}}'
with (d / "conf.json").open() as f:
    assert f.read() == '{{"a": 1}}'
assert [e.name for e in d.ls()] == ["conf.json"]
# an upload that broke off goes on from what the server has, and the digest is checked
data = open({str(big)!r}, "rb").read()
rgpu._C.files_write("misc/big.bin", 0, [data[:1 << 20]], False, "")
(d / "big.bin").upload({str(big)!r})
assert (d / "big.bin").read_bytes() == data
assert not (d / "big.bin.partial").exists()
rgpu._C.files_write("misc/bad.bin", 0, [b"not what the digest says"], False, "")
try:
    rgpu._C.files_write("misc/bad.bin", 24, [], True, "00" * 32)
except ValueError as e:
    assert "do not match the digest" in str(e), e
else:
    raise AssertionError("a file that did not match its digest was kept")
assert not (d / "bad.bin").exists()
# shards
shards = rgpu.remote("shards")
torch.save({{"x": torch.arange(4)}}, shards / "0.pt")
save_file({{"x": torch.arange(4, 8).to("rgpu")}}, shards / "1.safetensors")
buf = io.BytesIO(); np.save(buf, np.arange(8, 12).reshape(2, 2).T); (shards / "2.npy").write_bytes(buf.getvalue())
ds = rgpu.data.ShardDataset(shards)
assert len(ds) == 3
assert torch.equal(ds[0]["x"].cpu(), torch.arange(4)) and ds[0]["x"].device.type == "rgpu"
assert torch.equal(ds[1]["x"].cpu(), torch.arange(4, 8))
assert torch.equal(ds[2].cpu(), torch.from_numpy(np.arange(8, 12).reshape(2, 2).T.copy()))
(d / "conf.json").rm()
shards.rm(recursive=True)
assert not shards.exists()
""")


def test_paths_outside_the_area_other_principals_and_quotas_are_refused(files_server):
    os.symlink("/etc", files_server.files / "alice" / "etc")
    os.mkfifo(files_server.files / "alice" / "fifo")
    client(files_server, "alice", """
torch.save(torch.ones(3), rgpu.remote("mine.pt"))
def refused(fn, kind, words):
    try:
        fn()
    except kind as e:
        assert words in str(e), (words, str(e))
    else:
        raise AssertionError(f"{fn} was not refused")
refused(lambda: rgpu.remote("../bob/x"), ValueError, "never leave")
refused(lambda: rgpu.remote("/etc/passwd"), ValueError, "relative")
refused(lambda: rgpu._C.files_read("a/../../bob/x", 0, 10), PermissionError, "'..'")
refused(lambda: rgpu.remote("etc/passwd").read_bytes(), PermissionError, "symbolic link")
refused(lambda: rgpu.remote("etc").ls(), PermissionError, "symbolic link")
refused(lambda: rgpu.remote("fifo").read_bytes(), PermissionError, "not a regular file")
refused(lambda: rgpu.remote("nothing.pt").read_bytes(), FileNotFoundError, "does not exist")
refused(lambda: torch.load(rgpu.remote("nothing.pt")), FileNotFoundError, "nothing.pt")
refused(lambda: rgpu.remote("x" * 2000).read_bytes(), ValueError, "more than 1024")
refused(lambda: rgpu.remote("big").write_bytes(b"0" * (65 << 20)), OSError, "quota")
assert not rgpu.remote("big").exists() and not rgpu.remote("big.partial").exists()
listed = {e.name for e in rgpu.remote("").ls()}
assert "mine.pt" in listed and not listed & {"etc", "fifo"}, listed  # links and FIFOs left out
print(rgpu.server_stats()["files_bytes"])
""")
    client(files_server, "bob", """
try:
    torch.load(rgpu.remote("mine.pt"))
except FileNotFoundError:
    pass
else:
    raise AssertionError("bob read alice's file")
assert "mine.pt" not in {e.name for e in rgpu.remote("").ls()}
print(torch.ones(3, device="rgpu").sum().item())
""")


def test_a_server_without_a_files_area_says_how_to_get_one(server):
    r = run_client(server.address, "import torch, rgpu\n"
                                   "torch.save(torch.ones(2), rgpu.remote('x.pt'))\n")
    assert r.returncode != 0 and "PermissionError" in r.stderr and "--files-dir" in r.stderr, \
        r.stderr
