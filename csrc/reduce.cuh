// Element types, 16-byte packs, and THE reduction formula every algorithm uses.
//
// Determinism rule: acc = float(x_0); acc += float(x_1); ...; acc += float(x_{W-1}); round once
// (round-to-nearest-even) to the output type. Same order on every rank and in every algorithm,
// so results are bitwise identical everywhere. The Triton fused kernels use the same formula.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "protocol.cuh"

namespace pcie_ar {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// A unit of transfer: either a 16-byte vector (aligned buffers) or a single element (the tail,
// or buffers that are not 16-byte aligned). Algorithms are written once over Unit.
template <typename T, typename Unit>
union Pack {
  static constexpr int kElems = sizeof(Unit) / sizeof(T);
  Unit unit;
  T elems[kElems];
};

// Plain load for memory this kernel's own rank owns or the user's input.
template <typename Unit>
__device__ __forceinline__ Unit load_unit(const Unit* p) { return *p; }

// `*p` loaded as raw bits of its size by `load` (a cache-operator load such as __ldcg or __ldcv,
// overloaded for uint4, unsigned int and unsigned short), as a Unit.
template <typename Unit, typename Load>
__device__ __forceinline__ Unit load_bits(const Unit* p, Load load) {
  if constexpr (sizeof(Unit) == 16) {
    uint4 v = load(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<Unit*>(&v);
  } else if constexpr (sizeof(Unit) == 4) {
    unsigned int v = load(reinterpret_cast<const unsigned int*>(p));
    return *reinterpret_cast<Unit*>(&v);
  } else {
    unsigned short v = load(reinterpret_cast<const unsigned short*>(p));
    return *reinterpret_cast<Unit*>(&v);
  }
}

// Load of data a peer pushed into our workspace: bypass L1 (.cg) so a line cached during an
// earlier call with the same parity cannot be served stale.
template <typename Unit>
__device__ __forceinline__ Unit load_pushed(const Unit* p) {
  return load_bits(p, [](const auto* q) { return __ldcg(q); });
}

// The kernels instanced per world size (oneshot_ll.cuh, oneshot_full.cuh): kWorld in
// [kMinRanks, kSmallWorld] is the world as a constant, so every loop over peers unrolls to exactly
// kWorld copies; kAnyWorld serves the larger worlds from a.world, its loops kMaxRanks predicated
// copies.
constexpr int kAnyWorld = 0;
template <int kWorld>
constexpr int kRankLoop = kWorld == kAnyWorld ? kMaxRanks : kWorld;
template <int kWorld>
__device__ __forceinline__ int world_of(const KernelArgs& a) {
  return kWorld == kAnyWorld ? a.world : kWorld;
}

// THE formula: fp32 sum in rank order 0..W-1, rounded once. Every path ends here.
template <typename T, typename Unit, int kCap>
__device__ __forceinline__ Unit sum_in_rank_order(const Pack<T, Unit> (&in)[kCap], int world) {
  Pack<T, Unit> out;
#pragma unroll
  for (int k = 0; k < Pack<T, Unit>::kElems; ++k) {
    float acc = to_float(in[0].elems[k]);
#pragma unroll
    for (int r = 1; r < kCap; ++r) {
      if (r < world) acc += to_float(in[r].elems[k]);
    }
    out.elems[k] = from_float<T>(acc);
  }
  return out.unit;
}

// Reduce unit `i` across ranks: our own contribution comes from `own`, every other rank's from
// its slot in our workspace (`slot0 + r * slot_units`). kCap: the rank capacity of the kernel's
// instance (kSmallWorld or kMaxRanks, protocol_constants.h), at least `world`.
template <typename T, typename Unit, int kCap>
__device__ __forceinline__ Unit reduce_unit(const Unit* own, const Unit* slot0, uint64_t slot_units, uint64_t i,
                                            int rank, int world) {
  // All loads first (independent, predicated), then the adds in rank order: W loads in flight at once.
  Pack<T, Unit> in[kCap];
#pragma unroll
  for (int r = 0; r < kCap; ++r) {
    if (r < world) in[r].unit = (r == rank) ? load_unit(own + i) : load_pushed(slot0 + static_cast<uint64_t>(r) * slot_units + i);
  }
  return sum_in_rank_order(in, world);
}

// A call that gives up (timeout, mismatch, abort) leaves NaN in its whole output: never the
// previous contents or a partial sum that could pass for a result (protocol invariant 5).
// Element stores, from every block that gave up: this is the failure path, not a fast one.
// (Declared in protocol.cuh, whose call frames use it.)
template <typename T> __device__ __forceinline__ T quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ __half quiet_nan<__half>() { return __ushort_as_half(0x7e00); }
template <> __device__ __forceinline__ __nv_bfloat16 quiet_nan<__nv_bfloat16>() { return __ushort_as_bfloat16(0x7fc0); }

template <typename T>
__device__ __noinline__ void fill_output_with_nan(const KernelArgs& a) {
  T* out = static_cast<T*>(a.output);
  const T nan = quiet_nan<T>();
  const uint64_t n = a.nbytes / sizeof(T);
  for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = nan;
}

}  // namespace pcie_ar
