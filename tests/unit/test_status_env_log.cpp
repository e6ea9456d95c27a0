// CPU unit tests: status names, error messages, environment parsing, logging configuration.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <set>
#include <string>

#include <graphep/graphep.hpp>

#include "engine/env.hpp"
#include "engine/error.hpp"
#include "engine/log.hpp"

namespace graphep {
namespace {

TEST(Unit_Status, NamesAreUniqueAndKnown) {
  std::set<std::string> names;
  for (int s = 0; s <= static_cast<int>(Status::kInternalError); ++s) {
    const std::string n = statusName(static_cast<Status>(s));
    EXPECT_NE(n, "UNKNOWN_STATUS") << s;
    EXPECT_TRUE(names.insert(n).second) << "duplicate " << n;
  }
  EXPECT_STREQ(statusName(static_cast<Status>(999)), "UNKNOWN_STATUS");
}

TEST(Unit_Status, RequireThrowsWithStatusAndNamedValue) {
  const int hidden = 7000;
  try {
    GRAPHEP_REQUIRE(hidden % 128 == 0, Status::kInvalidArgument,
                    "hidden=%d is not a multiple of %d", hidden, 128);
    FAIL() << "expected throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_STREQ(e.what(), "hidden=7000 is not a multiple of 128");
  }
}

TEST(Unit_Status, CudaCheckNamesCallErrorAndLocation) {
  try {
    GRAPHEP_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL() << "expected throw";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.status(), Status::kCudaError);
    EXPECT_NE(m.find("cudaErrorInvalidValue"), std::string::npos) << m;
    EXPECT_NE(m.find("test_status_env_log.cpp"), std::string::npos) << m;
  }
  try {
    GRAPHEP_NCCL_CHECK(ncclInvalidArgument);
    FAIL() << "expected throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNcclError);
    EXPECT_NE(std::string(e.what()).find("ncclInvalidArgument"), std::string::npos) << e.what();
  }
}

TEST(Unit_Env, EveryVariableIsPrefixedUniqueDocumentedAndItsDefaultParses) {
  std::set<std::string> names;
  for (const env::Var* v : env::all()) {
    const env::Info& i = v->info();
    EXPECT_EQ(std::string(i.name).rfind("GRAPHEP_", 0), 0u) << i.name;
    EXPECT_TRUE(names.insert(i.name).second) << "declared twice: " << i.name;
    EXPECT_GT(std::string(i.help).size(), 10u) << i.name;
  }
  EXPECT_EQ(env::kTimeoutMs.parse(env::kTimeoutMs.info().defaultValue), 10000);
  EXPECT_FALSE(env::kTrapOnTimeout.parse(env::kTrapOnTimeout.info().defaultValue));
  EXPECT_EQ(env::kForceTransport.parse(env::kForceTransport.info().defaultValue), "auto");
}

TEST(Unit_Env, IntParsingNamesVariableAndValue) {
  EXPECT_EQ(env::kTimeoutMs.parse("250"), 250);
  for (const char* bad : {"", "12ms", "abc", "1.5"}) {
    try {
      env::kTimeoutMs.parse(bad);
      FAIL() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("GRAPHEP_TIMEOUT_MS='"), std::string::npos) << e.what();
    }
  }
  try {
    env::kTimeoutMs.parse("0");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GRAPHEP_TIMEOUT_MS=0 is out of range"),
              std::string::npos)
        << e.what();
  }
}

TEST(Unit_Env, BoolAndChoiceParsing) {
  for (const char* t : {"1", "true", "YES", "on"}) EXPECT_TRUE(env::kTrapOnTimeout.parse(t)) << t;
  for (const char* f : {"0", "false", "No", "off"}) EXPECT_FALSE(env::kTrapOnTimeout.parse(f)) << f;
  EXPECT_THROW(env::kTrapOnTimeout.parse("maybe"), Error);
  EXPECT_EQ(env::kForceTransport.parse("REMOTE"), "remote");
  try {
    env::kForceTransport.parse("nvlink");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "GRAPHEP_FORCE_TRANSPORT='nvlink' is not one of auto|remote");
  }
}

