/* graphep C ABI: MoE dispatch / combine engines and their graphs, for C and for any language that
 * calls C. Opaque handles; versioned argument structs whose first field is their size (fill them
 * with the GRAPHEP_*_INIT macros, then set fields); every call returns a graphep_status_t and, on
 * failure, leaves a message naming the offending value in graphep_last_error() (per thread). No
 * C++ type or exception crosses this boundary.
 *
 * Versioning: a struct only ever grows at its end. A caller built against an older header passes
 * its smaller struct_size and keeps working: the library reads (or, for the layout and the status,
 * writes) only the fields that size covers; an input field it does not cover reads as 0, which
 * means "as before". GRAPHEP_C_API_VERSION counts the additions: test it (#if) before using a newer
 * field or call.
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

/* 1: the first ABI. 2: graphep_layout_t.expert_dropped, graphep_engine_path; the layout describes
 * only the rows kept when more rows arrive than recv_capacity (see graphep_layout_t).
 * 3: graphep_moe_config_t.epilogue_sms, receive_layout, rows_per_expert (the batched and rank-major
 * layouts); graphep_layout_t.receive_layout, rows_per_expert, rank_offsets, row_experts,
 * row_expert_weights. A version-2 caller's structs (config 56 bytes,
 * layout 128 bytes on 64-bit hosts) keep working: the new fields read as 0 and only its bytes are
 * written. 4: graphep_dispatch_args_t.top_k, token_in_rank, input, x_scales and its strides, and
 * the caller's outputs (out_*); graphep_combine_args_t.expert_output_rows, row_values, out_values,
 * num_values; graphep_moe_status_t.missing_combine_rows; graphep_token_layout; graphep_api_version.
 * Dispatch -> dispatch and combine -> combine are defined (no longer counted as unpaired).
 * 5 (the latency path's capabilities): graphep_dispatch_args_t.scale_format, recv_stats, half;
 * graphep_combine_args_t.topk_weights, half; graphep_layout_t.expert_source_ranges, scales_buffer;
 * graphep_receive; graphep_fp8_scales_t, graphep_half_t. A version-4 caller's structs (dispatch
 * args 160 bytes, combine args 56, layout 168 on 64-bit hosts) keep working.
 * 6 (the active-rank mask): graphep_set_active_ranks, graphep_engine_recover.
 * 7: graphep_moe_status_t.masked_entries; the mask on the direct throughput path.
 * 8 (shrink on timeout): graphep_moe_config_t.shrink_on_timeout, graphep_moe_status_t.shrunk_ranks.
 * 9: graphep_engine_barrier. */
#define GRAPHEP_C_API_VERSION 9
/* The most ranks an engine takes (graphep::kMaxRanks). */
#define GRAPHEP_MAX_RANKS 32

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

/* graphep::DType. FP8_E4M3: one fp32 scale per 128 values, scale = max(amax, 448 x 2^-126) / 448 (1 for
 * an all-zero tile), each value e4m3(x * (1 / scale)) in fp32, rounded to nearest even and saturating
 * at +-448. A token's row is quantised once per dispatch and every destination rank receives the same
 * bytes. */
typedef enum graphep_dtype { GRAPHEP_DTYPE_BF16 = 0, GRAPHEP_DTYPE_FP8_E4M3 = 1 } graphep_dtype_t;
/* graphep::DispatchInput: what x holds and how its rows travel. */
typedef enum graphep_dispatch_input {
  GRAPHEP_INPUT_CONFIG = 0,        /* x bf16, sent as the config's dispatch_dtype */
  GRAPHEP_INPUT_BF16 = 1,          /* x bf16, sent as bf16 (a bf16 engine) */
  GRAPHEP_INPUT_FP8_QUANTIZE = 2,  /* x bf16, quantised by graphep as GRAPHEP_DTYPE_FP8_E4M3 says */
  GRAPHEP_INPUT_FP8 = 3            /* x e4m3 bytes quantised by the caller, with x_scales: sent as is */
} graphep_dispatch_input_t;
/* graphep::Fp8Scales: the fp8 scales of a dispatch graphep quantises (scale_format); not FLOAT: latency
 * path. The values are quantised with the scale each form holds. */
