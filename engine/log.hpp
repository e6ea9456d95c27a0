// Logging in the NCCL mould: GRAPHEP_DEBUG=WARN|INFO|TRACE selects the level,
// GRAPHEP_DEBUG_SUBSYS=INIT,HEAP,... (or ^HEAP to exclude) selects subsystems. Lines look like
//   myhost:12345:12346 [0] graphep INFO HEAP carved 16 MiB ...
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace graphep::log {

enum class Level : int { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

enum Subsys : std::uint32_t {
  kInit = 1u << 0,
  kComm = 1u << 1,
  kHeap = 1u << 2,
  kTopo = 1u << 3,
  kSync = 1u << 4,
  kGraph = 1u << 5,
  kTune = 1u << 6,
  kAll = 0xffffffffu,
};

// Parsing, exposed for tests. Both throw graphep::Error naming the bad text.
Level parseLevel(std::string_view text);
std::uint32_t parseSubsysMask(std::string_view text);
const char* subsysName(std::uint32_t bit);

// "host:pid:tid [dev]"
std::string linePrefix(std::string_view host, long pid, long tid, int device);

bool enabled(Level level, std::uint32_t subsys);
void write(Level level, std::uint32_t subsys, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

// Test hooks: override the configuration read from the environment, and capture lines.
void configure(Level level, std::uint32_t mask);
void setSink(std::function<void(const std::string&)> sink);  // empty function restores stderr

}  // namespace graphep::log

#define GRAPHEP_LOG_AT(level, subsys, ...)                                  \
  do {                                                                      \
    if (::graphep::log::enabled((level), (subsys)))                         \
      ::graphep::log::write((level), (subsys), __VA_ARGS__);                \
  } while (0)
#define GRAPHEP_LOG_WARN(subsys, ...) GRAPHEP_LOG_AT(::graphep::log::Level::kWarn, subsys, __VA_ARGS__)
#define GRAPHEP_LOG_INFO(subsys, ...) GRAPHEP_LOG_AT(::graphep::log::Level::kInfo, subsys, __VA_ARGS__)
#define GRAPHEP_LOG_TRACE(subsys, ...) \
  GRAPHEP_LOG_AT(::graphep::log::Level::kTrace, subsys, __VA_ARGS__)
