// Host-side entry to the kernels: picks the instantiation for (algorithm, dtype, alignment).
#pragma once

#include <cuda_runtime.h>

#include "protocol.cuh"

namespace pcie_ar {

// 32-bit signature of a call's shape; peers must agree on it (protocol invariant 3).
uint32_t call_signature(Algo algo, int dtype, uint64_t nbytes, int blocks);

void launch_all_reduce(Algo algo, int dtype, const KernelArgs& args, int blocks, cudaStream_t stream);

}  // namespace pcie_ar
