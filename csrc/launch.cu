#include "launch.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "checks.cuh"
#include "host_oneshot.cuh"
#include "host_twoshot.cuh"
#include "island_oneshot.cuh"
#include "island_twoshot.cuh"
#include "oneshot.cuh"
#include "oneshot_full.cuh"
#include "oneshot_ll.cuh"
#include "pull.cuh"
#include "twoshot.cuh"
#include "twoshot_full.cuh"

namespace pcie_ar {

uint32_t call_signature(Algo algo, int dtype, uint64_t nbytes, int blocks) {
  // FNV-1a over the fields: cheap, and any difference in shape flips the word with high probability.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(algo));
  mix(static_cast<uint64_t>(dtype));
  mix(nbytes);
  mix(static_cast<uint64_t>(blocks));
  return static_cast<uint32_t>(h ^ (h >> 32));
}

namespace {

// f(std::integral_constant<int, W>{}) for W == world: the kernels instanced per world size.
template <typename F>
void with_world(int world, F&& f) {
  static_assert(kMinRanks == 2 && kMaxRanks == 8, "one instance per world size below");
  switch (world) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: PCIE_AR_HOST_ASSERT(false, "world size " + std::to_string(world) + " out of range");
  }
}

template <typename T, typename Unit>
void launch_typed(Algo algo, const KernelArgs& args, int blocks, cudaStream_t stream) {
  const dim3 grid(blocks), block(kThreadsPerBlock);
  switch (algo) {
    case Algo::kOneShot: oneshot_kernel<T, Unit, false><<<grid, block, 0, stream>>>(args); break;
    case Algo::kStaged: oneshot_kernel<T, Unit, true><<<grid, block, 0, stream>>>(args); break;
    case Algo::kTwoShot: twoshot_kernel<T, Unit, false><<<grid, block, 0, stream>>>(args); break;
    case Algo::kTwoShotStaged: twoshot_kernel<T, Unit, true><<<grid, block, 0, stream>>>(args); break;
    case Algo::kHostOneShot: host_oneshot_kernel<T, Unit><<<grid, block, 0, stream>>>(args); break;
    case Algo::kHostTwoShot: host_twoshot_kernel<T, Unit><<<grid, block, 0, stream>>>(args); break;
    case Algo::kOneShotFull:
      with_world(args.world, [&](auto w) { oneshot_full_kernel<T, Unit, decltype(w)::value><<<grid, block, 0, stream>>>(args); });
      break;
    case Algo::kTwoShotFull: twoshot_full_kernel<T, Unit><<<grid, block, 0, stream>>>(args); break;
    case Algo::kIslandTwoShot: island_twoshot_kernel<T, Unit><<<grid, block, 0, stream>>>(args); break;
    case Algo::kIslandOneShot: island_oneshot_kernel<T, Unit><<<grid, block, 0, stream>>>(args); break;
    case Algo::kOneShotPull: oneshot_pull_kernel<T, Unit><<<grid, block, 0, stream>>>(args); break;
    case Algo::kTwoShotPull: twoshot_pull_kernel<T, Unit><<<grid, block, 0, stream>>>(args); break;
    default: PCIE_AR_HOST_ASSERT(false, "unknown algorithm id " + std::to_string(static_cast<int>(algo)));
  }
}

template <typename T>
void launch_low_latency(const KernelArgs& args, int blocks, cudaStream_t stream) {
  // 8-byte payload words need 8-byte aligned input and output; line slots are always aligned.
  const bool aligned = ((reinterpret_cast<uintptr_t>(args.input) | reinterpret_cast<uintptr_t>(args.output)) & 7u) == 0;
  const dim3 grid(blocks), block(kThreadsPerBlock);
  with_world(args.world, [&](auto w) {
    if (aligned) {
      oneshot_ll_kernel<T, true, decltype(w)::value><<<grid, block, 0, stream>>>(args);
    } else {
      oneshot_ll_kernel<T, false, decltype(w)::value><<<grid, block, 0, stream>>>(args);
    }
  });
}

template <typename T>
void launch_aligned_or_not(Algo algo, const KernelArgs& args, int blocks, cudaStream_t stream) {
  if (algo == Algo::kOneShotLL) {
    launch_low_latency<T>(args, blocks, stream);
    return;
  }
  // Vectors need 16-byte aligned input and output; slots are always 256-byte aligned.
  const bool aligned = ((reinterpret_cast<uintptr_t>(args.input) | reinterpret_cast<uintptr_t>(args.output)) & 15u) == 0;
  if (aligned) {
    launch_typed<T, uint4>(algo, args, blocks, stream);
  } else {
    launch_typed<T, T>(algo, args, blocks, stream);
  }
}

}  // namespace

void launch_all_reduce(Algo algo, int dtype, const KernelArgs& args, int blocks, cudaStream_t stream) {
  PCIE_AR_HOST_ASSERT(blocks >= 1 && blocks <= kMaxLaunchBlocks,
                      "blocks must be in [1, " + std::to_string(kMaxLaunchBlocks) + "], got " + std::to_string(blocks));
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: launch_aligned_or_not<float>(algo, args, blocks, stream); break;
    case DType::kFloat16: launch_aligned_or_not<__half>(algo, args, blocks, stream); break;
    case DType::kBFloat16: launch_aligned_or_not<__nv_bfloat16>(algo, args, blocks, stream); break;
    default: PCIE_AR_HOST_ASSERT(false, "unsupported dtype id " + std::to_string(dtype));
  }
  PCIE_AR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace pcie_ar