typedef enum graphep_fp8_scales {
  GRAPHEP_FP8_SCALES_FLOAT = 0,  /* fp32, as GRAPHEP_DTYPE_FP8_E4M3 says */
  GRAPHEP_FP8_SCALES_POW2 = 1,   /* fp32, that scale rounded up to a power of two (DeepEP's
                                  * round_scale) */
  GRAPHEP_FP8_SCALES_UE8M0 = 2   /* those powers of two as their biased exponent bytes (UE8M0): the
                                  * scales then hold [rows][H / 128] bytes, four per int32, value
                                  * 4w + i in byte i (DeepEP's use_ue8m0) */
} graphep_fp8_scales_t;
/* graphep::MoeHalf: which part of an operation a call enqueues (half). Latency path. */
typedef enum graphep_half {
  GRAPHEP_HALF_WHOLE = 0,  /* one kernel: the send, then the receive in the same launch */
  GRAPHEP_HALF_SEND = 1    /* the send half alone; graphep_receive enqueues the receive half later (the
                            * stream may run other work between them, e.g. the other micro-batch's GEMMs) */
} graphep_half_t;
typedef enum graphep_index_type { GRAPHEP_INDEX_INT32 = 0, GRAPHEP_INDEX_INT64 = 1 } graphep_index_type_t;
typedef enum graphep_path { GRAPHEP_PATH_AUTO = 0, GRAPHEP_PATH_LATENCY = 1, GRAPHEP_PATH_THROUGHPUT = 2 } graphep_path_t;
/* graphep::ReceiveLayout. */
typedef enum graphep_receive_layout {
  GRAPHEP_LAYOUT_EXPERT_MAJOR = 0, /* rows grouped by local expert, packed (each expert's first row aligned) */
  GRAPHEP_LAYOUT_BATCHED = 1,      /* [E_local, rows_per_expert, hidden]: expert j's rows at j x rows_per_expert */
  GRAPHEP_LAYOUT_RANK_MAJOR = 2    /* one row per (source token, this rank), by source; see graphep_layout_t */
} graphep_receive_layout_t;

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
  /* Rows, expert-major (leave 0 for the other layouts). 0: T_max x R x min(K, E / R) + (E / R) x
   * (expert_alignment - 1), which holds every row unless K > E / R and tokens name one expert in
   * several slots (a row per slot). Rows past the capacity are dropped and counted. */
  long long recv_capacity;
  int expert_alignment;        /* >= 1 */
  /* CTAs each kernel may use, those epilogue_sms sets aside (graphep::MoeConfig::smBudget); 0: the
   * default. */
  int sm_budget;
  int strict;                  /* nonzero: trap on bad input instead of counting it */
  int path;                    /* graphep_path_t */
  /* Version 3 (a shorter caller's struct reads these as 0). */
  /* CTAs of the receiving side (graphep::MoeConfig::epilogueSms): the direct throughput path's fp8
   * quantise, receive, combine reduce and final; the latency path's receive parts. 0: the default. */
  int epilogue_sms;
  int receive_layout;          /* graphep_receive_layout_t */
  long long rows_per_expert;   /* batched: rows per local expert; 0: world size x max_tokens_per_rank */
  /* Version 8. Nonzero: latency path only, a wait that times out masks its peer instead of failing
   * the engine (graphep::MoeConfig::shrinkOnTimeout; graphep_moe_status_t.shrunk_ranks). */
  int shrink_on_timeout;
} graphep_moe_config_t;
#define GRAPHEP_MOE_CONFIG_INIT \
  { sizeof(graphep_moe_config_t), 0, 0, 0, 0, GRAPHEP_DTYPE_BF16, 0, 1, 0, 0, GRAPHEP_PATH_AUTO, 0, GRAPHEP_LAYOUT_EXPERT_MAJOR, 0, 0 }

