"""rgpu-opserver's command line: useful help, clear refusals, non-zero exits."""

import subprocess

import torch
from conftest import opserver_path


def run(*args):
    return subprocess.run([opserver_path(), *args], capture_output=True, text=True, timeout=60)


def test_help_explains_every_flag():
    r = run("--help")
    assert r.returncode == 0
    for flag in ("--device", "--port", "--bind", "--compiler", "--max-frame-mib"):
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
