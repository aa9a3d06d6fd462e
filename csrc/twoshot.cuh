// Two-shot push all-reduce: reduce-scatter, then all-gather, in one kernel.
//
// The message is cut into W shards; rank o owns shard o. Each block owns the same sub-range of
// every shard.
//   1. Reduce-scatter: for s = 1..W-1 (staged order), push our input's sub-range of shard
//      (rank+s)%W into that owner's slot for us; flag every peer (kind 0).
//   2. Wait for every peer's kind-0 flag; reduce our own shard's sub-range in rank order, write
//      it to the output and push it into every peer's slot for us; flag every peer (kind 1).
//   3. Wait for every peer's kind-1 flag; copy each peer's reduced sub-range from its slot.
// Each rank moves 2(W-1)/W of the message instead of (W-1): the choice for large messages.
//
// Plain: step 1 pushes to the owners one after another but flags them all at the end, and step 2
//   pushes the reduced shard to every peer at once (one load, W-1 posted writes).
// Staged (twoshot_staged): both exchanges go one peer at a time in ring order, peer (rank+s)%W
//   in stage s, each flagged as soon as its part is written, so that in every stage each rank
//   has one outbound and one inbound stream (the staged one-shot's schedule, oneshot.cuh): for
//   PCIe root complexes, which collapse under all-to-all posted writes but sustain one-to-one.
//   The same bytes as the plain two-shot.
//
// Slot reuse within one parity: in step 1 we write shard o's range of o's slot for us; in step 2,
// shard rank's range of every peer's slot for us. Those ranges never overlap, so both exchanges
// share the same double-buffered slots. The tail (< 16 bytes) is exchanged one-shot style in
// step 1 and reduced locally by the last block.
// In place is safe: a block reads each input range before it writes that same output range.
// Protocol invariants: protocol.cuh.
#pragma once

#include "moves.cuh"

namespace pcie_ar {

// Plain: the reduce-scatter's pushes one after another, one flag to every peer after them all,
// and the all-gather from the reduction itself (one load, W-1 posted writes).
template <typename T, typename Unit, int kCap>
__device__ __forceinline__ bool twoshot_plain(const KernelArgs& a, Epoch epoch, bool aborted) {
  const Range tail = block_tail<T>(a.nbytes);
  const Unit* in = static_cast<const Unit*>(a.input);
  const T* in_t = static_cast<const T*>(a.input);
  Unit* out = static_cast<Unit*>(a.output);

  if (!aborted) {
    for (int s = 1; s < a.world; ++s) {
      const int owner = (a.rank + s) % a.world;
      push_to_peer<Unit>(a, owner, epoch, in, shard_part<Unit>(a.nbytes, a.world, owner));
    }
    push_to_all_peers<T, kCap>(a, epoch, in_t, tail);
  }
  if (verdict_barrier(aborted)) {
    signal_all_peers(a, 0, epoch);

    if (wait_all_peers(a, 0, epoch, Stage::kReduceScatter)) {
      reduce_range<T, Unit, true, kCap>(a, epoch, in, out, shard_part<Unit>(a.nbytes, a.world, a.rank));
      reduce_range<T, T, false, kCap>(a, epoch, in_t, static_cast<T*>(a.output), tail);
      __syncthreads();
      signal_all_peers(a, 1, epoch);

      if (wait_all_peers(a, 1, epoch, Stage::kAllGather)) {
        for (int s = 1; s < a.world; ++s) {
          const int peer = (a.rank + s) % a.world;
          copy_from_slot<Unit>(a, peer, epoch, out, shard_part<Unit>(a.nbytes, a.world, peer));
        }
        return true;
      }
    }
  }
  return false;
}

// Staged: both exchanges one peer at a time, each flagged as soon as its part has been written
// (the tail goes with every peer's part of the reduce-scatter, as in the plain form's step 1).
template <typename T, typename Unit, int kCap>
__device__ __forceinline__ bool twoshot_staged(const KernelArgs& a, Epoch epoch, bool aborted) {
  const Range tail = block_tail<T>(a.nbytes);
  const Range mine = shard_part<Unit>(a.nbytes, a.world, a.rank);
  const Unit* in = static_cast<const Unit*>(a.input);
  const T* in_t = static_cast<const T*>(a.input);
  Unit* out = static_cast<Unit*>(a.output);

  bool sent = true;
  for (int s = 1; s < a.world && sent; ++s) {
    const int owner = (a.rank + s) % a.world;
    if (!aborted) {
      push_to_peer<Unit>(a, owner, epoch, in, shard_part<Unit>(a.nbytes, a.world, owner));
      push_to_peer<T>(a, owner, epoch, in_t, tail);
    }
    sent = verdict_barrier(aborted);
    if (sent && threadIdx.x == 0) signal_peer(a, owner, 0, epoch);
  }
  if (!sent || !wait_all_peers(a, 0, epoch, Stage::kReduceScatter)) return false;
  reduce_range<T, Unit, false, kCap>(a, epoch, in, out, mine);
  reduce_range<T, T, false, kCap>(a, epoch, in_t, static_cast<T*>(a.output), tail);
  for (int s = 1; s < a.world; ++s) {  // the same threads read `out` as wrote it
    const int peer = (a.rank + s) % a.world;
    push_to_peer<Unit>(a, peer, epoch, out, mine);
    __syncthreads();
    if (threadIdx.x == 0) signal_peer(a, peer, 1, epoch);
  }
  if (!wait_all_peers(a, 1, epoch, Stage::kAllGather)) return false;
  for (int s = 1; s < a.world; ++s) {
    const int peer = (a.rank + s) % a.world;
    copy_from_slot<Unit>(a, peer, epoch, out, shard_part<Unit>(a.nbytes, a.world, peer));
  }
  return true;
}

template <typename T, typename Unit, bool kStaged, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock) twoshot_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kFirstBarrier>(a, [&](Epoch epoch, bool aborted) {
    return kStaged ? twoshot_staged<T, Unit, kCap>(a, epoch, aborted) : twoshot_plain<T, Unit, kCap>(a, epoch, aborted);
  });
}

}  // namespace pcie_ar
