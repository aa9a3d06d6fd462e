// One-shot all-reduce with data-as-flag lines ("LL", after NCCL's low-latency protocol).
//
// The message is cut into 8-byte payload units; unit k travels to every peer as line k (16 bytes,
// ll_line.cuh) of our line slot in that peer's workspace. A thread pushes its units, then polls
// the same units' lines from every peer in its own workspace, reduces each unit as soon as all W
// contributions are there, and clears the lines it consumed. No __syncthreads, no fence, no flag
// round trip: the cost of a call is one posted write and one local poll per line. Lines are twice
// the payload, so this is for small messages (Layout::ll_capacity caps it).
//
// Invariants (in addition to protocol.cuh 1 and 3-6; 2 is replaced by L1-L2):
//  L1. A line is "arrived" when both its flag words equal line_flag(epoch, signature). The data
//      and its flag travel in one naturally aligned 8-byte half, so an arrived line is never torn.
//  L2. Lines are zero whenever they are not in flight: the receiving thread clears every line it
//      reduced, inside the same kernel. A peer writes this parity again only in call e + 2, after
//      it saw our lines of call e + 1, which we send after this kernel has finished, so a clear
//      can never erase a newer line. Zero is never a flag, so nothing stale is taken for data.
//  L3. A line whose flag word is non-zero and not ours was written by a peer in this epoch for a
//      different call (another size, dtype or algorithm): recorded as a mismatch, never reduced.
//  L4. The wire format does not depend on alignment: line k always carries message bytes
//      [8k, 8k + 8), zero-padded past the end, so a rank whose buffers are not 8-byte aligned
//      (element loads) interoperates with one that moves 8-byte words.
//  L5. Every unit is reduced by the thread that pushed it, from the input it reloads before
//      writing that unit's output: in place (output == input) is safe.
#pragma once

#include "ll_line.cuh"
#include "partition.cuh"
#include "protocol.cuh"
#include "reduce.cuh"

