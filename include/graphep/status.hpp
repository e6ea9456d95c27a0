// graphep error model, C++ side: every failure is a graphep::Error carrying a Status and a message
// that names the offending value ("hidden=7000 is not a multiple of 8"). The library never calls
// exit() or abort().
#pragma once

#include <stdexcept>
#include <string>

namespace graphep {

enum class Status : int {
  kSuccess = 0,
  kInvalidArgument = 1,   // a value passed by the caller is out of range or inconsistent
  kInvalidUsage = 2,      // a call made in the wrong state (e.g. setup while capturing)
  kNotSupported = 3,      // feature not built in, or not available on this hardware
  kNoDevice = 4,          // no usable CUDA device/driver on this machine
  kCudaError = 5,         // a CUDA runtime or driver call failed
  kNcclError = 6,         // an NCCL call failed
  kMpiError = 7,          // an MPI call failed
  kSystemError = 8,       // an OS call failed
  kOutOfMemory = 9,       // device or host allocation failed
  kTimeout = 10,          // a bounded wait expired (device or host)
  kGraphInvalidated = 11, // an operation would invalidate pointers baked into captured graphs
  kRemoteError = 12,      // a peer rank failed or reported an error
  kInternalError = 13,    // a graphep bug: please report
};

// Stable upper-case name, e.g. "INVALID_ARGUMENT".
const char* statusName(Status status) noexcept;

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

}  // namespace graphep