/* graphep::DispatchArgs: device pointers, rewritten in place between graph replays. */
typedef struct graphep_dispatch_args {
  size_t struct_size;
  const void* x;               /* [T_max, H] bf16 (e4m3 bytes with GRAPHEP_INPUT_FP8), 16-byte aligned */
  const void* topk_idx;        /* [T_max, K], -1 = none; NULL with token_in_rank: no slots */
  int index_type;              /* graphep_index_type_t */
  const float* topk_weights;   /* [T_max, K] */
  const int* num_tokens;       /* device scalar: the live T */
  /* Version 4 (graphep::DispatchArgs; 0 / NULL: as before). */
  int top_k;                   /* columns of topk_idx this call, <= the config's top_k; 0: the config's */
  const unsigned char* token_in_rank;  /* [T, R] bytes: route token t to rank r when nonzero (rank-major) */
  int input;                   /* graphep_dispatch_input_t */
  const float* x_scales;       /* GRAPHEP_INPUT_FP8: fp32 scales, one per 128 values */
  long long scale_token_stride;   /* elements; 0 and 0: row-major [T, H / 128] */
  long long scale_hidden_stride;
  /* The caller's buffers for the received rows (rank-major, throughput path; see
   * graphep::DispatchOutputs); NULL: the engine's. out_rows: their rows (rows past it dropped). */
  void* out_recv_x;
  float* out_recv_scales;
  void* out_row_experts;       /* int32 or int64 as index_type */
  float* out_row_expert_weights;
  int* out_row_src_rank;
  int* out_row_src_token;
  int* out_rank_prefix_matrix; /* [R, R] */
  long long out_rows;
  /* Version 5 (graphep::DispatchArgs; 0 / NULL: as before). */
  int scale_format;            /* graphep_fp8_scales_t of a dispatch graphep quantises; not FLOAT: latency path */
  int* recv_stats;             /* [E_local] or NULL: each local expert's rows of this dispatch (kept or
                                * dropped) added on the device (DeepEP's cumulative_local_expert_recv_stats);
                                * rank-major: its (row, slot) entries, as expert_counts */
  int half;                    /* graphep_half_t; SEND: latency path, graphep_receive completes it */
} graphep_dispatch_args_t;
#define GRAPHEP_DISPATCH_ARGS_INIT \
  { sizeof(graphep_dispatch_args_t), NULL, NULL, GRAPHEP_INDEX_INT32, NULL, NULL, 0, NULL, GRAPHEP_INPUT_CONFIG, NULL, 0, \
    0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, GRAPHEP_FP8_SCALES_FLOAT, NULL, GRAPHEP_HALF_WHOLE }

/* graphep::CombineArgs. */
typedef struct graphep_combine_args {
  size_t struct_size;
  const void* expert_output;   /* [expert_output_rows, H] bf16; NULL: the layout's expert_output */
  void* out;                   /* [T_max, H] bf16 */
  /* Version 4 (graphep::CombineArgs). */
  long long expert_output_rows;  /* 0: the capacity; rows needed past it add nothing (counted) */
  const float* row_values;     /* rank-major, direct path: [rows, num_values] fp32 summed like the rows */
  float* out_values;           /* [T, num_values] */
  int num_values;              /* 1 .. 16 with row_values */
  /* Version 5 (graphep::CombineArgs). */
  const float* topk_weights;   /* [T, K] (K: the dispatch's top_k) or NULL: the weights to reduce with in
                                * place of the dispatch's (DeepEP's low-latency combine). Latency path,
                                * expert-major or batched */
  int half;                    /* graphep_half_t; SEND: latency path, graphep_receive completes it; with
                                * topk_weights the send half waits for no peer and the receive half may
                                * read expert_output and topk_weights: keep them until it has run */
} graphep_combine_args_t;
#define GRAPHEP_COMBINE_ARGS_INIT \
  { sizeof(graphep_combine_args_t), NULL, NULL, 0, NULL, NULL, 0, NULL, GRAPHEP_HALF_WHOLE }

