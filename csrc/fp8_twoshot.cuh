// twoshot_fp8: the pull two-shot (pull.cuh's protocol, flags and slots) with the message on the
// wire as FP8 e4m3 codes, one power-of-two fp32 scale per block of kFp8Block elements: 132 bytes
// per 128 values instead of 256 for bf16 / fp16. Opt-in (all_reduce(x, wire="fp8")), never auto.
//
// The format and its rounding are pcie_allreduce/fp8_wire.py's, bit for bit:
//   scale s of a block: its largest finite magnitude a = m * 2^E (frexp, 0.5 <= m < 1) gives
//     s = 2^(E - 9 + (m > 0.8125)), never below 2^-126; s = 1 for a block without a nonzero finite;
//     finite values then code within +-416, and the codes +-448 carry +-Inf (e4m3fn has no Inf);
//   code: x clamped to +-kFp8Largest (1.875 * 2^127: four significant bits of anything larger
//     round to 2^128, beyond fp32) times 1/s (exact: a power of two) rounded to nearest even
//     e4m3; +-Inf codes as +-448, NaN as NaN;
//   value: code * s (exact), +-Inf for the codes +-448.
// Dataflow per call: every rank codes its input's blocks of the other ranks' shards into its own
// slot (local stores, on the host transport its own host segment), flags kind 0; the owner of a
// shard decodes every rank's blocks of it (its own coded in registers from its input, the peers'
// read from their slots), sums in fp32 in rank order, codes the sum into its own shard's blocks of
// its own slot, writes the sum's decoded value rounded once to T as its output, flags kind 1;
// every rank decodes the other owners' coded sums into its output. The same sum and the same
// codes on every rank, whatever the launch shape: bitwise identical results.
//
// Layout in a rank's own slot of the call's parity: the codes of every block (block b at byte
// 128 b, the last block's padding coded as zeros), then the scales (fp32, block b at codes_bytes + 4 b).
// fp8_wire_bytes(nbytes / sizeof(T)) must fit slot_bytes (checked at launch).
// Invariants, beside pull.cuh's P1-P2:
//  Q1. Shards are runs of whole blocks (the message's blocks split among the ranks, each shard's
//      among the CUDA blocks), so every rank cuts a message the same way whatever its alignment.
//  Q2. Peers read only the blocks of their own shards from our slot; we write our own shard's
//      blocks (the coded sum) there only after our kind-0 wait, and nobody else reads them
//      before our kind-1 flag (pull.cuh's P3).
//  Q3. A warp codes a group of kFp8GroupBlocks = 8 consecutive blocks of a CUDA block's range
//      (the last group of a range clipped to it): lane l holds 16 consecutive elements of blocks
//      l/8 and 4 + l/8 of the group, one 16-byte vector of codes each, so a warp moves the group's
//      1 KiB of codes in two fully coalesced loads or stores and its 8 scales (32 contiguous
//      bytes) in one. A block's scale comes from a max over its 8 lanes of their largest finite
//      magnitudes (a max is exact: the same whatever the order).
// In place is safe: each element's input is read before its output is written, by the same lane.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "pull.cuh"