namespace pcie_ar {

// Line 0 of `sender`'s line slot in `owner`'s workspace for this call's parity.
__device__ __forceinline__ uint4* line_slot(const KernelArgs& a, int world, int owner, int sender, Epoch epoch) {
  const uint64_t parity = static_cast<uint64_t>(parity_of(epoch)) * a.layout.ll_slot_bytes * static_cast<uint64_t>(world);
  return reinterpret_cast<uint4*>(a.bases[owner] + a.layout.ll_offset + parity +
                                  static_cast<uint64_t>(sender) * a.layout.ll_slot_bytes);
}

// Message bytes [8 unit, 8 unit + 8) as a payload word, zero past the end of the message.
template <typename T, bool kAligned>
__device__ __forceinline__ uint2 load_payload(const void* base, uint64_t unit, uint64_t nbytes) {
  const uint64_t first = unit * kLinePayloadBytes;
  if (kAligned && first + kLinePayloadBytes <= nbytes) {
    return *reinterpret_cast<const uint2*>(static_cast<const char*>(base) + first);
  }
  Pack<T, uint2> p;
  p.unit = make_uint2(0u, 0u);
  const T* src = static_cast<const T*>(base);
  const uint64_t count = nbytes / sizeof(T), e0 = first / sizeof(T);
#pragma unroll
  for (int j = 0; j < Pack<T, uint2>::kElems; ++j) {
    if (e0 + j < count) p.elems[j] = src[e0 + j];
  }
  return p.unit;
}

template <typename T, bool kAligned>
__device__ __forceinline__ void store_payload(void* base, uint64_t unit, uint64_t nbytes, uint2 value) {
  const uint64_t first = unit * kLinePayloadBytes;
  if (kAligned && first + kLinePayloadBytes <= nbytes) {
    *reinterpret_cast<uint2*>(static_cast<char*>(base) + first) = value;
    return;
  }
  Pack<T, uint2> p;
  p.unit = value;
  T* dst = static_cast<T*>(base);
  const uint64_t count = nbytes / sizeof(T), e0 = first / sizeof(T);
#pragma unroll
  for (int j = 0; j < Pack<T, uint2>::kElems; ++j) {
    if (e0 + j < count) dst[e0 + j] = p.elems[j];
  }
}

// Bounded wait until line `i` of every peer has arrived in our workspace; their payloads go to
// got[peer]. False (error recorded, or another thread's) on mismatch, timeout or abort.
template <int kWorld>
__device__ __forceinline__ bool gather_lines(const KernelArgs& a, const uint4* lines0, uint64_t stride, uint64_t i,
                                             uint32_t flag, Epoch epoch, uint2 (&got)[kRankLoop<kWorld>]) {
  constexpr int kLoop = kRankLoop<kWorld>;
  uint32_t pending = ((1u << world_of<kWorld>(a)) - 1u) & ~(1u << a.rank);
  uint64_t started = 0;
  for (uint32_t spins = 0;; ++spins) {
    // Issue every pending peer's load before testing any: tested one by one, each test waits for
    // its load, so a spin cost W - 1 dependent round trips instead of one.
    uint4 v[kLoop];
#pragma unroll
    for (int r = 0; r < kLoop; ++r) {
      v[r] = (pending & (1u << r)) ? load_line(lines0 + static_cast<uint64_t>(r) * stride + i) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int r = 0; r < kLoop; ++r) {
      if (pending & (1u << r)) {
        if (v[r].y == flag && v[r].w == flag) {
          got[r] = make_uint2(v[r].x, v[r].z);
          pending &= ~(1u << r);
        } else if ((v[r].y != 0u && v[r].y != flag) || (v[r].w != 0u && v[r].w != flag)) {
          const uint32_t seen = (v[r].y != 0u && v[r].y != flag) ? v[r].y : v[r].w;
          record_error(a, ErrorKind::kMismatch, r, Stage::kLowLatencyGather, epoch, line_signature(seen, low_epoch(epoch)));
          return false;
        }
      }
    }
    if (pending == 0u) return true;
    const SpinVerdict verdict = spin_verdict(a, spins, started, epoch, Stage::kLowLatencyGather);
    if (verdict == SpinVerdict::kTimedOut) {
      record_error(a, ErrorKind::kTimeout, __ffs(pending) - 1, Stage::kLowLatencyGather, epoch, 0);
    }
    if (verdict != SpinVerdict::kSpin) return false;
  }
}

// kWorld: the world size as a constant (== a.world; the launch picks the instance), so every loop
// over peers is unrolled to exactly W - 1 copies instead of kMaxRanks predicated ones: each thread
// runs its call once, so the instructions it issues are its latency. kAnyWorld (reduce.cuh): the
// instance for worlds above kSmallWorld. The bound of one block per SM leaves ptxas room to keep
// every peer's line address in its own register, so the W - 1 poll loads issue back to back
// (without it the W = 4 instance reuses one register for two peers and its fourth load trails).
template <typename T, bool kAligned, int kWorld>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) oneshot_ll_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kAtEnd>(a, [&](Epoch epoch, bool aborted) {
    const void* input = a.input;
    const uint32_t flag = line_flag(low_epoch(epoch), a.signature);
    const uint64_t units = (a.nbytes + kLinePayloadBytes - 1) / kLinePayloadBytes;
    // A thread that saw the abort flag (begin_call) moves nothing and fails its block.
    const Range mine = aborted ? Range{0, 0} : split(units, gridDim.x, blockIdx.x);

    constexpr int kLoop = kRankLoop<kWorld>;
    const int world = world_of<kWorld>(a);
    uint4* lines0 = line_slot(a, world, a.rank, 0, epoch);
    uint4* peer_lines[kLoop];
#pragma unroll
    for (int s = 1; s < kLoop; ++s) {
      if (s < world) peer_lines[s] = line_slot(a, world, (a.rank + s) % world, a.rank, epoch);
    }
    for (uint64_t i = mine.begin + threadIdx.x; i < mine.end; i += blockDim.x) {
      const uint2 payload = load_payload<T, kAligned>(input, i, a.nbytes);
#pragma unroll
      for (int s = 1; s < kLoop; ++s) {
        if (s < world) store_line(peer_lines[s] + i, payload, flag);
      }
    }

    const uint64_t stride = a.layout.ll_slot_bytes / kLineBytes;
    for (uint64_t i = mine.begin + threadIdx.x; i < mine.end; i += blockDim.x) {
      uint2 got[kLoop];
      if (!gather_lines<kWorld>(a, lines0, stride, i, flag, epoch, got)) return false;
      const uint2 own = load_payload<T, kAligned>(input, i, a.nbytes);
      Pack<T, uint2> in[kLoop];
#pragma unroll
      for (int r = 0; r < kLoop; ++r) {
        if (r < world) in[r].unit = (r == a.rank) ? own : got[r];  // a select per r: registers only
      }
      store_payload<T, kAligned>(a.output, i, a.nbytes, sum_in_rank_order(in, world));
#pragma unroll
      for (int r = 0; r < kLoop; ++r) {
        if (r < world && r != a.rank) clear_line(lines0 + static_cast<uint64_t>(r) * stride + i);
      }
    }
    return !aborted;
  });
}

}  // namespace pcie_ar
