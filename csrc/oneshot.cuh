// One-shot push all-reduce, plain and staged.
//
// Each block owns a contiguous part of the message. It pushes that part of its input into its
// slot of every peer's workspace, flags each peer, waits for every peer's flag for the same part
// in its own workspace, then reduces the W contributions in rank order into the output.
//
// Plain: one load, W-1 stores per vector; all peers receive at once (best when the fabric takes
//   all-to-all writes, e.g. NVLink, a PCIe switch, or one GPU under MPS).
// Staged: in stage s (1..W-1) the block writes only to peer (rank+s)%W and flags it before moving
//   on, so each rank has one outbound and one inbound stream at a time: PCIe root complexes
//   collapse under all-to-all posted writes but sustain one-to-one.
//
// In place (output == input) is safe: a block writes only its own part of the output, after it
// has pushed that part, and no other block reads it.
// Protocol invariants: protocol.cuh.
#pragma once

#include "moves.cuh"

namespace pcie_ar {

template <typename T, typename Unit, bool kStaged, int kCap>
__global__ void __launch_bounds__(kThreadsPerBlock) oneshot_kernel(const __grid_constant__ KernelArgs a) {
  p2p_call<T, AbortVerdict::kFirstBarrier>(a, [&](Epoch epoch, bool aborted) {
    const Range body = to_units<Unit>(split(a.nbytes / kGranule, gridDim.x, blockIdx.x));
    const Range tail = block_tail<T>(a.nbytes);
    const Unit* in = static_cast<const Unit*>(a.input);
    const T* in_t = static_cast<const T*>(a.input);

    bool sent = true;
    if constexpr (kStaged) {
      for (int s = 1; s < a.world && sent; ++s) {
        const int peer = (a.rank + s) % a.world;
        if (!aborted) {
          push_to_peer<Unit>(a, peer, epoch, in, body);
          push_to_peer<T>(a, peer, epoch, in_t, tail);
        }
        sent = verdict_barrier(aborted);
        if (sent && threadIdx.x == 0) signal_peer(a, peer, 0, epoch);
      }
    } else {
      if (!aborted) {
        push_to_all_peers<Unit, kCap>(a, epoch, in, body);
        push_to_all_peers<T, kCap>(a, epoch, in_t, tail);
      }
      sent = verdict_barrier(aborted);
      if (sent) signal_all_peers(a, 0, epoch);
    }

    if (!sent || !wait_all_peers(a, 0, epoch, Stage::kOneShotGather)) return false;
    reduce_range<T, Unit, false, kCap>(a, epoch, in, static_cast<Unit*>(a.output), body);
    reduce_range<T, T, false, kCap>(a, epoch, in_t, static_cast<T*>(a.output), tail);
    return true;
  });
}

}  // namespace pcie_ar
