// The write-once exchange of the host transport, shared by host_oneshot.cuh and host_twoshot.cuh:
// every rank writes what it sends ONCE into its own shared host segment, and every peer reads it
// there, each access over its own GPU's PCIe link. No flag round trip: the data is its own flag.
// (The push kernels also run on the host transport, but they write every message W-1 times over
// the same link and spin on flags in host memory.)
//
// Invariants (the shared protocol's 3-6 of protocol.cuh hold as well: epochs, bounded waits,
// NaN on failure, rank-order fp32 sums):
//  H1. Data as flag. A rank's shared buffers hold kPoisonWord wherever no data of the current
//      use landed. On the wire -0.0 of bf16/fp16 travels as +0.0 and the fp32 word kPoisonWord
//      (a negative subnormal) as -0.0, so a written word is never poison, and a reader that
//      sees no poison lane in a unit has that unit of this call (lanes are written atomically).
//      Every rank uses the values as they travel (its own too), so results stay identical.
//  H2. Rotation. Call s of these algorithms uses buffer s % 3 (Control::shared_state, advanced
//      by these calls only) and, once it knows every peer started call s, re-poisons what its
//      previous call wrote in buffer (s - 1) % 3, then fences at system scope. A peer that
//      reached call s finished call s - 1, so nobody reads that buffer any more; it is written
//      again at call s + 2.
//  H3. Nothing stale passes. In call s - 1 every reader waited for every peer's header of call
//      s - 1 (H4), written by a kernel that started after the peer's call s - 2 (which
//      re-poisoned buffer s % 3 and fenced) had completed; so in call s the reader finds poison
//      or call s's data there, never call s - 3's.
//  H4. Headers vouch for the call. With its data, block k of each rank writes the call's sealed
//      word (invariant 3 of protocol.cuh) for (buffer, block) in its own segment; threads 0..W-1
//      of the reader's block k wait for exactly that word from each peer, in parallel with the
//      data. A peer that issued another call (size, dtype, algorithm, blocks) never writes it: its
//      call notice names it as a mismatch while the reader waits, and nothing is reduced.
//  H5. Blocks agree on what they cover: messages are cut in 16-byte granules (partition.cuh),
//      whatever unit a rank moves, so block k of every rank covers the same bytes, and block k
//      polls only what block k of a peer wrote (invariant 8 of protocol.cuh).
#pragma once

#include <cstdint>

#include "partition.cuh"
#include "protocol.cuh"
#include "reduce.cuh"

namespace pcie_ar {

// ---- the wire format (H1) ----------------------------------------------------------------------

template <typename T, typename Unit>
__device__ __forceinline__ Unit to_wire(Unit v) {
  if constexpr (sizeof(T) == 2) {
    uint16_t* lanes = reinterpret_cast<uint16_t*>(&v);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(Unit) / 2); ++k) {
      if (lanes[k] == 0x8000u) lanes[k] = 0;
    }
  } else {
    uint32_t* words = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(Unit) / 4); ++k) {
      if (words[k] == kPoisonWord) words[k] = 0x80000000u;
    }
  }
  return v;
}

template <typename T, typename Unit>
__device__ __forceinline__ bool has_arrived(Unit v) {
  bool arrived = true;
  if constexpr (sizeof(T) == 2) {
    const uint16_t* lanes = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(Unit) / 2); ++k) arrived &= lanes[k] != 0x8000u;
  } else {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(Unit) / 4); ++k) arrived &= words[k] != kPoisonWord;
  }
  return arrived;
}

// What an unwritten unit holds: -0.0 in every 16-bit lane (kPoisonWord as 32-bit words).
template <typename Unit>
__device__ __forceinline__ Unit poison_unit() {
  Unit u;
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(Unit) / 2); ++k) reinterpret_cast<uint16_t*>(&u)[k] = 0x8000u;
  return u;
}

// A load that goes to memory every time (a poll of another GPU's writes into host memory).
template <typename Unit>
__device__ __forceinline__ Unit load_wire(const Unit* p) {
  Unit v;
  if constexpr (sizeof(Unit) == 16) {
    uint4 x;
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "l"(p) : "memory");
    v = *reinterpret_cast<Unit*>(&x);
  } else if constexpr (sizeof(Unit) == 4) {
    uint32_t x;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(x) : "l"(p) : "memory");
    v = *reinterpret_cast<Unit*>(&x);
  } else {
    uint16_t x;
    asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(x) : "l"(p) : "memory");
    v = *reinterpret_cast<Unit*>(&x);
  }
  return v;
}

