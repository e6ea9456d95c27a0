# One place for compile flags: every graphep target (library, tests, tools, benchmarks) calls this.

set(GRAPHEP_CUDA_GENCODE "")
foreach(arch IN LISTS GRAPHEP_CUDA_ARCHS)
  list(APPEND GRAPHEP_CUDA_GENCODE "-gencode=arch=compute_${arch},code=sm_${arch}")
  set(_graphep_last_arch ${arch})
endforeach()
if(_graphep_last_arch)
  # Embed PTX of the last target so newer GPUs can JIT it.
  list(APPEND GRAPHEP_CUDA_GENCODE "-gencode=arch=compute_${_graphep_last_arch},code=compute_${_graphep_last_arch}")
endif()

# CMake before 3.26 does not know nvcc's C++20 dialect flag (nvcc >= 12 has -std=c++20).
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION OR CMAKE_CUDA20_STANDARD_COMPILE_OPTION STREQUAL "")
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
endif()

function(graphep_set_common_options target)
  set_target_properties(${target} PROPERTIES
    CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
    CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF
    CUDA_ARCHITECTURES OFF
    POSITION_INDEPENDENT_CODE ON)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<COMPILE_LANGUAGE:CUDA>:${GRAPHEP_CUDA_GENCODE} --expt-relaxed-constexpr -Xcompiler=-Wall>
    # Source lines in device code (no change to the generated code): compute-sanitizer and Nsight
    # name file:line instead of a SASS offset.
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
  if(GRAPHEP_SANITIZE)  # host C++ under AddressSanitizer + UndefinedBehaviorSanitizer (CI's second build)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined>)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()

# A GoogleTest executable whose cases are discovered one by one, so CTest shows each skip.
function(graphep_add_gtest name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  graphep_set_common_options(${name})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/tests)
  target_link_libraries(${name} PRIVATE graphep::graphep GTest::gtest GTest::gtest_main Threads::Threads)
  gtest_discover_tests(${name}
    DISCOVERY_TIMEOUT 60
    PROPERTIES LABELS "${ARG_LABELS}" SKIP_REGULAR_EXPRESSION "\\[  SKIPPED")
endfunction()