TEST(Unit_Env, ReadsTheEnvironment) {
  ::setenv("GRAPHEP_TIMEOUT_MS", "1234", 1);
  EXPECT_EQ(env::kTimeoutMs.get(), 1234);
  EXPECT_TRUE(env::kTimeoutMs.isSet());
  ::setenv("GRAPHEP_TIMEOUT_MS", "", 1);
  EXPECT_EQ(env::kTimeoutMs.get(), 10000) << "empty means default";
  ::unsetenv("GRAPHEP_TIMEOUT_MS");
  EXPECT_FALSE(env::kTimeoutMs.isSet());
}

TEST(Unit_Log, LevelsAndSubsystems) {
  EXPECT_EQ(log::parseLevel("info"), log::Level::kInfo);
  EXPECT_EQ(log::parseLevel("TRACE"), log::Level::kTrace);
  EXPECT_EQ(log::parseLevel(""), log::Level::kWarn);
  EXPECT_THROW(log::parseLevel("LOUD"), Error);
  EXPECT_EQ(log::parseSubsysMask("INIT,HEAP"), log::kInit | log::kHeap);
  EXPECT_EQ(log::parseSubsysMask("heap"), static_cast<std::uint32_t>(log::kHeap));
  EXPECT_EQ(log::parseSubsysMask("^HEAP"), ~static_cast<std::uint32_t>(log::kHeap));
  EXPECT_EQ(log::parseSubsysMask("ALL"), static_cast<std::uint32_t>(log::kAll));
  try {
    log::parseSubsysMask("INIT,BOGUS");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'BOGUS'"), std::string::npos) << e.what();
  }
}

TEST(Unit_Log, PrefixAndFiltering) {
  EXPECT_EQ(log::linePrefix("node1", 42, 43, 0), "node1:42:43 [0]");
  EXPECT_EQ(log::linePrefix("node1", 42, 43, -1), "node1:42:43 [-]");
  std::vector<std::string> lines;
  log::setSink([&](const std::string& l) { lines.push_back(l); });
  log::configure(log::Level::kInfo, log::kHeap);
  GRAPHEP_LOG_INFO(log::kHeap, "carved %d bytes", 4096);
  GRAPHEP_LOG_INFO(log::kComm, "filtered out by subsystem");
  GRAPHEP_LOG_TRACE(log::kHeap, "filtered out by level");
  log::configure(log::Level::kWarn, log::kAll);
  log::setSink({});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find(" graphep INFO HEAP carved 4096 bytes"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(":"), std::string::npos);
}

TEST(Unit_Version, VersionAndNccl) {
  EXPECT_STREQ(versionString(), GRAPHEP_VERSION_STRING);
  // libnccl loads without a driver; the run-time version is at least 2.18.
  EXPECT_GE(ncclRuntimeVersion(), 21800);
}

TEST(Unit_Version, CudaTargetsAreTheBuildsArchitectures) {
  // Space-separated compute capabilities with an optional feature suffix (90a, 100f, 89), at least
  // one: what graphep-info prints and a user compares with the GPU's.
  const std::string targets = cudaTargets();
  ASSERT_FALSE(targets.empty());
  std::size_t at = 0, count = 0;
  while (at < targets.size()) {
    const std::size_t end = std::min(targets.find(' ', at), targets.size());
    const std::string t = targets.substr(at, end - at);
    std::size_t digits = 0;
    while (digits < t.size() && std::isdigit(static_cast<unsigned char>(t[digits]))) ++digits;
    EXPECT_GE(digits, 2u) << "'" << t << "' in '" << targets << "'";
    EXPECT_LE(t.size() - digits, 1u) << "'" << t << "' in '" << targets << "'";
    ++count;
    at = end + 1;
  }
  EXPECT_GE(count, 1u);
}

}  // namespace
}  // namespace graphep
