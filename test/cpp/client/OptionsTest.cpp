#include "Options.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

using rgpu::client::kMaxInFlightFrames;
using rgpu::client::Options;

TEST(Options, TheEnvironmentIsReadInOnePlace) {
  std::map<std::string, std::string> env = {{"RGPU_MAX_INFLIGHT", "500"},
                                            {"RGPU_DYNAMIC", "0"},
                                            {"RGPU_COMPRESS", "off"},
                                            {"RGPU_CACHE_DIR", "off"},
                                            {"RGPU_OPSERVER", "gpu:9720"},
                                            {"RGPU_RECONNECT_SECONDS", "0"}};
  Options o = Options::read([&](const char *name) -> const char * {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  EXPECT_EQ(o.maxInflight, kMaxInFlightFrames); // clamped
  EXPECT_FALSE(o.dynamic);
  EXPECT_EQ(o.compress, Options::Compress::Never);
  EXPECT_EQ(o.cacheDir, "");
  EXPECT_EQ(o.connection.server, "gpu:9720");
  EXPECT_EQ(o.connection.reconnectSeconds, 1); // at least one second
  EXPECT_TRUE(o.connection.token.empty());
}

TEST(Options, UnsetVariablesMeanTheDefaults) {
  Options o = Options::read([](const char *) -> const char * { return nullptr; });
  EXPECT_EQ(o.maxInflight, 8u);
  EXPECT_TRUE(o.dynamic);
  EXPECT_EQ(o.compress, Options::Compress::Auto);
  EXPECT_EQ(o.connection.reconnectSeconds, 60);
  EXPECT_TRUE(o.connection.server.empty());
}
