"""Whole models as people train them: a ResNet-18 with BatchNorm, a GPT cast wholly to bf16."""

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import same, train_losses

import rgpu  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from models import TinyGPT, gpt_batch  # noqa: E402

R = "rgpu"


def gpt_loss(model, step, device):
    idx, targets = gpt_batch(step)
    return model(idx.to(device), targets.to(device))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (torchvision is not installed beside this torch)."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def test_resnet18_trains_5_steps_with_batchnorm_like_cpu():
    torch.manual_seed(0)
    cpu = ResNet18()
    dev = copy.deepcopy(cpu).to(R)

    def loss_at(model, step, device):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (4,), generator=g)
        return F.cross_entropy(model(x.to(device)), y.to(device))

    runs = [train_losses(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
                         loss_at, 5) for m in (cpu, dev)]
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-4)
    for (name, b), (_, c) in zip(dev.named_buffers(), cpu.named_buffers()):
        same(b, c, rtol=1e-3, atol=1e-4)
    dev.eval()
    cpu.eval()
    x = torch.randn(2, 3, 32, 32)
    same(dev(x.to(R)), cpu(x), rtol=1e-3, atol=1e-3)


def test_a_gpt_cast_wholly_to_bf16_trains_like_cpu_bf16():
    torch.manual_seed(0)
    cpu = TinyGPT().to(torch.bfloat16)
    dev = copy.deepcopy(cpu).to(R)
    runs = [train_losses(m, torch.optim.SGD(m.parameters(), lr=0.1), gpt_loss, 5) for m in (cpu, dev)]
    assert all(p.dtype == torch.bfloat16 for p in dev.parameters())
    torch.testing.assert_close(runs[1], runs[0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("training", [True, False])
def test_norm_statistics_come_back_as_the_client_was_promised(dtype, training):
    # CPU's kernels keep bf16/fp16 statistics (and none at all in eval mode) where the meta
    # kernels promise float32 per channel; the server gives the client what it was promised.
    x = torch.randn(6, 4, dtype=dtype)
    w, rm, rv = torch.ones(4, dtype=dtype), torch.zeros(4, dtype=dtype), torch.ones(4, dtype=dtype)
    outs = [
        torch.native_layer_norm(x.to(R), [4], w.to(R), w.to(R), 1e-5),
        torch.native_batch_norm(x.to(R), w.to(R), w.to(R), rm.to(R), rv.to(R), training, 0.1, 1e-5),
    ]
    expected = [
        torch.native_layer_norm(x, [4], w, w, 1e-5),
        torch.native_batch_norm(x, w, w, rm.clone(), rv.clone(), training, 0.1, 1e-5),
    ]
    for got, want in zip(outs, expected):
        same(got[0], want[0], rtol=1e-2, atol=1e-2)
        for stat, ref in zip(got[1:], want[1:]):
            cpu = stat.cpu()
            assert cpu.dtype == stat.dtype and cpu.shape == stat.shape
            if ref.numel():
                torch.testing.assert_close(cpu, ref.to(cpu.dtype), rtol=1e-2, atol=1e-2)


def test_a_hugging_face_gpt2_trains_saves_and_generates_like_cpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    cpu = transformers.GPT2LMHeadModel(config)
    dev = copy.deepcopy(cpu).to(R)
    assert dev.lm_head.weight is dev.transformer.wte.weight  # tied, as on CPU
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))

    def loss_at(model, step, device):
        return model(ids.to(device), labels=ids.to(device)).loss

    runs = []
    for m in (cpu, dev):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        runs.append(train_losses(m, opt, loss_at, 20, sched))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-6)

    # Every tensor fetched in one round trip (it was one per tensor); the files a CPU model of
    # the same weights writes.
    waits = rgpu.stats()["waits"]
    dev.save_pretrained(tmp_path)
    assert rgpu.stats()["waits"] - waits <= 2
    copy.deepcopy(dev).to("cpu").save_pretrained(tmp_path / "cpu")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / name).read_bytes() == (tmp_path / "cpu" / name).read_bytes(), name
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(back.state_dict().items(), dev.state_dict().items()):
        assert torch.equal(a, b.cpu()), name

    dev.eval()
    cpu.eval()
    prompt = ids[:1, :4]
    expected = cpu.generate(prompt, max_new_tokens=8, do_sample=False)
    assert dev.generate(prompt.to(R), max_new_tokens=8, do_sample=False).cpu().tolist() == expected.tolist()



