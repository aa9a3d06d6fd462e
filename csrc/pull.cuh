// Pull forms of the one-shot and the two-shot: each rank stages its input in its OWN workspace
// and peers read it from there, for fabrics whose peer reads outrun their peer writes (behind
// some PCIe switches posted peer writes crawl while reads run at link rate: b12x measured
// 2.6 against 52 GB/s on 16 RTX PRO 6000). The flags stay as in every algorithm: one posted
// 8-byte write per block and peer into the peer's workspace, each rank spinning on its own.
//
// oneshot_pull: copy our part of the input into our own slot (local stores), flag every peer
//   (kind 0, "ready"); wait for every peer's flag; read every peer's part from its workspace and
//   reduce in rank order into the output.
// twoshot_pull: copy our whole input into our own slot, flag every peer (kind 0); wait for every
//   peer's flag; reduce our shard from every peer's slot (rank order), write it to the output and
//   over our own shard's range of our own slot (nobody else reads that range of it), flag every
//   peer (kind 1); wait for every peer's kind-1 flag; read each peer's reduced shard from its
//   slot. The tail (< 16 bytes) is read from every peer and reduced by the last block of each rank.
//
// Invariants of these kernels, on top of protocol.cuh's (they are the exception to its
// invariant 1, "push, don't pull"):
//  P1. What peers read is only ever a workspace's own slot (slot index = its owner's rank), never
//      a user's tensor: a rank writes its own slot of parity e%2 in call e, after it saw every
//      peer's flags of call e-1, i.e. after every peer finished call e-2 and so all its reads of
//      that parity (protocol invariant 4 with reader and writer swapped).
//  P2. A reader loads peer memory only after acquiring that peer's flag of this call (then a
//      block barrier), with loads that cache nothing (.cv): the data a flag released is what the
//      reader sees, never a line kept from an earlier call of the same parity.
//  P3. In twoshot_pull a rank overwrites only its own shard's range of its own slot, which no
//      peer reads in the reduce-scatter (each reads its own shard there), and flags kind 1 after.
// In place is safe: the input is copied to the workspace before any of its output is written.
//
// twoshot_symm: twoshot_pull without the copy. The caller's input already lies in its rank's
//   symmetric input area (Layout::input_offset, the tensor Communicator.symmetric_input returns),
//   the same offset in every workspace, so the reduce-scatter reads every rank's input where it
//   is; the reduced shard is published in our own slot as in twoshot_pull (P1, P3). Per rank the
//   memory moves N + (W-1)N/W reads and (W+1)N/W writes where twoshot_pull adds a full copy
//   (N more of each): torch symmetric memory's two-shot, whose input lives in its buffer too.
//  S1. Peers read a rank's input area only in the reduce-scatter of twoshot_symm (shard and
//      tail), after that rank's kind-0 flag of the call (released after the stream's earlier
//      work wrote the input), and each reader's block finishes those reads before its kind-1
//      flag. A rank's kernel ends only after every peer's kind-1 flag of every block, so once
//      the call completes on its stream no peer reads its input area again: the caller may
//      write the next input there (stream order), and out may be the input (in place: each
//      output range is written after every rank's reads of that range, S1 with P3; the tail,
//      which every rank reads, waits in our own slot until every peer's kind-1 flag).
//  S2. Every rank agrees the input is the area: twoshot_symm is its own algorithm id, part of
//      the call signature, and the launch refuses an input anywhere else.
#pragma once

#include "moves.cuh"

namespace pcie_ar {

// A load of a peer's workspace (or of host memory another rank writes): fetched again every time.
template <typename Unit>
__device__ __forceinline__ Unit load_remote(const Unit* p) {
  return load_bits(p, [](const auto* q) { return __ldcv(q); });
}

// Rank `owner`'s own slot in its own workspace, where it stages what peers pull (P1).
template <typename Unit>
__device__ __forceinline__ Unit* own_slot(const KernelArgs& a, int owner, Epoch epoch) {
  return slot_units<Unit>(a, owner, owner, epoch);
}

// Rank `owner`'s symmetric input area (S1), as mapped here.
template <typename Unit>
__device__ __forceinline__ const Unit* symmetric_input(const KernelArgs& a, int owner) {
  return reinterpret_cast<const Unit*>(a.bases[owner] + a.layout.input_offset);
}

// out[r] = the rank-order sum of every rank's staged input (ours from `own`, the peers' read from
// their workspaces: their own slots, or with `kSymmetric` their input areas); with `publish`,
// also over our own slot's range (twoshot_pull's shard, P3).
template <typename T, typename Unit, bool kPublish, int kCap, bool kSymmetric = false>
__device__ __forceinline__ void reduce_pulled(const KernelArgs& a, Epoch epoch, const Unit* own, Unit* out, Range r) {
  const Unit* src[kCap];
#pragma unroll
  for (int q = 0; q < kCap; ++q) {
    src[q] = q >= a.world ? nullptr : kSymmetric ? symmetric_input<Unit>(a, q) : own_slot<Unit>(a, q, epoch);
  }
  Unit* mine = own_slot<Unit>(a, a.rank, epoch);
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    Pack<T, Unit> in[kCap];
#pragma unroll
    for (int q = 0; q < kCap; ++q) {
      if (q < a.world) in[q].unit = q == a.rank ? load_unit(own + i) : load_remote(src[q] + i);
    }
    const Unit v = sum_in_rank_order(in, a.world);
    out[i] = v;
    if constexpr (kPublish) mine[i] = v;
  }
}

