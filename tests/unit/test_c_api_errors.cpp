// The C ABI's error paths on the host (no GPU needed): every failure is a status and a message
// naming the value, per thread; nothing throws across the boundary.
#include <gtest/gtest.h>

#include <graphep/graphep.h>
#include <graphep/graphep.hpp>

#include <cstddef>
#include <string>
#include <thread>

namespace graphep::test {
namespace {

TEST(Unit_CApi, ErrorsAreNamedStatusesPerThread) {
  EXPECT_STREQ(graphep_version(), versionString());
  EXPECT_STREQ(graphep_status_name(GRAPHEP_INVALID_ARGUMENT), "INVALID_ARGUMENT");
  EXPECT_STREQ(graphep_status_name(GRAPHEP_REMOTE_ERROR), "REMOTE_ERROR");

  graphep_comm_t comm = nullptr;
  EXPECT_EQ(graphep_comm_create_local_group(nullptr, 1, &comm), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("devices is NULL"), std::string::npos) << graphep_last_error();
  const int devices[1] = {0};
  EXPECT_EQ(graphep_comm_create_local_group(devices, 0, &comm), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("count=0 is not positive"), std::string::npos);

  graphep_moe_config_t cfg = GRAPHEP_MOE_CONFIG_INIT;
  graphep_engine_t engine = nullptr;
  EXPECT_EQ(graphep_engine_create_all(nullptr, &cfg, &engine, 1), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("comm is NULL"), std::string::npos);
  EXPECT_EQ(graphep_dispatch(nullptr, nullptr, nullptr), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("engine is NULL"), std::string::npos);
  EXPECT_EQ(graphep_graph_launch(nullptr, nullptr), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("graph is NULL"), std::string::npos);
  // The active-rank mask (version 6): a NULL engine named.
  EXPECT_EQ(graphep_set_active_ranks(nullptr, 1u, nullptr), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("engine is NULL"), std::string::npos);
  EXPECT_EQ(graphep_engine_recover(nullptr, 1u, nullptr), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("engine is NULL"), std::string::npos);
  EXPECT_EQ(graphep_engine_barrier(nullptr, nullptr), GRAPHEP_INVALID_ARGUMENT);  // version 9
  EXPECT_NE(std::string(graphep_last_error()).find("engine is NULL"), std::string::npos);

  // graphep_engine_path (version 2): each NULL named, the output left alone on failure.
  EXPECT_GE(GRAPHEP_C_API_VERSION, 3);
  int path = -7;
  EXPECT_EQ(graphep_engine_path(nullptr, &path), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("engine is NULL"), std::string::npos) << graphep_last_error();
  EXPECT_EQ(path, -7);
  EXPECT_EQ(graphep_engine_path(nullptr, nullptr), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("path is NULL"), std::string::npos) << graphep_last_error();
  graphep_layout_t layout = GRAPHEP_LAYOUT_INIT;
  EXPECT_EQ(graphep_engine_layout(nullptr, &layout), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("engine is NULL"), std::string::npos);

  // graphep_graph_create refuses the combine fields a MoeGraph would drop, each named, before it
  // looks at the engine.
  {
    graphep_dispatch_args_t d = GRAPHEP_DISPATCH_ARGS_INIT;
    graphep_combine_args_t c = GRAPHEP_COMBINE_ARGS_INIT;
    graphep_graph_t g = nullptr;
    c.expert_output_rows = 5;
    EXPECT_EQ(graphep_graph_create(nullptr, &d, &c, nullptr, &g), GRAPHEP_INVALID_ARGUMENT);
    EXPECT_NE(std::string(graphep_last_error()).find("expert_output_rows=5"), std::string::npos) << graphep_last_error();
    c = GRAPHEP_COMBINE_ARGS_INIT;
    float values[4] = {0.f, 0.f, 0.f, 0.f};
    c.row_values = values;
    c.out_values = values;
    c.num_values = 3;
    EXPECT_EQ(graphep_graph_create(nullptr, &d, &c, nullptr, &g), GRAPHEP_INVALID_ARGUMENT);
    EXPECT_NE(std::string(graphep_last_error()).find("num_values=3"), std::string::npos) << graphep_last_error();
    c = GRAPHEP_COMBINE_ARGS_INIT;
    EXPECT_EQ(graphep_graph_create(nullptr, &d, &c, nullptr, &g), GRAPHEP_INVALID_ARGUMENT);
    EXPECT_NE(std::string(graphep_last_error()).find("engine is NULL"), std::string::npos) << graphep_last_error();
    EXPECT_EQ(g, nullptr);
  }

  // graphep_token_layout names out-of-range counts before it touches a device.
  {
    int perRank[2], perExpert[8];
    unsigned char inRank[4];
    const int ids[2] = {0, 1};
    EXPECT_EQ(graphep_token_layout(ids, GRAPHEP_INDEX_INT32, 2147483647, 1, 8, 2, perRank, perExpert, inRank, nullptr),
              GRAPHEP_INVALID_ARGUMENT);
    EXPECT_NE(std::string(graphep_last_error()).find("numTokens=2147483647 is outside [0, 1073741824]"),
              std::string::npos) << graphep_last_error();
    EXPECT_EQ(graphep_token_layout(ids, GRAPHEP_INDEX_INT32, 2, 1, 2147483616, 2, perRank, perExpert, inRank, nullptr),
              GRAPHEP_INVALID_ARGUMENT);
    EXPECT_NE(std::string(graphep_last_error()).find("numExperts=2147483616 is more than 1024 per rank"),
              std::string::npos) << graphep_last_error();
  }

  // The last error belongs to the thread that failed.
  std::string other = "unset";
  std::thread([&] { other = graphep_last_error(); }).join();
  EXPECT_EQ(other, "");

  // Without a usable GPU a communicator is a named NO_DEVICE, with one it is made and destroyed.
  const graphep_status_t s = graphep_comm_create_local_group(devices, 1, &comm);
  if (cudaDeviceCountOrZero() == 0) {
    EXPECT_EQ(s, GRAPHEP_NO_DEVICE) << graphep_last_error();
    EXPECT_STRNE(graphep_last_error(), "");
  } else {
    ASSERT_EQ(s, GRAPHEP_SUCCESS) << graphep_last_error();
    graphep_moe_config_t small = cfg;
    small.struct_size = 8;  // not initialised with GRAPHEP_MOE_CONFIG_INIT
    EXPECT_EQ(graphep_engine_create_all(comm, &small, &engine, 1), GRAPHEP_INVALID_ARGUMENT);
    EXPECT_NE(std::string(graphep_last_error()).find("struct_size=8"), std::string::npos);
    EXPECT_EQ(graphep_comm_destroy(comm), GRAPHEP_SUCCESS);
  }
}

// Version 7: the status's masked entries per rank, appended (a version-6 caller's struct, which
// ends before them, keeps its size and is written only that far), zero from the INIT macro.
TEST(Unit_CApi, Version7MaskedEntries) {
  EXPECT_EQ(GRAPHEP_MAX_RANKS, kMaxRanks);
  const graphep_moe_status_t st = GRAPHEP_MOE_STATUS_INIT;
  EXPECT_EQ(st.struct_size, sizeof(graphep_moe_status_t));
  for (unsigned long long m : st.masked_entries) EXPECT_EQ(m, 0ull);
  EXPECT_EQ(offsetof(graphep_moe_status_t, masked_entries),
            offsetof(graphep_moe_status_t, missing_combine_rows) + sizeof(unsigned long long));
  EXPECT_EQ(graphep_engine_status(nullptr, nullptr), GRAPHEP_INVALID_ARGUMENT);
}

// Version 8 (shrink on timeout): the config's flag and the status's masked ranks, after the
// version-7 fields, zero from the INIT macros; a version-7 caller's config (without the flag) reads
// it as off.
TEST(Unit_CApi, Version8ShrinkOnTimeout) {
  const graphep_moe_config_t c = GRAPHEP_MOE_CONFIG_INIT;
  EXPECT_EQ(c.shrink_on_timeout, 0);
  EXPECT_GT(offsetof(graphep_moe_config_t, shrink_on_timeout), offsetof(graphep_moe_config_t, rows_per_expert));
  const graphep_moe_status_t st = GRAPHEP_MOE_STATUS_INIT;
  EXPECT_EQ(st.shrunk_ranks, 0u);
  EXPECT_EQ(offsetof(graphep_moe_status_t, shrunk_ranks),
            offsetof(graphep_moe_status_t, masked_entries) + sizeof(st.masked_entries));
  // Read from a version-8 struct: on the throughput path the flag is refused by name; a version-7
  // caller's struct ends before it, so the same bytes past its end are not read.
  graphep_moe_config_t v8 = GRAPHEP_MOE_CONFIG_INIT;
  v8.max_tokens_per_rank = 64;
  v8.hidden = 1024;
  v8.num_experts = 8;
  v8.top_k = 2;
  v8.path = GRAPHEP_PATH_THROUGHPUT;
  v8.shrink_on_timeout = 1;
  graphep_moe_memory_t mem = GRAPHEP_MOE_MEMORY_INIT;
  EXPECT_EQ(graphep_memory_requirements(&v8, 2, &mem), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("shrinkOnTimeout"), std::string::npos) << graphep_last_error();
  graphep_moe_config_t v7 = v8;
  v7.struct_size = offsetof(graphep_moe_config_t, shrink_on_timeout);
  EXPECT_EQ(graphep_memory_requirements(&v7, 2, &mem), GRAPHEP_SUCCESS) << graphep_last_error();
  v8.path = GRAPHEP_PATH_AUTO;  // the latency path at this size: taken
  EXPECT_EQ(graphep_memory_requirements(&v8, 2, &mem), GRAPHEP_SUCCESS) << graphep_last_error();
  EXPECT_EQ(mem.path, GRAPHEP_PATH_LATENCY);
}

// Version 5 (the latency path's capabilities): the version, the INIT defaults ("as before"), the
// enums equal to the C++ ones, and graphep_receive's NULL engine named.
TEST(Unit_CApi, Version5LatencyCapabilities) {
  EXPECT_EQ(GRAPHEP_C_API_VERSION, 9);
  EXPECT_EQ(graphep_api_version(), GRAPHEP_C_API_VERSION);
  EXPECT_EQ(GRAPHEP_FP8_SCALES_FLOAT, static_cast<int>(Fp8Scales::kFloat));
  EXPECT_EQ(GRAPHEP_FP8_SCALES_POW2, static_cast<int>(Fp8Scales::kPow2));
  EXPECT_EQ(GRAPHEP_FP8_SCALES_UE8M0, static_cast<int>(Fp8Scales::kUe8m0));
  EXPECT_EQ(GRAPHEP_HALF_WHOLE, static_cast<int>(MoeHalf::kWhole));
  EXPECT_EQ(GRAPHEP_HALF_SEND, static_cast<int>(MoeHalf::kSend));

  const graphep_dispatch_args_t d = GRAPHEP_DISPATCH_ARGS_INIT;
  EXPECT_EQ(d.struct_size, sizeof(graphep_dispatch_args_t));
  EXPECT_EQ(d.out_rows, 0);
  EXPECT_EQ(d.scale_format, GRAPHEP_FP8_SCALES_FLOAT);
  EXPECT_EQ(d.recv_stats, nullptr);
  EXPECT_EQ(d.half, GRAPHEP_HALF_WHOLE);
  const graphep_combine_args_t c = GRAPHEP_COMBINE_ARGS_INIT;
  EXPECT_EQ(c.struct_size, sizeof(graphep_combine_args_t));
  EXPECT_EQ(c.num_values, 0);
  EXPECT_EQ(c.topk_weights, nullptr);
  EXPECT_EQ(c.half, GRAPHEP_HALF_WHOLE);
  const graphep_layout_t l = GRAPHEP_LAYOUT_INIT;
  EXPECT_EQ(l.struct_size, sizeof(graphep_layout_t));
  EXPECT_EQ(l.row_expert_weights, nullptr);
  EXPECT_EQ(l.expert_source_ranges, nullptr);
  EXPECT_EQ(l.scales_buffer, nullptr);

  EXPECT_EQ(graphep_receive(nullptr, nullptr), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("engine is NULL"), std::string::npos) << graphep_last_error();
}

// A C config from GRAPHEP_MOE_CONFIG_INIT (the ABI's defaults) with the four shape fields set.
graphep_moe_config_t cConfig(int tokens, int hidden, int experts, int topK) {
  graphep_moe_config_t c = GRAPHEP_MOE_CONFIG_INIT;
  c.max_tokens_per_rank = tokens;
  c.hidden = hidden;
  c.num_experts = experts;
  c.top_k = topK;
  return c;
}

// The memory query through the C ABI: the same figures as Engine::memoryRequirements, no GPU
// needed, the bad field named.
TEST(Unit_CApi, StructSizesThatCutAFieldAreRefused) {
  graphep_moe_config_t c = cConfig(128, 2048, 128, 8);
  graphep_moe_memory_t m = GRAPHEP_MOE_MEMORY_INIT;
  c.struct_size = 58;  // past the first version's size, inside a field
  EXPECT_EQ(graphep_memory_requirements(&c, 2, &m), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("config->struct_size=58 is not a multiple of 8"), std::string::npos)
      << graphep_last_error();
  c.struct_size = sizeof(graphep_moe_config_t);
  m.struct_size = sizeof(graphep_moe_memory_t) - 4;
  EXPECT_EQ(graphep_memory_requirements(&c, 2, &m), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("memory->struct_size="), std::string::npos) << graphep_last_error();
  m.struct_size = sizeof(graphep_moe_memory_t);
  EXPECT_EQ(graphep_memory_requirements(&c, 2, &m), GRAPHEP_SUCCESS) << graphep_last_error();
}

TEST(Unit_CApi, MemoryRequirementsMatchTheCppQuery) {
  for (int path : {GRAPHEP_PATH_AUTO, GRAPHEP_PATH_THROUGHPUT}) {
    for (int dtype : {GRAPHEP_DTYPE_BF16, GRAPHEP_DTYPE_FP8_E4M3}) {
      graphep_moe_config_t c = cConfig(128, 2048, 128, 8);
      c.dispatch_dtype = dtype;
      c.path = path;
      graphep_moe_memory_t m = GRAPHEP_MOE_MEMORY_INIT;
      ASSERT_EQ(graphep_memory_requirements(&c, 2, &m), GRAPHEP_SUCCESS) << graphep_last_error();
      const MoeConfig cpp{.maxTokensPerRank = 128, .hidden = 2048, .numExperts = 128, .topK = 8,
                          .dispatchType = dtype == GRAPHEP_DTYPE_FP8_E4M3 ? DType::kFp8E4m3 : DType::kBf16,
                          .path = static_cast<MoePath>(path)};
      const MoeMemory want = Engine::memoryRequirements(cpp, 2);
      EXPECT_EQ(m.path, static_cast<int>(want.path));
      EXPECT_EQ(m.path, path == GRAPHEP_PATH_AUTO ? GRAPHEP_PATH_LATENCY : GRAPHEP_PATH_THROUGHPUT);
      EXPECT_EQ(m.symmetric_heap_bytes, want.symmetricHeapBytes);
      EXPECT_EQ(m.private_bytes, want.privateBytes);
      EXPECT_EQ(m.nccl_staging_bytes, want.ncclStagingBytes);
      EXPECT_GT(m.symmetric_heap_bytes, 0u);
      EXPECT_EQ(m.struct_size, sizeof(graphep_moe_memory_t));
    }
  }
  graphep_moe_config_t bad = cConfig(16, 100, 8, 2);  // hidden=100: not a multiple of 8
  graphep_moe_memory_t m = GRAPHEP_MOE_MEMORY_INIT;
  EXPECT_EQ(graphep_memory_requirements(&bad, 2, &m), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("hidden=100"), std::string::npos) << graphep_last_error();
  EXPECT_EQ(graphep_memory_requirements(&bad, 2, nullptr), GRAPHEP_INVALID_ARGUMENT);

  // epilogue_sms (v3): read when the caller's struct has it, 0 for a v2 caller's shorter struct.
  graphep_moe_config_t v3 = cConfig(16, 256, 8, 2);
  v3.epilogue_sms = -1;
  EXPECT_EQ(graphep_memory_requirements(&v3, 2, &m), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("epilogueSms=-1"), std::string::npos) << graphep_last_error();
  graphep_moe_config_t v2 = v3;  // the -1 lies past a v2 caller's struct: not read
  v2.struct_size = offsetof(graphep_moe_config_t, epilogue_sms);
  EXPECT_EQ(graphep_memory_requirements(&v2, 2, &m), GRAPHEP_SUCCESS) << graphep_last_error();

  // The batched layout from C: the same figures as the C++ query; a bad layout named.
  v3.epilogue_sms = 0;
  v3.receive_layout = GRAPHEP_LAYOUT_BATCHED;
  v3.rows_per_expert = 24;
  ASSERT_EQ(graphep_memory_requirements(&v3, 2, &m), GRAPHEP_SUCCESS) << graphep_last_error();
  MoeConfig cpp{.maxTokensPerRank = 16, .hidden = 256, .numExperts = 8, .topK = 2,
                .receiveLayout = ReceiveLayout::kBatched, .rowsPerExpert = 24};
  EXPECT_EQ(m.private_bytes, Engine::memoryRequirements(cpp, 2).privateBytes);
  EXPECT_EQ(Engine::receiveCapacity(cpp, 2), 4 * 24);
  v3.receive_layout = GRAPHEP_LAYOUT_RANK_MAJOR;
  v3.rows_per_expert = 0;
  ASSERT_EQ(graphep_memory_requirements(&v3, 2, &m), GRAPHEP_SUCCESS) << graphep_last_error();
  cpp.receiveLayout = ReceiveLayout::kRankMajor;
  cpp.rowsPerExpert = 0;
  EXPECT_EQ(m.private_bytes, Engine::memoryRequirements(cpp, 2).privateBytes);
  v3.receive_layout = 7;
  EXPECT_EQ(graphep_memory_requirements(&v3, 2, &m), GRAPHEP_INVALID_ARGUMENT);
  EXPECT_NE(std::string(graphep_last_error()).find("receive_layout=7"), std::string::npos) << graphep_last_error();
}

}  // namespace
}  // namespace graphep::test
