// graphep._graphep: the compiled half of the graphep Python package (python/graphep/).
#include <graphep/graphep.hpp>

#include "bindings.hpp"

namespace nb = nanobind;

NB_MODULE(_graphep, m) {
  m.doc() = "graphep: CUDA-graph-native MoE expert parallelism (compiled core; use the graphep package)";
  m.attr("__version__") = graphep::versionString();
  m.def("nccl_runtime_version", &graphep::ncclRuntimeVersion,
        "NCCL version as ncclGetVersion() reports it at run time (e.g. 22803).");
  m.def(
      "cuda_device_count",
      []() {
        const char* reason = nullptr;
        const int n = graphep::cudaDeviceCountOrZero(&reason);
        return nb::make_tuple(n, reason != nullptr ? reason : "");
      },
      "(usable CUDA devices, why none is usable or ''): never raises.");
  graphep::python::bindErrors(m);
  graphep::python::bindConfig(m);
  graphep::python::bindGroup(m);
  graphep::python::bindEngine(m);
  graphep::python::bindDlpack(m);
}
