// One NCCL group call (ncclGroupStart ... ncclGroupEnd) that a throw cannot leave open.
#pragma once
#include <nccl.h>

#include "engine/error.hpp"

namespace graphep {

// ncclGroupStart in the constructor; end() calls ncclGroupEnd (and reports its error); if a call
// between them threw, the destructor ends the group instead. NCCL's group depth is per thread: a
// group left open queues every later NCCL call on the thread unrun, ncclCommInitAll's included,
// which then returns communicators of 0 ranks. Check what can be checked (the communicators, the
// peers) before the group starts: the destructor's ncclGroupEnd still launches what was queued.
class NcclGroup {
 public:
  NcclGroup() { GRAPHEP_NCCL_CHECK(ncclGroupStart()); }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }
  void end() {
    open_ = false;
    GRAPHEP_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

}  // namespace graphep
