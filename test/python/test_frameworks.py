"""The layers people drive training through, with rgpu imported and nothing else changed:
Hugging Face's Trainer and accelerate and Lightning train on rgpu exactly as on the CPU, and on
the CPU when asked, without touching the server; Hugging Face's generate waits once a token.
Each training run is a process of its own, as a user's script is (accelerate keeps its device
for the life of a process)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import Server, run_client

TRAINER = textwrap.dedent("""
    import json, sys, torch, rgpu
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
            return {{"input_ids": ids, "labels": ids.clone()}}

    args = TrainingArguments(output_dir={out!r}, max_steps=10, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], logging_steps=1,
                             save_strategy="steps", save_steps=5, use_cpu={use_cpu},
                             seed=0, data_seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    before = rgpu.stats()["messages"]
    trainer.train(resume_from_checkpoint={resume!r})
    messages = rgpu.stats()["messages"] - before
    trainer.save_model({out!r} + "/final")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({{"device": str(args.device), "losses": losses, "messages": messages,
                      "where": str(next(model.parameters()).device)}}))
""")


def trainer_run(address, out, use_cpu, resume=None):
    r = run_client(address, TRAINER.format(out=str(out), use_cpu=use_cpu, resume=resume),
                   timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def final_weights(out):
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "final", "model.safetensors"))


def test_hf_trainer_trains_on_rgpu_like_the_cpu_and_on_the_cpu_when_asked(server, tmp_path):
    import rgpu

    sessions = rgpu.server_stats()["sessions"]
    cpu = trainer_run(server.address, tmp_path / "cpu", use_cpu=True)
    assert cpu["device"] == "cpu" and cpu["where"] == "cpu", cpu
    # use_cpu never touches the server: no message, not even a session at exit.
    assert cpu["messages"] == 0, cpu
    assert rgpu.server_stats()["sessions"] == sessions
    dev = trainer_run(server.address, tmp_path / "rgpu", use_cpu=False)
    assert dev["device"].startswith("rgpu") and dev["where"].startswith("rgpu"), dev
    assert dev["messages"] > 0
    assert len(dev["losses"]) == 10
    torch.testing.assert_close(dev["losses"], cpu["losses"], rtol=1e-5, atol=1e-6)
    want = final_weights(tmp_path / "cpu")
    got = final_weights(tmp_path / "rgpu")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    # Resumed from its step-5 checkpoint, the run ends where the uninterrupted one did.
    resumed = trainer_run(server.address, tmp_path / "rgpu", use_cpu=False,
                          resume=str(tmp_path / "rgpu" / "checkpoint-5"))
    torch.testing.assert_close(resumed["losses"][-5:], dev["losses"][-5:], rtol=1e-5, atol=1e-6)
    for name, tensor in final_weights(tmp_path / "rgpu").items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6)


ACCELERATE = textwrap.dedent("""
    import json, torch, torch.nn.functional as F, rgpu
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                       n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    # SGD: Adam's first steps are the sign of each gradient, which turns a difference in the
    # last bit of a gradient that is almost 0 into one of the learning rate.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = torch.randint(0, 100, (32, 16), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)
    accelerator = Accelerator(cpu={cpu})
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses, where = [], set()
    for (batch,) in loader:
        where.add(str(batch.device))
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    print(json.dumps({{"device": str(accelerator.device), "where": sorted(where),
                      "losses": losses}}))
""")


def test_an_accelerate_loop_trains_on_rgpu_like_the_cpu(server):
    runs = []
    for cpu in (True, False):
        r = run_client(server.address, ACCELERATE.format(cpu=cpu), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    on_cpu, on_rgpu = runs
    assert on_cpu["device"] == "cpu" and on_cpu["where"] == ["cpu"], on_cpu
    assert on_rgpu["device"] == "rgpu" and on_rgpu["where"] == ["rgpu:0"], on_rgpu
    torch.testing.assert_close(on_rgpu["losses"], on_cpu["losses"], rtol=1e-5, atol=1e-6)


LIGHTNING = textwrap.dedent("""
    import json, torch, rgpu
    import lightning as L
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)

    class SmallGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                                  n_positions=32, resid_pdrop=0.0,
                                                  embd_pdrop=0.0, attn_pdrop=0.0))
            self.seen = []

        def training_step(self, batch, index):
            (ids,) = batch
            loss = self.gpt(input_ids=ids, labels=ids).loss
            self.seen.append((loss.item(), str(ids.device), str(self.gpt.lm_head.weight.device)))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    ids = torch.randint(0, 100, (32, 16), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)
    model = SmallGPT()
    trainer = L.Trainer(accelerator={accelerator!r}, devices=1, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader)
    print(json.dumps(model.seen))
