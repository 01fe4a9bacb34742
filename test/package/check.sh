#!/usr/bin/env bash
# rgpu installed as a Python package, as a user installs it (`make test-package`, part of
# `make test`): a clean clone of this checkout's commit is pip-installed into a fresh venv that
# has only torch; then `pip wheel` builds a wheel that goes into a second fresh venv. Each venv
# then imports its rgpu, checks and uses its own rgpu-opserver (test/package/step.py); last, the
# wheel told it was built for another torch must refuse to import, saying what to do.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON_SYS:-python3}
torch_pin=${TORCH_PIN:-torch==2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

git clone -q "$root" "$work/src"
# Paths under $work are rewritten relative to it for ccache (the clone's and the venvs' alike),
# so a second run on one machine compiles nothing that the first one compiled.
export CCACHE_BASEDIR="$work"
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
echo "== the wheel, told it was built for another torch"
built="$("$work/wheel/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/rgpu/_build.py"
sed -i 's/^TORCH_VERSION = .*/TORCH_VERSION = "2.99.0"/' "$built"
if error=$(cd "$work" && "$work/wheel/bin/python" -c "import rgpu" 2>&1); then
  echo "import rgpu worked with a wheel recorded for torch 2.99.0"; exit 1
fi
echo "$error" | tail -1
echo "$error" | grep -q "rgpu was built against torch 2.99.0.*Install torch==2.99.0, or rebuild rgpu"

echo "== packaging checks passed in ${SECONDS} s"
