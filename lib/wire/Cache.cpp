#include "rgpu/wire/Cache.h"
#include "rgpu/wire/Paths.h"
#include "rgpu/wire/Wire.h"

#include <capnp/serialize.h>
#include <llvm/Support/FileSystem.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/Path.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

namespace rgpu::wire {

std::string defaultCacheDir() {
  if (const char *dir = std::getenv("RGPU_CACHE_DIR"); dir && *dir)
    return std::string(dir) == "off" ? "" : dir;
  return userDir(UserDir::Cache) + "/rgpu/graphs";
}

std::string cacheFilePath(const std::string &dir, const ir::Hash256 &hash) {
  llvm::SmallString<256> path(dir);
  llvm::sys::path::append(path, hash.hex() + ".rgraph");
  return std::string(path);
}

llvm::Error writeMessageFile(const std::string &path, capnp::MessageBuilder &message) {
  auto words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  std::string tmp = path + ".tmp" + std::to_string(getpid());
  FILE *f = std::fopen(tmp.c_str(), "wb");
  if (!f)
    return failure("cannot write " + tmp);
  bool ok = std::fwrite(bytes.begin(), 1, bytes.size(), f) == bytes.size();
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return failure("cannot write " + path);
  }
  return llvm::Error::success();
}

llvm::Expected<kj::Array<capnp::word>> readMessageFile(const std::string &path) {
  auto buffer = llvm::MemoryBuffer::getFile(path);
  if (!buffer)
    return failure(path + ": " + buffer.getError().message());
  llvm::StringRef data = (*buffer)->getBuffer();
  if (data.size() % sizeof(capnp::word) != 0 || data.empty())
    return failure(path + ": truncated or corrupt");
  auto words = kj::heapArray<capnp::word>(data.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), data.data(), data.size());
  return std::move(words);
}

llvm::Error writeCachedGraph(const std::string &dir, const GraphRecord &g) {
  if (std::error_code ec = llvm::sys::fs::create_directories(dir))
    return failure("cannot create " + dir + ": " + ec.message());
  capnp::MallocMessageBuilder b;
  auto root = b.initRoot<wire::CachedGraph>();
  encodeHash(g.hash, root.initHash());
  encodeGraph(g.graph, root.initGraph());
  root.setFirstSeen(g.firstSeen);
  root.setRuns(g.runs);
  root.setCutAt(g.cutAt);
  return writeMessageFile(cacheFilePath(dir, g.hash), b);
}

llvm::Expected<GraphRecord> readCachedGraph(const std::string &path) {
  auto words = readMessageFile(path);
  if (!words)
    return words.takeError();
  GraphRecord g;
  try {
    Limits limits;
    capnp::FlatArrayMessageReader reader(*words,
                                         readerOptions(limits, words->asBytes().size(), false));
    auto root = reader.getRoot<wire::CachedGraph>();
    g.hash = decodeHash(root.getHash());
    if (llvm::Error e = decodeGraph(root.getGraph(), limits, g.graph))
      return failure(path + ": corrupt graph: " + message(std::move(e)));
    if (ir::hashGraph(g.graph) != g.hash)
      return failure(path + ": corrupt graph: its contents do not match its hash");
    g.firstSeen = root.getFirstSeen();
    g.runs = root.getRuns();
    g.cutAt = root.getCutAt();
  } catch (const kj::Exception &e) {
    return failure(path + ": not a graph cache file (" + e.getDescription().cStr() + ")");
  }
  return std::move(g);
}

std::vector<ir::Hash256> listCachedGraphs(const std::string &dir) {
  std::vector<ir::Hash256> hashes;
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec; it.increment(ec)) {
    llvm::StringRef name = llvm::sys::path::filename(it->path());
    ir::Hash256 h;
    if (name.endswith(".rgraph") && ir::Hash256::parse(name.drop_back(7), h))
      hashes.push_back(h);
  }
  std::sort(hashes.begin(), hashes.end());
  return hashes;
}

} // namespace rgpu::wire
