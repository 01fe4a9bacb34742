#!/usr/bin/env bash
# rgpu installed as a Python package, as a user installs it (`make test-package`, part of
# `make test`): a clean clone of this checkout's commit is pip-installed into a fresh venv that
# has only torch; then `pip wheel` builds a wheel that goes into a second fresh venv. Each venv
# then imports its rgpu, checks and uses its own rgpu-opserver (test/package/step.py).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON_SYS:-python3}
torch_pin=${TORCH_PIN:-torch==2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

git clone -q "$root" "$work/src"
for venv in installed wheel; do
  "$python" -m venv "$work/$venv"
  "$work/$venv/bin/pip" install -q "$torch_pin"
done

echo "== pip install --no-build-isolation . (a clean clone, a venv with only torch)"
"$work/installed/bin/pip" install -q --no-build-isolation "$work/src"
(cd "$work" && "$work/installed/bin/python" "$root/test/package/step.py")

echo "== pip wheel, installed into a second venv"
"$work/installed/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/dist" "$work/src"
"$work/wheel/bin/pip" install -q "$work"/dist/rgpu-*.whl
(cd "$work" && "$work/wheel/bin/python" "$root/test/package/step.py")
echo "== packaging checks passed in ${SECONDS} s"
