// From graphep's expert-major layout to the batched layout the GEMMs read, and back.
//
// graphep's dispatch lays recv_x out expert-major: local expert j's rows are
// [expertOffsets[j], expertOffsets[j] + expertCounts[j]), with the counts and offsets in device
// memory. A strided-batched GEMM needs a fixed stride per expert, so the gather copies expert j's
// rows to rows [0, count) of its block of M rows, and the scatter copies the MLP's outputs back to
// the same expert-major rows of the layout's expertOutput, where combine reads them:
//
//   recv_x       | e0: 3 rows | e1: 1 row | e2: 0 | e3: 2 rows |     (capacity rows)
//   batched x    | e0: 3 + (M-3) pad | e1: 1 + (M-1) pad | e2: M pad | e3: 2 + (M-2) pad |
//
// Both kernels read the counts when they run (any count, no host work: capturable); rows past M
// are not copied and are counted in a device counter. They go away once the engine publishes the
// batched layout itself.
#pragma once

#include <cuda_runtime.h>

#include <graphep/moe.hpp>

#include "common/batched_experts.cuh"

namespace graphep::example {

// Capturable. Copies each local expert's received rows into `experts.input()`; *overflow +=
// rows past experts.rowsPerExpert() (not copied). Throws std::invalid_argument naming a mismatch
// between the layout and the experts (expert count, hidden size, an fp8 layout).
void gatherFromLayout(const graphep::DispatchLayout& layout, BatchedExperts& experts, unsigned long long* overflow,
                      cudaStream_t stream);

// Capturable. Copies rows [0, min(count, M)) of each expert's outputs to the layout's expertOutput.
void scatterToLayout(const BatchedExperts& experts, const graphep::DispatchLayout& layout, cudaStream_t stream);

}  // namespace graphep::example
