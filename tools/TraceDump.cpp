//===- tools/TraceDump.cpp - rgpu-trace-dump: what got traced, and why it recompiled -===//
//
// Reads a graph cache directory (lib/wire/Cache.h). Needs neither torch nor Python, so it starts
// at once.
//
//===----------------------------------------------------------------------===//
#include "rgpu/wire/Cache.h"

#include <llvm/Support/raw_ostream.h>

#include <cstdlib>
#include <ctime>

using namespace rgpu;

namespace {

const char *kUsage = R"(usage: rgpu-trace-dump [--cache DIR] COMMAND

Shows the graphs rgpu traced, from a graph cache directory.

commands:
  list                          one line per graph: hash, nodes, inputs/outputs, runs, and the
                                line whose sync cut it
  show HASH [--format text|dot] the graph, one aten op per line (text) or as Graphviz dot
  diff HASH1 HASH2              what differs between two graphs: why a step recompiled

HASH may be any unique prefix of a graph's hash, as in git.

options:
  --cache DIR   the cache directory (default: $RGPU_CACHE_DIR, else ~/.cache/rgpu/graphs)
  -h, --help    show this help
)";

int fail(const std::string &message, int code = 1) {
  llvm::errs() << "rgpu-trace-dump: " << message << "\n";
  return code;
}

/// The graph a hash or unique prefix names, loaded.
llvm::Expected<wire::GraphRecord> load(const std::string &dir, llvm::StringRef prefix) {
  std::vector<ir::Hash256> all = wire::listCachedGraphs(dir);
  if (all.empty())
    return failure("no graphs in " + dir +
                   " (run a program on rgpu first; RGPU_CACHE_DIR sets the place)");
  std::string want = prefix.lower();
  std::vector<ir::Hash256> matches;
  for (const ir::Hash256 &h : all)
    if (llvm::StringRef(h.hex()).startswith(want))
      matches.push_back(h);
  if (want.empty() || matches.empty())
    return failure("no graph matches '" + prefix + "' in " + dir);
  if (matches.size() > 1)
    return failure("'" + prefix + "' is ambiguous: it matches " + llvm::Twine(matches.size()) +
                   " graphs; give more digits");
  return wire::readCachedGraph(wire::cacheFilePath(dir, matches[0]));
}

int list(const std::string &dir) {
  std::vector<ir::Hash256> all = wire::listCachedGraphs(dir);
  if (all.empty())
    return fail("no graphs in " + dir + " (run a program on rgpu first; RGPU_CACHE_DIR sets the place)");
  int bad = 0;
  for (const ir::Hash256 &h : all) {
    auto read = wire::readCachedGraph(wire::cacheFilePath(dir, h));
    if (!read) {
      llvm::errs() << "rgpu-trace-dump: " << message(read.takeError()) << "\n";
      ++bad;
      continue;
    }
    const wire::GraphRecord &g = *read;
    char when[32] = "?";
    std::time_t t = g.firstSeen;
    std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
    llvm::outs() << h.hex() << "  nodes " << g.graph.nodes.size() << "  in "
                 << g.graph.inputs.size() << "  out " << g.graph.outputs.size() << "  runs "
                 << g.runs << "  first " << when << "  cut at "
                 << (g.cutAt.empty() ? "?" : g.cutAt) << "\n";
  }
  return bad ? 1 : 0;
}

} // namespace

int main(int argc, char **argv) {
  std::string dir = wire::defaultCacheDir(), format = "text";
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    llvm::StringRef a = argv[i];
    if (a == "-h" || a == "--help") {
      llvm::outs() << kUsage;
      return 0;
    }
    if ((a == "--cache" || a == "--format") && i + 1 < argc) {
      (a == "--cache" ? dir : format) = argv[++i];
      continue;
    }
    if (a.startswith("-"))
      return fail("unknown option " + a.str() + " (see --help)", 2);
    args.push_back(a.str());
  }
  if (args.empty())
    return fail("missing command: list, show or diff (see --help)", 2);
  const std::string &cmd = args[0];
  if (cmd == "list" && args.size() == 1)
    return list(dir);
  if (cmd == "show" && args.size() == 2) {
    if (format != "text" && format != "dot")
      return fail("--format must be text or dot", 2);
    auto loaded = load(dir, args[1]);
    if (!loaded)
      return fail(message(loaded.takeError()));
    const wire::GraphRecord &g = *loaded;
    if (format == "dot") {
      ir::printDot(g.graph, llvm::outs());
      return 0;
    }
    llvm::outs() << "# graph " << g.hash.hex() << ", " << g.graph.nodes.size() << " nodes, "
                 << g.runs << " runs, cut at " << (g.cutAt.empty() ? "?" : g.cutAt) << "\n";
    ir::printText(g.graph, llvm::outs());
    return 0;
  }
  if (cmd == "diff" && args.size() == 3) {
    auto first = load(dir, args[1]);
    if (!first)
      return fail(message(first.takeError()));
    auto second = load(dir, args[2]);
    if (!second)
      return fail(message(second.takeError()));
    const wire::GraphRecord &a = *first, &b = *second;
    bool shapesOnly = false;
    std::vector<std::string> lines = ir::diffGraphs(a.graph, b.graph, &shapesOnly);
    llvm::outs() << "--- " << a.hash.hex() << " (cut at " << a.cutAt << ")\n+++ " << b.hash.hex()
                 << " (cut at " << b.cutAt << ")\n";
    if (lines.empty())
      llvm::outs() << "same structure (they differ only in source locations)\n";
    for (const std::string &l : lines)
      llvm::outs() << l << "\n";
    if (shapesOnly)
      llvm::outs() << "same ops; only tensor shapes differ\n";
    return 0;
  }
  return fail("bad command line (see --help)", 2);
}
