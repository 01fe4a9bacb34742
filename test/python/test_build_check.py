"""`import rgpu` checks that its compiled parts were built against the torch it finds, and says
what to do when they were not, or when they are missing, before anything fails on a symbol."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import package_copy


def import_copy(tmp_path, build_py, code="import rgpu"):
    """Runs `code` with a copy of the package whose _build.py is `build_py` first on the path."""
    package_copy(tmp_path, build_py)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path)), cwd=str(tmp_path))


def import_error(tmp_path, build_py):
    r = import_copy(tmp_path, build_py)
    assert r.returncode != 0, r.stdout
    return r.stderr.strip().splitlines()[-1]


def test_another_torch_is_named_with_the_fix(tmp_path):
    error = import_error(tmp_path, 'TORCH_VERSION = "2.99.0+cu999"\n')
    assert error.startswith("ImportError: rgpu was built against torch 2.99.0+cu999"), error
    assert f"this environment has torch {torch.__version__}" in error, error
    assert "torch==2.99.0" in error and "rebuild" in error, error


def test_a_checkout_that_was_not_built_says_how_to_build(tmp_path):
    error = import_error(tmp_path, None)
    assert error.startswith("ImportError: rgpu is not built"), error
    assert "make" in error and "pip install --no-build-isolation ." in error, error


def test_the_build_records_this_torch():
    from rgpu._build import TORCH_VERSION

    assert TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]


@pytest.mark.parametrize("local", ["+cpu", "+cu130", ""])
def test_a_build_of_the_same_release_loads(tmp_path, local):
    release = torch.__version__.split("+")[0]
    r = import_copy(tmp_path, f'TORCH_VERSION = "{release}{local}"\n', "import rgpu; print(rgpu.__file__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(tmp_path)), r.stdout


@pytest.mark.parametrize("package, debian", [("CapnProto", "capnproto libcapnp-dev"),
                                             ("LLVM", "llvm-dev")])
def test_a_missing_cpp_dependency_names_its_debian_packages(tmp_path, package, debian):
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    cmake = os.path.join(os.path.dirname(sys.executable), "cmake")
    r = subprocess.run([cmake, "-S", root, "-B", str(tmp_path), "-DRGPU_WITH_TORCH=OFF",
                        f"-DCMAKE_DISABLE_FIND_PACKAGE_{package}=ON"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    error = " ".join(r.stderr.split())
    assert f"On Debian or Ubuntu: sudo apt-get install {debian}" in error, r.stderr
