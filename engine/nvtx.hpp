// NVTX ranges in the "graphep" domain around host entry points (header-only NVTX v3 from the CUDA
// toolkit: no library to link, near-zero cost when no tool is attached).
#pragma once

#include <nvtx3/nvToolsExt.h>

namespace graphep::detail {

inline nvtxDomainHandle_t nvtxDomain() {
  static nvtxDomainHandle_t d = nvtxDomainCreateA("graphep");
  return d;
}

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
    nvtxEventAttributes_t a{};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name;
    nvtxDomainRangePushEx(nvtxDomain(), &a);
  }
  ~NvtxRange() { nvtxDomainRangePop(nvtxDomain()); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace graphep::detail

#define GRAPHEP_NVTX_CONCAT2(a, b) a##b
#define GRAPHEP_NVTX_CONCAT(a, b) GRAPHEP_NVTX_CONCAT2(a, b)
#define GRAPHEP_NVTX_RANGE(name) \
  ::graphep::detail::NvtxRange GRAPHEP_NVTX_CONCAT(graphepNvtxRange_, __LINE__)(name)