// Poll one unit until it arrived (bounded); false on timeout (recorded against `peer` in
// `stage`) or abort.
template <typename T, typename Unit>
__device__ __forceinline__ bool await_unit(const KernelArgs& a, const Unit* p, Unit& v, int peer, Epoch epoch,
                                           Stage stage, uint32_t& spins, uint64_t& started) {
  while (!has_arrived<T, Unit>(v)) {
    const SpinVerdict verdict = spin_verdict(a, ++spins, started, epoch, stage);
    if (verdict == SpinVerdict::kTimedOut) record_error(a, ErrorKind::kTimeout, peer, stage, epoch, 0);
    if (verdict != SpinVerdict::kSpin) return false;
    v = load_wire(p);
  }
  return true;
}

// ---- where things are --------------------------------------------------------------------------

enum class SharedArea : uint32_t { kInput = 0, kResult = 1 };  // what a rank sends / its reduced shard

__device__ __forceinline__ uint64_t* shared_header(const KernelArgs& a, int owner, uint32_t buffer, int block) {
  return reinterpret_cast<uint64_t*>(a.bases[owner] + a.layout.shared_offset) + buffer * kMaxFlagBlocks + block;
}

template <typename Unit>
__device__ __forceinline__ Unit* shared_area(const KernelArgs& a, int owner, uint32_t buffer, SharedArea area) {
  return reinterpret_cast<Unit*>(a.bases[owner] + a.layout.shared_offset + kSharedHeaderBytes +
                                 (buffer * kSharedAreas + static_cast<uint32_t>(area)) * a.layout.slot_bytes);
}

// Control::shared_state: bit 31 set when the previous call wrote a result shard (two-shot),
// bits 2..30 the bytes of the previous call, bits 0..1 the buffer of the next call.
constexpr uint32_t kStateWroteResult = 1u << 31;

__device__ __forceinline__ uint32_t shared_state_word(uint64_t nbytes, uint32_t next_buffer, bool wrote_result) {
  return (wrote_result ? kStateWroteResult : 0u) | static_cast<uint32_t>(nbytes << 2) | next_buffer;
}

// ---- the steps -------------------------------------------------------------------------------

// This block's header of this call (H4): thread 0, before its data.
__device__ __forceinline__ void publish_header(const KernelArgs& a, uint32_t buffer, Epoch epoch) {
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile uint64_t*>(shared_header(a, a.rank, buffer, blockIdx.x)) = flag_word(epoch, a.signature);
  }
}

// Write our units [r) of the message once into our input area: before waiting for anything, so
// the data is on its way while the headers are (H4).
template <typename T, typename Unit>
__device__ __forceinline__ void publish_input(const KernelArgs& a, uint32_t buffer, const Unit* in, Range r) {
  Unit* mine = shared_area<Unit>(a, a.rank, buffer, SharedArea::kInput);
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) mine[i] = to_wire<T, Unit>(load_unit(in + i));
}

// Bounded wait (one thread) for the header word of `peer` at `header` to hold this call's sealed
// word (H4): false on mismatch (a peer's notice), timeout or abort, recorded in `stage`.
// kAcquire: the write-once kernels read data areas whose re-poisoning the header vouches for
// (H3), so they load it with acquire; the full-payload push kernels use it for mismatches only
// (their slots are re-poisoned by the reader itself) and load it relaxed, off the data's path.
template <bool kAcquire>
static __device__ __noinline__ bool wait_header_word(const KernelArgs& a, const uint64_t* header, int peer,
                                                     Epoch epoch, Stage stage) {
  const uint64_t want = flag_word(epoch, a.signature);
  uint64_t started = 0;
  for (uint32_t spins = 0;; ++spins) {
    if ((kAcquire ? load_acquire_sys(header) : load_relaxed_sys(header)) == want) return true;
    const SpinVerdict verdict = spin_verdict(a, spins, started, epoch, stage);
    if (verdict == SpinVerdict::kTimedOut) record_error(a, ErrorKind::kTimeout, peer, stage, epoch, 0);
    if (verdict != SpinVerdict::kSpin) return false;
  }
}