/* graphep::DispatchLayout: pointers to engine-owned device memory, set at setup and fixed for the
 * engine's life, recv_scales aside (as of the last graphep_dispatch call when this is filled: the
 * scales buffer after an fp8 dispatch, NULL after a bf16 one; scales_buffer is the fixed pointer). The
 * contents (expert_output aside) are the last dispatch's output: valid once it has run on its stream,
 * until the next dispatch runs; a combine leaves them as they are. E_local = num_local_experts.
 *
 *   recv_x rows:  [ expert 0 | pad | expert 1 | pad | ... | expert E_local-1 ]  unused to capacity
 *                 ^offsets[0]=0    ^offsets[1]                                ^offsets[E_local]
 *
 * Expert j's rows are [expert_offsets[j], expert_offsets[j] + expert_counts[j]), each expert's
 * first row at a multiple of expert_alignment; within an expert, rows come in (source rank, source
 * token, top-k slot) order. Padding rows and rows past expert_offsets[E_local] are never written.
 * When more rows arrive than the capacity, the excess is dropped (and counted in the status'
 * dropped_rows): the layout describes only the rows kept, which are the first ones of each expert
 * in that order, so the rows dropped are the last ones of the last experts. Then expert_offsets[j]
 * is the aligned offset clamped to the capacity, expert_counts[j] counts expert j's kept rows,
 * expert_dropped[j] its dropped rows, offsets[j] + counts[j] <= capacity, expert_offsets[E_local]
 * <= capacity and num_recv_rows (the sum of expert_counts) <= capacity. combine() ignores dropped
 * rows: a token's slot routed to a dropped row adds nothing to its output.
 *
 * That is the expert-major layout (receive_layout GRAPHEP_LAYOUT_EXPERT_MAJOR). Batched: expert
 * j's rows start at j x rows_per_expert, and an expert keeps its first rows_per_expert rows.
 * Rank-major: one row per source token sent to this rank (a slot here, or token_in_rank), sources
 * one after another (rank_offsets); num_recv_rows is that row count, and expert_counts / expert_offsets count the
 * (row, slot) entries per expert (their sum may exceed the capacity). The capacity, R x T_max, holds
 * every row, so expert_dropped is 0; only rows past out_rows are dropped (dropped_rows). */
typedef struct graphep_layout {
  size_t struct_size;          /* on return: the bytes filled, min(struct_size, sizeof) */
  void* recv_x;                /* [capacity, hidden] bf16, or e4m3 bytes for fp8 dispatch */
  float* recv_scales;          /* fp8: [capacity, hidden / 128], a scale per 128 values; bf16: NULL */
  const int* expert_offsets;   /* [E_local + 1] */
  const int* expert_counts;    /* [E_local]: rows of local expert j kept */
  const int* row_src_rank;     /* [capacity]: per kept row, its source rank */
  const int* row_src_token;    /* [capacity]: ... the token on that rank */
  const int* row_topk_slot;    /* [capacity]: ... the top-k slot of that token */
  const float* row_weight;     /* [capacity]: ... the slot's top-k weight */
  const int* num_recv_rows;    /* device scalar: rows kept, padding excluded */
  /* [E_local]: rows routed to local expert j (kept or dropped) since the engine was created;
   * rank-major: its (row, slot) entries. */
  const unsigned long long* expert_totals;
  void* expert_output;         /* [capacity, hidden] bf16, where experts may write for combine */
  long long capacity;          /* rows */
  int hidden;
  int num_local_experts;
  int first_local_expert;      /* global id of local expert 0 */
  /* Version 2. */
  const int* expert_dropped;   /* [E_local]: rows of local expert j the last dispatch dropped */
  /* Version 3. */
  int receive_layout;          /* graphep_receive_layout_t */
  long long rows_per_expert;   /* batched: rows of each expert's block; expert-major, rank-major: 0 */
  /* Rank-major (NULL otherwise): [world size + 1] first row of each source's rows, then the end;
   * [capacity, top_k] (the dispatch's top_k) each row's local expert per top-k slot (-1: not on this
   * rank, or the slot is unused) and weight (0 where the expert is -1). Experts write one row per
   * received row: the weighted sum over its slots. */
  const int* rank_offsets;
  const int* row_experts;
  const float* row_expert_weights;
  /* Version 5 (written only when the caller's struct_size covers them). Expert-major and batched
   * (NULL for rank-major): [E_local][world size], the rows of expert j that came from rank q as
   * begin << 32 | count, begin counted from the expert's first row (DeepEP's layout_range); kept
   * rows only. */
  const long long* expert_source_ranges;
  /* The engine's scales buffer, [capacity, hidden / 128] fp32 (bytes with GRAPHEP_FP8_SCALES_UE8M0),
   * there whenever hidden is a multiple of 128 whatever the dispatch_dtype: a bf16 engine's fp8
   * dispatch writes e4m3 rows into recv_x and their scales here (recv_scales points to it after an
   * fp8 dispatch). */
  float* scales_buffer;
} graphep_layout_t;
#define GRAPHEP_LAYOUT_INIT \
  { sizeof(graphep_layout_t), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 0, 0, NULL, 0, 0, \
    NULL, NULL, NULL, NULL, NULL }

