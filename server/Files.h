//===- server/Files.h - The files area: each principal's files on the server's disk -===//
//
// With --files-dir, each principal has a directory of its own there (named by
// principalDirectory) for checkpoints, datasets and model directories that never cross the
// user's link (rgpu.remote). Every path a client names is relative to its principal's
// directory and is walked one component at a time from that directory's descriptor: no
// component may be empty, ".", ".." or a symbolic link, and what is opened must be a regular
// file or a directory (never a device, a FIFO or a socket). What a principal's files hold
// together is bounded by --files-quota, counted as they are written.
//
// No ATen here: the commands that move tensors (server/FileCommands.cpp) use it.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "rgpu/ir/Graph.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace rgpu::server {

/// A request of the files area that cannot be served: its message names the path, and
/// pythonType is the exception a local file operation would raise.
struct FileError : std::runtime_error {
  FileError(std::string message, std::string pythonType)
      : std::runtime_error(std::move(message)), pythonType(std::move(pythonType)) {}
  std::string pythonType;
};

/// An open file descriptor, closed with it.
class Fd {
public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd &&o) noexcept : fd_(o.release()) {}
  Fd &operator=(Fd &&o) noexcept;
  ~Fd();
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

private:
  int fd_ = -1;
};

class FilesArea {
public:
  /// \p dir empty: no files area (every request fails with PermissionError).
  FilesArea(std::string dir, uint64_t quota);

  bool enabled() const { return !dir_.empty(); }
  uint64_t quota() const { return quota_; }
  /// The bytes \p principal's files hold.
  uint64_t used(const std::string &principal);

  struct Entry {
    std::string name;
    uint64_t size = 0;
    bool directory = false;
  };
  /// A directory's entries (symbolic links and special files left out), sorted; a file's own.
  std::vector<Entry> list(const std::string &principal, const std::string &path);
  /// A regular file, open for reading, and its size.
  std::pair<Fd, uint64_t> open(const std::string &principal, const std::string &path);
  /// Removes a file or an empty directory.
  void remove(const std::string &principal, const std::string &path);

  /// Writes to a partial file, then (commit) renames it to PATH. Bytes past the quota fail the
  /// write with an OSError naming it, and the partial file is removed.
  class Writer {
  public:
    void append(const void *data, uint64_t size);
    /// Renames the partial file to its path, after checking \p digest if given.
    void commit(const std::optional<ir::Hash256> &digest);
    /// A private partial file not committed is removed.
    ~Writer();

  private:
    friend class FilesArea;
    Writer(FilesArea &area, std::string principal, std::string path, Fd dir, std::string leaf,
           std::string partial, bool own, Fd file, uint64_t size);
    /// Removes the partial file and gives its bytes back to the quota.
    void discard();
    FilesArea &area_;
    std::string principal_, path_, leaf_, partial_;
    bool own_; ///< the partial file is this writer's alone
    Fd dir_, file_;
    uint64_t size_;
    bool failed_ = false, done_ = false;
  };
  /// A writer of \p path. With \p whole, into a partial file of its own (a file written in one
  /// request: writers of one path do not mix their bytes); else into PATH.partial from
  /// \p offset, which must be its size (0 starts it over), so that an upload that broke off
  /// goes on. Directories on the way are made.
  std::unique_ptr<Writer> write(const std::string &principal, const std::string &path,
                                uint64_t offset, bool whole = false);

  /// The longest path accepted, and the most components it may have.
  static constexpr size_t kMaxPath = 1024, kMaxDepth = 32;

private:
  /// The directory that holds \p path's last component (made if \p create), and that
  /// component; the root's descriptor for an empty path with \p allowRoot.
  std::pair<Fd, std::string> parent(const std::string &principal, const std::string &path,
                                    bool create, bool allowRoot = false);
  Fd root(const std::string &principal);
  void charge(const std::string &principal, int64_t bytes); // may throw past the quota

  std::string dir_;
  uint64_t quota_;
  std::mutex mu_;
  std::map<std::string, uint64_t> used_; ///< by principal, counted at first use (under mu_)
};

} // namespace rgpu::server
