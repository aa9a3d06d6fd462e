// What the island algorithms (island_twoshot.cuh, island_oneshot.cuh) share: the world is K >= 2
// islands of S >= 2 consecutive ranks (KernelArgs::island_ranks = S; island g holds ranks gS ..
// gS+S-1), and a sum crosses the islands as ONE chain of fp32 partials in island order: island
// 0's ranks summed in rank order, pushed as fp32 to the next island, which adds its own ranks in
// rank order, ..., rounded once in the last island. That is the very sum of every flat algorithm
// (protocol invariant 6), split at island boundaries, so the results are bitwise theirs.
// A partial from island g lands in the receiver's data slots of island g's senders, read as one
// float array indexed by element (S >= 2 slots hold 2 x slot_bytes >= 4 bytes per element of a
// 16-bit message, the fp32 message's 4 bytes too); each algorithm says why nobody else writes
// there in the same call.
#pragma once

#include "moves.cuh"

namespace pcie_ar {

// The fp32 partial sums of one unit, at element offset `element` of a float array.
template <int N>
__device__ __forceinline__ void store_partial(float* area, uint64_t element, const float (&acc)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      *reinterpret_cast<float4*>(area + element + k) = make_float4(acc[k], acc[k + 1], acc[k + 2], acc[k + 3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) area[element + k] = acc[k];
  }
}

// The previous island's partial sums of one unit; .cg like every load of pushed data.
template <int N>
__device__ __forceinline__ void load_partial(const float* area, uint64_t element, float (&acc)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(area + element + k));
      acc[k] = v.x;
      acc[k + 1] = v.y;
      acc[k + 2] = v.z;
      acc[k + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = __ldcg(area + element + k);
  }
}

// Where this rank sits among the islands, as every island kernel needs it: island `index` of
// `count`, each of `size` consecutive ranks; `first` its first rank, `local` this rank's index in
// it, `finisher` this rank's partner in the last island (where its chain ends), `peers` the other
// ranks of its island as a mask.
struct IslandPlace {
  int size, count, index, first, local, finisher;
  uint32_t peers;

  __device__ __forceinline__ explicit IslandPlace(const KernelArgs& a)
      : size(a.island_ranks),
        count(a.world / a.island_ranks),
        index(a.rank / a.island_ranks),
        first(index * size),
        local(a.rank - first),
        finisher((count - 1) * size + local),
        peers((((1u << size) - 1u) << first) & ~(1u << a.rank)) {}

  __device__ __forceinline__ bool last() const { return index == count - 1; }
  // Our partner in the previous island (who sends us its partial), or -1 in island 0.
  __device__ __forceinline__ int previous(int rank) const { return index > 0 ? rank - size : -1; }
};

// Where the partial of island `sender_island` lands in `receiver`'s workspace (above).
__device__ __forceinline__ float* partial_area(const KernelArgs& a, int receiver, int sender_island, Epoch epoch) {
  return reinterpret_cast<float*>(slot_of(a, receiver, sender_island * a.island_ranks, epoch));
}

// Unit `i` summed over our island in rank order, onto `partial` (the previous island's sums) or,
// in island 0, from the island's first rank: invariant 6's formula, split at island boundaries.
template <typename T, typename Unit>
__device__ __forceinline__ void island_sum(const KernelArgs& a, Epoch epoch, const Unit* own, uint64_t i,
                                           const float* partial, float (&acc)[Pack<T, Unit>::kElems]) {
  constexpr int kElems = Pack<T, Unit>::kElems;
  const int first = a.rank - a.rank % a.island_ranks;
  const uint64_t slot_units_each = a.layout.slot_bytes / sizeof(Unit);
  const Unit* slot0 = slot_units<Unit>(a, a.rank, 0, epoch);
  // An island holds at most half the world (there are at least two), so kSmallWorld entries
  // hold it in every instance.
  static_assert(kMaxRanks / 2 <= kSmallWorld, "an island must fit the small-world capacity");
  Pack<T, Unit> in[kSmallWorld];
#pragma unroll
  for (int m = 0; m < kSmallWorld; ++m) {
    const int r = first + m;
    if (m < a.island_ranks) {
      in[m].unit = r == a.rank ? load_unit(own + i) : load_pushed(slot0 + static_cast<uint64_t>(r) * slot_units_each + i);
    }
  }
  if (partial != nullptr) {
    load_partial<kElems>(partial, i * kElems, acc);
#pragma unroll
    for (int k = 0; k < kElems; ++k) acc[k] += to_float(in[0].elems[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kElems; ++k) acc[k] = to_float(in[0].elems[k]);
  }
#pragma unroll
  for (int m = 1; m < kSmallWorld; ++m) {
    if (m < a.island_ranks) {
#pragma unroll
      for (int k = 0; k < kElems; ++k) acc[k] += to_float(in[m].elems[k]);
    }
  }
}

// A link of the chain outside the last island: our island's sums onto the previous partial,
// pushed as fp32 to our partner in the next island.
template <typename T, typename Unit>
__device__ __forceinline__ void push_partial(const KernelArgs& a, Epoch epoch, const Unit* own, Range r,
                                             const float* partial_in, float* partial_out) {
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    float acc[Pack<T, Unit>::kElems];
    island_sum<T, Unit>(a, epoch, own, i, partial_in, acc);
    store_partial(partial_out, i * Pack<T, Unit>::kElems, acc);
  }
}

