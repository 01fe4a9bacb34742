//===- rgpu/wire/Paths.h - Where this user's rgpu files live ----------------===//
//
// The XDG base directories, resolved in one place for the client, the server and the tools
// (sockets, tokens, graph caches): each names a directory of this user's, never created here.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <string>

namespace rgpu::wire {

/// The XDG base directories rgpu uses.
enum class UserDir {
  Cache,   ///< $XDG_CACHE_HOME, else ~/.cache.
  Config,  ///< $XDG_CONFIG_HOME, else ~/.config.
  Runtime, ///< $XDG_RUNTIME_DIR if it names a directory, else empty (the spec has no default).
};

/// The directory \p which, as the environment says now. An unset or empty variable counts as
/// absent; an unset or empty $HOME counts as ".".
std::string userDir(UserDir which);

/// $HOME, else ".".
std::string homeDir();

} // namespace rgpu::wire
