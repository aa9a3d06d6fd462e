// The host transport's write-once one-shot ("host_oneshot"): each rank writes its message once
// into its input area (host_wire.cuh) and reads the W-1 others' there. Per rank and call, over
// its own PCIe link: the message out once, W-1 messages in.
#pragma once

#include <cstdint>

#include "host_wire.cuh"

namespace pcie_ar {

// Sum every rank's units [r) in rank order: ours from our input as it travels (H1), the peers'
// from their input areas, polled until each unit arrived. False (this thread) on timeout or abort.
template <typename T, typename Unit, int kCap>
__device__ __forceinline__ bool reduce_inputs(const KernelArgs& a, uint32_t buffer, Epoch epoch, const Unit* in,
                                              Unit* out, Range r) {
  const auto theirs = [&](int p) -> const Unit* { return shared_area<Unit>(a, p, buffer, SharedArea::kInput); };
  uint64_t started = 0;
  uint32_t spins = 0;
  for (uint64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    Pack<T, Unit> got[kCap];
    if (!gather_unit<T, Unit, kCap>(a, a.world, theirs, in, i, epoch, Stage::kHostGather, spins, started, got)) return false;
    out[i] = sum_in_rank_order(got, a.world);  // in place: this unit's input was read above
  }
  return true;
}

template <typename T, typename Unit, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) host_oneshot_kernel(const __grid_constant__ KernelArgs a) {
  write_once_call<T>(a, false, [&](uint32_t buffer, Epoch epoch) {
    const Range body = to_units<Unit>(split(a.nbytes / kGranule, gridDim.x, blockIdx.x));
    const Range tail = block_tail<T>(a.nbytes);
    publish_header(a, buffer, epoch);
    publish_input<T, Unit>(a, buffer, static_cast<const Unit*>(a.input), body);
    publish_input<T, T>(a, buffer, static_cast<const T*>(a.input), tail);
    bool ok = wait_headers(a, buffer, epoch);
    ok = ok && reduce_inputs<T, Unit, kCap>(a, buffer, epoch, static_cast<const Unit*>(a.input),
                                      static_cast<Unit*>(a.output), body);
    ok = ok && reduce_inputs<T, T, kCap>(a, buffer, epoch, static_cast<const T*>(a.input), static_cast<T*>(a.output), tail);
    return ok;
  });
}

}  // namespace pcie_ar