namespace pcie_ar {

constexpr int kFp8GroupBlocks = 8;                              // blocks a warp codes at once (Q3)
constexpr int kFp8LanesPerBlock = 32 / (kFp8GroupBlocks / 2);   // each lane holds two blocks' worth
constexpr int kFp8PerLane = static_cast<int>(kFp8Block) / kFp8LanesPerBlock;  // values per lane per block
constexpr int kFp8MinExponent = -126;
constexpr uint8_t kFp8NaN = 0x7F;      // e4m3's NaN, what a NaN codes as
constexpr uint8_t kFp8PosInf = 0x7E;   // e4m3's +448, which the wire gives to +Inf
constexpr uint8_t kFp8NegInf = 0xFE;   // and -448 to -Inf
constexpr float kFp8InfValue = 448.0f;
constexpr float kFp8Largest = 0x1.ep127f;  // 1.875 * 2^127 = 240 * 2^120, where finite values saturate

static_assert(kFp8PerLane == 16, "a lane's codes of one block are one 16-byte vector (Q3)");
static_assert(kFp8GroupBlocks <= 32, "a group's scales are loaded by one lane each");

// One rank's coded message: codes then scales, in `owner`'s own slot of this call's parity.
struct Fp8Wire {
  uint8_t* codes;
  float* scales;
};

__device__ __forceinline__ Fp8Wire fp8_wire_of(const KernelArgs& a, int owner, Epoch epoch, uint64_t blocks) {
  uint8_t* base = own_slot<uint8_t>(a, owner, epoch);
  return {base, reinterpret_cast<float*>(base + blocks * kFp8Block)};
}

// The scale of a block whose largest finite magnitude is `amax` (fp8_wire.block_scales): at most
// 416 / amax, so no finite code reaches 448 (+-Inf's).
__device__ __forceinline__ float fp8_scale(float amax, float* inverse) {
  if (!(amax > 0.0f)) {
    *inverse = 1.0f;
    return 1.0f;
  }
  int e;
  const float m = frexpf(amax, &e);
  int exponent = e - 9 + (m > 0.8125f ? 1 : 0);
  exponent = exponent < kFp8MinExponent ? kFp8MinExponent : exponent;
  *inverse = ldexpf(1.0f, -exponent);
  return ldexpf(1.0f, exponent);
}

__device__ __forceinline__ uint32_t fp8_code(float x, float inverse) {
  if (!isfinite(x)) return isnan(x) ? kFp8NaN : (x > 0.0f ? kFp8PosInf : kFp8NegInf);
  // The clamp acts only in blocks of scale 2^120 (their rounding would reach 2^128); then
  // |x * inverse| <= 416 by the scale, so the saturation never acts; round to nearest even.
  const float clamped = fminf(fmaxf(x, -kFp8Largest), kFp8Largest);
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(__fmul_rn(clamped, inverse), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float fp8_value(uint32_t code, float scale) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code & 0xFFu), __NV_E4M3);
  const float f = __half2float(__half(h));
  // +-448 is +-Inf (f * Inf); any other code times its scale, exact.
  return __fmul_rn(f, fabsf(f) == kFp8InfValue ? __int_as_float(0x7f800000) : scale);
}

// Where this lane's part of a group starting at block `group` lies (Q3): half h is block
// group + 4h + lane/8, elements 16 (lane % 8) .. +15 of it.
struct Fp8Lane {
  uint64_t block[2];
  uint64_t first[2];  // element index of its first value
};

__device__ __forceinline__ Fp8Lane fp8_lane(uint64_t group) {
  const int lane = threadIdx.x % 32;
  Fp8Lane l;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l.block[h] = group + h * (kFp8GroupBlocks / 2) + lane / kFp8LanesPerBlock;
    l.first[h] = l.block[h] * kFp8Block + (lane % kFp8LanesPerBlock) * kFp8PerLane;
  }
  return l;
}

// Codes a lane's 16 values of a block: the scale from a max over the block's 8 lanes (all 32
// lanes call it together), the codes packed low byte first.
__device__ __forceinline__ uint4 fp8_code_part(const float (&v)[kFp8PerLane], float* scale) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kFp8PerLane; ++j) amax = fmaxf(amax, isfinite(v[j]) ? fabsf(v[j]) : 0.0f);
#pragma unroll
  for (int d = 1; d < kFp8LanesPerBlock; d *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
  float inverse;
  *scale = fp8_scale(amax, &inverse);
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[k] = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) w[k] |= fp8_code(v[4 * k + j], inverse) << (8 * j);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void fp8_decode_part(uint4 packed, float scale, float (&v)[kFp8PerLane]) {
  const uint32_t w[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[4 * k + j] = fp8_value(w[k] >> (8 * j), scale);
  }
}

