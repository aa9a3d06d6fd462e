// How a message is cut among blocks (and, for two-shot, among owner ranks).
//
// Cuts are made in 16-byte granules whatever the transfer unit, so a rank whose buffer is not
// 16-byte aligned (it moves single elements) still covers exactly the same bytes per block as its
// peers moving 16-byte vectors: flags are per block, so every rank must agree on what a block is.
// The tail (nbytes % 16) belongs to the last block and always moves as single elements.
#pragma once

#include <cstdint>

namespace pcie_ar {

constexpr uint64_t kGranule = 16;

struct Range {
  uint64_t begin;
  uint64_t end;
};

// Part `idx` of `parts` near-equal contiguous parts of [0, n).
__host__ __device__ __forceinline__ Range split(uint64_t n, uint64_t parts, uint64_t idx) {
  const uint64_t per = (n + parts - 1) / parts;
  const uint64_t b = per * idx < n ? per * idx : n;
  const uint64_t e = b + per < n ? b + per : n;
  return {b, e};
}

// Granule range -> range in units of `Unit`.
template <typename Unit>
__device__ __forceinline__ Range to_units(Range granules) {
  constexpr uint64_t k = kGranule / sizeof(Unit);
  return {granules.begin * k, granules.end * k};
}

// Rank `owner`'s shard of a two-shot message of `nbytes`, in granules (the tail bytes belong to
// the last rank's shard and move as single elements).
__device__ __forceinline__ Range shard_granules(uint64_t nbytes, int world, int owner) {
  return split(nbytes / kGranule, world, owner);
}

// This block's part of rank `owner`'s shard, in units: the shard's granules split among the blocks.
template <typename Unit>
__device__ __forceinline__ Range shard_part(uint64_t nbytes, int world, int owner) {
  const Range shard = shard_granules(nbytes, world, owner);
  const Range sub = split(shard.end - shard.begin, gridDim.x, blockIdx.x);
  return to_units<Unit>(Range{shard.begin + sub.begin, shard.begin + sub.end});
}

// Tail elements of type T: [first, last) in element indices.
template <typename T>
__device__ __forceinline__ Range tail_elements(uint64_t nbytes) {
  return {nbytes / kGranule * (kGranule / sizeof(T)), nbytes / sizeof(T)};
}

__device__ __forceinline__ bool owns_tail() { return blockIdx.x == gridDim.x - 1; }

// This block's share of the tail: all of it in the last block (owns_tail), nothing in the others.
template <typename T>
__device__ __forceinline__ Range block_tail(uint64_t nbytes) {
  return owns_tail() ? tail_elements<T>(nbytes) : Range{0, 0};
}

}  // namespace pcie_ar
