//===- rgpu/net/Auth.h - Who may open a session: sockets, tokens, MACs ----===//
//
// Two ways in. The default is a Unix-domain socket in a directory only its user can open, whose
// server accepts only peers of its own uid. Over TCP the server sends a random challenge first and
// the client answers with a keyed MAC of it under a shared token, so the token never travels; the
// server then proves it knows the token too. MACs are HMAC-SHA-256 (libsodium), compared in
// constant time.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Error.h"

#include <cstddef>
#include <string>

namespace rgpu::net::auth {

constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;

/// \p n bytes from the system's CSPRNG.
std::string randomBytes(size_t n);

/// A MAC of \p challenge and \p clientNonce under \p key, for the handshake named by \p label:
/// each protocol and direction has its own label, so no answer can be replayed as another's.
std::string mac(const char *label, const std::string &key, const std::string &challenge,
                const std::string &clientNonce);

/// The client's answer to \p challenge: a MAC over both nonces under \p token.
std::string clientMac(const std::string &token, const std::string &challenge,
                      const std::string &clientNonce);
/// The server's proof that it holds \p token too (a different label, so one cannot be replayed
/// as the other).
std::string serverMac(const std::string &token, const std::string &challenge,
                      const std::string &clientNonce);
/// Constant-time equality of two MACs; false if either is not kMacBytes long.
bool sameMac(const std::string &a, const std::string &b);
/// A short public name of a token (8 hex digits of its SHA-256), so that a user can tell which
/// token a client used from which one a server expects without either being shown.
std::string fingerprint(const std::string &token);

/// $XDG_RUNTIME_DIR/rgpu/opserver.sock, else ~/.rgpu/opserver.sock.
std::string defaultSocketPath();
/// $XDG_CONFIG_HOME/rgpu/token, else ~/.config/rgpu/token.
std::string defaultTokenPath();

/// Creates \p dir (and its parents) if missing; the directory itself must then belong to this
/// user and be closed to everybody else (mode 0700), else a failure saying why.
[[nodiscard]] llvm::Error ensurePrivateDir(const std::string &dir);
/// Reads the token in \p path: a file of this user that nobody else can read.
[[nodiscard]] llvm::Expected<std::string> readToken(const std::string &path);
/// A token, and whether loadOrCreateToken created it.
struct LoadedToken {
  std::string token;
  bool created = false;
};
/// Reads the token in \p path, or creates it (32 random bytes as hex, mode 0600) if the file
/// does not exist.
[[nodiscard]] llvm::Expected<LoadedToken> loadOrCreateToken(const std::string &path);

} // namespace rgpu::net::auth