// 16 values of `x` from element `first` (a multiple of 16) as fp32, 0 beyond numel: vector
// loads where `x` is 16-byte aligned and the run is whole, else element by element.
template <typename T>
__device__ __forceinline__ void fp8_load_values(const T* x, uint64_t first, uint64_t numel, float (&v)[kFp8PerLane]) {
  constexpr int kPerVector = 16 / sizeof(T);
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0 && first + kFp8PerLane <= numel) {
    const uint4* p = reinterpret_cast<const uint4*>(x + first);
#pragma unroll
    for (int u = 0; u < kFp8PerLane / kPerVector; ++u) {
      const uint4 bits = p[u];
      const T* t = reinterpret_cast<const T*>(&bits);
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) v[u * kPerVector + j] = static_cast<float>(t[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kFp8PerLane; ++j) v[j] = first + j < numel ? static_cast<float>(x[first + j]) : 0.0f;
  }
}

// Stores 16 fp32 values rounded once to T (round to nearest even) from element `first`,
// nothing beyond numel.
template <typename T>
__device__ __forceinline__ void fp8_store_values(T* x, uint64_t first, uint64_t numel, const float (&v)[kFp8PerLane]) {
  constexpr int kPerVector = 16 / sizeof(T);
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0 && first + kFp8PerLane <= numel) {
    uint4* p = reinterpret_cast<uint4*>(x + first);
#pragma unroll
    for (int u = 0; u < kFp8PerLane / kPerVector; ++u) {
      uint4 bits;
      T* t = reinterpret_cast<T*>(&bits);
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) t[j] = static_cast<T>(v[u * kPerVector + j]);
      p[u] = bits;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kFp8PerLane; ++j) {
      if (first + j < numel) x[first + j] = static_cast<T>(v[j]);
    }
  }
}

// Loads a lane's two parts of a group of `x` (0 at or beyond block `end` and beyond numel).
template <typename T>
__device__ __forceinline__ void fp8_load_group(const T* x, uint64_t end, uint64_t numel, const Fp8Lane& l,
                                               float (&v)[2][kFp8PerLane]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) fp8_load_values(x, l.first[h], l.block[h] < end ? numel : 0, v[h]);
}

// Codes a lane's two parts of a group and stores them (codes, and the group's scales gathered
// into lanes 0..7 so one 32-byte store writes them) into `wire`, nothing at or beyond `end`.
__device__ __forceinline__ void fp8_put_group(const Fp8Wire& wire, uint64_t group, uint64_t end, const Fp8Lane& l,
                                              float (&v)[2][kFp8PerLane], bool decode_back) {
  const int lane = threadIdx.x % 32;
  float scale[2];
  uint4 packed[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    packed[h] = fp8_code_part(v[h], &scale[h]);
    if (l.block[h] < end) {
      *reinterpret_cast<uint4*>(wire.codes + l.first[h]) = packed[h];
    }
    if (decode_back) fp8_decode_part(packed[h], scale[h], v[h]);
  }
  const int source = (lane % (kFp8GroupBlocks / 2)) * kFp8LanesPerBlock;  // lane l < 8 takes block l's
  const float s0 = __shfl_sync(0xffffffffu, scale[0], source);
  const float s1 = __shfl_sync(0xffffffffu, scale[1], source);
  if (lane < kFp8GroupBlocks && group + lane < end) wire.scales[group + lane] = lane < kFp8GroupBlocks / 2 ? s0 : s1;
}

// Loads and decodes a lane's two parts of a group from a peer's `wire` (0 at or beyond `end`).
__device__ __forceinline__ void fp8_get_group(const Fp8Wire& wire, uint64_t group, uint64_t end, const Fp8Lane& l,
                                              float (&v)[2][kFp8PerLane]) {
  const int lane = threadIdx.x % 32;
  const float mine = lane < kFp8GroupBlocks && group + lane < end ? load_remote(wire.scales + group + lane) : 1.0f;
  uint4 packed[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    packed[h] = l.block[h] < end ? load_remote(reinterpret_cast<const uint4*>(wire.codes + l.first[h]))
                                 : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float scale = __shfl_sync(0xffffffffu, mine, static_cast<int>(l.block[h] - group));
    fp8_decode_part(packed[h], scale, v[h]);
  }
}