/* graphep::MoeStatus (the device error, if any, is in graphep_last_error() after the call). Each
 * engine counts what its rank's kernels found. */
typedef struct graphep_moe_status {
  size_t struct_size;
  unsigned long long invalid_expert_ids;   /* ids outside [-1, E) in this rank's topk_idx: skipped */
  unsigned long long dropped_rows;         /* rows this rank received past its capacity, a batched
                                            * expert's block or out_rows: not written; the sending rank
                                            * does not count them */
  unsigned long long clamped_token_counts; /* this rank's dispatches, live count outside [0, T_max] */
  long long first_invalid_id;
  int first_invalid_token;
  int first_invalid_slot;
  int first_clamped_count;
  int device_error;            /* nonzero: a timeout or protocol error was recorded */
  unsigned long long unpaired_dispatches;  /* stays 0 since version 4 (dispatch -> dispatch is defined) */
  unsigned long long unpaired_combines;    /* combines before the first dispatch */
  /* Version 4. */
  unsigned long long missing_combine_rows; /* expert output rows a combine needed past expert_output_rows */
  /* Version 7. [r]: this rank's (token, slot) entries whose expert lives on rank r, dropped because
   * r (or this rank) was outside the active-rank mask (graphep_set_active_ranks): not an error. */
  unsigned long long masked_entries[GRAPHEP_MAX_RANKS];
  /* Version 8. Bit r: rank r was masked after a wait on it timed out (shrink_on_timeout): not an
   * error. */
  unsigned int shrunk_ranks;
} graphep_moe_status_t;
#define GRAPHEP_MOE_STATUS_INIT { sizeof(graphep_moe_status_t), 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, {0}, 0 }

/* graphep::MoeMemory: what an engine of a config allocates per rank, known before anything is
 * allocated (size a KV cache after it). */
typedef struct graphep_moe_memory {
  size_t struct_size;
  int path;                    /* graphep_path_t the figures are for (never AUTO) */
  size_t symmetric_heap_bytes; /* the symmetric heap */
  size_t private_bytes;        /* the engine's local buffers */
  size_t nccl_staging_bytes;   /* 0: NCCL moves the exchanges' slots in place (kept for the layout) */
} graphep_moe_memory_t;
#define GRAPHEP_MOE_MEMORY_INIT { sizeof(graphep_moe_memory_t), 0, 0, 0, 0 }

/* Library. */
const char* graphep_version(void);
/* The GRAPHEP_C_API_VERSION the library was built with (a caller built against a newer header can
 * check before using newer fields). Version 4. */
int graphep_api_version(void);
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
/* Not collective, no GPU needed: the memory an engine of `config` over `world_size` ranks would
 * allocate on each rank (Engine::memoryRequirements). */
graphep_status_t graphep_memory_requirements(const graphep_moe_config_t* config, int world_size,
                                             graphep_moe_memory_t* memory);
graphep_status_t graphep_engine_destroy(graphep_engine_t engine);
/* Fills *layout with the engine's views (see graphep_layout_t for how long what they point to holds).
 * Host only, not collective. */