""")


def test_lightning_trains_on_rgpu_by_name_and_by_auto_like_the_cpu(server):
    runs = {}
    for accelerator in ("cpu", "rgpu", "auto"):
        r = run_client(server.address, LIGHTNING.format(accelerator=accelerator), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[accelerator] = json.loads(r.stdout.strip().splitlines()[-1])
    assert {(d, w) for _, d, w in runs["cpu"]} == {("cpu", "cpu")}
    for accelerator in ("rgpu", "auto"):  # auto: rgpu is the accelerator, as cuda would be
        seen = runs[accelerator]
        assert {(d, w) for _, d, w in seen} == {("rgpu:0", "rgpu:0")}, seen
        assert len(seen) == 8
        torch.testing.assert_close([v for v, _, _ in seen], [v for v, _, _ in runs["cpu"]],
                                   rtol=1e-5, atol=1e-6)


LIGHTNING_DDP = textwrap.dedent("""
    import json, torch, rgpu
    import lightning as L
    torch.manual_seed(0)
    X, Y = torch.randn(64, 16), torch.randn(64, 4)

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                           torch.nn.Linear(32, 4))

        def training_step(self, batch, i):
            x, y = batch
            self.devices_seen = str(x.device)
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
    model = Model()
    trainer = L.Trainer(accelerator="rgpu", devices=2, strategy="ddp", max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, data)
    # Each rank says what it did in a file of its own (the ranks share one stdout).
    with open(f"rank{trainer.global_rank}.json", "w") as f:
        json.dump({"device": model.devices_seen,
                   "backend": torch.distributed.get_backend() if
                   torch.distributed.is_initialized() else None,
                   "params": [p.detach().cpu().tolist() for p in model.parameters()]}, f)
    if trainer.global_rank == 0:
        # One process on the global batch: both ranks' batches of each step, in the order
        # Lightning's DistributedSampler gives them (shuffled with seed 0, rank r every other).
        order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
        ref = Model()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for s in range(4):
            rows = order[0::2][8 * s:8 * s + 8] + order[1::2][8 * s:8 * s + 8]
            loss = (ref.net(X[rows]) - Y[rows]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with open("reference.json", "w") as f:
            json.dump([p.detach().tolist() for p in ref.parameters()], f)
""")


def test_lightning_ddp_on_two_devices_equals_one_process_on_the_global_batch(tmp_path):
    # Lightning starts rank 1 by running the script again: it must be a file.
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_DDP)
    server = Server("--devices", "cpu,cpu")
    try:
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path,
                           env=dict(os.environ, RGPU_OPSERVER=server.address))
        assert r.returncode == 0, r.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
        assert [rank["device"] for rank in ranks] == ["rgpu:0", "rgpu:1"]
        assert ranks[0]["backend"] == "rgpu"
        reference = json.loads((tmp_path / "reference.json").read_text())
        for rank in (0, 1):
            for got, want in zip(ranks[rank]["params"], reference):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want),
                                           rtol=1e-5, atol=1e-6)
    finally:
        server.stop()


def _hf_model(family):
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                         n_positions=64, bos_token_id=1, eos_token_id=2)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, hidden_size=32,
                                      intermediate_size=64, vocab_size=100,
                                      max_position_embeddings=64, bos_token_id=1,
                                      eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "top_k"])
def test_hf_generate_waits_once_a_token_and_gives_the_cpus_tokens(family, sampling):
    # generate's own checks of the ids it was given ((eos < 0).any(), isin(eos, pad).any(),
    # (mask == 1).all()) are answered on the client, which computed them as it traced; what
    # is left is the stopping check of each token.
    import rgpu

    model = _hf_model(family)
    # A batch of two prompts, the second left-padded, with its attention mask.
    prompt = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    prompt[1, :2] = 0
    mask = (prompt != 0).long()
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, pad_token_id=0, do_sample=sampling,
                  top_k=5)
    torch.manual_seed(7)
    expected = model.generate(prompt, attention_mask=mask, **kwargs)
    model.to("rgpu")
    torch.manual_seed(7)
    before = rgpu.stats()["waits"]
    tokens = model.generate(prompt.to("rgpu"), attention_mask=mask.to("rgpu"), **kwargs)
    waits = rgpu.stats()["waits"] - before
    assert torch.equal(tokens.cpu(), expected)
    assert waits <= 20, waits  # one per token; the download of the tokens makes 21
