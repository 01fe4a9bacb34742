#!/usr/bin/env bash
# The GPU check, one command on a machine with CUDA, torch, cmake and ninja but none of our
# Debian packages: builds rgpu (client extension and rgpu-opserver) against that machine's
# torch from the folder tools/device/make-deps.sh made, runs the GPU tests and the GPU
# benchmark, and writes check.log, tests.xml and figures.json to $OUT (default device-out/).
#
#   tools/device/make-deps.sh          # here, once: .device-deps (ignored by git)
#   tools/device/check.sh [BENCH ARGS]  # there, from the repository root, with .device-deps
#
# BENCH ARGS go to bench/gpu.py (--quick, --workloads gpt2, --systems rgpu-inductor, ...).
# Each stage has a time limit (RGPU_CHECK_TEST_SECONDS, RGPU_CHECK_BENCH_SECONDS) and each test
# one too, so that a slow one still leaves the others' results; RGPU_CHECK_STAGES picks stages
# (default "tests bench"; the build always runs).
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
out=${OUT:-$repo/device-out}
deps=${RGPU_DEPS_DIR:-$repo/.device-deps}
py=$(command -v "${PYTHON:-python3}")
stages=${RGPU_CHECK_STAGES:-tests bench}
mkdir -p "$out"
exec > >(tee "$out/check.log") 2>&1
step() { echo "== $(date +%T) $*"; }
status=0

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'

step build
export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}"
timeout 600 cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DRGPU_DEPS_DIR="$deps" \
  -DRGPU_TORCH_FROM_PYTHON=ON -DRGPU_BUILD_TESTS=OFF -DPython3_EXECUTABLE="$py" >/dev/null &&
  timeout 600 cmake --build build-device || { echo "check: the build failed"; exit 1; }
# The compile worker of --compiler inductor runs under this Python.
export RGPU_PYTHON="$py" PYTHONUNBUFFERED=1

if [[ " $stages " == *" tests "* ]]; then
  step tests
  # Failures are reported as they happen (-rfE with --tb=line would wait for the end).
  per_test=()
  "$py" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 150)
  timeout "${RGPU_CHECK_TEST_SECONDS:-300}" "$py" -m pytest -v --tb=short -p no:cacheprovider \
    "${per_test[@]}" --junitxml="$out/tests.xml" test/python/test_cuda.py test/python/test_memory.py ||
    status=1
fi
if [[ " $stages " == *" bench "* ]]; then
  step bench
  timeout "${RGPU_CHECK_BENCH_SECONDS:-300}" "$py" bench/gpu.py --json "$out/figures.json" "$@" || status=1
fi
step "done (status $status)"
exit $status
