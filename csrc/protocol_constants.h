// The numbers and names of the protocol (protocol.cuh) that the binding exports to Python: sizes,
// ids of algorithms, dtypes, stages and error kinds, the local control words, and the workspace
// layout. Plain C++ (no CUDA headers), so the host-compiled binding includes it and exports every
// value from its C++ name; pcie_allreduce/constants.py mirrors them for imports without the
// extension, and a CPU test checks the mirror.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define PCIE_AR_HOST_DEVICE __host__ __device__
#else
#define PCIE_AR_HOST_DEVICE
#endif

namespace pcie_ar {

constexpr int kMinRanks = 2;
constexpr int kMaxRanks = 16;
// Kernels hold one register (or a pack of them) per rank in arrays of a capacity fixed at compile
// time. Worlds up to kSmallWorld run instances of capacity kSmallWorld, so the sizes most boxes
// have (2-8 GPUs) keep the registers and instructions they had before the protocol grew to
// kMaxRanks; larger worlds run instances of capacity kMaxRanks.
constexpr int kSmallWorld = 8;
constexpr int kMaxFlagBlocks = 128;  // flag slots per (kind, sender); CUDA kernels use <= kMaxLaunchBlocks
constexpr int kMaxLaunchBlocks = 64;
constexpr int kThreadsPerBlock = 512;
// Kinds of flag: 0: first exchange (one-shot push, two-shot reduce-scatter), 1: all-gather,
// 2 (kNoticeKind): call notices, word 0 of each (sender, parity) (invariant 7 of protocol.cuh).
// Every kind has a row per epoch parity (invariant 4), so the flag array has kFlagRows rows of
// kMaxRanks x kMaxFlagBlocks words: row 2 * kind + parity.
constexpr int kFlagKinds = 3;
constexpr int kNoticeKind = 2;
constexpr int kFlagRows = 2 * kFlagKinds;
constexpr uint64_t kAlign = 256;
// The low-latency line (ll_line.cuh): 8 bytes of payload travel as one 16-byte line whose flag is
// signature ^ (epoch * kLineFlagMix). Odd: epochs e and e + 2 never share a flag.
constexpr uint64_t kLinePayloadBytes = 8;
constexpr uint64_t kLineBytes = 16;
constexpr uint32_t kLineFlagMix = 0x9E3779B9u;
// The words a waiter matches (flags and headers) carry the low 32 bits of the 64-bit epoch and the
// signature XOR (wraps * kWrapSealMix), wraps being the epoch's high 32 bits (invariant 3 of
// protocol.cuh). Odd: consecutive wrap counts never share a seal; wrap 0 seals nothing.
constexpr uint32_t kWrapSealMix = 0x85EBCA6Bu;

enum class Algo : int {
  kOneShot = 0, kStaged = 1, kTwoShot = 2, kOneShotLL = 3, kHostOneShot = 4, kHostTwoShot = 5, kOneShotFull = 6,
  kTwoShotFull = 7, kIslandTwoShot = 8, kOneShotPull = 9, kTwoShotPull = 10, kTwoShotStaged = 11,
  kIslandOneShot = 12, kTwoShotSymm = 13, kTwoShotFp8 = 14
};
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum class Stage : uint32_t { kNone = 0, kOneShotGather = 1, kReduceScatter = 2, kAllGather = 3, kFusedGather = 4,
                              kFusedReduceScatter = 5, kFusedAllGather = 6, kLowLatencyGather = 7,
                              kFusedRowStats = 8, kHostGather = 9, kFullGather = 10, kFullReduceScatter = 11,
                              kFullAllGather = 12, kIslandChain = 13, kIslandResult = 14,
                              kPullGather = 15, kPullReduceScatter = 16, kPullAllGather = 17,
                              kIslandGather = 18 };
enum class ErrorKind : uint32_t { kNone = 0, kTimeout = 1, kMismatch = 2 };
// Where a workspace lives. kP2P: device memory, peers map it through CUDA IPC and their stores
// cross the GPU-to-GPU path. kHost: pinned host memory shared by the ranks of one host (boxes
// without usable peer-to-peer): every load and store a kernel makes on it crosses that GPU's
// own PCIe link. The protocol and the kernels are the same on both.
enum class Transport : int { kP2P = 0, kHost = 1 };

// The names Python knows each id by (dtype names, error messages, error kinds; the algorithms'
// names are in their records, kAlgorithms below).
template <typename Id>
struct Named {
  Id id;
  const char* name;
};
constexpr Named<DType> kDTypeNames[] = {
    {DType::kFloat32, "float32"}, {DType::kFloat16, "float16"}, {DType::kBFloat16, "bfloat16"}};
constexpr Named<Stage> kStageNames[] = {
    {Stage::kOneShotGather, "one-shot gather"},     {Stage::kReduceScatter, "reduce-scatter"},
    {Stage::kAllGather, "all-gather"},              {Stage::kFusedGather, "fused gather"},
    {Stage::kFusedReduceScatter, "fused reduce-scatter"}, {Stage::kFusedAllGather, "fused all-gather"},
    {Stage::kLowLatencyGather, "low-latency gather"}, {Stage::kFusedRowStats, "fused row statistics"},
    {Stage::kHostGather, "host transport gather"}, {Stage::kFullGather, "full-payload gather"},
    {Stage::kFullReduceScatter, "full-payload reduce-scatter"}, {Stage::kFullAllGather, "full-payload all-gather"},
    {Stage::kIslandChain, "island chain"}, {Stage::kIslandResult, "island result"},
    {Stage::kPullGather, "pull gather"}, {Stage::kPullReduceScatter, "pull reduce-scatter"},
    {Stage::kPullAllGather, "pull all-gather"}, {Stage::kIslandGather, "island gather"}};
constexpr Named<ErrorKind> kErrorKindNames[] = {{ErrorKind::kTimeout, "timeout"}, {ErrorKind::kMismatch, "mismatch"}};
constexpr Named<Transport> kTransportNames[] = {{Transport::kP2P, "p2p"}, {Transport::kHost, "host"}};

// Lives in pinned, host-mapped memory: the host reads it with no CUDA call.
struct ErrorRecord {
  uint32_t kind;
  int32_t rank;
  int32_t peer;
  uint32_t stage;
  int32_t block;
  uint32_t epoch;
  uint32_t expected_signature;
  uint32_t observed_signature;
};

// Local-only state at the end of each rank's workspace (peers never touch it).
// The epoch (the last completed call's, 64-bit: invariant 3 of protocol.cuh) is kept once per block
// slot, all copies equal between calls: block b of a call reads epochs[b] and, when done, writes
// every slot i with i % gridDim.x == b. No block reads a slot another block of the same call
// writes, so advancing needs no atomics, no fence and no "last block" detection, whatever the grid
// size of the previous or next call.
struct Control {
  uint64_t epochs[kMaxFlagBlocks];
  uint32_t abort;        // set once any wait failed; every later call skips its work
  uint32_t error_claim;  // first failing thread wins the right to fill the ErrorRecord
  // The write-once host algorithms' state, one copy per block slot like the epochs, advanced by
  // their calls only (host_wire.cuh): what the previous call wrote, and the next call's buffer.
  uint32_t shared_state[kMaxFlagBlocks];
};

// The same records as arrays of 32-bit words (how the Triton kernels address them); the epochs
// are kEpochCopies 64-bit words at the start.
constexpr uint64_t kEpochCopies = kMaxFlagBlocks;
constexpr uint64_t kAbortWord = offsetof(Control, abort) / sizeof(uint32_t);
constexpr uint64_t kClaimWord = offsetof(Control, error_claim) / sizeof(uint32_t);
constexpr uint64_t kSharedStateWords = offsetof(Control, shared_state) / sizeof(uint32_t);
constexpr uint64_t kControlWords = sizeof(Control) / sizeof(uint32_t);
constexpr uint64_t kErrorRecordWords = sizeof(ErrorRecord) / sizeof(uint32_t);

// Byte offsets inside one rank's workspace allocation. Identical on every rank (checked at rendezvous).
//   [2 parities x W data slots][2 parities x W low-latency line slots][flags][control][row stats]
//   [host: shared buffers][full-payload headers and slots]
// The line slots hold the data-as-flag exchange of oneshot_ll.cuh: kLineBytes of line per
// kLinePayloadBytes of payload, for messages up to ll_capacity bytes (a fixed cap: the format
// doubles the traffic, so it only pays for small messages).
constexpr uint64_t kLowLatencyMaxBytes = 512 * 1024;
// Largest max_bytes a workspace takes: one stream's workspace (about 2 x W x max_bytes) stays a
// few GiB, and the layout arithmetic far from overflow (the Triton kernels' offsets are 64-bit
// anyway); larger messages are NCCL's ground.
constexpr uint64_t kMaxMessageBytes = 256ull << 20;
// Longest wait a kernel may be given (one day): its nanosecond deadline stays far from overflow.
constexpr uint64_t kMaxTimeoutSeconds = 24 * 3600;
// Bytes each rank writes into every peer's workspace at creation to prove that its stores
// arrive (drivers report peer access where the platform drops or misroutes P2P writes).
constexpr uint64_t kProbeBytes = 16;
// Local-only words the fused Triton one-shot uses to share per-chunk RMSNorm statistics among
// the programs of one row (fused/rmsnorm.py); zero when not in flight, like the lines.
constexpr uint64_t kRowStatsSlots = 1024;
// The host transport's write-once algorithms (host_wire.cuh) rotate through this many buffers of
// their own, each of kSharedAreas areas of max_bytes (what a rank sends; its reduced shard): a
// rank writes into buffer b of its own segment and re-poisons the buffer of its previous call, so
// a buffer is written again three calls after its last use.
constexpr uint64_t kSharedBuffers = 3;
constexpr uint64_t kSharedAreas = 2;
// What an unwritten word of those buffers holds: -0.0 in both 16-bit lanes (the bf16 / fp16
// sentinel) and, read as one 32-bit word, the fp32 sentinel. A kernel sends -0.0 (2-byte types)
// as +0.0 and the fp32 word 0x80008000 (a negative subnormal) as -0.0, so data never looks unwritten.
constexpr uint32_t kPoisonWord = 0x80008000u;
// The full-payload one-shot (oneshot_full.cuh) has slots of its own, like the lines: 2 parities
// x W senders x ll_capacity bytes (the same cap), after one header word per (parity, sender, block).
// The full-payload two-shot (twoshot_full.cuh) shares them, as 2W inboxes of half that per parity,
// for messages up to ll_capacity - kFullTwoShotMargin bytes (so every shard and the tail fit one).
constexpr uint64_t kFullTwoShotMargin = 16;
constexpr uint64_t kFullHeaderBytes = (2 * kMaxRanks * kMaxFlagBlocks * sizeof(uint64_t) + kAlign - 1) / kAlign * kAlign;
// Before the host transport's buffers: one header word (epoch << 32 | signature) per (buffer, block).
constexpr uint64_t kSharedHeaderBytes = (kSharedBuffers * kMaxFlagBlocks * sizeof(uint64_t) + kAlign - 1) / kAlign * kAlign;

// The FP8 wire of twoshot_fp8 (fp8_twoshot.cuh, pcie_allreduce/fp8_wire.py): blocks of
// kFp8Block elements, each kFp8Block e4m3 codes and one fp32 scale.
constexpr uint64_t kFp8Block = 128;
PCIE_AR_HOST_DEVICE constexpr uint64_t fp8_blocks(uint64_t numel) { return (numel + kFp8Block - 1) / kFp8Block; }
PCIE_AR_HOST_DEVICE constexpr uint64_t fp8_wire_bytes(uint64_t numel) { return fp8_blocks(numel) * (kFp8Block + 4); }
PCIE_AR_HOST_DEVICE constexpr uint64_t dtype_bytes(int dtype) { return dtype == static_cast<int>(DType::kFloat32) ? 4 : 2; }

struct Layout {
  uint64_t slot_bytes;     // one sender's data slot: max_bytes rounded up
  uint64_t parity_bytes;   // world * slot_bytes
  uint64_t ll_capacity;    // largest payload the line slots carry
  uint64_t ll_slot_bytes;  // one sender's line slot: ll_capacity bytes of payload as lines
  uint64_t ll_offset;      // after 2 parities of data; each parity is world * ll_slot_bytes
  uint64_t flags_offset;   // after 2 parities of lines
  uint64_t control_offset;
  uint64_t stats_offset;
  uint64_t shared_offset;  // host transport: headers, then kSharedBuffers x kSharedAreas areas of slot_bytes
  uint64_t shared_bytes;   // 0 for p2p
  uint64_t full_offset;    // the full-payload one-shot's headers, then 2 parities x W slots of ll_capacity
  uint64_t full_bytes;
  // p2p: the symmetric input area, slot_bytes that a caller fills in place of a copy (the tensor
  // Communicator.symmetric_input returns) and twoshot_symm reads on every rank (pull.cuh, S1-S2);
  // 0 on the host transport, whose workspace lives in host memory.
  uint64_t input_offset;
  uint64_t input_bytes;
  uint64_t total_bytes;

