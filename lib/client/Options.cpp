#include "Options.h"

#include "rgpu/wire/Cache.h"

#include <algorithm>
#include <cstdlib>

namespace rgpu::client {

namespace {
/// \p name's value, or null if it is unset or empty.
const char *nonEmpty(Lookup getenv, const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : nullptr;
}

const char *fromProcess(const char *name) { return std::getenv(name); }
} // namespace

ConnectionOptions ConnectionOptions::read(Lookup getenv) {
  ConnectionOptions o;
  if (const char *v = nonEmpty(getenv, "RGPU_OPSERVER"))
    o.server = v;
  if (const char *v = nonEmpty(getenv, "RGPU_TOKEN"))
    o.token = v;
  if (const char *v = nonEmpty(getenv, "RGPU_TOKEN_FILE"))
    o.tokenFile = v;
  if (const char *v = nonEmpty(getenv, "RGPU_RECONNECT_SECONDS"))
    o.reconnectSeconds = std::max(1, std::atoi(v));
  return o;
}

ConnectionOptions ConnectionOptions::fromEnvironment() { return read(fromProcess); }

Options Options::read(Lookup getenv) {
  Options o;
  o.connection = ConnectionOptions::read(getenv);
  if (const char *v = getenv("RGPU_MAX_INFLIGHT"))
    o.maxInflight = size_t(std::clamp(std::atoi(v), 1, int(kMaxInFlightFrames)));
  if (const char *v = getenv("RGPU_DYNAMIC"))
    o.dynamic = std::string(v) != "0";
  if (const char *v = nonEmpty(getenv, "RGPU_STREAM_CUT"))
    o.streamCutNodes = uint64_t(std::max(0LL, std::atoll(v)));
  if (const char *v = nonEmpty(getenv, "RGPU_COMPRESS")) {
    const std::string z = v;
    o.compress = z == "0" || z == "off"  ? Compress::Never
                 : z == "1" || z == "on" ? Compress::Always
                                         : Compress::Auto;
  }
  if (const char *v = nonEmpty(getenv, "RGPU_UPLOAD_STORE"))
    o.contentUploads = std::string(v) != "0" && std::string(v) != "off";
  if (const char *v = nonEmpty(getenv, "RGPU_CACHE_DIR"))
    o.cacheDir = std::string(v) == "off" ? "" : v;
  else
    o.cacheDir = wire::defaultCacheDir();
  return o;
}

Options Options::fromEnvironment() { return read(fromProcess); }

} // namespace rgpu::client
