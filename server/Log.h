//===- server/Log.h - The server's log on stderr ------------------------------===//
#pragma once

#include <iostream>
#include <mutex>
#include <string>

namespace rgpu::server {

/// False silences the log (the fuzz targets run millions of sessions in-process).
inline bool &logEnabled() {
  static bool enabled = true;
  return enabled;
}

/// Writes one line, prefixed with "rgpu-opserver: ", to stderr; thread-safe.
inline void log(const std::string &message) {
  if (!logEnabled())
    return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << "rgpu-opserver: " << message << std::endl;
}

} // namespace rgpu::server
