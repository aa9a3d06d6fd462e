// Island one-shot: the small-message form of the island all-reduce (island.cuh), three exchanges
// and nothing larger than the message crossing between islands.
//
// Rank r of island g (K islands of S ranks) has the local index j = r - gS; its partner in island
// h is hS + j. Each block owns a contiguous part of the message (as the one-shot), the last block
// also the tail.
//   1. Gather inside the island: push our part to every island peer's slot for us, flag them
//      (kind 0), wait for theirs.
//   2. Chain across islands: island 0 sums its S inputs in rank order (fp32); every other island
//      waits for its partner's fp32 partial from the previous island (kind 0) and adds its own S
//      inputs to it. Outside the last island the partial goes to the partner in the next island.
//      Every rank of an island computes the same partial (the same inputs, the same order), so
//      the partners of one chain are each other's only link between islands.
//   3. The partner in the last island (the finisher of its chain) rounds once, writes its output
//      and pushes the result to its partners in every other island (kind 1), which copy it out.
// Per rank per call: (S-1) x the message out and in inside the island; across islands one fp32
// partial out (twice the bytes of a 16-bit message) and the result in, or for the finisher one
// partial in and the result to K - 1 partners. The flat one-shot puts K - 1 island's worth of
// copies (S (K-1) messages) on the links between islands per rank instead. Three exchange
// latencies in the first island, where the island two-shot has four and more.
//
// Invariants of this kernel, on top of protocol.cuh's and island.cuh's:
//  J1. Disjoint landings. In a receiver's data slots of one parity: the slot of an island peer
//      holds that peer's input (step 1); the partial from the previous island lands in the slots
//      of THAT island's senders (island.cuh), whom the receiver hears from in no other way; the
//      result lands in the slot of the finisher, a rank of the last island, which sends nothing
//      else to ranks outside it. Flags likewise: kind 0 from island peers or from the partner
//      in the previous island, kind 1 from the finisher only.
//  J2. One parity ahead at most (protocol invariant 4). A rank writes into an island peer only
//      after that peer's kind-0 flag of the previous call; into its partner in the next island,
//      and the finisher into its partners, only after the previous call's result went round its
//      chain (j, S + j, ..., (K-1)S + j), which every partner of the chain had started: every
//      rank a rank writes to has started the previous call.
//  J3. Every wait is one of the protocol's bounded waits on this rank's own flags, and names its
//      stage: island gather, island chain (the partial), island result (the finisher's result).
// In place is safe: a block reads its input range (steps 1-2) before it writes that output range.
#pragma once

#include "island.cuh"

namespace pcie_ar {

template <typename T, typename Unit>
__global__ void __launch_bounds__(kThreadsPerBlock) island_oneshot_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kFirstBarrier>(a, [&](Epoch epoch, bool aborted) {
    const IslandPlace place(a);
    const int S = place.size;
    const Range body = to_units<Unit>(split(a.nbytes / kGranule, gridDim.x, blockIdx.x));
    const Range tail = block_tail<T>(a.nbytes);
    const Unit* in = static_cast<const Unit*>(a.input);
    const T* in_t = static_cast<const T*>(a.input);
    Unit* out = static_cast<Unit*>(a.output);
    T* out_t = static_cast<T*>(a.output);

    if (!aborted) {
      for (int s = 1; s < S; ++s) {
        const int peer = place.first + (place.local + s) % S;
        push_to_peer<Unit>(a, peer, epoch, in, body);
        push_to_peer<T>(a, peer, epoch, in_t, tail);
      }
    }
    if (!verdict_barrier(aborted)) return false;
    signal_targets(a, 0, epoch, place.peers);
    const int prev = place.previous(a.rank);
    if (!wait_targets(a, 0, epoch, place.peers, Stage::kIslandGather, prev, Stage::kIslandChain)) return false;
    const float* partial_in = prev >= 0 ? partial_area(a, a.rank, place.index - 1, epoch) : nullptr;
    if (!place.last()) return relay_and_receive<T, Unit>(a, place, epoch, in, in_t, out, out_t, body, tail, partial_in);
    finish_shard<T, Unit>(a, epoch, in, out, body, partial_in);
    finish_shard<T, T>(a, epoch, in_t, out_t, tail, partial_in);
    for (int h = 0; h < place.count - 1; ++h) {  // the same threads read `out` as wrote it
      push_to_peer<Unit>(a, h * S + place.local, epoch, out, body);
      push_to_peer<T>(a, h * S + place.local, epoch, out_t, tail);
    }
    __syncthreads();
    uint32_t partners = 0;
    for (int h = 0; h < place.count - 1; ++h) partners |= 1u << (h * S + place.local);
    signal_targets(a, 1, epoch, partners);
    return true;
  });
}

}  // namespace pcie_ar
