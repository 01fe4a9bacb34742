#!/bin/sh
# Runs one fuzz target: test/fuzz/run.sh BUILD_DIR TARGET SECONDS [libFuzzer options...]
# New inputs go to BUILD_DIR/corpus/TARGET; the seeds and regression inputs in the repository
# are read, never written. A crash leaves BUILD_DIR/crash-TARGET-* and a non-zero status: add the
# input to test/fuzz/regressions/TARGET/ once it is fixed.
set -e
build=$1 target=$2 seconds=$3
shift 3
here=$(dirname "$0")
case $target in
  graph_fuzz) seeds=$here/corpus/frame ;;
  planes_fuzz) seeds=$here/corpus/planes ;;
  seal_fuzz) seeds=$here/corpus/seal ;;
  store_fuzz) seeds=$here/corpus/store ;;
  *) seeds=$here/corpus/stream ;;
esac
mkdir -p "$build/corpus/$target" "$here/regressions/$target"
# Leak detection is off: libtorch's one-time allocations would be reported as leaks.
ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
  "$build/test/fuzz/$target" -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 \
  -timeout=20 -print_final_stats=1 -artifact_prefix="$build/crash-$target-" "$@" \
  "$build/corpus/$target" "$seeds" "$here/regressions/$target"
