//===- rgpu/ir/Bytes.h - Building byte-string keys in place ------------------===//
#pragma once

#include <algorithm>
#include <cstring>
#include <string>

namespace rgpu::ir {

/// Appends raw bytes to a string that serves as an exact key, growing it geometrically: one
/// inline branch per value, where std::string::append is an out-of-line call per value (most of
/// the cost of keys built once per traced op or per cut). finish() trims the string.
class ByteWriter {
public:
  explicit ByteWriter(std::string &out) : out_(out), used_(out.size()) {}
  void write(const void *p, size_t n) {
    if (used_ + n > out_.size())
      out_.resize(std::max(2 * out_.size(), used_ + n + 256));
    std::memcpy(&out_[used_], p, n);
    used_ += n;
  }
  template <class T> void put(T v) { write(&v, sizeof v); }
  /// A length-prefixed string.
  void str(const std::string &s) {
    put(uint64_t(s.size()));
    write(s.data(), s.size());
  }
  void finish() { out_.resize(used_); }

private:
  std::string &out_;
  size_t used_;
};

} // namespace rgpu::ir
