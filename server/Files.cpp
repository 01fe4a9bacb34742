#include "Files.h"

#include "ContentStore.h"
#include "Memory.h"

#include "rgpu/ir/Digest.h"

#include <llvm/ADT/SmallVector.h>
#include <llvm/ADT/StringRef.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <filesystem>
#include <sys/stat.h>
#include <unistd.h>

namespace rgpu::server {

namespace fs = std::filesystem;

Fd &Fd::operator=(Fd &&o) noexcept {
  if (this != &o) {
    if (fd_ >= 0)
      ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0)
    ::close(fd_);
}

namespace {

/// The exception a local file operation that failed with \p err raises in Python.
std::string pythonTypeOf(int err) {
  switch (err) {
  case ENOENT: return "FileNotFoundError";
  case EEXIST: return "FileExistsError";
  case EACCES:
  case EPERM: return "PermissionError";
  case EISDIR: return "IsADirectoryError";
  case ENOTDIR: return "NotADirectoryError";
  default: return "OSError";
  }
}

[[noreturn]] void fail(const std::string &path, const std::string &what, int err = 0) {
  throw FileError("files area: '" + path + "': " + what +
                      (err ? std::string(" (") + std::strerror(err) + ")" : ""),
                  err ? pythonTypeOf(err) : "PermissionError");
}

/// \p path's components, each checked; a refusal names the path and why.
llvm::SmallVector<std::string, 8> components(const std::string &path, bool allowRoot) {
  if (path.size() > FilesArea::kMaxPath)
    fail(path.substr(0, 64) + "...", "longer than " + std::to_string(FilesArea::kMaxPath) +
                                         " bytes");
  if (path.find('\0') != std::string::npos)
    fail(path, "holds a NUL byte");
  llvm::SmallVector<std::string, 8> out;
  if (path.empty()) {
    if (!allowRoot)
      fail(path, "names no file");
    return out;
  }
  if (path[0] == '/')
    fail(path, "is absolute: paths are relative to your files area");
  llvm::SmallVector<llvm::StringRef, 8> parts;
  llvm::StringRef(path).split(parts, '/', -1, /*KeepEmpty=*/true);
  for (llvm::StringRef p : parts) {
    if (p.empty() || p == "." || p == "..")
      fail(path, "has a component '" + p.str() + "': no empty, '.' or '..' components");
    if (p.size() > 255)
      fail(path, "has a component longer than 255 bytes");
    out.push_back(p.str());
  }
  if (out.size() > FilesArea::kMaxDepth)
    fail(path, "is deeper than " + std::to_string(FilesArea::kMaxDepth) + " directories");
  return out;
}

/// The kind of \p name in \p dir, not following a link; 0 if it does not exist.
mode_t kindOf(int dir, const std::string &name, uint64_t *size = nullptr) {
  struct stat st;
  if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
    return 0;
  if (size)
    *size = uint64_t(st.st_size);
  return st.st_mode & S_IFMT;
}

/// What refuses a component of kind \p kind where a directory or regular file was wanted.
[[noreturn]] void refuseKind(const std::string &path, mode_t kind) {
  if (kind == S_IFLNK)
    fail(path, "passes through a symbolic link: the files area follows none");
  fail(path, "is not a regular file or a directory");
}

} // namespace

FilesArea::FilesArea(std::string dir, uint64_t quota) : dir_(std::move(dir)), quota_(quota) {
  if (!enabled())
    return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
}

Fd FilesArea::root(const std::string &principal) {
  if (!enabled())
    throw FileError("this rgpu-opserver has no files area: start it with --files-dir DIR",
                    "PermissionError");
  const std::string name = principalDirectory(principal);
  Fd top(::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (top.get() < 0)
    fail(dir_, "the files area cannot be opened", errno);
  if (::mkdirat(top.get(), name.c_str(), 0700) != 0 && errno != EEXIST)
    fail(name, "the principal's directory cannot be made", errno);
  Fd fd(::openat(top.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0)
    fail(name, "the principal's directory cannot be opened", errno);
  return fd;
}

std::pair<Fd, std::string> FilesArea::parent(const std::string &principal,
                                             const std::string &path, bool create,
                                             bool allowRoot) {
  llvm::SmallVector<std::string, 8> parts = components(path, allowRoot);
  Fd dir = root(principal);
  if (parts.empty())
    return {std::move(dir), std::string()};
  for (size_t k = 0; k + 1 < parts.size(); ++k) {
    const std::string &c = parts[k];
    if (create && ::mkdirat(dir.get(), c.c_str(), 0700) != 0 && errno != EEXIST)
      fail(path, "cannot make directory '" + c + "'", errno);
    Fd next(::openat(dir.get(), c.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (next.get() < 0) {
      const int err = errno;
      if (mode_t kind = kindOf(dir.get(), c); kind && kind != S_IFDIR)
        kind == S_IFREG ? fail(path, "'" + c + "' is a file, not a directory", ENOTDIR)
                        : refuseKind(path, kind);
      fail(path, err == ENOENT ? "directory '" + c + "' does not exist"
                               : "cannot open directory '" + c + "'",
           err);
    }
    dir = std::move(next);
  }
  return {std::move(dir), parts.back()};
}

std::vector<FilesArea::Entry> FilesArea::list(const std::string &principal,
                                              const std::string &path) {
  auto [dir, leaf] = parent(principal, path, false, /*allowRoot=*/true);
  Fd listed;
  if (leaf.empty()) {
    listed = std::move(dir);
  } else {
    uint64_t size = 0;
    mode_t kind = kindOf(dir.get(), leaf, &size);
    if (!kind)
      fail(path, "does not exist", ENOENT);
    if (kind == S_IFREG)
      return {{leaf, size, false}};
    if (kind != S_IFDIR)
      refuseKind(path, kind);
    listed = Fd(::openat(dir.get(), leaf.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (listed.get() < 0)
      fail(path, "cannot be listed", errno);
  }
  std::vector<Entry> out;
  DIR *d = ::fdopendir(::dup(listed.get()));
  if (!d)
    fail(path, "cannot be listed", errno);
  constexpr size_t kMaxEntries = 1 << 16;
  while (dirent *e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name == "." || name == "..")
      continue;
    uint64_t size = 0;
    mode_t kind = kindOf(listed.get(), name, &size);
    if (kind != S_IFREG && kind != S_IFDIR)
      continue;
    if (out.size() == kMaxEntries) {
      ::closedir(d);
      fail(path, "has more than " + std::to_string(kMaxEntries) + " entries", E2BIG);
    }
    out.push_back({name, kind == S_IFREG ? size : 0, kind == S_IFDIR});
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(),
            [](const Entry &a, const Entry &b) { return a.name < b.name; });
  return out;
}

std::pair<Fd, uint64_t> FilesArea::open(const std::string &principal, const std::string &path) {
  auto [dir, leaf] = parent(principal, path, false);
  // Not blocking: a FIFO would block an open for reading until a writer came.
  Fd fd(::openat(dir.get(), leaf.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (mode_t kind = kindOf(dir.get(), leaf); kind && kind != S_IFREG && kind != S_IFDIR)
      refuseKind(path, kind);
    fail(path, err == ENOENT ? "does not exist" : "cannot be opened", err);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0)
    fail(path, "cannot be read", errno);
  if (S_ISDIR(st.st_mode))
    fail(path, "is a directory", EISDIR);
  if (!S_ISREG(st.st_mode))
    refuseKind(path, st.st_mode & S_IFMT);
  return {std::move(fd), uint64_t(st.st_size)};
}

void FilesArea::remove(const std::string &principal, const std::string &path) {
  auto [dir, leaf] = parent(principal, path, false);
  uint64_t size = 0;
  mode_t kind = kindOf(dir.get(), leaf, &size);
  if (!kind)
    fail(path, "does not exist", ENOENT);
  if (kind != S_IFREG && kind != S_IFDIR)
    refuseKind(path, kind);
  if (::unlinkat(dir.get(), leaf.c_str(), kind == S_IFDIR ? AT_REMOVEDIR : 0) != 0)
    fail(path, "cannot be removed", errno);
  if (kind == S_IFREG)
    charge(principal, -int64_t(size));
}

uint64_t FilesArea::used(const std::string &principal) {
  if (!enabled())
    return 0;
  charge(principal, 0);
  std::lock_guard<std::mutex> lock(mu_);
  return used_[principal];
}

void FilesArea::charge(const std::string &principal, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = used_.find(principal);
  if (it == used_.end()) {
    // Counted once, at first use: what the operator put there counts too.
    uint64_t total = 0;
    std::error_code ec;
    fs::recursive_directory_iterator walk(dir_ + "/" + principalDirectory(principal), ec), end;
    for (; !ec && walk != end; walk.increment(ec))
      if (walk->is_regular_file(ec) && !walk->is_symlink(ec))
        total += walk->file_size(ec);
    it = used_.emplace(principal, total).first;
  }
  if (bytes > 0 && quota_ && it->second + uint64_t(bytes) > quota_)
    throw FileError("files area: writing " + memory::sizeText(uint64_t(bytes)) + " more would pass "
                        "the quota of " + memory::sizeText(quota_) + " (" +
                        memory::sizeText(it->second) + " used): remove files first",
                    "OSError");
  it->second = bytes < 0 ? it->second - std::min(it->second, uint64_t(-bytes))
                         : it->second + uint64_t(bytes);
}

std::unique_ptr<FilesArea::Writer> FilesArea::write(const std::string &principal,
                                                    const std::string &path, uint64_t offset,
                                                    bool whole) {
  auto [dir, leaf] = parent(principal, path, true);
  if (leaf.size() + 32 > 255)
    fail(path, "has a last component longer than 223 bytes");
  if (mode_t kind = kindOf(dir.get(), leaf); kind == S_IFDIR)
    fail(path, "is a directory", EISDIR);
  std::string partial = leaf + ".partial";
  if (whole) {
    static std::atomic<uint64_t> writes{0};
    char unique[40];
    std::snprintf(unique, sizeof unique, "-%d-%llu", int(::getpid()),
                  (unsigned long long)writes++);
    partial += unique;
    offset = 0;
  }
  const std::string shown = path.substr(0, path.size() - leaf.size()) + partial;
  Fd fd(::openat(dir.get(), partial.c_str(),
                 O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | (offset == 0 ? O_CREAT : 0) |
                     (whole ? O_EXCL : 0),
                 0600));
  if (fd.get() < 0) {
    const int err = errno;
    if (mode_t kind = kindOf(dir.get(), partial); kind && kind != S_IFREG)
      refuseKind(shown, kind);
    fail(shown, offset ? "no partial file to go on from" : "cannot be written", err);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0)
    fail(shown, "cannot be written", errno);
  if (!S_ISREG(st.st_mode))
    refuseKind(shown, st.st_mode & S_IFMT);
  const uint64_t size = uint64_t(st.st_size);
  if (offset == 0 && size) {
    if (::ftruncate(fd.get(), 0) != 0)
      fail(shown, "cannot be truncated", errno);
    charge(principal, -int64_t(size));
  } else if (offset != size) {
    throw FileError("files area: '" + shown + "' has " + std::to_string(size) +
                        " bytes; a write goes on from its end, not from " + std::to_string(offset),
                    "ValueError");
  }
  if (::lseek(fd.get(), 0, SEEK_END) < 0)
    fail(shown, "cannot be written", errno);
  return std::unique_ptr<Writer>(new Writer(*this, principal, path, std::move(dir), leaf,
                                            partial, whole, std::move(fd), offset));
}

FilesArea::Writer::Writer(FilesArea &area, std::string principal, std::string path, Fd dir,
                          std::string leaf, std::string partial, bool own, Fd file,
                          uint64_t size)
    : area_(area), principal_(std::move(principal)), path_(std::move(path)),
      leaf_(std::move(leaf)), partial_(std::move(partial)), own_(own), dir_(std::move(dir)),
      file_(std::move(file)), size_(size) {}

FilesArea::Writer::~Writer() {
  if (own_ && !done_ && !failed_)
    discard();
}

void FilesArea::Writer::discard() {
  ::unlinkat(dir_.get(), partial_.c_str(), 0);
  try {
    area_.charge(principal_, -int64_t(size_));
  } catch (...) {
  }
  size_ = 0;
}

void FilesArea::Writer::append(const void *data, uint64_t size) {
  if (failed_)
    fail(path_, "an earlier part of this write failed");
  try {
    area_.charge(principal_, int64_t(size));
  } catch (...) {
    // Nothing of a write past the quota is kept.
    failed_ = true;
    discard();
    throw;
  }
  const char *at = static_cast<const char *>(data);
  uint64_t done = 0;
  while (done < size) {
    ssize_t n = ::write(file_.get(), at + done, size - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      const int err = errno;
      failed_ = true;
      area_.charge(principal_, -int64_t(size - done));
      size_ += done;
      fail(path_, "cannot be written", err ? err : EIO);
    }
    done += uint64_t(n);
  }
  size_ += size;
}

void FilesArea::Writer::commit(const std::optional<ir::Hash256> &digest) {
  if (failed_)
    fail(path_, "an earlier part of this write failed");
  if (digest) {
    ir::Digester d;
    std::vector<char> buf(uint64_t(4) << 20);
    uint64_t at = 0;
    while (at < size_) {
      ssize_t n = ::pread(file_.get(), buf.data(), std::min<uint64_t>(buf.size(), size_ - at),
                          off_t(at));
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0)
        fail(path_, "cannot be read back", errno ? errno : EIO);
      d.update(buf.data(), size_t(n));
      at += uint64_t(n);
    }
    if (d.finish() != *digest) {
      const uint64_t bytes = size_;
      failed_ = true;
      discard();
      throw FileError("files area: '" + path_ + "': its " + std::to_string(bytes) +
                          " bytes do not match the digest sent with them; nothing was kept",
                      "ValueError");
    }
  }
  uint64_t old = 0;
  mode_t kind = kindOf(dir_.get(), leaf_, &old);
  if (kind == S_IFDIR)
    fail(path_, "is a directory", EISDIR);
  if (::renameat(dir_.get(), partial_.c_str(), dir_.get(), leaf_.c_str()) != 0)
    fail(path_, "cannot be written", errno);
  done_ = true;
  if (kind == S_IFREG)
    area_.charge(principal_, -int64_t(old));
}

} // namespace rgpu::server
