#!/usr/bin/env bash
# Proves that rgpu builds from the carried folder alone: builds it (as check.sh does, against
# this machine's torch) in a private mount namespace where the Debian packages that
# make-deps.sh extracts from (their headers, libraries, pkg-config and CMake files, capnp) are
# hidden behind empty files and folders. Needs root (unshare -m).
#
# usage: tools/device/build-isolated.sh [DEPS] [BUILD]   (defaults: .device-deps, build-isolated)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
deps=$(realpath "${1:-$repo/.device-deps}")
build=$(realpath -m "${2:-$repo/build-isolated}")
py=${PYTHON:-$repo/.venv/bin/python}
cmake=$(command -v cmake || echo "$repo/.venv/bin/cmake")

if [ "${RGPU_ISOLATED:-}" != 1 ]; then
  exec unshare -m env RGPU_ISOLATED=1 "$0" "$deps" "$build"
fi
empty=$(mktemp -d)
ma=/usr/lib/x86_64-linux-gnu
for d in /usr/include/capnp /usr/include/kj /usr/include/uv /usr/include/sodium /usr/lib/llvm-14 \
         /usr/include/llvm-14 /usr/include/llvm-c-14 $ma/cmake/CapnProto /usr/lib/cmake/llvm-14; do
  [ -d "$d" ] && mount --bind "$empty" "$d"
done
for f in /usr/include/uv.h /usr/include/sodium.h $ma/lib{capnp,kj,uv,sodium}*.{so,a} $ma/libuv_a.a \
         $ma/pkgconfig/{libuv,libsodium,capnp,kj}*.pc /usr/bin/capnp /usr/bin/llvm-config*; do
  [ -e "$f" ] && mount --bind /dev/null "$f"
done
if [ -e /usr/include/capnp/common.h ] || [ -s $ma/libcapnp.a ]; then
  echo "build-isolated: could not hide the system's packages" >&2
  exit 1
fi
cd "$repo"
"$cmake" -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRGPU_DEPS_DIR="$deps" \
  -DRGPU_TORCH_FROM_PYTHON=ON -DRGPU_BUILD_TESTS=OFF -DPython3_EXECUTABLE="$py" \
  -DRGPU_PYTHON_DIR="$build/rgpu"
"$cmake" --build "$build"
echo "build-isolated: built from $deps alone into $build"
