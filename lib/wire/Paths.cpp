#include "rgpu/wire/Paths.h"

#include <cstdlib>
#include <sys/stat.h>

namespace rgpu::wire {

namespace {
const char *nonEmpty(const char *name) {
  const char *v = std::getenv(name);
  return v && *v ? v : nullptr;
}
} // namespace

std::string homeDir() {
  const char *home = nonEmpty("HOME");
  return home ? home : ".";
}

std::string userDir(UserDir which) {
  switch (which) {
  case UserDir::Cache:
    if (const char *xdg = nonEmpty("XDG_CACHE_HOME"))
      return xdg;
    return homeDir() + "/.cache";
  case UserDir::Config:
    if (const char *xdg = nonEmpty("XDG_CONFIG_HOME"))
      return xdg;
    return homeDir() + "/.config";
  case UserDir::Runtime: {
    const char *run = nonEmpty("XDG_RUNTIME_DIR");
    struct stat st;
    if (run && ::stat(run, &st) == 0 && S_ISDIR(st.st_mode))
      return run;
    return "";
  }
  }
  return "";
}

} // namespace rgpu::wire
