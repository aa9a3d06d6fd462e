// One-shot all-reduce with the data as its own flag, at full payload ("oneshot_full").
//
// Each rank pushes its message, in the wire format of host_wire.cuh (H1: no word is ever the
// poison pattern), into its slot of every peer's workspace, and polls its own slots, in local
// memory, until no poison is left in a unit. oneshot_ll.cuh needs no flag round trip either,
// but sends 16 bytes of line per 8 of payload; this sends the message's own bytes: half the
// bytes on the wire, which is what a PCIe link is paid in. Small messages (the lines' cap).
//
// Invariants (in addition to protocol.cuh 1 and 3-6; 2 is replaced by F1-F3):
//  F1. A receiver's slots hold kPoisonWord wherever no data of the call in flight landed: they
//      start so, and the thread that reduces a unit re-poisons that unit of every peer's slot
//      in the same kernel, in its own memory. A peer writes this parity again only in call
//      e + 2, after it saw our data of call e + 1, which we send after this kernel finished, so
//      a re-poison never erases newer data and nothing stale is taken for data.
//  F2. Headers vouch for the call: block k of each sender also stores the call's sealed word
//      (invariant 3 of protocol.cuh) into its header slot (parity, sender, k) in every peer's
//      workspace; lanes 0..W-1 of the last warp of the receiver's block k wait for exactly that
//      word from each peer, in parallel with the data. A peer that issued another call never
//      writes it: its call notice names the mismatch while the lane waits, and the block's output
//      is NaN, never its reduction; a peer whose data never arrives is a timeout.
//  F3. Every unit is reduced by the thread that pushed it, from the input it loads again before
//      writing that unit's output: in place (output == input) is safe. Blocks cover 16-byte
//      granules (partition.cuh), so ranks that move vectors and ranks that move elements
//      (unaligned buffers) interoperate.
#pragma once

#include <cstdint>

#include "host_wire.cuh"

namespace pcie_ar {

__device__ __forceinline__ uint64_t* full_header(const KernelArgs& a, int owner, uint32_t parity, int sender, int block) {
  return reinterpret_cast<uint64_t*>(a.bases[owner] + a.layout.full_offset) +
         (static_cast<uint64_t>(parity) * kMaxRanks + sender) * kMaxFlagBlocks + block;
}

// `sender`'s slot in `owner`'s workspace for this call's parity.
template <typename Unit>
__device__ __forceinline__ Unit* full_slot(const KernelArgs& a, int owner, uint32_t parity, int sender) {
  const uint64_t slot = (static_cast<uint64_t>(parity) * a.world + sender) * a.layout.ll_capacity;
  return reinterpret_cast<Unit*>(a.bases[owner] + a.layout.full_offset + kFullHeaderBytes + slot);
}

// The peer whose header this thread sends and waits for (F2): lane p of the block's LAST warp,
// else -1. Units go to threads from the first one up, so for the small messages these kernels
// take the last warp has no data to move and the header round trip runs beside the data's
// instead of ahead of a warp's share of it.
__device__ __forceinline__ int header_peer(const KernelArgs& a) {
  const int lane = static_cast<int>(threadIdx.x) - static_cast<int>(blockDim.x - 32);
  return lane >= 0 && lane < a.world && lane != a.rank ? lane : -1;
}

// Our header of this call into `peer`'s workspace (F2); nothing for -1.
__device__ __forceinline__ void publish_full_header(const KernelArgs& a, int peer, uint32_t parity, Epoch epoch) {
  if (peer < 0) return;
  *reinterpret_cast<volatile uint64_t*>(full_header(a, peer, parity, a.rank, blockIdx.x)) = flag_word(epoch, a.signature);
}

// `peer`'s header of this call in our workspace (F2): true once it holds this call's word, false
// on mismatch, timeout or abort; true for -1. Relaxed loads: the header carries no data.
__device__ __forceinline__ bool await_full_header(const KernelArgs& a, int peer, uint32_t parity, Epoch epoch,
                                                  Stage stage) {
  return peer < 0 || wait_header_word<false>(a, full_header(a, a.rank, parity, peer, blockIdx.x), peer, epoch, stage);
}

// Push our units [r) into our slot of every peer's workspace, before waiting for anything: the
// data is on its way while the headers are (F2). kWorld: the kernel's instance (reduce.cuh).
template <typename T, typename Unit, int kWorld>
__device__ __forceinline__ void push_units(const KernelArgs& a, uint32_t parity, const Unit* in, Range r) {
  const int world = world_of<kWorld>(a);
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const Unit v = to_wire<T, Unit>(load_unit(in + i));
#pragma unroll
    for (int p = 0; p < kRankLoop<kWorld>; ++p) {
      if (p < world && p != a.rank) full_slot<Unit>(a, p, parity, a.rank)[i] = v;
    }
  }
}

// Reduce our units [r) from every peer's slot in our memory as each arrived (ours from our input
// as it travels), then re-poison what we consumed (F1). False (this thread) on timeout or abort.
template <typename T, typename Unit, int kWorld>
__device__ __forceinline__ bool poll_reduce(const KernelArgs& a, uint32_t parity, Epoch epoch, const Unit* in,
                                            Unit* out, Range r) {
  // Every peer's slot from one base and a stride (see gather_unit on registers).
  Unit* const slots = full_slot<Unit>(a, a.rank, parity, 0);
  const uint64_t stride = a.layout.ll_capacity / sizeof(Unit);
  const auto from_peer = [&](int p) { return slots + p * stride; };
  const Unit poison = poison_unit<Unit>();
  const int world = world_of<kWorld>(a);
  uint64_t started = 0;
  uint32_t spins = 0;
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    Pack<T, Unit> got[kRankLoop<kWorld>];
    if (!gather_unit<T, Unit>(a, world, from_peer, in, i, epoch, Stage::kFullGather, spins, started, got)) return false;
    out[i] = sum_in_rank_order(got, world);  // in place: this unit's input was read above (F3)
#pragma unroll
    for (int p = 0; p < kRankLoop<kWorld>; ++p) {
      if (p < world && p != a.rank) from_peer(p)[i] = poison;
    }
  }
  return true;
}

// kWorld: the world size as a constant (== a.world; the launch picks the instance), as for
// oneshot_ll: every loop over peers unrolls to exactly W copies; kAnyWorld above kSmallWorld.
template <typename T, typename Unit, int kWorld>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) oneshot_full_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kAtEnd>(a, [&](Epoch epoch, bool aborted) {
    if (aborted) return false;
    const uint32_t parity = parity_of(epoch);
    const Range body = to_units<Unit>(split(a.nbytes / kGranule, gridDim.x, blockIdx.x));
    const Range tail = block_tail<T>(a.nbytes);
    const int peer = header_peer(a);
    publish_full_header(a, peer, parity, epoch);
    push_units<T, Unit, kWorld>(a, parity, static_cast<const Unit*>(a.input), body);
    push_units<T, T, kWorld>(a, parity, static_cast<const T*>(a.input), tail);
    bool ok = await_full_header(a, peer, parity, epoch, Stage::kFullGather);
    ok = ok && poll_reduce<T, Unit, kWorld>(a, parity, epoch, static_cast<const Unit*>(a.input), static_cast<Unit*>(a.output),
                                    body);
    ok = ok && poll_reduce<T, T, kWorld>(a, parity, epoch, static_cast<const T*>(a.input), static_cast<T*>(a.output), tail);
    return ok;
  });
}

}  // namespace pcie_ar
