/* graphep C ABI: MoE dispatch / combine engines and their graphs, for C and for any language that
 * calls C. Opaque handles; versioned argument structs whose first field is their size (fill them
 * with the GRAPHEP_*_INIT macros, then set fields); every call returns a graphep_status_t and, on
 * failure, leaves a message naming the offending value in graphep_last_error() (per thread). No
 * C++ type or exception crosses this boundary.
 *
 * Lifetimes: destroy graphs before their engine and engines before their communicator. Engines of
 * one communicator are created together (graphep_engine_create_all is collective over it). */
#ifndef GRAPHEP_GRAPHEP_H
#define GRAPHEP_GRAPHEP_H

#include <stddef.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GRAPHEP_C_API_VERSION 1

/* Mirrors graphep::Status (include/graphep/status.hpp). */
typedef enum graphep_status {
  GRAPHEP_SUCCESS = 0,
  GRAPHEP_INVALID_ARGUMENT = 1,
  GRAPHEP_INVALID_USAGE = 2,
  GRAPHEP_NOT_SUPPORTED = 3,
  GRAPHEP_NO_DEVICE = 4,
  GRAPHEP_CUDA_ERROR = 5,
  GRAPHEP_NCCL_ERROR = 6,
  GRAPHEP_MPI_ERROR = 7,
  GRAPHEP_SYSTEM_ERROR = 8,
  GRAPHEP_OUT_OF_MEMORY = 9,
  GRAPHEP_TIMEOUT = 10,
  GRAPHEP_GRAPH_INVALIDATED = 11,
  GRAPHEP_REMOTE_ERROR = 12,
  GRAPHEP_INTERNAL_ERROR = 13
} graphep_status_t;

typedef enum graphep_dtype { GRAPHEP_DTYPE_BF16 = 0, GRAPHEP_DTYPE_FP8_E4M3 = 1 } graphep_dtype_t;
typedef enum graphep_index_type { GRAPHEP_INDEX_INT32 = 0, GRAPHEP_INDEX_INT64 = 1 } graphep_index_type_t;
typedef enum graphep_path { GRAPHEP_PATH_AUTO = 0, GRAPHEP_PATH_LATENCY = 1, GRAPHEP_PATH_THROUGHPUT = 2 } graphep_path_t;

typedef struct graphep_comm* graphep_comm_t;
typedef struct graphep_engine* graphep_engine_t;
typedef struct graphep_graph* graphep_graph_t;

/* graphep::MoeConfig. */
typedef struct graphep_moe_config {
  size_t struct_size;          /* sizeof(graphep_moe_config_t) */
  int max_tokens_per_rank;
  int hidden;
  int num_experts;
  int top_k;
  int dispatch_dtype;          /* graphep_dtype_t */
  long long recv_capacity;     /* rows; 0: the worst case */
  int expert_alignment;        /* >= 1 */
  int sm_budget;               /* 0: the engine's default */
  int strict;                  /* nonzero: trap on bad input instead of counting it */
  int path;                    /* graphep_path_t */
} graphep_moe_config_t;
#define GRAPHEP_MOE_CONFIG_INIT \
  { sizeof(graphep_moe_config_t), 0, 0, 0, 0, GRAPHEP_DTYPE_BF16, 0, 1, 0, 0, GRAPHEP_PATH_AUTO }

/* graphep::DispatchArgs: device pointers, rewritten in place between graph replays. */
typedef struct graphep_dispatch_args {
  size_t struct_size;
  const void* x;               /* [T_max, H] bf16, 16-byte aligned */
  const void* topk_idx;        /* [T_max, K], -1 = none */
  int index_type;              /* graphep_index_type_t */
  const float* topk_weights;   /* [T_max, K] */
  const int* num_tokens;       /* device scalar: the live T */
} graphep_dispatch_args_t;
#define GRAPHEP_DISPATCH_ARGS_INIT { sizeof(graphep_dispatch_args_t), NULL, NULL, GRAPHEP_INDEX_INT32, NULL, NULL }

