// The write-once one-shot of the host transport ("host_oneshot"): every rank writes its message
// ONCE into a buffer of its own shared host segment and reads every peer's buffer there, each
// access over its own GPU's PCIe link (egress: the message once; ingress: W-1 messages). On the
// host transport the push kernels write every message W-1 times over the same link and spin on
// flags in host memory; this kernel needs no flag round trip: the data is its own flag.
//
// Invariants (the shared protocol's 3-6 of protocol.cuh hold as well: epochs, bounded waits,
// NaN on failure, rank-order fp32 sums):
//  H1. Data as flag. A rank's shared buffers hold kPoisonWord wherever no data of the current
//      use landed. On the wire -0.0 of bf16/fp16 travels as +0.0 and the fp32 word kPoisonWord
//      (a negative subnormal) as -0.0, so a written word is never poison, and a reader that
//      sees no poison lane in a unit has that unit of this call (lanes are written atomically).
//      Every rank sums the values as they travel (its own too), so results stay identical.
//  H2. Rotation. Call s of this algorithm uses buffer s % 3 (Control::shared_state, advanced by
//      these calls only) and, once it knows every peer started call s, re-poisons the extent its
//      previous call wrote in buffer (s - 1) % 3, then fences at system scope. A peer that
//      reached call s finished call s - 1, so nobody reads that buffer any more; it is written
//      again at call s + 2.
//  H3. Nothing stale passes. A reader at call s reads a peer's buffer s % 3 after it saw that
//      peer's data of call s - 1, written by a kernel that started after the peer's call s - 2
//      (which re-poisoned this buffer and fenced) had completed: the buffer holds poison or
//      call s's data, never call s - 3's.
//  H4. Headers catch mismatches. With its data, block k of each rank writes a header word
//      (epoch << 32 | signature) for (buffer, block) in its own segment; threads 0..W-1 of the
//      reader's block k wait for each peer's header of this epoch, in parallel with the data.
//      The same epoch with another signature (size, dtype, algorithm, blocks) is a mismatch,
//      recorded and never reduced; the header is also what proves a peer started call s (H2).
//  H5. Blocks agree on what they cover: the message is cut in 16-byte granules (partition.cuh),
//      whatever unit a rank moves, so block k of every rank covers the same bytes.
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

// ---- where things are --------------------------------------------------------------------------

__device__ __forceinline__ uint64_t* shared_header(const KernelArgs& a, int owner, uint32_t buffer, int block) {
  return reinterpret_cast<uint64_t*>(a.bases[owner] + a.layout.shared_offset) + buffer * kMaxFlagBlocks + block;
}

template <typename Unit>
__device__ __forceinline__ Unit* shared_buffer(const KernelArgs& a, int owner, uint32_t buffer) {
  return reinterpret_cast<Unit*>(a.bases[owner] + a.layout.shared_offset + kSharedHeaderBytes +
                                 buffer * a.layout.slot_bytes);
}

// Control::shared_state: (bytes of the previous call << 2) | buffer of the next call.
__device__ __forceinline__ uint32_t shared_state_word(uint64_t nbytes, uint32_t next_buffer) {
  return static_cast<uint32_t>(nbytes << 2) | next_buffer;
}

// ---- the steps -------------------------------------------------------------------------------

// Bounded wait (one thread) for `peer`'s header of this call; false on mismatch, timeout or abort.
static __device__ __noinline__ bool wait_header(const KernelArgs& a, int peer, uint32_t buffer, uint32_t epoch) {
  const uint64_t* header = shared_header(a, peer, buffer, blockIdx.x);
  uint64_t started = 0;
  for (uint32_t spins = 0;; ++spins) {
    const uint64_t word = load_acquire_sys(header);
    if (static_cast<uint32_t>(word >> 32) == epoch) {
      const uint32_t observed = static_cast<uint32_t>(word);
      if (observed == a.signature) return true;
      record_error(a, ErrorKind::kMismatch, peer, Stage::kHostGather, epoch, observed);
      return false;
    }
    const SpinVerdict verdict = spin_verdict(a, spins, started);
    if (verdict == SpinVerdict::kTimedOut) record_error(a, ErrorKind::kTimeout, peer, Stage::kHostGather, epoch, 0);
    if (verdict != SpinVerdict::kSpin) return false;
  }
}

