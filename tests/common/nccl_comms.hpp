// Test helpers around NCCL communicators owned by the test (the embedding application's role).
#pragma once

#include <nccl.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <graphep/comm.hpp>

namespace graphep::test {

// NCCL comms made by ncclCommInitAll over `devices` (default 0 and 1), one per device, as an
// embedding application would; every entry null when NCCL refused.
struct CallerNcclComms {
  explicit CallerNcclComms(std::vector<int> devices = {0, 1}) : comms(devices.size(), nullptr) {
    if (ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()) != ncclSuccess) {
      comms.assign(devices.size(), nullptr);
    }
  }
  ~CallerNcclComms() {
    for (ncclComm_t c : comms)
      if (c) ncclCommDestroy(c);
  }
  CallerNcclComms(const CallerNcclComms&) = delete;
  CallerNcclComms& operator=(const CallerNcclComms&) = delete;
  std::vector<ncclComm_t> comms;
};

// The caller's NCCL comms over `devices`, adopted into one communicator; `comm` is null when NCCL
// refused (the test asserts it). Declared after the comms it borrows, so destroyed before them.
struct AdoptedNcclGroup {
  explicit AdoptedNcclGroup(std::vector<int> devices)
      : nccl(std::move(devices)), comm(nccl.comms[0] != nullptr ? adoptNcclComms(nccl.comms) : nullptr) {}
  CallerNcclComms nccl;
  std::unique_ptr<Communicator> comm;
};

// Sets an environment variable for the lifetime of the object (restores the old value after).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    if (old) {
      hadOld_ = true;
      old_ = old;
    }
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (hadOld_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool hadOld_ = false;
  std::string old_;
};

// Brackets calls for several local ranks in one NCCL group when the communicator carries NCCL
// comms (NCCL's rule for one thread driving several GPUs); a no-op otherwise.
class NcclGroupIfAny {
 public:
  explicit NcclGroupIfAny(const Communicator& comm) : active_(comm.ncclComm(0) != nullptr) {
    if (active_) ncclGroupStart();
  }
  ~NcclGroupIfAny() {
    if (active_) ncclGroupEnd();
  }

 private:
  bool active_;
};

}  // namespace graphep::test
