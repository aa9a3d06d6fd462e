// Two-shot all-reduce with the data as its own flag in both phases ("twoshot_full").
//
// Reduce-scatter: each rank pushes its part of shard o, in the wire format of host_wire.cuh (H1:
// no word is ever the poison pattern), into its reduce-scatter inbox in owner o's workspace.
// Owner o polls its inboxes in local memory, sums every rank's part in rank order, and pushes the
// sum as it travels (to_wire) into its all-gather inbox in every peer's workspace, keeping the
// same bits as its own output. All-gather: each rank polls its all-gather inboxes for the other
// shards. Per rank and call: 2(W-1)/W of the message out and in, like the flag-based two-shot,
// and no flag round trip in either phase. Small and medium messages (the lines' cap, less one
// granule): it shares oneshot_full's slots.
//
// Invariants: those of oneshot_full.cuh, which hold for every call on its slots, whichever of
// the two full-payload algorithms made it:
//  F1. Every unit a peer writes into our slots is consumed by us in the same call and re-poisoned
//      in our own memory by the thread that consumed it, so a call leaves the slots all poison;
//      the slots of a parity are written again only two calls later, after every writer saw our
//      data of the call between (here: a sender's part needs the owner's all-gather of the call
//      before; an owner's sum needs the receiver's part of this call).
//  F2. Block k of each rank stores its header (the call's sealed word, invariant 3 of
//      protocol.cuh) into every peer; lanes 0..W-1 of the last warp of the receiver's block k wait
//      for exactly that word from each peer beside the data. A peer that issued another call
//      (size, dtype, algorithm, blocks) never writes it: its call notice names the mismatch.
//  F3. Every unit is reduced (owner) or copied (all-gather) by one thread, which reads its own
//      input before writing that unit's output: in place is safe.
// Layout: each parity of the full slots (W x ll_capacity bytes) is cut into 2W inboxes of
// ll_capacity / 2: reduce-scatter inbox of sender s at s, all-gather inbox of owner o at W + o.
// A shard's bytes sit in an inbox from its start; the tail (nbytes % 16, single elements)
// follows the last shard's granules. Every shard fits an inbox when nbytes <= ll_capacity -
// kGranule (checked at launch).
#pragma once

#include <cstdint>

#include "oneshot_full.cuh"

namespace pcie_ar {

enum class FullInbox : int { kReduceScatter = 0, kAllGather = 1 };

// Inbox (kind, index) of `area_owner`'s slots holding shard `shard_owner`, indexed by message
// unit: the inbox holds the shard from its first byte, so the pointer returned is that inbox's
// start less the shard's first unit (never dereferenced outside the shard).
template <typename Unit>
__device__ __forceinline__ Unit* full_inbox(const KernelArgs& a, int area_owner, uint32_t parity, FullInbox kind,
                                            int index, int shard_owner) {
  const uint64_t inbox = static_cast<uint64_t>(static_cast<int>(kind) * a.world + index);
  char* start = a.bases[area_owner] + a.layout.full_offset + kFullHeaderBytes +
                static_cast<uint64_t>(parity) * a.world * a.layout.ll_capacity + inbox * (a.layout.ll_capacity / 2);
  const uint64_t first_unit = shard_granules(a.nbytes, a.world, shard_owner).begin * (kGranule / sizeof(Unit));
  return reinterpret_cast<Unit*>(start) - first_unit;
}

// This block's units of shard `owner` (granules), or, with `tail`, the message's tail elements
// when this block carries them and they belong to that shard (the last one).
template <typename T, typename Unit>
__device__ __forceinline__ Range full_shard_units(const KernelArgs& a, int owner, bool tail) {
  if (!tail) return shard_part<Unit>(a.nbytes, a.world, owner);
  return owner == a.world - 1 ? block_tail<T>(a.nbytes) : Range{0, 0};
}

// Reduce-scatter, sending side: our units of every other rank's shard into its inbox for us.
template <typename T, typename Unit>
__device__ __forceinline__ void push_shards(const KernelArgs& a, uint32_t parity, const Unit* in, bool tail) {
  for (int s = 1; s < a.world; ++s) {
    const int owner = (a.rank + s) % a.world;  // spread the first writes over the owners
    const Range r = full_shard_units<T, Unit>(a, owner, tail);
    Unit* inbox = full_inbox<Unit>(a, owner, parity, FullInbox::kReduceScatter, a.rank, owner);
    for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) inbox[i] = to_wire<T, Unit>(load_unit(in + i));
  }
}