// The end of the chain (the last island): its sums onto the chain, rounded once, to our output.
template <typename T, typename Unit>
__device__ __forceinline__ void finish_shard(const KernelArgs& a, Epoch epoch, const Unit* own, Unit* out, Range r,
                                             const float* partial_in) {
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    float acc[Pack<T, Unit>::kElems];
    island_sum<T, Unit>(a, epoch, own, i, partial_in, acc);
    Pack<T, Unit> v;
#pragma unroll
    for (int k = 0; k < Pack<T, Unit>::kElems; ++k) v.elems[k] = from_float<T>(acc[k]);
    out[i] = v.unit;
  }
}

// Threads 0..W-1: thread p stores our flag of `kind` into peer p when p is in `targets`.
__device__ __forceinline__ void signal_targets(const KernelArgs& a, int kind, Epoch epoch, uint32_t targets) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < a.world && ((targets >> peer) & 1u)) signal_peer(a, peer, kind, epoch);
}

// Threads 0..W-1: thread p waits for peer p's flag of `kind` when p is in `peers` (in `stage`),
// or when p is `other` (in `other_stage`); true for the whole block only if every wait succeeded.
__device__ __forceinline__ bool wait_targets(const KernelArgs& a, int kind, Epoch epoch, uint32_t peers, Stage stage,
                                             int other = -1, Stage other_stage = Stage::kNone) {
  bool ok = true;
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < a.world) {
    if ((peers >> peer) & 1u) {
      ok = wait_peer(a, peer, kind, epoch, stage);
    } else if (peer == other) {
      ok = wait_peer(a, peer, kind, epoch, other_stage);
    }
  }
  return __syncthreads_and(ok) != 0;
}

// A link of the chain outside the last island, for the range `r` (units) and `tail` (elements):
// our island's sums onto the previous island's partial (`partial_in`, null in island 0), pushed
// as fp32 to our partner in the next island and flagged (kind 0); then the chain's result, which
// our partner in the last island (`place.finisher`) pushes into its slot of ours (kind 1), copied
// to `out`. False when that wait gave up.
template <typename T, typename Unit>
__device__ __forceinline__ bool relay_and_receive(const KernelArgs& a, const IslandPlace& place, Epoch epoch,
                                                  const Unit* in, const T* in_t, Unit* out, T* out_t, Range r,
                                                  Range tail, const float* partial_in) {
  const int finisher = place.finisher;
  const int next = a.rank + place.size;
  float* partial_out = partial_area(a, next, place.index, epoch);
  push_partial<T, Unit>(a, epoch, in, r, partial_in, partial_out);
  push_partial<T, T>(a, epoch, in_t, tail, partial_in, partial_out);
  __syncthreads();
  signal_targets(a, 0, epoch, 1u << next);
  if (!wait_targets(a, 1, epoch, 0u, Stage::kNone, finisher, Stage::kIslandResult)) return false;
  copy_from_slot<Unit>(a, finisher, epoch, out, r);
  copy_from_slot<T>(a, finisher, epoch, out_t, tail);
  return true;
}

}  // namespace pcie_ar
