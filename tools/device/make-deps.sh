#!/usr/bin/env bash
# Makes the folder that a GPU machine without our Debian packages builds rgpu from:
#   include/  the headers of Cap'n Proto and KJ, libuv, libsodium, zlib and LLVM's ADT and Support
#   lib/      LLVM Support's static libraries (linked with hidden symbols, as always) and the
#             others' shared ones, with zlib and terminfo that LLVM needs (Debian's other static
#             libraries are not position-independent, and rgpu's Python modules are shared
#             objects); the build's RPATH finds them here
#   gen/      the C++ of lib/wire/*.capnp, generated here (that machine has no capnp)
#   VERSIONS  the Debian packages they came from
# The headers and libraries are extracted from the Debian packages that `apt-get download`
# fetches, not copied from this machine's /usr, so the folder is the same on any Debian 12
# machine. CMake takes it as -DRGPU_DEPS_DIR=... (cmake/CarriedDeps.cmake).
#
# usage: tools/device/make-deps.sh [OUT]   (default OUT: .device-deps in the repository root)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(realpath -m "${1:-$repo/.device-deps}")
pkgs=(libcapnp-0.9.2 libcapnp-dev libuv1 libuv1-dev libsodium23 libsodium-dev llvm-14-dev zlib1g zlib1g-dev libtinfo6)

command -v capnp >/dev/null || { echo "make-deps: needs the capnp compiler (make deps)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && chmod 777 . && apt-get download -q "${pkgs[@]}" >/dev/null)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
r=$work/root
multiarch=$r/usr/lib/x86_64-linux-gnu
llvm=$r/usr/lib/llvm-14

rm -rf "$out"
mkdir -p "$out/include/llvm" "$out/lib" "$out/gen"
cp -r "$r/usr/include/capnp" "$r/usr/include/kj" "$r/usr/include/uv" "$r/usr/include/uv.h" \
      "$r/usr/include/sodium" "$r/usr/include/sodium.h" "$r/usr/include/zlib.h" \
      "$r/usr/include/zconf.h" "$out/include/"
for d in ADT Support Config Demangle; do cp -r "$r/usr/include/llvm-14/llvm/$d" "$out/include/llvm/"; done
cp -r "$r/usr/include/llvm-c-14/llvm-c" "$out/include/"
cp -L "$multiarch"/libcapnp-[0-9]*.so "$multiarch"/libkj-[0-9]*.so "$multiarch/libuv.so.1" \
   "$multiarch/libsodium.so.23" "$r/lib/x86_64-linux-gnu/libz.so.1" \
   "$r/lib/x86_64-linux-gnu/libtinfo.so.6" "$out/lib/"
cp "$llvm/lib/libLLVMSupport.a" "$llvm/lib/libLLVMDemangle.a" "$out/lib/"
strip --strip-debug "$out"/lib/*

# The generated sources must come from the capnp that matches the carried headers.
want=$(dpkg-deb -f "$work"/libcapnp-dev_*.deb Version | sed 's/-[^-]*$//')
have=$(capnp --version | awk '{print $NF}')
[ "$want" = "$have" ] || { echo "make-deps: capnp $have here, headers of $want" >&2; exit 1; }
capnp compile -oc++:"$out/gen" --src-prefix="$repo/lib/wire" "$repo"/lib/wire/*.capnp

for deb in "$work"/*.deb; do dpkg-deb -f "$deb" Package Version | sed 's/^[^:]*: //' | paste -sd' '; done >"$out/VERSIONS"
echo "make-deps: $(du -sh "$out" | cut -f1) in $out"
