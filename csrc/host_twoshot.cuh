// The host transport's write-once two-shot ("host_twoshot"), for large messages: each rank
// writes its message once into its input area (host_wire.cuh); rank o reduces shard o from
// every rank's input area and writes the reduced shard once into its result area; every rank
// then reads the other shards there. Per rank and call, over its own PCIe link: out the message
// and one shard, in 2(W-1)/W messages (the one-shot reads W-1).
//
// Every rank uses a shard as it travels on the wire (H1), the owner too, so outputs are
// identical on every rank; the shard is the same rank-order fp32 sum as every other algorithm's.
//
// Block k of every rank publishes part k of every shard (shard_part: each shard's granules split
// among the blocks), reduces part k of its own shard and reads part k of the others' reduced
// shards; the tail goes with the last block throughout. So block k polls only what block k of a
// peer wrote (invariant 8 of protocol.cuh). It still writes the whole message, its own shard
// included (which nobody reads): the owner reduces its own shard from its input.
#pragma once

#include <cstdint>

#include "host_wire.cuh"

namespace pcie_ar {

// Our shard [r): every rank's units from their input areas, summed in rank order, as it will
// travel; into our output and, once, into our result area. False (this thread) on timeout or abort.
template <typename T, typename Unit, int kCap>
__device__ __forceinline__ bool reduce_shard(const KernelArgs& a, uint32_t buffer, Epoch epoch, const Unit* in,
                                             Unit* out, Range r) {
  Unit* result = shared_area<Unit>(a, a.rank, buffer, SharedArea::kResult);
  const auto inputs = [&](int p) -> const Unit* { return shared_area<Unit>(a, p, buffer, SharedArea::kInput); };
  uint64_t started = 0;
  uint32_t spins = 0;
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    Pack<T, Unit> got[kCap];
    if (!gather_unit<T, Unit, kCap>(a, a.world, inputs, in, i, epoch, Stage::kHostGather, spins, started, got)) return false;
    const Unit sum = to_wire<T, Unit>(sum_in_rank_order(got, a.world));
    result[i] = sum;
    out[i] = sum;
  }
  return true;
}

// `owner`'s reduced shard [r) from its result area into our output.
template <typename T, typename Unit>
__device__ __forceinline__ bool gather_shard(const KernelArgs& a, uint32_t buffer, Epoch epoch, int owner, Unit* out,
                                             Range r) {
  const Unit* result = shared_area<Unit>(a, owner, buffer, SharedArea::kResult);
  uint64_t started = 0;
  uint32_t spins = 0;
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    Unit v = load_wire(result + i);
    if (!await_unit<T, Unit>(a, result + i, v, owner, epoch, Stage::kHostGather, spins, started)) return false;
    out[i] = v;
  }
  return true;
}

template <typename T, typename Unit, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) host_twoshot_kernel(const __grid_constant__ KernelArgs a) {
  write_once_call<T>(a, true, [&](uint32_t buffer, Epoch epoch) {
    const Unit* in = static_cast<const Unit*>(a.input);
    Unit* out = static_cast<Unit*>(a.output);
    const T* in_t = static_cast<const T*>(a.input);
    T* out_t = static_cast<T*>(a.output);
    // The tail elements belong to the last rank's shard and to the last block.
    const bool tail_is_ours = a.rank == a.world - 1 && owns_tail();
    const Range tail = tail_elements<T>(a.nbytes);

    publish_header(a, buffer, epoch);
    for (int s = 1; s <= a.world; ++s) {  // the owners that read it first, our own shard last
      const int owner = (a.rank + s) % a.world;
      publish_input<T, Unit>(a, buffer, in, shard_part<Unit>(a.nbytes, a.world, owner));
    }
    if (owns_tail()) publish_input<T, T>(a, buffer, in_t, tail);
    bool ok = wait_headers(a, buffer, epoch);
    ok = ok && reduce_shard<T, Unit, kCap>(a, buffer, epoch, in, out, shard_part<Unit>(a.nbytes, a.world, a.rank));
    if (tail_is_ours) ok = ok && reduce_shard<T, T, kCap>(a, buffer, epoch, in_t, out_t, tail);
    for (int s = 1; s < a.world && ok; ++s) {
      const int owner = (a.rank + s) % a.world;  // start with the next rank: spread the reads over owners
      ok = gather_shard<T, Unit>(a, buffer, epoch, owner, out, shard_part<Unit>(a.nbytes, a.world, owner));
      if (ok && owner == a.world - 1 && owns_tail()) ok = gather_shard<T, T>(a, buffer, epoch, owner, out_t, tail);
    }
    return ok;
  });
}

}  // namespace pcie_ar
