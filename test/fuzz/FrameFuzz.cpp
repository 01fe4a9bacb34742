// libFuzzer target: the frame decoder and every message decoder behind it (commands, graphs,
// metas, scalars), with no torch. A malformed input must be an error, never a crash, an
// out-of-bounds access or undefined behaviour.
#include "FuzzCommon.h"

#include <kj/exception.h>

using namespace rgpu;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const wire::Limits l = fuzz::limits();
  for (const net::Frame &frame : fuzz::frames(data, size, l)) {
    try {
      auto reader = net::openFrame(frame, l);
      auto cf = reader->getRoot<wire::ClientFrame>();
      for (auto cmd : cf.getCommands()) {
        switch (cmd.which()) {
        case wire::Command::DEFINE: {
          ir::Graph g;
          if (llvm::Error e = wire::decodeGraph(cmd.getDefine().getGraph(), l, g))
            llvm::consumeError(std::move(e));
          else {
            ir::hashGraph(g);
            ir::canonicalize(g);
          }
          break;
        }
        case wire::Command::RUN: {
          // A reader that remembers nothing: a relative Run must fail cleanly; a whole one
          // against the shape it claims, then again relative to itself.
          auto run = cmd.getRun();
          wire::RunArgsReader reader;
          const ir::Hash256 h = wire::decodeHash(run.getHash());
          const wire::RunShape shape{run.isWhole() ? run.getWhole().getInputs().size() : 0,
                                     run.isWhole() ? run.getWhole().getScalars().size() : 0,
                                     run.getNumOutputs()};
          for (int pass = 0; pass < 2; ++pass)
            llvm::consumeError(reader.read(h, run, shape).takeError());
          break;
        }
        case wire::Command::UPLOAD: {
          ir::TensorMeta m;
          if (wire::decodeMeta(cmd.getUpload().getMeta(), m))
            m.storageBytes();
          cmd.getUpload().getData();
          break;
        }
        case wire::Command::DOWNLOAD: {
          ir::TensorMeta m;
          if (wire::decodeMeta(cmd.getDownload().getMeta(), m))
            m.str();
          break;
        }
        default: break;
        }
      }
    } catch (const kj::Exception &) {
      // A malformed message: the server closes that connection.
    }
  }
  return 0;
}
