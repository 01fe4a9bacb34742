#include "ContentStore.h"

#include "Log.h"

#include "rgpu/ir/Digest.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <unistd.h>
#include <vector>

namespace rgpu::server {

namespace fs = std::filesystem;

std::string principalDirectory(const std::string &principal) {
  bool plain = !principal.empty() && principal.size() <= 64 && principal[0] != '.' &&
               std::all_of(principal.begin(), principal.end(), [](char c) {
                 return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ||
                        c == '.';
               });
  if (plain)
    return principal;
  return "principal-" + ir::digestOf(principal.data(), principal.size()).hex().substr(0, 32);
}

ContentStore::ContentStore(std::string dir, uint64_t capacity)
    : dir_(std::move(dir)), capacity_(capacity) {
  if (!capacity_)
    return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  fs::permissions(dir_, fs::perms::owner_all, ec);
  // What an earlier server kept, least recently written first; half-written files go.
  std::vector<std::pair<fs::file_time_type, std::pair<std::string, uint64_t>>> found;
  for (const auto &who : fs::directory_iterator(dir_, ec)) {
    if (!who.is_directory(ec) || who.is_symlink(ec))
      continue;
    for (const auto &f : fs::directory_iterator(who.path(), ec)) {
      const std::string name = f.path().filename().string();
      ir::Hash256 digest;
      if (!f.is_regular_file(ec) || f.is_symlink(ec) || !ir::Hash256::parse(name, digest)) {
        if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0)
          fs::remove(f.path(), ec);
        continue;
      }
      found.push_back({f.last_write_time(ec),
                       {who.path().filename().string() + "/" + name, f.file_size(ec)}});
    }
  }
  std::sort(found.begin(), found.end());
  std::lock_guard<std::mutex> lock(mu_);
  for (auto &[when, entry] : found) {
    lru_.push_front(entry.first);
    entries_[entry.first] = {entry.second, lru_.begin()};
    bytes_ += entry.second;
  }
  evict(0);
}

std::string ContentStore::key(const std::string &principal, const ir::Hash256 &digest) const {
  return principalDirectory(principal) + "/" + digest.hex();
}

void ContentStore::use(const std::string &key) {
  auto it = entries_.find(key);
  lru_.splice(lru_.begin(), lru_, it->second.lru);
}

void ContentStore::evict(uint64_t room) {
  while (!lru_.empty() && bytes_ + room > capacity_) {
    const std::string victim = lru_.back();
    std::error_code ec;
    fs::remove(dir_ + "/" + victim, ec);
    bytes_ -= entries_[victim].size;
    entries_.erase(victim);
    lru_.pop_back();
    ++evictions;
  }
}

bool ContentStore::has(const std::string &principal, const ir::Hash256 &digest) {
  if (!enabled())
    return false;
  std::lock_guard<std::mutex> lock(mu_);
  const std::string k = key(principal, digest);
  if (!entries_.count(k))
    return false;
  use(k);
  return true;
}

bool ContentStore::read(const std::string &principal, const ir::Hash256 &digest, void *out,
                        uint64_t size) {
  if (!enabled())
    return false;
  int fd = -1;
  {
    // Opened under the lock: an eviction after this unlinks the name, not the open file.
    std::lock_guard<std::mutex> lock(mu_);
    const std::string k = key(principal, digest);
    auto it = entries_.find(k);
    if (it == entries_.end() || it->second.size != size)
      return false;
    use(k);
    fd = ::open((dir_ + "/" + k).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  }
  if (fd < 0)
    return false;
  uint64_t done = 0;
  auto *at = static_cast<char *>(out);
  while (done < size) {
    ssize_t n = ::pread(fd, at + done, size - done, off_t(done));
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    done += uint64_t(n);
  }
  ::close(fd);
  return done == size;
}

void ContentStore::put(const std::string &principal, const ir::Hash256 &digest,
                       const void *bytes, uint64_t size) {
  if (!enabled() || size > capacity_ || has(principal, digest))
    return;
  const std::string k = key(principal, digest);
  const std::string dir = dir_ + "/" + principalDirectory(principal);
  std::error_code ec;
  fs::create_directories(dir, ec);
  const std::string tmp = dir_ + "/" + k + "." + std::to_string(::getpid()) + "-" +
                          std::to_string(temporaries_++) + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    log("content store: cannot write " + tmp + ": " + std::strerror(errno));
    return;
  }
  uint64_t done = 0;
  const auto *at = static_cast<const char *>(bytes);
  while (done < size) {
    ssize_t n = ::write(fd, at + done, size - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    done += uint64_t(n);
  }
  const bool ok = done == size && ::close(fd) == 0;
  if (done != size)
    ::close(fd);
  if (!ok) {
    log("content store: cannot write " + tmp + ": " + std::strerror(errno));
    fs::remove(tmp, ec);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.count(k)) { // another session stored the same bytes meanwhile
    fs::remove(tmp, ec);
    return;
  }
  evict(size);
  fs::rename(tmp, dir_ + "/" + k, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return;
  }
  lru_.push_front(k);
  entries_[k] = {size, lru_.begin()};
  bytes_ += size;
}

uint64_t ContentStore::bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

} // namespace rgpu::server
