#include "engine/log.hpp"

#include <cuda_runtime.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdarg>
#include <cstdio>
#include <mutex>

#include "engine/env.hpp"
#include "engine/error.hpp"

namespace graphep::log {
namespace {

struct SubsysEntry {
  const char* name;
  std::uint32_t bit;
};
constexpr SubsysEntry kSubsys[] = {{"INIT", kInit},   {"COMM", kComm},   {"HEAP", kHeap},
                                   {"TOPO", kTopo},   {"SYNC", kSync},   {"GRAPH", kGraph},
                                   {"TUNE", kTune},   {"ALL", kAll}};

std::string upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

struct State {
  std::once_flag once;
  std::atomic<int> level{static_cast<int>(Level::kWarn)};
  std::atomic<std::uint32_t> mask{kAll};
  std::mutex sinkMutex;
  std::function<void(const std::string&)> sink;
};
State& state() {
  static State s;
  return s;
}

// Set while the environment is parsed: a parse error raises graphep::Error, whose constructor path
// logs, and must not re-enter call_once.
thread_local bool tInitializing = false;

void initFromEnv() {
  State& s = state();
  std::call_once(s.once, [&] {
    tInitializing = true;
    // A malformed variable must not make logging itself throw: fall back and say so.
    try {
      s.level = static_cast<int>(parseLevel(env::kDebug.get()));
    } catch (const Error& e) {
      std::fprintf(stderr, "graphep WARN %s; using WARN\n", e.what());
    }
    try {
      s.mask = parseSubsysMask(env::kDebugSubsys.get());
    } catch (const Error& e) {
      std::fprintf(stderr, "graphep WARN %s; using ALL\n", e.what());
    }
    tInitializing = false;
  });
}

const char* levelName(Level l) {
  switch (l) {
    case Level::kWarn: return "WARN";
    case Level::kInfo: return "INFO";
    case Level::kTrace: return "TRACE";
    default: return "NONE";
  }
}

}  // namespace

Level parseLevel(std::string_view text) {
  std::string t = upper(text);
  if (t.empty() || t == "WARN") return Level::kWarn;
  if (t == "NONE" || t == "OFF") return Level::kNone;
  if (t == "INFO") return Level::kInfo;
  if (t == "TRACE") return Level::kTrace;
  GRAPHEP_FAIL(Status::kInvalidArgument,
               "GRAPHEP_DEBUG='%.*s' is not one of NONE, WARN, INFO, TRACE",
               static_cast<int>(text.size()), text.data());
}

std::uint32_t parseSubsysMask(std::string_view text) {
  std::string t = upper(text);
  if (t.empty()) return kAll;
  bool exclude = t[0] == '^';
  if (exclude) t.erase(0, 1);
  std::uint32_t mask = 0;
  size_t pos = 0;
  while (pos <= t.size()) {
    size_t comma = t.find(',', pos);
    std::string tok = t.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!tok.empty()) {
      bool found = false;
      for (const auto& e : kSubsys) {
        if (tok == e.name) {
          mask |= e.bit;
          found = true;
        }
      }
      GRAPHEP_REQUIRE(found, Status::kInvalidArgument,
                      "GRAPHEP_DEBUG_SUBSYS: unknown subsystem '%s' (known: INIT, COMM, HEAP, "
                      "TOPO, SYNC, GRAPH, TUNE, ALL)",
                      tok.c_str());
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return exclude ? ~mask : mask;
}

const char* subsysName(std::uint32_t bit) {
  for (const auto& e : kSubsys)
    if (e.bit == bit) return e.name;
  return "ALL";
}

std::string linePrefix(std::string_view host, long pid, long tid, int device) {
  std::string dev = device >= 0 ? std::to_string(device) : std::string("-");
  return std::string(host) + ":" + std::to_string(pid) + ":" + std::to_string(tid) + " [" + dev +
         "]";
}

bool enabled(Level level, std::uint32_t subsys) {
  if (tInitializing) return false;
  initFromEnv();
  const State& s = state();
  return static_cast<int>(level) <= s.level.load(std::memory_order_relaxed) &&
         (subsys & s.mask.load(std::memory_order_relaxed)) != 0;
}

void write(Level level, std::uint32_t subsys, const char* fmt, ...) {
  char host[64] = "?";
  gethostname(host, sizeof(host) - 1);
  host[sizeof(host) - 1] = '\0';
  for (char* p = host; *p; ++p)
    if (*p == '.') *p = '\0';  // short host name, as NCCL prints it
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    dev = -1;
  }
  char body[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(body, sizeof(body), fmt, ap);
  va_end(ap);
  std::string line = linePrefix(host, static_cast<long>(getpid()),
                                static_cast<long>(syscall(SYS_gettid)), dev) +
                     " graphep " + levelName(level) + " " + subsysName(subsys) + " " + body;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.sinkMutex);
  if (s.sink) {
    s.sink(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

void configure(Level level, std::uint32_t mask) {
  initFromEnv();
  state().level = static_cast<int>(level);
  state().mask = mask;
}

void setSink(std::function<void(const std::string&)> sink) {
  std::lock_guard<std::mutex> lock(state().sinkMutex);
  state().sink = std::move(sink);
}

}  // namespace graphep::log
