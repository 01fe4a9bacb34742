// libFuzzer target: an in-process server session fed an arbitrary frame stream, against the CPU
// executor: every command, graphs running on real kernels, uploads, downloads, errors. A session
// may fail (that closes it); the process must not, and no sanitizer may fire.
// Leak detection is off (see test/fuzz/CMakeLists.txt): libtorch's one-time allocations
// (dispatcher tables, thread pools) are reported as leaks otherwise.
#include "FuzzCommon.h"
#include "Session.h"

using namespace rgpu;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static server::Context *ctx = [] {
    server::logEnabled() = false;
    return new server::Context({at::Device(at::kCPU)}, fuzz::limits());
  }();
  server::Session session(*ctx, "fuzz");
  for (const net::Frame &frame : fuzz::frames(data, size, ctx->limits()))
    if (session.handle(frame).close)
      break;
  return 0;
}