/* graphep::CombineArgs. */
typedef struct graphep_combine_args {
  size_t struct_size;
  const void* expert_output;   /* [capacity, H] bf16; NULL: the layout's expert_output */
  void* out;                   /* [T_max, H] bf16 */
} graphep_combine_args_t;
#define GRAPHEP_COMBINE_ARGS_INIT { sizeof(graphep_combine_args_t), NULL, NULL }

/* graphep::DispatchLayout: engine-owned device memory, fixed for the engine's life. */
typedef struct graphep_layout {
  size_t struct_size;
  void* recv_x;
  float* recv_scales;
  const int* expert_offsets;
  const int* expert_counts;
  const int* row_src_rank;
  const int* row_src_token;
  const int* row_topk_slot;
  const float* row_weight;
  const int* num_recv_rows;
  const unsigned long long* expert_totals;
  void* expert_output;
  long long capacity;
  int hidden;
  int num_local_experts;
  int first_local_expert;
} graphep_layout_t;
#define GRAPHEP_LAYOUT_INIT { sizeof(graphep_layout_t) }

/* graphep::MoeStatus (the device error, if any, is in graphep_last_error() after the call). */
typedef struct graphep_moe_status {
  size_t struct_size;
  unsigned long long invalid_expert_ids;
  unsigned long long dropped_rows;
  unsigned long long clamped_token_counts;
  long long first_invalid_id;
  int first_invalid_token;
  int first_invalid_slot;
  int first_clamped_count;
  int device_error;            /* nonzero: a timeout or protocol error was recorded */
  unsigned long long unpaired_dispatches;
  unsigned long long unpaired_combines;
} graphep_moe_status_t;
#define GRAPHEP_MOE_STATUS_INIT { sizeof(graphep_moe_status_t) }

/* Library. */
const char* graphep_version(void);
const char* graphep_status_name(graphep_status_t status);
/* The message of this thread's last failed call ("" when none). */
const char* graphep_last_error(void);

/* Communicators. create_local_group: this process drives `count` ranks on `devices` (a device may
 * repeat: emulated ranks). adopt_nccl: one caller-owned NCCL communicator per rank this process
 * drives; the caller destroys them after graphep_comm_destroy. */
graphep_status_t graphep_comm_create_local_group(const int* devices, int count, graphep_comm_t* comm);
graphep_status_t graphep_comm_adopt_nccl(const ncclComm_t* comms, int count, graphep_comm_t* comm);
graphep_status_t graphep_comm_world_size(graphep_comm_t comm, int* world_size);
graphep_status_t graphep_comm_local_ranks(graphep_comm_t comm, int* local_ranks);
graphep_status_t graphep_comm_destroy(graphep_comm_t comm);

/* Engines: one per local rank, in local-rank order (`count` must equal the local ranks). */
graphep_status_t graphep_engine_create_all(graphep_comm_t comm, const graphep_moe_config_t* config,
                                           graphep_engine_t* engines, int count);
graphep_status_t graphep_engine_destroy(graphep_engine_t engine);
graphep_status_t graphep_engine_layout(graphep_engine_t engine, graphep_layout_t* layout);
/* Capturable; every rank must call them. */
graphep_status_t graphep_dispatch(graphep_engine_t engine, const graphep_dispatch_args_t* args, cudaStream_t stream);
graphep_status_t graphep_combine(graphep_engine_t engine, const graphep_combine_args_t* args, cudaStream_t stream);
/* Diagnostics (synchronises the engine's device). */
graphep_status_t graphep_engine_status(graphep_engine_t engine, graphep_moe_status_t* status);

/* MoeGraph with an expert child graph (copied; swap it with graphep_graph_set_experts). */
graphep_status_t graphep_graph_create(graphep_engine_t engine, const graphep_dispatch_args_t* dispatch,
                                      const graphep_combine_args_t* combine, cudaGraph_t experts,
                                      graphep_graph_t* graph);
graphep_status_t graphep_graph_set_experts(graphep_graph_t graph, cudaGraph_t experts);
graphep_status_t graphep_graph_launch(graphep_graph_t graph, cudaStream_t stream);
graphep_status_t graphep_graph_destroy(graphep_graph_t graph);

#ifdef __cplusplus
}
#endif

#endif /* GRAPHEP_GRAPHEP_H */
