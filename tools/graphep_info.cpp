// graphep-info: version, NCCL, devices, per-peer topology among the visible devices, and every
// GRAPHEP_* environment variable with its default, current value and help. Runs (and exits 0) on
// machines with no GPU: it says so and prints what it can.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>
#include <exception>
#include <vector>

#include <graphep/graphep.hpp>

#include "engine/env.hpp"
#include "engine/topology.hpp"

namespace {

void printEnv() {
  std::printf("\nEnvironment variables:\n");
  std::printf("  %-24s %-7s %-8s %-10s %s\n", "name", "type", "default", "current", "help");
  for (const graphep::env::Var* v : graphep::env::all()) {
    const auto& i = v->info();
    std::printf("  %-24s %-7s %-8s %-10s %s%s%s\n", i.name, graphep::env::typeName(i.type),
                i.defaultValue, v->isSet() ? v->raw().c_str() : "(unset)", i.help,
                i.choices ? "; one of " : "", i.choices ? i.choices : "");
  }
}

int run() {
  std::printf("graphep %s\n", graphep::versionString());
  std::printf("NCCL: built against %d.%d.%d, runtime %d\n", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH,
              graphep::ncclRuntimeVersion());
  std::printf("MPI bootstrap: %s\n", graphep::mpiSupported() ? "built" : "not built");
  std::printf("CUDA targets: %s (machine code for each, PTX of the last; GRAPHEP_CUDA_ARCHS)\n",
              graphep::cudaTargets());
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
  std::printf("CUDA runtime %d, driver %d\n", rt, drv);

  const char* reason = nullptr;
  const int n = graphep::cudaDeviceCountOrZero(&reason);
  if (n == 0) {
    std::printf("\nDevices: none usable (%s)\n", reason ? reason : "unknown");
    printEnv();
    return 0;
  }
  std::printf("\nDevices (%d):\n", n);
  // Whether the build has machine code for a device's compute capability (an arch-specific target
  // such as 90a runs on that capability alone; the PTX of a plain one JITs on later ones too).
  auto builtFor = [](int major, int minor) {
    const std::string targets = graphep::cudaTargets(), cc = std::to_string(major * 10 + minor);
    std::size_t at = 0;
    while (at <= targets.size()) {
      const std::size_t end = std::min(targets.find(' ', at), targets.size());
      std::string t = targets.substr(at, end - at);
      while (!t.empty() && std::isalpha(static_cast<unsigned char>(t.back()))) t.pop_back();
      if (t == cc) return true;
      at = end + 1;
    }
    return false;
  };
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    char bus[32] = {0};
    cudaDeviceGetPCIBusId(bus, sizeof(bus), d);
    std::printf("  [%d] %s  sm_%d%d  %d SMs  %.1f GiB  L2 %d MiB  pci %s%s\n", d, p.name, p.major,
                p.minor, p.multiProcessorCount,
                static_cast<double>(p.totalGlobalMem) / (1 << 30), p.l2CacheSize >> 20, bus,
                builtFor(p.major, p.minor) ? "" : "  (not a build target: rebuild with -DGRAPHEP_CUDA_ARCHS=...)");
  }

  const graphep::ForceTransport force = graphep::forceTransportFromEnv();
  std::printf("\nTopology (row: from, column: to; within this process%s):\n",
              force == graphep::ForceTransport::kRemote ? ", GRAPHEP_FORCE_TRANSPORT=remote" : "");
  std::printf("  %6s", "");
  for (int b = 0; b < n; ++b) std::printf(" %12d", b);
  std::printf("\n");
  for (int a = 0; a < n; ++a) {
    std::printf("  %6d", a);
    for (int b = 0; b < n; ++b) {
      graphep::PeerFacts f;
      f.isSelf = a == b;
      f.sameHost = f.sameProcess = f.peerVisible = true;
      int can = 0, atomics = 0;
      if (a != b && cudaDeviceCanAccessPeer(&can, a, b) == cudaSuccess && can) {
        cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, a, b);
      }
      f.canAccessPeer = can != 0;
      f.nativeAtomics = atomics != 0;
      std::printf(" %12s", graphep::peerClassName(graphep::classifyPeer(f, force)));
    }
    std::printf("\n");
  }
  printEnv();
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "graphep-info: %s\n", e.what());
    return 1;
  }
}
