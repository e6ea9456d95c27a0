// CPU unit tests: heap layout (computed size == carved size, regions aligned and disjoint),
// config validation, topology classification, communicator errors without a GPU.
#include <gtest/gtest.h>

#include <algorithm>

#include <graphep/graphep.hpp>

#include "common/expect_error.hpp"
#include "engine/heap_layout.hpp"
#include "engine/topology.hpp"

namespace graphep {
namespace {

void expectWellFormed(const HeapConfig& cfg) {
  const std::size_t size = heapBytes(cfg);
  const HeapLayout l = carveHeap(cfg, size);  // carving exactly the computed size must fit
  EXPECT_EQ(l.totalBytes, size);
  EXPECT_EQ(size % 4096, 0u);
  std::vector<HeapRegion> r = l.regions;
  ASSERT_EQ(r.size(), 15u);
  std::sort(r.begin(), r.end(), [](auto& a, auto& b) { return a.offset < b.offset; });
  for (std::size_t i = 0; i < r.size(); ++i) {
    EXPECT_EQ(r[i].offset % r[i].align, 0u) << r[i].name;
    EXPECT_LE(r[i].offset + r[i].bytes, size) << r[i].name;
    if (i > 0) {
      EXPECT_LE(r[i - 1].offset + r[i - 1].bytes, r[i].offset) << r[i].name;
    }
  }
  // One byte less than the computed size cannot hold the layout.
  EXPECT_THROW(carveHeap(cfg, size - 1), Error);
}

TEST(Unit_HeapLayout, ComputedSizeEqualsCarvedSize) {
  for (int ranks : {1, 2, 4, 8, 32}) {
    for (std::size_t user : {std::size_t{0}, std::size_t{1}, std::size_t{4097},
                             std::size_t{64} << 20}) {
      HeapConfig cfg;
      cfg.numRanks = ranks;
      cfg.userBytes = user;
      SCOPED_TRACE("ranks=" + std::to_string(ranks) + " user=" + std::to_string(user));
      expectWellFormed(cfg);
    }
  }
}

TEST(Unit_HeapLayout, ClosedFormSize) {
  HeapConfig cfg;
  cfg.numRanks = 8;           // 8 channels x 8 ranks x 4 B = 256 B per sem/flag region
  cfg.numSemChannels = 8;
  cfg.numFlagChannels = 8;
  cfg.numEpochs = 8;          // 32 B
  cfg.userBytes = 10000;
  cfg.moverLLBytes = 4096;
  cfg.moverBlocks = 16;
  const HeapLayout l = carveHeap(cfg, SIZE_MAX);
  EXPECT_EQ(l.semCount, 0u);
  EXPECT_EQ(l.semArrived, 256u);
  EXPECT_EQ(l.semConsumed, 512u);
  EXPECT_EQ(l.flagInbox, 768u);
  EXPECT_EQ(l.flagStep, 1024u);
  EXPECT_EQ(l.epochs, 1280u);
  // Mover channels: 8 ranks x 16 blocks x 4 B = 512 B each, 256-aligned after epochs (1312).
  EXPECT_EQ(l.moverHead, 1536u);
  EXPECT_EQ(l.moverTail, 2048u);
  EXPECT_EQ(l.moverReady, 2560u);
  EXPECT_EQ(l.moverSendStep, 3072u);
  EXPECT_EQ(l.moverRecvStep, 3584u);
  EXPECT_EQ(l.moverMailbox, 4096u);  // 8 x 16 x 16 B = 2 KiB
  EXPECT_EQ(l.user, 8192u);      // 6144 rounded up to the 4 KiB alignment
  EXPECT_EQ(l.staging, 20480u);  // 8192 + 10000 = 18192 -> 20480, no staging bytes
  EXPECT_EQ(l.ll, 20480u);       // 8 ranks x 16 channels x 2 halves x 8 KiB (4 KiB of data as lines)
  EXPECT_EQ(l.totalBytes, 20480u + 8 * 16 * 2 * 8192u);
  cfg.moverSlotBytes = 65536;    // 8 x 16 x 4 slots x 64 KiB = 32 MiB of staging
  EXPECT_EQ(carveHeap(cfg, SIZE_MAX).totalBytes,
            20480u + (std::size_t{32} << 20) + 8 * 16 * 2 * 8192u);
}

TEST(Unit_HeapLayout, ValidationNamesTheField) {
  HeapConfig cfg;
  auto expectNamed = [&cfg](const char* words) {
    test::expectError([&cfg] { cfg.validate(); }, Status::kInvalidArgument, words);
  };
  cfg.numRanks = 33;
  expectNamed("numRanks=33");
  cfg.numRanks = 2;
  cfg.timeoutMs = 0;
  EXPECT_THROW(cfg.validate(), Error);
  cfg.timeoutMs = -1;
  cfg.numSemChannels = 0;
  EXPECT_THROW(cfg.validate(), Error);
  cfg.numSemChannels = 8;
  cfg.moverSlots = 3;
  expectNamed("moverSlots=3");
  cfg.moverSlots = 4;
  cfg.moverSlotBytes = 100;
  EXPECT_THROW(cfg.validate(), Error);
  cfg.moverSlotBytes = 0;
  cfg.moverLLBytes = 24;  // a multiple of 8, not of 16
  EXPECT_THROW(cfg.validate(), Error);
  cfg.moverLLBytes = 4096;
  cfg.moverWarps = 9;
  expectNamed("moverWarps=9");
}

// The regions whose words start at counterStart exist under the names the heap initialises.
TEST(Unit_HeapLayout, MonotonicRegionsAreCarved) {
  HeapConfig cfg;
  cfg.numRanks = 4;
  const HeapLayout l = carveHeap(cfg, SIZE_MAX);
  int monotonic = 0;
  std::size_t moverWords = 0;
  for (const HeapRegion& r : l.regions) {
    if (!isMonotonicRegion(r.name)) continue;
    ++monotonic;
    if (r.name == "moverTail") moverWords = r.bytes / 4;
  }
  EXPECT_EQ(monotonic, 10);
  EXPECT_EQ(moverWords, 4u * static_cast<std::size_t>(cfg.moverBlocks));  // ranks x channels
  EXPECT_FALSE(isMonotonicRegion("semCount"));  // counting semaphores start at 0
}

TEST(Unit_HeapLayout, HashCoversLayoutFields) {
  HeapConfig a;
  a.numRanks = 2;
  HeapConfig b = a;
  EXPECT_EQ(a.hash(), b.hash());
  b.userBytes = 1;
  EXPECT_NE(a.hash(), b.hash());
  b = a;
  b.counterStart = 7;
  EXPECT_NE(a.hash(), b.hash());
  b = a;
  b.moverWarps = 4;
  EXPECT_NE(a.hash(), b.hash());
}

TEST(Unit_Topology, Classification) {
  PeerFacts self;
  self.isSelf = true;
  EXPECT_EQ(classifyPeer(self, ForceTransport::kAuto), PeerClass::kSelf);
  EXPECT_EQ(classifyPeer(self, ForceTransport::kRemote), PeerClass::kSelf);

  PeerFacts nvl;
  nvl.sameHost = nvl.peerVisible = nvl.canAccessPeer = nvl.nativeAtomics = true;
  EXPECT_EQ(classifyPeer(nvl, ForceTransport::kAuto), PeerClass::kNvLink);
  EXPECT_EQ(classifyPeer(nvl, ForceTransport::kRemote), PeerClass::kRemote);

  PeerFacts pcie = nvl;
  pcie.nativeAtomics = false;
  EXPECT_EQ(classifyPeer(pcie, ForceTransport::kAuto), PeerClass::kPcie);

  PeerFacts noP2p = nvl;
  noP2p.canAccessPeer = false;
  EXPECT_EQ(classifyPeer(noP2p, ForceTransport::kAuto), PeerClass::kRemote);

  PeerFacts hidden = nvl;
  hidden.peerVisible = false;  // e.g. CUDA_VISIBLE_DEVICES hides the peer's GPU
  EXPECT_EQ(classifyPeer(hidden, ForceTransport::kAuto), PeerClass::kRemote);

  PeerFacts otherHost = nvl;
  otherHost.sameHost = false;
  EXPECT_EQ(classifyPeer(otherHost, ForceTransport::kAuto), PeerClass::kRemote);

  PeerFacts sameGpu;
  sameGpu.sameHost = sameGpu.sameDevice = true;
  EXPECT_EQ(classifyPeer(sameGpu, ForceTransport::kAuto), PeerClass::kSameDevice);
  EXPECT_EQ(classifyPeer(sameGpu, ForceTransport::kRemote), PeerClass::kRemote);
}

// The latency path's 128-byte payload lines: whole on this GPU and over NVLink only.
TEST(Unit_Topology, WholeLinesOnlyOnThisGpuAndNvLink) {
  EXPECT_TRUE(takesWholeLines(PeerClass::kSelf));
  EXPECT_TRUE(takesWholeLines(PeerClass::kSameDevice));
  EXPECT_TRUE(takesWholeLines(PeerClass::kNvLink));
  EXPECT_FALSE(takesWholeLines(PeerClass::kPcie));
  EXPECT_FALSE(takesWholeLines(PeerClass::kRemote));
  EXPECT_TRUE(isLoadStore(PeerClass::kPcie));  // the throughput path's direct kernels still reach it
}

TEST(Unit_Topology, ForceTransportParsing) {
  EXPECT_EQ(parseForceTransport("auto"), ForceTransport::kAuto);
  EXPECT_EQ(parseForceTransport("Remote"), ForceTransport::kRemote);
  EXPECT_THROW(parseForceTransport("pcie"), Error);
  EXPECT_STREQ(peerClassName(PeerClass::kNvLink), "nvlink");
}

TEST(Unit_Comm, ArgumentErrorsNameTheValue) {
  try {
    createLocalGroup({});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("0 ranks"), std::string::npos) << e.what();
  }
  const char* reason = nullptr;
  if (cudaDeviceCountOrZero(&reason) == 0) {
    try {
      createLocalGroup({0, 0});
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kNoDevice);
      EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
    }
  } else {
    try {
      createLocalGroup({0, 999});
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("device 999"), std::string::npos) << e.what();
    }
  }
  if (!mpiSupported()) {
    try {
      createMpiCommunicator();
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kNotSupported);
    }
  }
}

}  // namespace
}  // namespace graphep
