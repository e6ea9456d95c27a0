// A byte model of expert-parallel traffic across nodes (docs/DESIGN.md §5.10), a pure function so its
// rules are unit-tested on the CPU: per rank, the expected bytes a dispatch and a combine put on the
// network (NIC) and on NVLink, and the bandwidth-bound time, for a flat scheme (a token crosses the
// network once per remote destination rank) against a node-aware one (once per remote node, landing
// on the rank of the same local index there, which forwards it over NVLink; combine reduces within
// the node first and sends one partial per (token, node) home).
//
// Routing: DeepSeek-V3's group-limited top-k, in expectation. The E experts form `numGroups` equal
// groups of consecutive ids; a token chooses `groupsPerToken` of them uniformly, then `topK` distinct
// experts uniformly among their experts. groupsPerToken == numGroups is plain uniform top-k.
// Experts live in consecutive blocks (rank r: E / R of them; node n: its ranksPerNode ranks').
#pragma once

namespace graphep {

struct TrafficModelInput {
  int numRanks = 0;        // R (the EP size)
  int ranksPerNode = 0;    // G: GPUs of one NVLink domain; R a multiple of it
  long long tokensPerRank = 0;  // T
  int hidden = 0;          // H
  int numExperts = 0;      // E: a multiple of R and of numGroups
  int topK = 0;            // K: at most the experts of groupsPerToken groups
  int numGroups = 1;       // routing groups (DeepSeek-V3: 8)
  int groupsPerToken = 1;  // groups a token may use (DeepSeek-V3: 4)
  // Bytes on the wire per dispatched token row (fp8 as DeepEP counts it: H + H / 128 x 4 + 16) and
  // per combined row (bf16: 2H).
  double dispatchRowBytes = 0;
  double combineRowBytes = 0;
  double nicGBps = 0;      // one NIC per GPU, per direction (400 Gb/s: 50)
  double nvlinkGBps = 0;   // NVLink per GPU, per direction
};

struct TrafficPhase {
  double nicBytes = 0;     // per rank, sent (= received, by symmetry)
  double nvlinkBytes = 0;  // per rank, sent over NVLink
  double us = 0;           // max(nicBytes / nicGBps, nvlinkBytes / nvlinkGBps): both links busy at once
};

struct TrafficModelResult {
  double rankHit = 0;      // P(a token has an expert on a given other rank)
  double nodeHit = 0;      // P(a token has an expert on a given other node)
  TrafficPhase flatDispatch, flatCombine, nodeAwareDispatch, nodeAwareCombine;
};

// Throws graphep::Error (kInvalidArgument) naming the first field out of range.
TrafficModelResult trafficModel(const TrafficModelInput& in);

}  // namespace graphep