graphep_status_t graphep_engine_layout(graphep_engine_t engine, graphep_layout_t* layout);
/* The path chosen at setup (a graphep_path_t, never GRAPHEP_PATH_AUTO: AUTO resolves to LATENCY
 * when max_tokens_per_rank <= 256 and every peer has load/store access, else THROUGHPUT). Host
 * only, not collective. Version 2. */
graphep_status_t graphep_engine_path(graphep_engine_t engine, int* path);
/* Capturable; every rank must call them. */
graphep_status_t graphep_dispatch(graphep_engine_t engine, const graphep_dispatch_args_t* args, cudaStream_t stream);
graphep_status_t graphep_combine(graphep_engine_t engine, const graphep_combine_args_t* args, cudaStream_t stream);
/* Capturable; every rank must call it. The receive half of this engine's last dispatch or combine
 * enqueued with half = GRAPHEP_HALF_SEND, on `stream` (the same stream or another ordered after the
 * send half). No other dispatch or combine of the engine may come between a send half and its
 * receive; with none waiting, GRAPHEP_INVALID_ARGUMENT. Version 5. */
graphep_status_t graphep_receive(graphep_engine_t engine, cudaStream_t stream);
/* Capturable. The active-rank mask (bit r: rank r takes part; every rank at setup), written on
 * `stream` in stream order; the latency path and (version 7) the direct throughput path (the
 * throughput path over the movers refuses any mask but every rank, GRAPHEP_NOT_SUPPORTED).
 * Every rank gives the same mask for the same dispatch and its combine; a rank outside it is sent
 * nothing and waited for by no one, the entries routed to its experts are dropped and counted, and
 * a rank outside its own mask takes part in nothing (graphep::Engine::setActiveRanks). Refused
 * (GRAPHEP_INVALID_ARGUMENT): bits of ranks >= world size, or no rank. Version 6. */
graphep_status_t graphep_set_active_ranks(graphep_engine_t engine, unsigned int mask, cudaStream_t stream);
/* Back to service among the survivors after a bounded wait named a dead peer: synchronises the
 * engine's device, clears its status and failed state, and writes `mask` (this rank in it, the
 * dead peer out) as graphep_set_active_ranks does; every survivor calls it with the same mask,
 * nothing is recaptured (graphep::Engine::recover says what cannot be recovered). Not capturable.
 * Version 6. */
graphep_status_t graphep_engine_recover(graphep_engine_t engine, unsigned int mask, cudaStream_t stream);
/* Capturable, collective. A device barrier among the ranks of the active-rank mask on `stream`: it
 * returns on each rank once every rank of the mask reached it. A rank that does not come within
 * GRAPHEP_TIMEOUT_MS is named (the engine fails), or with shrink_on_timeout masked while the
 * barrier completes among the others (graphep::Engine::barrier). The throughput path over the
 * movers refuses it (GRAPHEP_NOT_SUPPORTED). Version 9. */
graphep_status_t graphep_engine_barrier(graphep_engine_t engine, cudaStream_t stream);
/* Diagnostics (synchronises the engine's device). */
graphep_status_t graphep_engine_status(graphep_engine_t engine, graphep_moe_status_t* status);
/* graphep::tokenLayout (DeepEP's get_dispatch_layout): per-rank and per-expert counts and the
 * token-in-rank mask [num_tokens, num_ranks] of a top-k routing, on the current device. Capturable,
 * not collective, no engine. num_tokens 0 .. 2^30, at most 1024 experts per rank. Version 4. */
graphep_status_t graphep_token_layout(const void* topk_idx, int index_type, int num_tokens, int top_k,
                                      int num_experts, int num_ranks, int* tokens_per_rank,
                                      int* tokens_per_expert, unsigned char* token_in_rank, cudaStream_t stream);

/* MoeGraph with an expert child graph (copied; swap it with graphep_graph_set_experts). Its combine
 * takes expert_output and out only: combine args with expert_output_rows, row_values, out_values,
 * num_values or topk_weights set, or either half other than WHOLE, are refused (INVALID_ARGUMENT)
 * rather than dropped. */
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