// Write our units [r) once into our buffer; sum every rank's, polling each peer's buffer until
// its unit arrived (H1). False (this thread) on timeout or abort.
template <typename T, typename Unit>
__device__ __forceinline__ bool exchange_and_reduce(const KernelArgs& a, uint32_t buffer, uint32_t epoch,
                                                    const Unit* in, Unit* out, Range r) {
  Unit* mine = shared_buffer<Unit>(a, a.rank, buffer);
  const Unit* theirs[kMaxRanks];
#pragma unroll
  for (int p = 0; p < kMaxRanks; ++p) theirs[p] = p < a.world ? shared_buffer<Unit>(a, p, buffer) : nullptr;
  uint64_t started = 0;
  uint32_t spins = 0;
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const Unit v = to_wire<T, Unit>(load_unit(in + i));
    mine[i] = v;
    Pack<T, Unit> got[kMaxRanks];
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {  // every peer's first load in flight at once
      if (p < a.world) got[p].unit = p == a.rank ? v : load_wire(theirs[p] + i);
    }
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p >= a.world || p == a.rank) continue;
      while (!has_arrived<T, Unit>(got[p].unit)) {
        const SpinVerdict verdict = spin_verdict(a, ++spins, started);
        if (verdict == SpinVerdict::kTimedOut) record_error(a, ErrorKind::kTimeout, p, Stage::kHostGather, epoch, 0);
        if (verdict != SpinVerdict::kSpin) return false;
        got[p].unit = load_wire(theirs[p] + i);
      }
    }
    out[i] = sum_in_rank_order<T, Unit>(got, a.world);
  }
  return true;
}

// Re-poison this block's share of the extent the previous call wrote in `buffer` (H2), then make
// the poison visible at system scope before this kernel ends.
__device__ __forceinline__ void repoison(const KernelArgs& a, uint32_t buffer, uint64_t previous_nbytes) {
  uint4* buf = shared_buffer<uint4>(a, a.rank, buffer);
  const Range r = split((previous_nbytes + kGranule - 1) / kGranule, gridDim.x, blockIdx.x);
  const uint4 poison = make_uint4(kPoisonWord, kPoisonWord, kPoisonWord, kPoisonWord);
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) buf[i] = poison;
  __threadfence_system();
}

template <typename T, typename Unit>
__global__ void __launch_bounds__(kThreadsPerBlock) host_oneshot_kernel(const __grid_constant__ KernelArgs a) {
  bool aborted;
  const uint32_t epoch = begin_call(a, &aborted);
  Control* ctl = control_of(a);
  const uint32_t state = __ldcg(&ctl->shared_state[blockIdx.x]);
  const uint32_t buffer = state & 3u;
  const uint64_t previous_nbytes = state >> 2;
  bool done = false;
  if (!aborted) {
    if (threadIdx.x == 0) {  // H4: this block of this call is in `buffer`
      *reinterpret_cast<volatile uint64_t*>(shared_header(a, a.rank, buffer, blockIdx.x)) = flag_word(epoch, a.signature);
    }
    bool ok = true;
    const int peer = static_cast<int>(threadIdx.x);
    if (peer < a.world && peer != a.rank) ok = wait_header(a, peer, buffer, epoch);
    const Range body = to_units<Unit>(split(a.nbytes / kGranule, gridDim.x, blockIdx.x));
    const Range tail = owns_tail() ? tail_elements<T>(a.nbytes) : Range{0, 0};
    ok = ok && exchange_and_reduce<T, Unit>(a, buffer, epoch, static_cast<const Unit*>(a.input),
                                            static_cast<Unit*>(a.output), body);
    ok = ok && exchange_and_reduce<T, T>(a, buffer, epoch, static_cast<const T*>(a.input),
                                         static_cast<T*>(a.output), tail);
    done = __syncthreads_and(ok) != 0;
    // Every peer's header of this call arrived: they all finished the previous call (H2).
    if (done) repoison(a, (buffer + kSharedBuffers - 1) % kSharedBuffers, previous_nbytes);
  }
  if (!done) fill_output_with_nan<T>(a);
  __syncthreads();  // every thread has read shared_state[blockIdx.x]
  const uint32_t next = shared_state_word(a.nbytes, (buffer + 1) % kSharedBuffers);
  for (uint32_t i = blockIdx.x + threadIdx.x * gridDim.x; i < kMaxFlagBlocks; i += blockDim.x * gridDim.x) {
    ctl->shared_state[i] = next;
  }
  end_call(a, epoch);
}

}  // namespace pcie_ar
