// graphep: CUDA-graph-native Mixture-of-Experts expert parallelism. Umbrella header of the C++ API.
#pragma once

#include <graphep/comm.hpp>
#include <graphep/graph.hpp>
#include <graphep/moe.hpp>
#include <graphep/status.hpp>
#include <graphep/types.hpp>
#include <graphep/version.hpp>

namespace graphep {

// "0.1.0"
const char* versionString() noexcept;

// The CUDA targets the library's kernels were built for (GRAPHEP_CUDA_ARCHS), space-separated, e.g.
// "90a" or "90a 100a": machine code for each, and the last one's PTX as well.
const char* cudaTargets() noexcept;

// Run-time NCCL version as ncclGetVersion() reports it (e.g. 22803), which may differ from the
// headers graphep was built with.
int ncclRuntimeVersion();

// Number of usable CUDA devices; 0 on a machine with no GPU or no driver (never throws).
// `reason`, when given, receives why none is usable.
int cudaDeviceCountOrZero(const char** reason = nullptr) noexcept;

}  // namespace graphep
