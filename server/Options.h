//===- server/Options.h - rgpu-opserver's command line ---------------------===//
//
// Every flag is one row of one table (Options.cpp): its name, what it takes, its help text
// and how it sets its field of Options. The table writes --help and parses the command line,
// so a flag cannot be documented and not parsed, or the other way round.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Compiler.h"
#include "Context.h"
#include "Loop.h"

#include "rgpu/wire/Wire.h"

#include <llvm/Support/Error.h>

#include <cstdint>
#include <string>

namespace rgpu::server {

/// What the command line asks for, with the defaults it leaves alone.
struct Options {
  /// --device / --devices as given ("cuda:0,cuda:1"); empty: cuda if available, else cpu.
  std::string devices;
  std::string compiler;  ///< --compiler: "inductor" or "plan" (default: inductor with RGPU_PYTHON)
  CompilerOptions compile;
  std::string socketPath; ///< --socket; empty: the default one when TCP is not asked for
  bool tcp = false;       ///< --port or --bind was given
  int port = 9720;        ///< --port
  std::string bind = "127.0.0.1";      ///< --bind
  std::string storeHost;               ///< --store-host; default: --bind's address
  std::string tokenFile, tokensDir;    ///< --token-file, --tokens-dir
  wire::Limits limits;                 ///< --max-frame-mib, --max-tensor-mib
  ConnectionLimits connection;         ///< --hello-timeout, --frame-timeout, --max-pending, ...
  Budgets budgets;                     ///< --session-memory, --graph-memory, --plan-cache, ...
  uint64_t memoryLimit = 0;            ///< --memory-limit (default: 85% of physical memory)
  std::string storeDir;                ///< --store-dir (default: store in the cache dir)
  uint64_t storeSize = uint64_t(16) << 30; ///< --store-size
  std::string filesDir;                ///< --files-dir; empty: no files area
  uint64_t filesQuota = uint64_t(64) << 30; ///< --files-quota; 0: none
  uint64_t sessionGraceMs = 120000;    ///< --session-grace
  size_t maxConnections = 256;         ///< --max-connections
  size_t workers = 0;                  ///< --workers (default: the cores, at least 4)
  int spinUs = 1000;                   ///< --spin-us
  bool help = false;                   ///< -h, --help: print the help and exit
  bool refusedOps = false;             ///< --refused-ops: list them and exit
};

/// The options \p argv gives, with every default resolved (those that follow from other
/// flags, the environment and the machine); a failure says which flag is wrong and how.
/// \p python is $RGPU_PYTHON (null if unset): --compiler inductor needs it.
llvm::Expected<Options> parseOptions(int argc, char **argv, const char *python);

/// --help: every flag of the table, grouped, with what it takes and its default.
std::string helpText();

} // namespace rgpu::server