// Every rank's unit i into `got`, in rank order: ours from our input as it travels (H1), each
// peer's polled at `where(p) + i` until it arrived. Every spin re-issues the loads of ALL peers
// still pending before testing any (as oneshot_ll's gather_lines does): waiting for the peers
// one by one would cost one more round trip per peer whose first load came too early, W - 2 at
// worst, where a round trip is an L2 access on one GPU and a PCIe read on the host transport. `where`
// computes a peer's area from the kernel's parameters each time it is asked: an array of W
// pointers held across the loop would cost 2W registers, and the 16-byte gather of 8 ranks
// already needs 32 for the units in flight (the kernels are capped at 128 by their 512 threads).
// `world` is a.world, or the same as a constant in a kernel instanced per world size (the loops
// then unroll to exactly `world` copies instead of kCap predicated ones); kCap, the size of `got`,
// is the kernel instance's rank capacity (reduce.cuh's reduce_unit), at least `world`.
// False (this thread) on timeout or abort.
template <typename T, typename Unit, int kCap, typename Where>
__device__ __forceinline__ bool gather_unit(const KernelArgs& a, int world, Where where, const Unit* in, uint64_t i,
                                            Epoch epoch, Stage stage, uint32_t& spins, uint64_t& started,
                                            Pack<T, Unit> (&got)[kCap]) {
  uint32_t pending = ((1u << world) - 1u) & ~(1u << a.rank);
#pragma unroll
  for (int p = 0; p < kCap; ++p) {
    if (p < world) got[p].unit = p == a.rank ? to_wire<T, Unit>(load_unit(in + i)) : load_wire(where(p) + i);
  }
  for (;;) {
#pragma unroll
    for (int p = 0; p < kCap; ++p) {
      if (p < world && (pending & (1u << p)) && has_arrived<T, Unit>(got[p].unit)) pending &= ~(1u << p);
    }
    if (pending == 0u) return true;
    const SpinVerdict verdict = spin_verdict(a, ++spins, started, epoch, stage);
    if (verdict == SpinVerdict::kTimedOut) record_error(a, ErrorKind::kTimeout, __ffs(pending) - 1, stage, epoch, 0);
    if (verdict != SpinVerdict::kSpin) return false;
#pragma unroll
    for (int p = 0; p < kCap; ++p) {
      if (p < world && (pending & (1u << p))) got[p].unit = load_wire(where(p) + i);
    }
  }
}

// Threads 0..W-1 each wait for one peer's header; the others go on (callers join with
// __syncthreads_and before anything depends on every header).
__device__ __forceinline__ bool wait_headers(const KernelArgs& a, uint32_t buffer, Epoch epoch) {
  const int peer = static_cast<int>(threadIdx.x);
  return peer >= a.world || peer == a.rank ||
         wait_header_word<true>(a, shared_header(a, peer, buffer, blockIdx.x), peer, epoch, Stage::kHostGather);
}

__device__ __forceinline__ void poison_granules(uint4* area, Range granules) {
  const Range r = split(granules.end - granules.begin, gridDim.x, blockIdx.x);
  const uint4 poison = make_uint4(kPoisonWord, kPoisonWord, kPoisonWord, kPoisonWord);
  for (uint64_t i = granules.begin + r.begin + threadIdx.x; i < granules.begin + r.end; i += blockDim.x) area[i] = poison;
}

// Re-poison this block's share of what the previous call wrote in `buffer` (H2): its input
// extent, and its own result shard if it was a two-shot; then make the poison visible at system
// scope before this kernel ends. Only once every peer's header of this call arrived.
__device__ __forceinline__ void repoison_previous(const KernelArgs& a, uint32_t buffer, uint32_t state) {
  const uint64_t nbytes = (state & ~kStateWroteResult) >> 2;
  poison_granules(shared_area<uint4>(a, a.rank, buffer, SharedArea::kInput), {0, (nbytes + kGranule - 1) / kGranule});
  if (state & kStateWroteResult) {
    Range shard = shard_granules(nbytes, a.world, a.rank);
    if (a.rank == a.world - 1) shard.end = (nbytes + kGranule - 1) / kGranule;  // and the tail
    poison_granules(shared_area<uint4>(a, a.rank, buffer, SharedArea::kResult), shard);
  }
  __threadfence_system();
}

// Read this block's copy of the state, then (after the call) advance every copy i with
// i % gridDim.x == blockIdx.x, as end_call does with the epochs.
__device__ __forceinline__ void advance_shared_state(Control* ctl, uint32_t next) {
  __syncthreads();  // every thread has read shared_state[blockIdx.x]
  for (uint32_t i = blockIdx.x + threadIdx.x * gridDim.x; i < kMaxFlagBlocks; i += blockDim.x * gridDim.x) {
    ctl->shared_state[i] = next;
  }
}

// One call of a write-once algorithm, around its exchange: this block's buffer from its copy of
// the state (H2); `exchange(buffer, epoch)` returns this thread's success; a block that fully
// succeeded re-poisons what its previous call wrote, one that did not leaves NaN (invariant 5 of
// protocol.cuh); the state (noting whether this call wrote a result shard) and the epoch advance
// either way.
template <typename T, typename Exchange>
__device__ __forceinline__ void write_once_call(const KernelArgs& a, bool writes_result, Exchange exchange) {
  bool aborted;
  const Epoch epoch = begin_call(a, &aborted);
  Control* ctl = control_of(a);
  const uint32_t state = __ldcg(&ctl->shared_state[blockIdx.x]);
  const uint32_t buffer = state & 3u;
  const bool done = __syncthreads_and(!aborted && exchange(buffer, epoch)) != 0;  // the block's verdict (begin_call)
  if (done) {
    repoison_previous(a, (buffer + kSharedBuffers - 1) % kSharedBuffers, state);
  } else {
    fill_output_with_nan<T>(a);
  }
  advance_shared_state(ctl, shared_state_word(a.nbytes, (buffer + 1) % kSharedBuffers, writes_result));
  end_call(a, epoch);
}

}  // namespace pcie_ar
