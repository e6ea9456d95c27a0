# FindNCCL
# --------
# Finds NCCL wherever it lives: the CUDA toolkit directory (some machines ship it there) or the
# system include/library directories (others install the Debian/RPM packages). NCCL_ROOT or the
# NCCL_HOME environment variable take precedence. The header and the library are searched as a
# pair under each prefix so a header from one install is never paired with another's library.
#
# Result: NCCL_FOUND, NCCL_VERSION, NCCL_INCLUDE_DIR, NCCL_LIBRARY and the target NCCL::nccl.
# The run-time version may differ from the header's: check ncclGetVersion() at run time.

set(_nccl_prefixes)
foreach(_p IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "$ENV{NCCL_HOME}")
  if(_p)
    list(APPEND _nccl_prefixes "${_p}")
  endif()
endforeach()
if(NOT TARGET CUDA::cudart)
  find_package(CUDAToolkit QUIET)
endif()
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_prefixes "${CUDAToolkit_LIBRARY_ROOT}")
endif()
if(CUDAToolkit_BIN_DIR)
  get_filename_component(_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  list(APPEND _nccl_prefixes "${_cuda_root}")
endif()
list(APPEND _nccl_prefixes /usr /usr/local)
list(REMOVE_DUPLICATES _nccl_prefixes)

if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  foreach(_prefix IN LISTS _nccl_prefixes)
    find_path(_nccl_inc nccl.h PATHS "${_prefix}/include" NO_DEFAULT_PATH)
    find_library(_nccl_lib NAMES nccl libnccl.so.2
      PATHS "${_prefix}/lib64" "${_prefix}/lib" "${_prefix}/lib/x86_64-linux-gnu"
            "${_prefix}/lib/aarch64-linux-gnu" "${_prefix}/targets/x86_64-linux/lib"
      NO_DEFAULT_PATH)
    if(_nccl_inc AND _nccl_lib)
      set(NCCL_INCLUDE_DIR "${_nccl_inc}" CACHE PATH "NCCL include directory")
      set(NCCL_LIBRARY "${_nccl_lib}" CACHE FILEPATH "NCCL library")
      unset(_nccl_inc CACHE)
      unset(_nccl_lib CACHE)
      break()
    endif()
    unset(_nccl_inc CACHE)
    unset(_nccl_lib CACHE)
  endforeach()
endif()

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  string(REGEX REPLACE ".*NCCL_MAJOR +([0-9]+).*" "\\1" _maj "${_nccl_ver}")
  string(REGEX REPLACE ".*NCCL_MINOR +([0-9]+).*" "\\1" _min "${_nccl_ver}")
  string(REGEX REPLACE ".*NCCL_PATCH +([0-9]+).*" "\\1" _pat "${_nccl_ver}")
  set(NCCL_VERSION "${_maj}.${_min}.${_pat}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
