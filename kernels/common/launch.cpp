// A launcher's refusal, kept per thread until the engine's error for the call reads it
// (kernels/common/launch.h).
#include "kernels/common/launch.h"

#include <cstdarg>
#include <cstdio>

namespace graphep {
namespace {
thread_local std::string lastRefusal;
}  // namespace

cudaError_t refuseLaunch(const char* launcher, const char* fmt, ...) {
  char what[384];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(what, sizeof what, fmt, args);
  va_end(args);
  lastRefusal = std::string(launcher) + ": " + what;
  return cudaErrorInvalidValue;
}

std::string takeLaunchRefusal() {
  std::string s;
  s.swap(lastRefusal);
  return s;
}

}  // namespace graphep