  PCIE_AR_HOST_DEVICE static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

  static Layout make(uint64_t max_bytes, int world, Transport transport = Transport::kP2P) {
    Layout l{};
    l.slot_bytes = round_up(max_bytes > 0 ? max_bytes : 1, kAlign);
    l.parity_bytes = l.slot_bytes * static_cast<uint64_t>(world);
    l.ll_capacity = l.slot_bytes < kLowLatencyMaxBytes ? l.slot_bytes : kLowLatencyMaxBytes;
    l.ll_slot_bytes = l.ll_capacity / kLinePayloadBytes * kLineBytes;  // ll_capacity is a multiple of kAlign
    l.ll_offset = 2 * l.parity_bytes;
    l.flags_offset = l.ll_offset + 2 * l.ll_slot_bytes * static_cast<uint64_t>(world);
    l.control_offset = l.flags_offset + round_up(sizeof(uint64_t) * kFlagRows * kMaxRanks * kMaxFlagBlocks, kAlign);
    l.stats_offset = l.control_offset + round_up(sizeof(Control), kAlign);
    l.shared_offset = l.stats_offset + round_up(sizeof(uint64_t) * kRowStatsSlots, kAlign);
    l.shared_bytes = transport == Transport::kHost ? kSharedHeaderBytes + kSharedBuffers * kSharedAreas * l.slot_bytes : 0;
    l.full_offset = l.shared_offset + l.shared_bytes;
    l.full_bytes = kFullHeaderBytes + 2 * static_cast<uint64_t>(world) * l.ll_capacity;
    l.input_offset = round_up(l.full_offset + l.full_bytes, kAlign);
    l.input_bytes = transport == Transport::kP2P ? l.slot_bytes : 0;
    l.total_bytes = l.input_offset + l.input_bytes;
    return l;
  }
};

// The algorithms: one record each, in id order, with what C++ checks before it launches one
// (Workspace::all_reduce). The binding exports the records (ALGO_RECORDS); Python's records
// (pcie_allreduce/plan/algorithms.py, REGISTRY) repeat these fields beside their own, and the
// import of that module fails where any field differs, so the two sides cannot drift.
constexpr uint32_t kAlgoHostOnly = 1u << 0;        // its buffers exist only in shared host memory (Transport::kHost)
constexpr uint32_t kAlgoCapped = 1u << 1;          // messages up to the low-latency capacity less capacity_margin
constexpr uint32_t kAlgoIsland = 1u << 2;          // needs the workspace's islands (island_ranks)
constexpr uint32_t kAlgoSymmetricInput = 1u << 3;  // reads every rank's input in place: the symmetric input area
constexpr uint32_t kAlgoFp8Wire = 1u << 4;         // the lossy FP8 wire: its coded message must fit a slot
struct AlgoRecord {
  Algo id;
  const char* name;
  uint32_t traits = 0;           // kAlgo* bits above
  uint64_t capacity_margin = 0;  // with kAlgoCapped: bytes below the low-latency capacity it keeps free
  constexpr bool has(uint32_t trait) const { return (traits & trait) != 0; }
};
constexpr AlgoRecord kAlgorithms[] = {
    {Algo::kOneShot, "oneshot"},
    {Algo::kStaged, "staged"},
    {Algo::kTwoShot, "twoshot"},
    {Algo::kOneShotLL, "oneshot_ll", kAlgoCapped},
    {Algo::kHostOneShot, "host_oneshot", kAlgoHostOnly},
    {Algo::kHostTwoShot, "host_twoshot", kAlgoHostOnly},
    {Algo::kOneShotFull, "oneshot_full", kAlgoCapped},
    {Algo::kTwoShotFull, "twoshot_full", kAlgoCapped, kFullTwoShotMargin},
    {Algo::kIslandTwoShot, "island_twoshot", kAlgoIsland},
    {Algo::kOneShotPull, "oneshot_pull"},
    {Algo::kTwoShotPull, "twoshot_pull"},
    {Algo::kTwoShotStaged, "twoshot_staged"},
    {Algo::kIslandOneShot, "island_oneshot", kAlgoIsland},
    {Algo::kTwoShotSymm, "twoshot_symm", kAlgoSymmetricInput},
    {Algo::kTwoShotFp8, "twoshot_fp8", kAlgoFp8Wire},
};
constexpr int kAlgoCount = static_cast<int>(sizeof(kAlgorithms) / sizeof(kAlgorithms[0]));

constexpr bool algorithms_in_id_order() {
  for (int i = 0; i < kAlgoCount; ++i) {
    if (static_cast<int>(kAlgorithms[i].id) != i) return false;
  }
  return true;
}
static_assert(algorithms_in_id_order(), "kAlgorithms: one record per Algo id, in id order (record i has id i)");

// The record of algorithm id `algo`, or nullptr for an id no kernel has.
constexpr const AlgoRecord* algo_record(int algo) {
  return algo >= 0 && algo < kAlgoCount ? &kAlgorithms[algo] : nullptr;
}

}  // namespace pcie_ar
