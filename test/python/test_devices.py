"""Several devices on one server: `rgpu-opserver --devices cpu,cpu` exposes rgpu:0 and rgpu:1.

Each test is a client process of its own against one two-device server, so that the process's
device count is that server's."""

import json

import pytest
from conftest import Server, run_client


@pytest.fixture(scope="module")
def two_devices():
    s = Server("--devices", "cpu,cpu")
    yield s
    s.stop()


def run(server, code):
    proc = run_client(server.address, "import json, torch, rgpu\n" + code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_devices_are_counted_current_and_switched_as_cuda_does(two_devices):
    out = run(two_devices, """
r = {"count": torch.rgpu.device_count(), "current": torch.rgpu.current_device()}
r["default"] = str(torch.ones(2, device="rgpu").device)
torch.rgpu.set_device(1)
r["after_set"] = [torch.rgpu.current_device(), str(torch.zeros(2, device="rgpu").device),
                  str(torch.tensor([1, 2]).to("rgpu").device)]
with torch.rgpu.device(0):
    r["inside"] = str(torch.zeros(1, device="rgpu").device)
r["outside"] = torch.rgpu.current_device()
with torch.rgpu.device_of(torch.ones(1, device="rgpu:0")):
    r["device_of"] = torch.rgpu.current_device()
with torch.rgpu.device_of(torch.ones(1)):
    r["device_of_cpu"] = torch.rgpu.current_device()
with torch.device("rgpu:0"):
    r["torch_device"] = str(torch.empty(3).device)
try:
    torch.rgpu.set_device(2)
except ValueError as e:
    r["bad"] = str(e)
r["memory"] = [torch.rgpu.memory_allocated(i) >= 0 for i in range(2)]
import io
buf = io.BytesIO()
torch.save({"w": torch.arange(3.0)}, buf)
buf.seek(0)
loaded = torch.load(buf, map_location={"cpu": "rgpu:1"})["w"]
r["moved"] = [str(loaded.device), loaded.cpu().tolist(), str(torch.ones(1).rgpu(1).device),
              torch.ones(1).to(torch.device("rgpu", 1)).get_device()]
r["hello"] = rgpu._C.server_hello()["devices"]
torch.accelerator.set_device_index(1)  # torch's device-generic API reaches the same state
with torch.accelerator.device_index(0):
    inner = torch.accelerator.current_device_index()
r["accelerator"] = [torch.accelerator.device_count(), torch.rgpu.current_device(), inner,
                    str(torch.ones(1, device="rgpu").device)]
print(json.dumps(r))
""")
    assert out["count"] == 2 and out["current"] == 0
    assert out["default"] == "rgpu:0"
    assert out["after_set"] == [1, "rgpu:1", "rgpu:1"]
    assert out["inside"] == "rgpu:0" and out["outside"] == 1
    assert out["device_of"] == 0 and out["device_of_cpu"] == 1
    assert out["torch_device"] == "rgpu:0"
    assert "rgpu:2 does not exist: the server has 2 device(s)" in out["bad"]
    assert out["memory"] == [True, True]
    assert out["moved"] == ["rgpu:1", [0.0, 1.0, 2.0], "rgpu:1", 1]
    assert out["hello"] == ["cpu", "cpu"]
    assert out["accelerator"] == [2, 1, 0, "rgpu:1"]


def test_tensors_on_two_devices_compute_independently_and_match_cpu(two_devices):
    out = run(two_devices, """
torch.manual_seed(0)
a, b = torch.randn(5, 6), torch.randn(6, 5, dtype=torch.float64)
i = torch.randint(-9, 9, (4, 3), dtype=torch.int32)
x, y, k = a.to("rgpu:0"), b.to("rgpu:1"), i.to("rgpu:1")
got = {
    "mm": ((x @ x.t()).softmax(-1), "rgpu:0", (a @ a.t()).softmax(-1)),
    "view": (y.t()[1:, ::2].mul_(2).sum(0), "rgpu:1", b.t()[1:, ::2].mul(2).sum(0)),
    "int": ((k * k).cumsum(0), "rgpu:1", (i * i).cumsum(0)),
    "bool": ((x > 0).any(1), "rgpu:0", (a > 0).any(1)),
}
r = {}
for name, (t, device, want) in got.items():
    r[name] = [str(t.device), torch.allclose(t.cpu(), want), t.dtype == want.dtype]
w = torch.randn(4, 4, requires_grad=True)
v = w.detach().to("rgpu:1").requires_grad_()
(v.sin() * v).sum().backward()
(w.sin() * w).sum().backward()
r["grad"] = [str(v.grad.device), torch.allclose(v.grad.cpu(), w.grad)]
try:
    x + torch.ones(5, 6, device="rgpu:1")
except RuntimeError as e:
    r["mixed"] = str(e)
print(json.dumps(r))
""")
    for name in ("mm", "view", "int", "bool"):
        assert out[name][1:] == [True, True], (name, out[name])
    assert [out[n][0] for n in ("mm", "view", "int", "bool")] == ["rgpu:0", "rgpu:1", "rgpu:1",
                                                                    "rgpu:0"]
    assert out["grad"] == ["rgpu:1", True]
    assert out["mixed"].startswith("Expected all tensors to be on the same device, but found at "
                                   "least two devices, rgpu:0 and rgpu:1!")
    assert "aten::add.Tensor" in out["mixed"]


def test_a_copy_between_devices_runs_on_the_server(two_devices):
    out = run(two_devices, """
a = torch.arange(12, dtype=torch.float32).view(3, 4)
x = a.to("rgpu:0") * 2
x.cpu()  # x is data on the server now
before = rgpu.stats()
y = x.to("rgpu:1")                       # .to
z = torch.empty(4, 3, device="rgpu:1")
z.copy_(x.t())                           # copy_ from a view on the other device
u = torch.zeros(3, 4, device="rgpu:0")
u[1:] = y[1:] + 1                        # back, into a view
rgpu.synchronize()
after = rgpu.stats()
r = {k: after[k] - before[k] for k in ("uploads", "downloads")}
r["devices"] = [str(t.device) for t in (y, z, u)]
r["values"] = [torch.equal(y.cpu(), a * 2), torch.equal(z.cpu(), (a * 2).t()),
               torch.equal(u.cpu(), torch.cat([torch.zeros(1, 4), a[1:] * 2 + 1]))]
print(json.dumps(r))
""")
    assert out["uploads"] == 0 and out["downloads"] == 0, out
    assert out["devices"] == ["rgpu:1", "rgpu:1", "rgpu:0"]
    assert out["values"] == [True, True, True]


def test_seeded_draws_on_either_device_repeat(two_devices):
    out = run(two_devices, """
def draws():
    torch.manual_seed(3)
    return [torch.randn(4, device=f"rgpu:{i}").cpu().tolist() for i in (0, 1)]
print(json.dumps({"first": draws(), "second": draws()}))
""")
    assert out["first"] == out["second"]


def test_generators_and_rng_snapshots_of_either_device(two_devices):
    out = run(two_devices, """
g = torch.Generator(device="rgpu:1").manual_seed(7)
a = torch.randn(3, generator=g, device="rgpu:1")
want = torch.randn(3, generator=torch.Generator().manual_seed(7))
torch.manual_seed(2)
with torch.random.fork_rng(devices=[0, 1], device_type="rgpu"):
    inside = torch.randn(2, device="rgpu:1")
after = torch.randn(2, device="rgpu:1")
print(json.dumps({"device": str(g.device), "draws": torch.equal(a.cpu(), want),
                  "restored": torch.equal(inside.cpu(), after.cpu()),
                  "states": len(torch.rgpu.get_rng_state_all())}))
""")
    assert out == {"device": "rgpu:1", "draws": True, "restored": True, "states": 2}
