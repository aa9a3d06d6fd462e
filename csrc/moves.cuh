// Block-wide data movements the algorithms are built from. Each runs over a unit range with all
// threads of the block striding by blockDim.x (coalesced 16-byte accesses when Unit is a vector).
#pragma once

#include "partition.cuh"
#include "protocol.cuh"
#include "reduce.cuh"

namespace pcie_ar {

template <typename Unit>
__device__ __forceinline__ Unit* slot_units(const KernelArgs& a, int owner, int sender, Epoch epoch) {
  return reinterpret_cast<Unit*>(slot_of(a, owner, sender, epoch));
}

// Posted writes of src[r] into `peer`'s slot for us.
template <typename Unit>
__device__ __forceinline__ void push_to_peer(const KernelArgs& a, int peer, Epoch epoch, const Unit* src, Range r) {
  Unit* dst = slot_units<Unit>(a, peer, a.rank, epoch);
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) dst[i] = load_unit(src + i);
}

// One load, W-1 posted writes: every peer's slot for us at once (the unstaged one-shot). kCap: the
// kernel instance's rank capacity (reduce.cuh's reduce_unit).
template <typename Unit, int kCap>
__device__ __forceinline__ void push_to_all_peers(const KernelArgs& a, Epoch epoch, const Unit* src, Range r) {
  Unit* dst[kCap];
#pragma unroll
  for (int s = 1; s < kCap; ++s) {
    if (s < a.world) dst[s] = slot_units<Unit>(a, (a.rank + s) % a.world, a.rank, epoch);
  }
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const Unit v = load_unit(src + i);
#pragma unroll
    for (int s = 1; s < kCap; ++s) {
      if (s < a.world) dst[s][i] = v;
    }
  }
}

// out[r] = sum over ranks (own input + peers' pushes in our slots), in rank order. When
// `forward` is set, also push the result into every peer's slot for us (two-shot all-gather).
template <typename T, typename Unit, bool kForward, int kCap>
__device__ __forceinline__ void reduce_range(const KernelArgs& a, Epoch epoch, const Unit* own, Unit* out, Range r) {
  const Unit* slot0 = slot_units<Unit>(a, a.rank, 0, epoch);
  const uint64_t per_slot = a.layout.slot_bytes / sizeof(Unit);
  Unit* dst[kCap];
  if constexpr (kForward) {
#pragma unroll
    for (int s = 1; s < kCap; ++s) {
      if (s < a.world) dst[s] = slot_units<Unit>(a, (a.rank + s) % a.world, a.rank, epoch);
    }
  }
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const Unit v = reduce_unit<T, Unit, kCap>(own, slot0, per_slot, i, a.rank, a.world);
    out[i] = v;
    if constexpr (kForward) {
#pragma unroll
      for (int s = 1; s < kCap; ++s) {
        if (s < a.world) dst[s][i] = v;
      }
    }
  }
}

// out[r] = what `peer` pushed into its slot in our workspace.
template <typename Unit>
__device__ __forceinline__ void copy_from_slot(const KernelArgs& a, int peer, Epoch epoch, Unit* out, Range r) {
  const Unit* src = slot_units<Unit>(a, a.rank, peer, epoch);
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) out[i] = load_pushed(src + i);
}

// Signal every peer (threads 0..W-1 each store one flag). Call after __syncthreads().
__device__ __forceinline__ void signal_all_peers(const KernelArgs& a, int kind, Epoch epoch) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < a.world && peer != a.rank) signal_peer(a, peer, kind, epoch);
}

}  // namespace pcie_ar
