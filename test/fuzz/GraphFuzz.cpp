// libFuzzer target: a Define's graph through everything the server does before running it:
// decode (op names checked before they are interned), structural verification, hashing,
// canonicalization and plan building (schema checks, argument values, view bounds).
// Input: one frame's flags byte, then its message payload.
#include "FuzzCommon.h"
#include "Plan.h"
#include "Policy.h"

#include <kj/exception.h>

#include <cstring>

using namespace rgpu;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 + sizeof(capnp::word))
    return 0;
  const wire::Limits l = fuzz::limits();
  net::Frame frame;
  frame.flags = data[0] & net::kFlagPacked;
  frame.bytes = size - 1;
  frame.words = kj::heapArray<capnp::word>((size - 1 + 7) / 8);
  std::memset(frame.words.begin(), 0, frame.words.size() * sizeof(capnp::word));
  std::memcpy(frame.words.begin(), data + 1, size - 1);
  try {
    auto reader = net::openFrame(frame, l);
    for (auto cmd : reader->getRoot<wire::ClientFrame>().getCommands()) {
      if (cmd.which() != wire::Command::DEFINE)
        continue;
      ir::Graph g;
      auto admit = [](llvm::StringRef op) { return server::policy::admit(op); };
      if (llvm::Error e = wire::decodeGraph(cmd.getDefine().getGraph(), l, g, admit)) {
        llvm::consumeError(std::move(e));
        continue;
      }
      ir::hashGraph(g);
      ir::canonicalize(g);
      llvm::consumeError(server::Plan::build(std::move(g), l.maxTensorBytes).takeError());
    }
  } catch (const kj::Exception &) {
  }
  return 0;
}
