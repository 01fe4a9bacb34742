"""rgpu-opserver's command line: useful help, clear refusals, non-zero exits."""

import os
import subprocess

import torch
from conftest import opserver_path


def run(*args):
    return subprocess.run([opserver_path(), *args], capture_output=True, text=True, timeout=60)


def test_help_explains_every_flag():
    r = run("--help")
    assert r.returncode == 0
    for flag in ("--device", "--port", "--bind", "--compiler", "--max-frame-mib",
                 "--max-tensor-mib", "--compile-timeout", "--refused-ops"):
        assert flag in r.stdout


def test_a_taken_port_is_an_error(server):
    r = run("--device", "cpu", "--port", str(server.port))
    assert r.returncode != 0
    assert "cannot listen" in r.stderr and r.stderr.startswith("rgpu-opserver:")


def test_an_unusable_device_is_an_error():
    if torch.cuda.is_available():
        return
    r = run("--device", "cuda", "--port", "0")
    assert r.returncode != 0
    assert "no usable CUDA device" in r.stderr


def test_unknown_options_are_errors():
    r = run("--frobnicate")
    assert r.returncode == 2 and "--help" in r.stderr


def test_docs_list_every_op_the_server_refuses():
    r = run("--refused-ops")
    assert r.returncode == 0, r.stderr
    by_rule = ("mutates its inputs", "returns a non-tensor value", "returns no tensor")
    refused = {line.split(": ", 1)[0] for line in r.stdout.splitlines()
               if not any(rule in line for rule in by_rule)}
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "refused-ops.md")) as f:
        listed = {line.split("`")[1] for line in f if line.startswith("- `")}
    assert refused == listed, (sorted(refused - listed), sorted(listed - refused))
    # Nothing a model needs is among them.
    assert not {"aten::addmm", "aten::convolution", "aten::_softmax", "aten::view_copy",
                "aten::as_strided_copy", "aten::_fused_adam", "aten::gelu"} & refused
