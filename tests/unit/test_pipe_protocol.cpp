// Model check of the pipelined point-to-point protocol (kernels/common/pipe.cuh) on the CPU.
//
// One link (sender S -> receiver R, one channel) runs a sequence of launches, each staged,
// zero-copy or LL with a random size, counters starting just below the 32-bit wrap. Each side is a
// state machine whose atomic actions follow the device roles and use the same rule functions
// (kernels/common/pipe.h); a random scheduler interleaves them. The model flags:
//   - a staged write into a slot (or an LL write into a half) not consumed yet,
//   - an LL receive completing on lines of another step,
//   - a receiver consuming a slot that does not hold the chunk it expects,
//   - a zero-copy write into dst before R's launch started (R's stream may still use dst),
//   - a zero-copy receive completing before S wrote the launch's data,
//   - a deadlock (neither side can act, work remains).
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/counter.h"
#include "kernels/common/pipe.h"

namespace graphep {
namespace {

struct Rules {
  std::uint32_t (*readyTarget)(std::uint32_t step0);
  std::uint32_t (*zeroCopySteps)(std::uint64_t bytes, std::uint32_t slotBytes);
};
const Rules kRealRules{readyValue, zeroCopySteps};

enum class Mode { kStaged, kZeroCopy, kLL };

struct Launch {
  std::uint64_t bytes;
  Mode mode;
};

// Returns "" when every interleaving explored was clean, else the first violation.
std::string runModel(const Rules& rules, std::uint32_t numSlots, std::uint32_t slotBytes,
                     const std::vector<Launch>& launches, std::uint32_t start, std::mt19937& rng) {
  std::uint32_t head = start, tail = start, ready = start;  // shared flags
  std::uint32_t sendStep = start, recvStep = start;
  std::vector<std::optional<std::uint64_t>> slots(numSlots);  // unconsumed chunk ids
  // LL halves: the step whose lines a half holds (the flag), unconsumed.
  std::vector<std::optional<std::uint32_t>> llHalves(2);
  std::uint64_t sentChunks = 0, recvChunks = 0;               // unwrapped, for slot contents
  const std::size_t L = launches.size();
  std::vector<bool> zcWritten(L, false), recvStarted(L, false);

  // Program counters: launch index and chunk index within it (-1: zero-copy start pending).
  std::size_t sk = 0, rk = 0;
  std::uint32_t si = 0, ri = 0;
  std::uint32_t sStep0 = sendStep, rStep0 = recvStep;
  bool rStartedThis = false;

  auto staged = [&](std::size_t k) { return pipeChunks(launches[k].bytes, slotBytes); };
  // The end of a launch that took `steps` steps: the side moves on to its next launch.
  auto endSend = [&](std::uint32_t steps) {
    sendStep = sStep0 + steps;
    ++sk;
    si = 0;
    sStep0 = sendStep;
  };
  auto endRecv = [&](std::uint32_t steps) {
    recvStep = rStep0 + steps;
    ++rk;
    ri = 0;
    rStep0 = recvStep;
    rStartedThis = false;
  };
  for (int guard = 0; guard < 1000000; ++guard) {
    if (sk == L && rk == L) return "";
    // Enabled actions.
    bool sendCan = false, recvCan = false;
    if (sk < L) {
      if (launches[sk].mode == Mode::kLL) {
        sendCan = counterReached(tail, slotFreeTarget(sStep0, 2));
      } else if (launches[sk].mode == Mode::kZeroCopy) {
        sendCan = counterReached(ready, rules.readyTarget(sStep0));
      } else if (si < staged(sk)) {
        sendCan = counterReached(tail, slotFreeTarget(sStep0 + si, numSlots));
      } else {
        sendCan = true;  // launch end
      }
    }
    if (rk < L) {
      if (launches[rk].mode == Mode::kLL) {
        // The receiver can finish once the half holds lines flagged for its step.
        const auto& half = llHalves[slotOf(rStep0, 2)];
        recvCan = launches[rk].bytes == 0 || (half.has_value() && llFlag(*half) == llFlag(rStep0));
      } else if (launches[rk].mode == Mode::kZeroCopy) {
        recvCan = !rStartedThis ||
                  counterReached(head, rStep0 + rules.zeroCopySteps(launches[rk].bytes, slotBytes));
      } else if (ri < staged(rk)) {
        recvCan = counterReached(head, rStep0 + ri + 1u);
      } else {
        recvCan = true;
      }
    }
    if (!sendCan && !recvCan) {
      return "deadlock at sender launch " + std::to_string(sk) + ", receiver launch " +
             std::to_string(rk);
    }
    const bool pickSend = sendCan && (!recvCan || (rng() & 1u));
    if (pickSend) {
      const Launch& l = launches[sk];
      if (l.mode == Mode::kLL) {
        auto& half = llHalves[slotOf(sStep0, 2)];
        if (l.bytes > 0) {
          if (half.has_value()) {
            return "LL launch " + std::to_string(sk) + " overwrote the unconsumed lines of step " +
                   std::to_string(*half);
          }
          half = sStep0;
        }
        endSend(1u);
      } else if (l.mode == Mode::kZeroCopy) {
        if (!recvStarted[sk]) {
          return "zero-copy launch " + std::to_string(sk) +
                 " wrote dst before the receiver's launch started";
        }
        zcWritten[sk] = true;
        const std::uint32_t n = rules.zeroCopySteps(l.bytes, slotBytes);
        head = sStep0 + n;
        sentChunks += n;
        endSend(n);
      } else if (si < staged(sk)) {
        const std::uint32_t s = sStep0 + si;
        auto& slot = slots[slotOf(s, numSlots)];
        if (slot.has_value()) {
          return "staged chunk " + std::to_string(sentChunks) + " overwrote unconsumed chunk " +
                 std::to_string(*slot);
        }
        slot = sentChunks++;
        head = s + 1u;
        ++si;
      } else {
        endSend(staged(sk));
      }
    } else {
      const Launch& l = launches[rk];
      if (l.mode == Mode::kLL) {
        auto& half = llHalves[slotOf(rStep0, 2)];
        if (l.bytes > 0) {
          if (!half.has_value() || *half != rStep0) {
            return "LL receive " + std::to_string(rk) + " read lines of the wrong step";
          }
          half.reset();
        }
        tail = rStep0 + 1u;
        endRecv(1u);
      } else if (l.mode == Mode::kZeroCopy) {
        if (!rStartedThis) {
          ready = rules.readyTarget(rStep0);
          recvStarted[rk] = true;
          rStartedThis = true;
        } else {
          if (!zcWritten[rk]) {
            return "zero-copy receive " + std::to_string(rk) + " completed before the data was written";
          }
          const std::uint32_t n = rules.zeroCopySteps(l.bytes, slotBytes);
          tail = rStep0 + n;
          recvChunks += n;
          endRecv(n);
        }
      } else if (ri < staged(rk)) {
        const std::uint32_t s = rStep0 + ri;
        auto& slot = slots[slotOf(s, numSlots)];
        if (!slot.has_value() || *slot != recvChunks) {
          return "receiver expected chunk " + std::to_string(recvChunks) + " in slot " +
                 std::to_string(slotOf(s, numSlots)) + ", found " +
                 (slot ? std::to_string(*slot) : std::string("nothing"));
        }
        slot.reset();
        ++recvChunks;
        tail = s + 1u;
        ++ri;
      } else {
        endRecv(staged(rk));
      }
    }
  }
  return "model did not finish";
}

std::vector<Launch> randomLaunches(std::mt19937& rng, std::size_t n, std::uint32_t slotBytes) {
  std::vector<Launch> v;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t bytes = rng() % 4 == 0 ? 0 : rng() % (12 * slotBytes);
    v.push_back({bytes, static_cast<Mode>(rng() % 3)});
  }
  return v;
}

TEST(Unit_PipeProtocol, RandomInterleavingsAcrossTheWrapAreClean) {
  std::mt19937 rng(12345);
  for (std::uint32_t slots : {1u, 2u, 4u, 8u}) {
    for (int trial = 0; trial < 1500; ++trial) {
      const auto launches = randomLaunches(rng, 24, 16);
      const std::string err = runModel(kRealRules, slots, 16, launches, 0xffffffffu - 40u, rng);
      ASSERT_EQ(err, "") << "slots=" << slots << " trial=" << trial;
    }
  }
}

TEST(Unit_PipeProtocol, LlFlagsAreNeverZeroAndUniquePerHalf) {
  EXPECT_EQ(llFlag(0xffffffffu), 1u);
  EXPECT_EQ(llFlag(0u), 1u);  // even half: flags are odd; odd half: the remapped 1 is unique
  for (std::uint32_t s : {0xfffffff0u, 0xfffffffeu, 0xffffffffu, 0u, 1u, 2u}) {
    EXPECT_NE(llFlag(s), 0u);
    EXPECT_NE(llFlag(s), llFlag(s + 2u)) << "consecutive uses of one half must differ";
  }
  EXPECT_EQ(llHalfBytes(8192), 16384u);
  EXPECT_EQ(llLines(1), 1u);
}

// The rule the first version used (wait for ready >= step0, zero-copy launches of no chunk take no
// step) lets the sender write dst before the receiver's launch started: the model must see it.
TEST(Unit_PipeProtocol, ModelCatchesTheOldZeroCopyRule) {
  const Rules old{[](std::uint32_t step0) { return step0; }, pipeChunks};
  std::mt19937 rng(7);
  int caught = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const auto launches = randomLaunches(rng, 8, 16);
    if (!runModel(old, 4, 16, launches, 0xffffffffu - 5u, rng).empty()) ++caught;
  }
  EXPECT_GT(caught, 0) << "the model failed to detect a known race";
}

}  // namespace
}  // namespace graphep
