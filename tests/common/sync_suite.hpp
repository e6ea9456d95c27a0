// Foundation test bodies shared by every configuration: 4 emulated ranks on one GPU, 2 GPUs in one
// process (local group and NCCL), and one process per GPU under mpirun. Each body drives all local
// ranks of the communicator and checks only those; gtest EXPECTs report every mismatch count.
#pragma once

#include <cstdint>

#include <graphep/comm.hpp>

namespace graphep::test {

// 100 below the 32-bit wrap point: 10,000 rounds cross it.
inline constexpr std::uint32_t kNearWrap = 0xffffffffu - 99u;

// Every rank publishes fresh random words; every rank reads each peer's words through the peer
// mapping and writes its own words into each peer's inbox. Exact comparison, poisoned targets.
void runHeapExchange(Communicator& comm, std::uint64_t seed);

// `rounds` rounds of flag ping-pong between every pair of ranks, eagerly or by replaying one
// captured graph per rank, counters starting at `counterStart`. Zero lost/extra signals.
void runFlagPingPong(Communicator& comm, int rounds, bool graph, std::uint32_t counterStart);

// The same with counting semaphores (kernel signal, stream wait, consume).
void runSemaphorePingPong(Communicator& comm, int rounds, bool graph, std::uint32_t counterStart);

// Rank `waiter` waits for a flag from rank `missing`, which never sends: the wait must fail within
// the bound, and the error must name the missing peer. Then the same with a captured semaphore
// (memop) wait, which only the host watchdog can bound: it must name the peer, refuse new work,
// and release() must drain the stream. Other ranks do nothing.
void runMissingPeer(Communicator& comm, int waiter, int missing, long long timeoutMs);

}  // namespace graphep::test
