// Island two-shot: a two-shot whose reduce-scatter and all-gather stay inside islands (GPUs under
// one PCIe switch or one NUMA node), with one chain of fp32 partial sums across them.
//
// The world is K >= 2 islands of S >= 2 consecutive ranks (KernelArgs::island_ranks = S): island
// g holds ranks gS .. gS+S-1, and a rank's local index is rank % S. The message is cut into S
// shards; in every island the rank of local index j owns shard j (the tail, < 16 bytes, goes with
// shard S-1 and moves as single elements). Each block owns the same sub-range of every shard.
//   1. Reduce-scatter inside the island: push our input's part of each island peer's shard into
//      that peer's slot for us; flag the island peers (kind 0).
//   2. Chain across islands, in island order: the owner of shard j in island 0 sums its island's
//      S contributions in fp32, in rank order, and pushes the fp32 partial to the owner of shard j
//      in island 1 (flag kind 0), which adds its island's S contributions to it, and so on. The
//      owner in the last island (the finisher) rounds once: ((x_0 + x_1) + ...) + x_{W-1}, the
//      very sum of every flat algorithm (protocol invariant 6), so results are bitwise equal to
//      theirs. Each byte of a shard crosses from island to island once, as fp32 (twice the bytes
//      of a 16-bit dtype).
//   3. The finisher writes the reduced shard to its output and pushes it to the other islands'
//      owners of the shard, then to its island peers, one at a time, flagging each (kind 1) as
//      its copy lands; each of those owners copies it to its output and forwards it the same way
//      to its own island peers.
//   4. All-gather inside the island: wait for the island peers' kind-1 flags, copy their shards.
// Per rank per call: (S-1)/S of the message out and in inside the island twice, and across
// islands one shard's partial out (fp32) and one reduced shard in; the finisher sends its shard
// to K-1 other islands.
//
// Invariants of this kernel, on top of protocol.cuh's:
//  I1. Disjoint landings. In a receiver's data slots of one parity: the slot of an island peer
//      holds that peer's input for our shard (step 1) and that peer's reduced shard (step 4), two
//      disjoint ranges, as in the flat two-shot; the fp32 partial from the previous island lands
//      in the slots of THAT island's senders, read as one float array indexed by element (S >= 2
//      slots hold 2 x slot_bytes >= 4 bytes per element of a 16-bit message, the fp32 message's
//      4 bytes too), which nobody of the receiver's own island writes; the finisher's reduced
//      shard lands in the finisher's slot, and the finisher is in no other island. The flags
//      split the same way: kind 0 from island peers (step 1) or from the previous island's owner
//      (step 2), kind 1 from island peers (step 4) or from the finisher (step 3).
//  I2. One parity ahead at most (protocol invariant 4). A rank writes into an island peer only
//      after that peer's flags of the previous call, into the next island's owner or the other
//      owners only after the finisher's kind-1 flag of the previous call, which the finisher sent
//      after the whole chain of that call reached it: every rank a rank writes to has started
//      the previous call.
//  I3. Every wait is one of the protocol's bounded waits on this rank's own flags, and names its
//      stage: reduce-scatter, island chain (the previous island's partial), island result (the
//      finisher's shard), all-gather.
// In place is safe: a block reads each input range (steps 1-2) before it writes that output range.
#pragma once

#include "island.cuh"

namespace pcie_ar {

// Who gets a rank's reduced shard, in turn (steps 3-4): in the last island, the other islands'
// owners of the shard first (they forward it), then the island peers, each rank of an island
// starting at a different one; elsewhere the island peers only.
struct ShardRecipients {
  int first, local, size, owners;  // owners: other islands' owners to send to (last island only)

  __device__ __forceinline__ int count() const { return owners + size - 1; }
  __device__ __forceinline__ int operator[](int k) const {
    return k < owners ? k * size + local : first + (local + 1 + k - owners) % size;
  }
};

// Steps 3-4: our reduced shard (in `out`, written by the same threads that read it here) to each
// recipient in turn, each flagged (kind 1) as soon as its copy has landed: one peer at a time, as
// the staged one-shot writes, since a CPU root complex serves one-to-one writes and collapses
// under all-to-all ones (bench/fabric_model.py).
template <typename T, typename Unit>
__device__ __forceinline__ void push_shard_in_turn(const KernelArgs& a, Epoch epoch, const Unit* out, Range r,
                                                   const T* out_t, Range tail, ShardRecipients to) {
  for (int k = 0; k < to.count(); ++k) {
    const int peer = to[k];
    push_to_peer<Unit>(a, peer, epoch, out, r);
    push_to_peer<T>(a, peer, epoch, out_t, tail);
    __syncthreads();
    if (threadIdx.x == 0) signal_peer(a, peer, 1, epoch);
  }
}

template <typename T, typename Unit>
__global__ void __launch_bounds__(kThreadsPerBlock) island_twoshot_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kFirstBarrier>(a, [&](Epoch epoch, bool aborted) {
    const IslandPlace place(a);
    const int S = place.size;
    const int first = place.first;
    const int tail_owner = first + S - 1;
    const Range tail = block_tail<T>(a.nbytes);
    const Range mine = shard_part<Unit>(a.nbytes, S, place.local);
    const Range my_tail = a.rank == tail_owner ? tail : Range{0, 0};
    const Unit* in = static_cast<const Unit*>(a.input);
    const T* in_t = static_cast<const T*>(a.input);
    Unit* out = static_cast<Unit*>(a.output);
    T* out_t = static_cast<T*>(a.output);

    if (!aborted) {
      for (int s = 1; s < S; ++s) {
        const int peer = first + (place.local + s) % S;
        push_to_peer<Unit>(a, peer, epoch, in, shard_part<Unit>(a.nbytes, S, peer - first));
      }
      if (a.rank != tail_owner) push_to_peer<T>(a, tail_owner, epoch, in_t, tail);
    }
    if (!verdict_barrier(aborted)) return false;
    signal_targets(a, 0, epoch, place.peers);
    const int prev = place.previous(a.rank);
    bool have_shard = false;
    if (wait_targets(a, 0, epoch, place.peers, Stage::kReduceScatter, prev, Stage::kIslandChain)) {
      const float* partial_in = prev >= 0 ? partial_area(a, a.rank, place.index - 1, epoch) : nullptr;
      const ShardRecipients to{first, place.local, S, place.last() ? place.count - 1 : 0};
      if (place.last()) {
        finish_shard<T, Unit>(a, epoch, in, out, mine, partial_in);
        finish_shard<T, T>(a, epoch, in_t, out_t, my_tail, partial_in);
        push_shard_in_turn<T, Unit>(a, epoch, out, mine, out_t, my_tail, to);
        have_shard = true;
      } else if (relay_and_receive<T, Unit>(a, place, epoch, in, in_t, out, out_t, mine, my_tail, partial_in)) {
        push_shard_in_turn<T, Unit>(a, epoch, out, mine, out_t, my_tail, to);
        have_shard = true;
      }
    }
    if (!have_shard || !wait_targets(a, 1, epoch, place.peers, Stage::kAllGather)) return false;
    for (int s = 1; s < S; ++s) {
      const int peer = first + (place.local + s) % S;
      copy_from_slot<Unit>(a, peer, epoch, out, shard_part<Unit>(a.nbytes, S, peer - first));
    }
    if (a.rank != tail_owner) copy_from_slot<T>(a, tail_owner, epoch, out_t, tail);
    return true;
  });
}

}  // namespace pcie_ar