// Our shard: every rank's part, polled in our inboxes (ours from our input as it travels), summed
// in rank order; the sum as it travels into our output and every peer's all-gather inbox; the
// inboxes re-poisoned (F1). False (this thread) on timeout or abort.
template <typename T, typename Unit, int kCap>
__device__ __forceinline__ bool reduce_own_shard(const KernelArgs& a, uint32_t parity, Epoch epoch, const Unit* in,
                                                 Unit* out, bool tail) {
  const Range r = full_shard_units<T, Unit>(a, a.rank, tail);
  if (r.begin + threadIdx.x >= r.end) return true;  // no units: skip the set-up (the tail's case)
  const Unit poison = poison_unit<Unit>();
  // full_inbox's divisions by W and 64-bit products once per call, not per unit and peer (the
  // compiler redid them there: it reloads the parameters after every store). The shard is ours
  // on both sides, so rank p's reduce-scatter inbox in our slots is rank 0's plus p inboxes, and
  // our all-gather inbox lies at one offset from every workspace's base (symmetric layout).
  char* const from0 = reinterpret_cast<char*>(full_inbox<Unit>(a, a.rank, parity, FullInbox::kReduceScatter, 0, a.rank));
  const ptrdiff_t to_offset =
      reinterpret_cast<char*>(full_inbox<Unit>(a, a.rank, parity, FullInbox::kAllGather, a.rank, a.rank)) - a.bases[a.rank];
  // A peer's address is a base plus an offset, its inbox size read from the parameters when
  // used: held in a register, it lets the compiler hoist kCap addresses out of the loop, 2 kCap
  // registers (kCap = 16: 128 and spills; see gather_unit on registers).
  const auto from = [&](int p) {  // rank p's part of our shard, in our reduce-scatter inbox for p
    return reinterpret_cast<Unit*>(from0 + static_cast<uint64_t>(p) * (a.layout.ll_capacity / 2));
  };
  const auto to = [&](int p) {  // our all-gather inbox in peer p
    return reinterpret_cast<Unit*>(a.bases[p] + to_offset);
  };
  uint64_t started = 0;
  uint32_t spins = 0;
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    Pack<T, Unit> got[kCap];
    if (!gather_unit<T, Unit, kCap>(a, a.world, from, in, i, epoch, Stage::kFullReduceScatter, spins, started, got)) return false;
    const Unit sum = to_wire<T, Unit>(sum_in_rank_order(got, a.world));
#pragma unroll
    for (int p = 0; p < kCap; ++p) {
      if (p < a.world && p != a.rank) {
        to(p)[i] = sum;
        from(p)[i] = poison;
      }
    }
    out[i] = sum;  // in place: this unit's input was read above (F3)
  }
  return true;
}

// All-gather: every other shard from our inboxes into our output, re-poisoned after use (F1).
template <typename T, typename Unit>
__device__ __forceinline__ bool gather_shards(const KernelArgs& a, uint32_t parity, Epoch epoch, Unit* out,
                                              bool tail) {
  const Unit poison = poison_unit<Unit>();
  uint64_t started = 0;
  uint32_t spins = 0;
  for (int s = 1; s < a.world; ++s) {
    const int owner = (a.rank + s) % a.world;
    const Range r = full_shard_units<T, Unit>(a, owner, tail);
    Unit* inbox = full_inbox<Unit>(a, a.rank, parity, FullInbox::kAllGather, owner, owner);
    for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
      Unit v = load_wire(inbox + i);
      if (!await_unit<T, Unit>(a, inbox + i, v, owner, epoch, Stage::kFullAllGather, spins, started)) return false;
      out[i] = v;
      inbox[i] = poison;
    }
  }
  return true;
}

template <typename T, typename Unit, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) twoshot_full_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kAtEnd>(a, [&](Epoch epoch, bool aborted) {
    if (aborted) return false;
    const uint32_t parity = parity_of(epoch);
    const Unit* in = static_cast<const Unit*>(a.input);
    Unit* out = static_cast<Unit*>(a.output);
    const T* in_t = static_cast<const T*>(a.input);
    T* out_t = static_cast<T*>(a.output);
    const int peer = header_peer(a);
    publish_full_header(a, peer, parity, epoch);
    push_shards<T, Unit>(a, parity, in, false);
    push_shards<T, T>(a, parity, in_t, true);
    bool ok = await_full_header(a, peer, parity, epoch, Stage::kFullReduceScatter);
    ok = ok && reduce_own_shard<T, Unit, kCap>(a, parity, epoch, in, out, false);
    ok = ok && reduce_own_shard<T, T, kCap>(a, parity, epoch, in_t, out_t, true);
    ok = ok && gather_shards<T, Unit>(a, parity, epoch, out, false);
    ok = ok && gather_shards<T, T>(a, parity, epoch, out_t, true);
    return ok;
  });
}

}  // namespace pcie_ar