def test_a_hugging_face_mixture_of_experts_trains_and_generates_like_cpu():
    """Mixtral's experts as transformers runs them on a GPU: tokens sorted by expert, counted
    with `histc` of integers (CPU's kernel counts floats only) and multiplied with float32
    `_grouped_mm` (torch's meta kernel admits bfloat16 only)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cpu = transformers.MixtralForCausalLM(config)
    dev = copy.deepcopy(cpu).to(R)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def loss_at(model, step, device):
        return model(ids.to(device), labels=ids.to(device)).loss

    runs = []
    for m in (cpu, dev):
        runs.append(train_losses(m, torch.optim.AdamW(m.parameters(), lr=1e-3), loss_at, 4))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-6)
    prompt = ids[:, :4]
    expected = cpu.generate(prompt, max_new_tokens=6, do_sample=False)
    assert dev.generate(prompt.to(R), max_new_tokens=6, do_sample=False).cpu().tolist() == expected.tolist()


RNNS = {
    "lstm": lambda: nn.LSTM(4, 6, num_layers=2, batch_first=True, bidirectional=True),
    "lstm_proj_no_bias": lambda: nn.LSTM(4, 6, proj_size=3, bias=False),
    "gru": lambda: nn.GRU(4, 6, num_layers=2, bidirectional=True),
    "gru_no_bias": lambda: nn.GRU(4, 6, bias=False, batch_first=True),
    "rnn_relu": lambda: nn.RNN(4, 6, nonlinearity="relu", batch_first=True),
}


@pytest.mark.parametrize("name", sorted(RNNS))
def test_recurrent_layers_train_like_cpu_with_packed_sequences(name):
    # On every device but CPU, torch's LSTM and GRU run fused cells (`_thnn_fused_*`), which
    # CPU lacks: a CPU server runs them as CUDA computes them. Packing takes host lengths.
    torch.manual_seed(0)
    cpu = RNNS[name]()
    dev = copy.deepcopy(cpu).to(R)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 4, generator=g)
    if cpu.batch_first:
        x = x.transpose(0, 1).contiguous()
    lengths = torch.tensor([2, 5, 3])  # unsorted: packing sorts, unpacking restores the order
    for mode in ("padded", "packed"):
        outs = []
        for m, device in ((cpu, "cpu"), (dev, R)):
            m.zero_grad()
            inp = x.to(device)
            if mode == "packed":
                inp = nn.utils.rnn.pack_padded_sequence(inp, lengths, cpu.batch_first,
                                                        enforce_sorted=False)
            out, state = m(inp)
            if mode == "packed":
                out, out_lengths = nn.utils.rnn.pad_packed_sequence(out, cpu.batch_first)
                assert out_lengths.tolist() == lengths.tolist()
            states = state if isinstance(state, tuple) else (state,)
            loss = out.pow(2).sum() + sum(s.sin().sum() for s in states)
            loss.backward()
            outs.append([out, *states] + [p.grad for p in m.parameters()])
        for a, e in zip(outs[1], outs[0]):
            same(a, e, rtol=1e-5, atol=1e-5)


def test_recurrent_cells_match_cpu():
    torch.manual_seed(0)
    for cell in (nn.LSTMCell(4, 5), nn.GRUCell(4, 5), nn.GRUCell(4, 5, bias=False)):
        dev = copy.deepcopy(cell).to(R)
        x, h = torch.randn(3, 4), torch.randn(3, 5)
        state = (h, torch.randn(3, 5)) if isinstance(cell, nn.LSTMCell) else h
        on_dev = tuple(t.to(R) for t in state) if isinstance(state, tuple) else state.to(R)
        expected, actual = cell(x, state), dev(x.to(R), on_dev)
        same(actual, expected, rtol=1e-5, atol=1e-5)

NORMS = {
    "layer_norm": (lambda: nn.LayerNorm(4), (3, 4)),
    "batch_norm_1d": (lambda: nn.BatchNorm1d(4), (5, 4)),
    "batch_norm_2d": (lambda: nn.BatchNorm2d(4), (2, 4, 3, 3)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (2, 4, 3)),
    "rms_norm": (lambda: nn.RMSNorm(4), (3, 4)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("training", [True, False])
def test_norm_modules_forward_and_backward_match_cpu_in_every_float_dtype(dtype, name, training):
    make, shape = NORMS[name]
    torch.manual_seed(0)
    cpu = make().to(dtype).train(training)
    dev = copy.deepcopy(cpu).to(R)
    x = torch.randn(*shape, dtype=dtype)
    xc, xr = x.clone().requires_grad_(), x.to(R).requires_grad_()
    yc, yr = cpu(xc), dev(xr)
    yc.float().sum().backward()
    yr.float().sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    same(yr, yc, rtol=tol, atol=tol)
    same(xr.grad, xc.grad, rtol=tol, atol=5e-2 if dtype != torch.float32 else 1e-5)
    for (n, p), (_, q) in zip(dev.named_parameters(), cpu.named_parameters()):
        same(p.grad, q.grad, rtol=tol, atol=5e-2 if dtype != torch.float32 else 1e-4)
