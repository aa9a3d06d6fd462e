// Host-side entry to the kernels: picks the instantiation for (algorithm, dtype, alignment).
#pragma once

#include <cuda_runtime.h>

#include "protocol.cuh"

namespace pcie_ar {

// 32-bit signature of a call's shape; peers must agree on it (protocol invariant 3).
uint32_t call_signature(Algo algo, int dtype, uint64_t nbytes, int blocks);

// `dependent`: launch as the previous kernel's programmatic dependent (Hopper and later; the
// kernel waits for that kernel in begin_call before it reads anything, so only the launch overlaps).
void launch_all_reduce(Algo algo, int dtype, const KernelArgs& args, int blocks, cudaStream_t stream,
                       bool dependent = false);

}  // namespace pcie_ar
