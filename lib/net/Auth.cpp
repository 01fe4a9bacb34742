#include "rgpu/net/Auth.h"
#include "rgpu/wire/Paths.h"

#include <sodium.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <sys/stat.h>
#include <unistd.h>

namespace rgpu::net::auth {

namespace {

void initSodium() {
  static const bool ok = sodium_init() >= 0;
  if (!ok)
    throw std::runtime_error("libsodium could not be initialised");
}

} // namespace

std::string randomBytes(size_t n) {
  initSodium();
  std::string out(n, '\0');
  randombytes_buf(out.data(), n);
  return out;
}

std::string mac(const char *label, const std::string &token, const std::string &challenge,
                const std::string &clientNonce) {
  initSodium();
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, reinterpret_cast<const unsigned char *>(token.data()),
                              token.size());
  auto add = [&](const std::string &s) {
    crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char *>(s.data()),
                                  s.size());
  };
  add(std::string(label, std::strlen(label) + 1)); // with its NUL: labels never run into data
  add(challenge);
  add(clientNonce);
  std::string out(crypto_auth_hmacsha256_BYTES, '\0');
  crypto_auth_hmacsha256_final(&st, reinterpret_cast<unsigned char *>(out.data()));
  return out;
}

std::string clientMac(const std::string &token, const std::string &challenge,
                      const std::string &clientNonce) {
  return mac("rgpu client v1", token, challenge, clientNonce);
}

std::string serverMac(const std::string &token, const std::string &challenge,
                      const std::string &clientNonce) {
  return mac("rgpu server v1", token, challenge, clientNonce);
}

bool sameMac(const std::string &a, const std::string &b) {
  static_assert(kMacBytes == crypto_auth_hmacsha256_BYTES);
  return a.size() == kMacBytes && b.size() == kMacBytes &&
         crypto_verify_32(reinterpret_cast<const unsigned char *>(a.data()),
                          reinterpret_cast<const unsigned char *>(b.data())) == 0;
}

std::string fingerprint(const std::string &token) {
  initSodium();
  unsigned char digest[crypto_hash_sha256_BYTES];
  crypto_hash_sha256(digest, reinterpret_cast<const unsigned char *>(token.data()), token.size());
  char hex[9];
  sodium_bin2hex(hex, sizeof hex, digest, 4);
  return hex;
}

std::string defaultSocketPath() {
  std::string run = wire::userDir(wire::UserDir::Runtime);
  return run.empty() ? wire::homeDir() + "/.rgpu/opserver.sock" : run + "/rgpu/opserver.sock";
}

std::string defaultTokenPath() { return wire::userDir(wire::UserDir::Config) + "/rgpu/token"; }

llvm::Error ensurePrivateDir(const std::string &dir) {
  // Parents are made as usual (0755 under the umask); only the last directory is ours alone.
  for (size_t slash = dir.find('/', 1); slash != std::string::npos;
       slash = dir.find('/', slash + 1))
    ::mkdir(dir.substr(0, slash).c_str(), 0755);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return failure("cannot create " + dir + ": " + std::strerror(errno));
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return failure(dir + " is not a directory");
  if (st.st_uid != ::geteuid())
    return failure(dir + " belongs to another user");
  if (st.st_mode & 077)
    return failure(dir + " is open to other users (mode " +
                   std::to_string((st.st_mode >> 6) & 7) + std::to_string((st.st_mode >> 3) & 7) +
                   std::to_string(st.st_mode & 7) + "); `chmod 700 " + dir + "` and start again");
  return llvm::Error::success();
}

llvm::Expected<std::string> readToken(const std::string &path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return failure("cannot read the token file " + path + ": " + std::strerror(errno));
  struct stat st;
  char buf[4096];
  ssize_t n = -1;
  std::string error;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    error = "the token file " + path + " is not a regular file";
  else if (st.st_uid != ::geteuid())
    error = "the token file " + path + " belongs to another user";
  else if (st.st_mode & 077)
    error = "the token file " + path + " can be read by other users; `chmod 600 " + path + "`";
  else if ((n = ::read(fd, buf, sizeof buf)) < 0)
    error = "cannot read the token file " + path + ": " + std::strerror(errno);
  ::close(fd);
  if (n < 0)
    return failure(error);
  std::string token(buf, size_t(n));
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back())))
    token.pop_back();
  if (token.size() < 16)
    return failure("the token file " + path + " holds no token (16 characters at least)");
  return token;
}

llvm::Expected<LoadedToken> loadOrCreateToken(const std::string &path) {
  std::string dir = path.substr(0, path.rfind('/'));
  if (!dir.empty())
    if (llvm::Error e = ensurePrivateDir(dir))
      return std::move(e);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno != EEXIST)
      return failure("cannot create the token file " + path + ": " + std::strerror(errno));
    auto token = readToken(path);
    if (!token)
      return token.takeError();
    return LoadedToken{std::move(*token), false};
  }
  std::string secret = randomBytes(32);
  char hex[65];
  sodium_bin2hex(hex, sizeof hex, reinterpret_cast<const unsigned char *>(secret.data()),
                 secret.size());
  std::string line = std::string(hex) + "\n";
  bool ok = ::write(fd, line.data(), line.size()) == ssize_t(line.size());
  ok = ::close(fd) == 0 && ok;
  if (!ok) {
    ::unlink(path.c_str());
    return failure("cannot write the token file " + path);
  }
  return LoadedToken{hex, true};
}

} // namespace rgpu::net::auth