// This CUDA block's blocks of rank `owner`'s shard (Q1).
__device__ __forceinline__ Range fp8_shard_part(uint64_t blocks, int world, int owner) {
  const Range shard = split(blocks, world, owner);
  const Range sub = split(shard.end - shard.begin, gridDim.x, blockIdx.x);
  return {shard.begin + sub.begin, shard.begin + sub.end};
}

template <typename T, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock) twoshot_fp8_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kFirstBarrier>(a, [&](Epoch epoch, bool aborted) {
    const uint64_t numel = a.nbytes / sizeof(T);
    const uint64_t blocks = fp8_blocks(numel);
    const T* in = static_cast<const T*>(a.input);
    T* out = static_cast<T*>(a.output);
    const uint64_t warp = threadIdx.x / 32;
    const uint64_t stride = static_cast<uint64_t>(blockDim.x / 32) * kFp8GroupBlocks;  // blocks per warp sweep
    const Fp8Wire mine = fp8_wire_of(a, a.rank, epoch, blocks);
    float v[2][kFp8PerLane];
    if (!aborted) {
      for (int s = 1; s < a.world; ++s) {  // our contribution to every other shard (Q2)
        const Range r = fp8_shard_part(blocks, a.world, (a.rank + s) % a.world);
        for (uint64_t g = r.begin + warp * kFp8GroupBlocks; g < r.end; g += stride) {
          const Fp8Lane l = fp8_lane(g);
          fp8_load_group(in, r.end, numel, l, v);
          fp8_put_group(mine, g, r.end, l, v, false);
        }
      }
    }
    if (!verdict_barrier(aborted)) return false;
    signal_all_peers(a, 0, epoch);
    if (!wait_all_peers(a, 0, epoch, Stage::kPullReduceScatter)) return false;
    const Range r = fp8_shard_part(blocks, a.world, a.rank);
    for (uint64_t g = r.begin + warp * kFp8GroupBlocks; g < r.end; g += stride) {
      const Fp8Lane l = fp8_lane(g);
      float acc[2][kFp8PerLane];
      for (int q = 0; q < a.world; ++q) {  // rank order
        float part[2][kFp8PerLane];
        if (q == a.rank) {  // our own contribution, coded as the peers code theirs
          fp8_load_group(in, r.end, numel, l, part);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float scale;
            fp8_decode_part(fp8_code_part(part[h], &scale), scale, part[h]);
          }
        } else {
          fp8_get_group(fp8_wire_of(a, q, epoch, blocks), g, r.end, l, part);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int j = 0; j < kFp8PerLane; ++j) acc[h][j] = q == 0 ? part[h][j] : __fadd_rn(acc[h][j], part[h][j]);
        }
      }
      fp8_put_group(mine, g, r.end, l, acc, true);  // the coded sum, and its value
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (l.block[h] < r.end) fp8_store_values(out, l.first[h], numel, acc[h]);
      }
    }
    __syncthreads();
    signal_all_peers(a, 1, epoch);
    if (!wait_all_peers(a, 1, epoch, Stage::kPullAllGather)) return false;
    for (int s = 1; s < a.world; ++s) {
      const int owner = (a.rank + s) % a.world;
      const Fp8Wire peer = fp8_wire_of(a, owner, epoch, blocks);
      const Range ro = fp8_shard_part(blocks, a.world, owner);
      for (uint64_t g = ro.begin + warp * kFp8GroupBlocks; g < ro.end; g += stride) {
        const Fp8Lane l = fp8_lane(g);
        fp8_get_group(peer, g, ro.end, l, v);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (l.block[h] < ro.end) fp8_store_values(out, l.first[h], numel, v[h]);
        }
      }
    }
    return true;
  });
}

}  // namespace pcie_ar
