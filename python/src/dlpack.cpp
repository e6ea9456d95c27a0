// dlpack_info: the facts graphep/arrays.py checks, read from any DLPack producer (CuPy, JAX, ...).
// The capsule is asked for with stream=-1, DLPack's "producer, do not synchronise": graphep
// enqueues on the caller's stream, and a producer-side sync (PyTorch's records an event on the
// default stream) would break a stream capture. The pointer stays valid while the caller holds
// the array.
#include <cuda_runtime.h>

#include <graphep/status.hpp>

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace nb = nanobind;

namespace graphep::python {
namespace {

std::string dtypeName(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  const std::string bits = std::to_string(t.bits);
  if (t.lanes != 1) return "vector of " + std::to_string(t.lanes);
  switch (static_cast<Code>(t.code)) {
    case Code::Int: return "int" + bits;
    case Code::UInt: return "uint" + bits;
    case Code::Float: return "float" + bits;
    case Code::Bfloat: return "bfloat" + bits;
    case Code::Float8_E4M3FN: return "float8_e4m3fn";
    case Code::Bool: return t.bits == 8 ? "bool" : "bool" + bits;  // one byte per entry, as torch.bool
    default: return "dlpack type code " + std::to_string(t.code) + " of " + bits + " bits";
  }
}

// The DLPack capsule of `array` ("dltensor": a DLManagedTensor, whose first member is the
// DLTensor), read and left unconsumed: its producer's destructor frees it with the capsule.
nb::tuple dlpackInfo(nb::handle array) {
  nb::object capsule;
  if (nb::hasattr(array, "__dlpack__")) {
    try {
      capsule = array.attr("__dlpack__")(nb::arg("stream") = -1);
    } catch (const nb::python_error&) {
      capsule = array.attr("__dlpack__")();  // producers that refuse stream=-1 (CPU arrays) export plainly
    }
  }
  if (!capsule.is_valid() || !PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    throw Error(Status::kInvalidArgument, "the array does not export a DLPack tensor (__dlpack__ returned no "
                                          "\"dltensor\" capsule)");
  }
  const auto* t = static_cast<const nb::dlpack::dltensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  nb::list shape, strides;
  std::int64_t compact = 1;  // DLPack: no strides means compact row-major
  std::vector<std::int64_t> s(static_cast<std::size_t>(t->ndim));
  for (int i = t->ndim - 1; i >= 0; --i) {
    s[static_cast<std::size_t>(i)] = t->strides != nullptr ? t->strides[i] : compact;
    compact *= t->shape[i];
  }
  for (int i = 0; i < t->ndim; ++i) {
    shape.append(t->shape[i]);
    strides.append(s[static_cast<std::size_t>(i)]);
  }
  const auto data = reinterpret_cast<std::uintptr_t>(t->data) + t->byte_offset;
  return nb::make_tuple(data, nb::tuple(shape), nb::tuple(strides), dtypeName(t->dtype), t->device.device_type,
                        t->device.device_id);
}

// The CUDA device of a device pointer (__cuda_array_interface__ does not say).
int pointerDevice(std::uintptr_t p) {
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(p));
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error(Status::kInvalidArgument, "pointer 0x" + [&] {
      char hex[32];
      std::snprintf(hex, sizeof(hex), "%llx", static_cast<unsigned long long>(p));
      return std::string(hex);
    }() + " is not a CUDA allocation: " + cudaGetErrorString(e));
  }
  return a.device;
}

}  // namespace

void bindDlpack(nb::module_& m) {
  m.def("dlpack_info", &dlpackInfo, nb::arg("array"),
        "(data pointer, shape, strides in elements, dtype name, DLPack device type, device id) of any "
        "DLPack array, read without synchronising its producer.");
  m.def("pointer_device", &pointerDevice, nb::arg("ptr"), "The CUDA device of a device pointer.");
}

}  // namespace graphep::python
