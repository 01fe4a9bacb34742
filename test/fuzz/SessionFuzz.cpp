// libFuzzer target: an in-process server session fed an arbitrary frame stream, against the CPU
// executor: every command, graphs running on real kernels, uploads, downloads, errors. A session
// may fail (that closes it); the process must not, and no sanitizer may fire.
// Leak detection is off (see test/fuzz/CMakeLists.txt): libtorch's one-time allocations
// (dispatcher tables, thread pools) are reported as leaks otherwise.
#include "ContentStore.h"
#include "Files.h"
#include "FuzzCommon.h"
#include "Session.h"

#include <stdlib.h>

using namespace rgpu;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static server::Context *ctx = [] {
    server::logEnabled() = false;
    auto *c = new server::Context({at::Device(at::kCPU)}, fuzz::limits());
    // A small files area and upload store of their own, so that what reads a file (archives,
    // tensors, gathers) reads what fuzzed writes put there.
    char dir[] = "/tmp/rgpu-session-fuzz-XXXXXX";
    if (mkdtemp(dir)) {
      c->setFiles(std::make_unique<server::FilesArea>(std::string(dir) + "/files", 4 << 20));
      c->setStore(std::make_unique<server::ContentStore>(std::string(dir) + "/store", 8 << 20));
    }
    return c;
  }();
  server::Session session(*ctx, "fuzz");
  for (const net::Frame &frame : fuzz::frames(data, size, ctx->limits()))
    if (session.handle(frame).close)
      break;
  return 0;
}
