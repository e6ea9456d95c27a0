#include <cstdio>
#include <cstring>

#include <graphep/graphep.hpp>

int main() {
  const char* reason = nullptr;
  const int gpus = graphep::cudaDeviceCountOrZero(&reason);
  std::printf("consumer linked graphep %s (NCCL runtime %d, %d GPU(s))\n", graphep::versionString(),
              graphep::ncclRuntimeVersion(), gpus);
  return std::strcmp(graphep::versionString(), GRAPHEP_VERSION_STRING) == 0 ? 0 : 1;
}
