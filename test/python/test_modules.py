"""Moving, saving and printing rgpu tensors and modules behaves as it does for CUDA tensors."""

import copy
import io
import os
import sys

import pytest
import torch
import torch.nn as nn
from conftest import same, train_losses

import rgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from models import TinyGPT, gpt_batch, gpt_optimizer  # noqa: E402

R = "rgpu"


class TiedGPT(TinyGPT):
    """GPT-2's layout: the output layer is the token embedding, one Parameter."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(self.tok.embedding_dim, self.tok.num_embeddings, bias=False)
        self.head.weight = self.tok.weight


def waits():
    return rgpu.stats()["waits"]


def test_a_tied_weight_is_one_parameter_after_moving_to_rgpu_and_back():
    torch.manual_seed(0)
    model = TiedGPT()
    n = len(list(model.parameters()))
    model.to(R)
    assert model.head.weight is model.tok.weight
    assert model.tok.weight.device.type == R
    assert len(list(model.parameters())) == n
    model.to("cpu")
    assert model.head.weight is model.tok.weight
    assert model.tok.weight.device.type == "cpu"


def test_tied_gpt_trains_like_cpu_for_20_adamw_steps_with_warmup():
    torch.manual_seed(0)
    cpu = TiedGPT()
    dev = TiedGPT()
    dev.load_state_dict(cpu.state_dict())
    dev.to(R)
    assert dev.head.weight is dev.tok.weight

    def loss_at(model, step, device):
        idx, targets = gpt_batch(step)
        return model(idx.to(device), targets.to(device))

    runs = []
    for m in (cpu, dev):
        opt, sched = gpt_optimizer(m)
        runs.append(train_losses(m, opt, loss_at, 20, sched))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(dev.named_parameters(), cpu.named_parameters()):
        same(p, q, rtol=1e-4, atol=1e-5)


def test_moving_a_model_to_the_cpu_is_one_round_trip():
    torch.manual_seed(0)
    model = TiedGPT().to(R)
    (model(*[t.to(R) for t in gpt_batch(0)])).backward()
    rgpu.synchronize()
    before = waits()
    model.to("cpu")
    assert waits() - before == 1
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in model.parameters())


def test_a_moved_back_model_has_the_values_it_had_on_rgpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(R)
    model(torch.randn(5, 4, device=R))  # changes the running stats on the server
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    model.to("cpu")
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_torch_save_of_a_state_dict_is_one_round_trip_and_loads_on_rgpu_or_the_cpu():
    torch.manual_seed(0)
    model = TiedGPT().to(R)
    state = model.state_dict()
    rgpu.synchronize()
    before = waits()
    buf = io.BytesIO()
    torch.save(state, buf)
    assert waits() - before == 1
    buf.seek(0)
    on_rgpu = torch.load(buf)
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    for k, v in state.items():
        assert on_rgpu[k].device.type == R and on_cpu[k].device.type == "cpu"
        assert torch.equal(on_cpu[k], v.cpu()) and torch.equal(on_rgpu[k].cpu(), v.cpu())


def test_a_saved_rgpu_state_dict_loads_into_a_cpu_model_and_back():
    torch.manual_seed(0)
    src = nn.Linear(3, 2).to(R)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = nn.Linear(3, 2)
    dst.load_state_dict(torch.load(buf, map_location="cpu"))
    same(src.weight, dst.weight)
    again = nn.Linear(3, 2).to(R)
    again.load_state_dict(dst.state_dict())  # from CPU tensors into rgpu parameters
    same(again.weight, dst.weight)
    assert again.weight.device.type == R


def test_torch_save_keeps_dtype_requires_grad_and_views_values():
    x = torch.arange(12.0).reshape(3, 4)
    tensors = {
        "param": nn.Parameter(x.to(R)),
        "bf16": x.to(torch.bfloat16).to(R),
        "int": torch.arange(5).to(R),
        "transposed": x.to(R).t(),
        "empty": torch.zeros(0, 3, device=R),
        "scalar": torch.tensor(3.5).to(R),
    }
    buf = io.BytesIO()
    torch.save(tensors, buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location="cpu")
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        assert torch.equal(loaded[k], v.detach().cpu()), k
    assert loaded["param"].requires_grad


def test_printing_an_rgpu_tensor_looks_like_printing_a_cpu_tensor():
    cases = [
        torch.ones(2),
        torch.zeros(0, 3),
        torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
        torch.arange(6).reshape(2, 3),
        torch.tensor(7.25),
        torch.tensor([1 + 2j]),
    ]
    for cpu in cases:
        text = repr(cpu.to(R))
        assert "functional" not in text
        expected = repr(cpu)
        # The same text with the device suffix, which torch adds for any non-default device.
        assert text.replace(", device='rgpu:0'", "").replace("device='rgpu:0', ", "") == expected
        assert "device='rgpu:0'" in text
    y = torch.ones(2, device=R, requires_grad=True) * 2
    assert repr(y) == "tensor([2., 2.], device='rgpu:0', grad_fn=<MulBackward0>)"
    assert str(nn.Parameter(torch.ones(1).to(R))).startswith("Parameter containing:\ntensor([1.], device='rgpu:0'")


def test_half_on_an_rgpu_model_keeps_its_parameters():
    model = nn.Linear(2, 2).to(R)
    weight = model.weight
    model.half()
    assert model.weight is weight and weight.dtype == torch.float16


def test_safetensors_saves_rgpu_tensors_and_tells_shared_ones_apart(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    a, b = torch.randn(3, 4), torch.randn(3, 4)  # same size: must not look shared
    ra, rb = a.to(R), b.to(R)
    assert ra.untyped_storage().data_ptr() != rb.untyped_storage().data_ptr()
    assert ra.untyped_storage().data_ptr() == ra.view(12).untyped_storage().data_ptr()
    waits = rgpu.stats()["waits"]
    st.save_file({"a": ra, "b": rb}, tmp_path / "t.safetensors")
    assert rgpu.stats()["waits"] - waits <= 1  # both fetched in one round trip
    loaded = st.load_file(tmp_path / "t.safetensors")
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b)
    model = TiedGPT().to(R)
    st.save_model(model, tmp_path / "m.safetensors")  # drops the tied duplicate, as for CUDA
    fresh = TiedGPT()
    st.load_model(fresh, tmp_path / "m.safetensors")
    for (name, p), (_, q) in zip(fresh.named_parameters(), model.named_parameters()):
        same(q, p, rtol=0, atol=0)


def test_a_cpu_checkpoint_loads_straight_onto_rgpu_with_its_sharing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    base = torch.arange(12.0)
    state = {"model": model.state_dict(), "view": base[2:8].view(2, 3), "base": base,
             "param": nn.Parameter(torch.ones(3)), "step": 7, "half": torch.ones(2).half(),
             "bool": torch.tensor([True, False])}
    buf = io.BytesIO()
    torch.save(state, buf)
    for where in ("rgpu", torch.device("rgpu", 0), "rgpu:0", {"cpu": "rgpu"}):
        buf.seek(0)
        loaded = torch.load(buf, map_location=where)
        assert loaded["step"] == 7
        for k in ("view", "base", "half", "bool"):
            assert loaded[k].device.type == R and loaded[k].dtype == state[k].dtype, k
            assert torch.equal(loaded[k].cpu(), state[k]), k
        assert isinstance(loaded["param"], nn.Parameter) and loaded["param"].requires_grad
        sd = loaded["model"]
        assert list(sd) == list(model.state_dict()) and hasattr(sd, "_metadata")
        assert torch.equal(sd["0.weight"].cpu(), model[0].weight.detach())
        # Shared storages stay shared: an in-place change shows through the other tensor.
        loaded["base"][3] = -1.0
        assert loaded["view"].cpu()[0, 1].item() == -1.0
        sd["0.weight"].mul_(2)
        assert torch.equal(sd["1.weight"].cpu(), 2 * model[0].weight.detach())
        fresh = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)).to(R)
        fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), map_location=where)["model"])
        same(fresh[0].weight, model[0].weight)


def test_an_rgpu_checkpoint_loads_as_a_cuda_one_does(tmp_path):
    """Saved storages are tagged with their rgpu device, as CUDA ones are with theirs: every
    map_location torch.load takes works, rgpu or not installed."""
    import pickle
    import subprocess

    x = torch.arange(6.0).reshape(2, 3).to(R)
    p = nn.Parameter(torch.ones(2).to(R))
    path = tmp_path / "ck.pt"
    torch.save({"x": x, "col": x[:, 1], "p": p, "e": torch.zeros(0, 3, device=R)}, path)
    for where, device in ((None, R), (R, R), ("cpu", "cpu"), (torch.device("cpu"), "cpu"),
                          ({"rgpu:0": "cpu"}, "cpu"), (lambda storage, loc: storage, "cpu")):
        for weights_only in (True, False):
            d = torch.load(path, map_location=where, weights_only=weights_only)
            assert d["x"].device.type == device and d["col"].device.type == device
            assert torch.equal(d["col"].cpu(), torch.tensor([1.0, 4.0]))
            assert isinstance(d["p"], nn.Parameter) and d["p"].requires_grad
            assert d["e"].shape == (0, 3)
    # Without rgpu: as a CUDA checkpoint on a machine without CUDA.
    script = ("import torch, sys; d = torch.load(sys.argv[1], map_location='cpu'); "
              "print(d['col'].tolist());"
              "torch.load(sys.argv[1])")
    r = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True)
    assert r.stdout.strip() == "[1.0, 4.0]", r.stderr
    assert "tagged with rgpu:0" in r.stderr
    # A plain pickle keeps the device.
    y = pickle.loads(pickle.dumps(x[:, 1]))
    assert y.device.type == R and y.cpu().tolist() == [1.0, 4.0]


def test_a_map_location_that_names_no_rgpu_device_is_torchs_own():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location={"cuda:0": "cpu"})
    assert loaded["w"].device.type == "cpu" and loaded["w"].tolist() == [0.0, 1.0, 2.0]


def test_client_side_rgpu_storages_are_a_clear_error():
    with pytest.raises(NotImplementedError, match="cannot be allocated on the client"):
        torch.UntypedStorage(16, device="rgpu")


def test_deep_copies_of_models_optimizers_and_tensors_are_independent_and_equal():
    # torch deep-copies a plain tensor through its storage, which rgpu does not hold on the
    # client: BatchNorm buffers (an EMA model), optimizer state and plain tensors used to fail.
    def run(d):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.Linear(8, 4)).to(d)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        ema = copy.deepcopy(model)
        for i in range(3):
            model(torch.randn(5, 4).to(d)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for e, p in zip(ema.state_dict().values(), model.state_dict().values()):
                    e.copy_(e * 0.5 + p * 0.5) if e.is_floating_point() else e.copy_(p)
        saved = copy.deepcopy(opt.state_dict())
        x = torch.arange(6.0).to(d).requires_grad_()
        x.grad = torch.ones(6).to(d)
        y = copy.deepcopy(x)
        y.data.add_(100)
        assert y.requires_grad and y.grad is not x.grad
        tied = torch.nn.Linear(3, 3, bias=False).to(d)
        pair = copy.deepcopy([tied.weight, tied.weight])
        assert pair[0] is pair[1]
        return [*ema.state_dict().values(), saved["state"][0]["exp_avg"], x, y.grad]

    for got, want in zip(run(R), run("cpu")):
        same(got, want, rtol=1e-5, atol=1e-5)


def test_transformer_encoders_in_eval_with_padding_give_cpus_values_without_nested_tensors():
    # torch packs such a batch into a nested tensor and pads the result with zeros; rgpu runs
    # the layers densely and zeroes the same positions, exactly when torch's fast path applies.
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    not_left_aligned = torch.tensor([[False] * 5, [True] + [False] * 4, [False] * 5])
    float_pad = torch.zeros(3, 5).masked_fill(pad, float("-inf"))
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    seq_first = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0)
    cases = [
        (nn.TransformerEncoder(layer, 2), x, pad),
        (nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16)), x, float_pad),
        (nn.TransformerEncoder(layer, 2), x, not_left_aligned),  # not packed
        (nn.TransformerEncoder(seq_first, 2, norm=nn.LayerNorm(16)), x.transpose(0, 1), pad),
    ]
    for encoder, src, mask in cases:
        encoder.eval()
        with torch.no_grad():
            expected = encoder(src, src_key_padding_mask=mask)
            actual = copy.deepcopy(encoder).to(R)(src.to(R), src_key_padding_mask=mask.to(R))
        same(actual, expected)
    with torch.no_grad():  # packed on the CPU: the padding comes back zero
        assert cases[0][0](x, src_key_padding_mask=pad)[2, 4].eq(0).all()
    transformer = nn.Transformer(16, 4, 1, 1, 32, dropout=0.0, batch_first=True).eval()
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        expected = transformer(x, x, tgt_mask=causal, src_key_padding_mask=pad)
        actual = copy.deepcopy(transformer).to(R)(x.to(R), x.to(R), tgt_mask=causal.to(R),
                                                  src_key_padding_mask=pad.to(R))
    same(actual, expected)
    # Training, or gradients wanted: torch's dense path, gradients included.
    encoder = nn.TransformerEncoder(layer, 2)
    for train in (True, False):
        encoder.train(train)
        src = x.clone().requires_grad_()
        rsrc = x.to(R).requires_grad_()
        expected = encoder(src, src_key_padding_mask=pad)
        actual = copy.deepcopy(encoder).to(R)(rsrc, src_key_padding_mask=pad.to(R))
        expected.sum().backward()
        actual.sum().backward()
        same(actual, expected)
        same(rsrc.grad, src.grad)


def test_batchnorm_running_statistics_update_when_the_output_is_unused():
    # native_batch_norm writes its running statistics without saying so in its schema: the
    # write used to be a side effect of running the node, lost when nothing read the output
    # (a forward whose result is dropped; swa_utils.update_bn).
    from torch.optim.swa_utils import AveragedModel, update_bn

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 3, 4, 4, generator=g) * (i + 1) + i for i in range(3)]
    for make in (lambda: nn.BatchNorm2d(3), lambda: nn.BatchNorm2d(3, momentum=None),
                 lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())):
        torch.manual_seed(0)
        cpu = make()
        dev = copy.deepcopy(cpu).to(R)
        for x in batches:
            cpu(x)
            dev(x.to(R))  # the result is dropped at once
        for (name, b), (_, rb) in zip(cpu.named_buffers(), dev.named_buffers()):
            same(rb, b)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    data = [(torch.randn(16, 4, generator=g),) for _ in range(3)]
    averaged = {}
    for device in ("cpu", R):
        swa = AveragedModel(copy.deepcopy(model).to(device))
        update_bn([(x.to(device),) for (x,) in data], swa)
        averaged[device] = [b.cpu() for b in swa.buffers()]  # n_averaged is a CPU tensor
    for b, c in zip(averaged[R], averaged["cpu"]):
        torch.testing.assert_close(b, c)


def test_a_model_moved_after_its_optimizer_was_made_keeps_its_parameters():
    # As a move to CUDA does: the optimizer (made first, as accelerate's prepare(model,
    # optimizer) has it) steps the very parameters the model computes with, tied ones too.
    torch.manual_seed(0)
    cpu = TiedGPT()
    dev = copy.deepcopy(cpu)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (cpu, dev)]
    before = list(dev.parameters())
    dev.to(R)
    assert all(p is q for p, q in zip(before, dev.parameters()))
    assert all(p.device.type == "rgpu" for p in before)
    for step in range(3):
        for model, opt, device in ((cpu, opts[0], "cpu"), (dev, opts[1], R)):
            opt.zero_grad()
            model(*[t.to(device) for t in gpt_batch(step)]).backward()
            opt.step()
    for p, q in zip(dev.parameters(), cpu.parameters()):
        same(p, q, rtol=1e-4, atol=1e-5)
    dev.to("cpu")
    assert all(p is q and p.device.type == "cpu" for p, q in zip(before, dev.parameters()))