// out[r] = what `peer` left in its own slot.
template <typename Unit>
__device__ __forceinline__ void copy_pulled(const KernelArgs& a, int peer, Epoch epoch, Unit* out, Range r) {
  const Unit* src = own_slot<Unit>(a, peer, epoch);
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) out[i] = load_remote(src + i);
}

template <typename T, typename Unit, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock) oneshot_pull_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kFirstBarrier>(a, [&](Epoch epoch, bool aborted) {
    const Range body = to_units<Unit>(split(a.nbytes / kGranule, gridDim.x, blockIdx.x));
    const Range tail = block_tail<T>(a.nbytes);
    const Unit* in = static_cast<const Unit*>(a.input);
    const T* in_t = static_cast<const T*>(a.input);
    if (!aborted) {
      push_to_peer<Unit>(a, a.rank, epoch, in, body);  // our own slot (P1)
      push_to_peer<T>(a, a.rank, epoch, in_t, tail);
    }
    if (!verdict_barrier(aborted)) return false;
    signal_all_peers(a, 0, epoch);
    if (!wait_all_peers(a, 0, epoch, Stage::kPullGather)) return false;
    reduce_pulled<T, Unit, false, kCap>(a, epoch, in, static_cast<Unit*>(a.output), body);
    reduce_pulled<T, T, false, kCap>(a, epoch, in_t, static_cast<T*>(a.output), tail);
    return true;
  });
}

template <typename T, typename Unit, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock) twoshot_pull_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kFirstBarrier>(a, [&](Epoch epoch, bool aborted) {
    const Range tail = block_tail<T>(a.nbytes);
    const Unit* in = static_cast<const Unit*>(a.input);
    const T* in_t = static_cast<const T*>(a.input);
    Unit* out = static_cast<Unit*>(a.output);
    if (!aborted) {
      for (int s = 1; s < a.world; ++s) {  // our own shard's range is read by nobody but us (P3)
        const int owner = (a.rank + s) % a.world;
        push_to_peer<Unit>(a, a.rank, epoch, in, shard_part<Unit>(a.nbytes, a.world, owner));
      }
      push_to_peer<T>(a, a.rank, epoch, in_t, tail);
    }
    if (!verdict_barrier(aborted)) return false;
    signal_all_peers(a, 0, epoch);
    if (!wait_all_peers(a, 0, epoch, Stage::kPullReduceScatter)) return false;
    reduce_pulled<T, Unit, true, kCap>(a, epoch, in, out, shard_part<Unit>(a.nbytes, a.world, a.rank));
    __syncthreads();
    signal_all_peers(a, 1, epoch);
    // Every rank reduces the tail itself (read from every peer's slot, which still holds it).
    reduce_pulled<T, T, false, kCap>(a, epoch, in_t, static_cast<T*>(a.output), tail);
    if (!wait_all_peers(a, 1, epoch, Stage::kPullAllGather)) return false;
    for (int s = 1; s < a.world; ++s) {
      const int peer = (a.rank + s) % a.world;
      copy_pulled<Unit>(a, peer, epoch, out, shard_part<Unit>(a.nbytes, a.world, peer));
    }
    return true;
  });
}

template <typename T, typename Unit, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock) twoshot_symm_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kFirstBarrier>(a, [&](Epoch epoch, bool aborted) {
    if (!verdict_barrier(aborted)) return false;
    signal_all_peers(a, 0, epoch);  // our input is there (S1)
    if (!wait_all_peers(a, 0, epoch, Stage::kPullReduceScatter)) return false;
    const Unit* in = static_cast<const Unit*>(a.input);  // our own input area (S2)
    Unit* out = static_cast<Unit*>(a.output);
    reduce_pulled<T, Unit, true, kCap, true>(a, epoch, in, out, shard_part<Unit>(a.nbytes, a.world, a.rank));
    // The tail is read from every rank's input, so it is reduced before the flag (after it a
    // peer may finish and its caller rewrite its input, S1) into our own slot's tail, which no
    // peer reads, and reaches the output only after every peer's flag: in place, our output's
    // tail is our input's, which the peers read until then.
    const Range tail = block_tail<T>(a.nbytes);
    T* own_tail = own_slot<T>(a, a.rank, epoch);
    reduce_pulled<T, T, false, kCap, true>(a, epoch, static_cast<const T*>(a.input), own_tail, tail);
    __syncthreads();
    signal_all_peers(a, 1, epoch);
    if (!wait_all_peers(a, 1, epoch, Stage::kPullAllGather)) return false;
    for (int s = 1; s < a.world; ++s) {
      const int peer = (a.rank + s) % a.world;
      copy_pulled<Unit>(a, peer, epoch, out, shard_part<Unit>(a.nbytes, a.world, peer));
    }
    T* out_t = static_cast<T*>(a.output);
    for (uint64_t i = tail.begin + threadIdx.x; i < tail.end; i += blockDim.x) out_t[i] = own_tail[i];  // same thread
    return true;
  });
}

}  // namespace pcie_ar
