#include "launch.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "checks.cuh"
#include "fp8_twoshot.cuh"
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

// One kernel launch of `blocks` x kThreadsPerBlock threads; `dependent`: as the previous kernel's
// programmatic dependent (cudaLaunchAttributeProgrammaticStreamSerialization), which lets it start
// once that kernel allowed it (protocol.cuh's allow_dependent_launch) or ended.
template <typename Kernel>
void start(Kernel kernel, int blocks, cudaStream_t stream, const KernelArgs& args, bool dependent) {
  if (!dependent) {
    kernel<<<dim3(blocks), dim3(kThreadsPerBlock), 0, stream>>>(args);
    return;
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kThreadsPerBlock);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  PCIE_AR_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args));
}

// f(std::integral_constant<int, W>{}) for W == world up to kSmallWorld, and f(kAnyWorld) above it:
// the kernels instanced per world size (reduce.cuh's kAnyWorld).
template <typename F>
void with_world(int world, F&& f) {
  static_assert(kMinRanks == 2 && kSmallWorld == 8, "one instance per world size below");
  switch (world) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default:
      PCIE_AR_HOST_ASSERT(world > kSmallWorld && world <= kMaxRanks, "world size " + std::to_string(world) + " out of range");
      f(std::integral_constant<int, kAnyWorld>{});
  }
}

// f(std::integral_constant<int, C>{}) for the rank capacity C of the instances that serve `world`
// (protocol_constants.h's kSmallWorld).
template <typename F>
void with_capacity(int world, F&& f) {
  if (world <= kSmallWorld) {
    f(std::integral_constant<int, kSmallWorld>{});
  } else {
    f(std::integral_constant<int, kMaxRanks>{});
  }
}

template <typename T, typename Unit, int kCap>
void launch_typed(Algo algo, const KernelArgs& args, int blocks, cudaStream_t stream, bool dependent) {
  switch (algo) {
    case Algo::kOneShot: start(oneshot_kernel<T, Unit, false, kCap>, blocks, stream, args, dependent); break;
    case Algo::kStaged: start(oneshot_kernel<T, Unit, true, kCap>, blocks, stream, args, dependent); break;
    case Algo::kTwoShot: start(twoshot_kernel<T, Unit, false, kCap>, blocks, stream, args, dependent); break;
    case Algo::kTwoShotStaged: start(twoshot_kernel<T, Unit, true, kCap>, blocks, stream, args, dependent); break;
    case Algo::kHostOneShot: start(host_oneshot_kernel<T, Unit, kCap>, blocks, stream, args, dependent); break;
    case Algo::kHostTwoShot: start(host_twoshot_kernel<T, Unit, kCap>, blocks, stream, args, dependent); break;
    case Algo::kOneShotFull:
      with_world(args.world, [&](auto w) {
        start(oneshot_full_kernel<T, Unit, decltype(w)::value>, blocks, stream, args, dependent);
      });
      break;
    case Algo::kTwoShotFull: start(twoshot_full_kernel<T, Unit, kCap>, blocks, stream, args, dependent); break;
    // An island holds at most half the world: the island kernels need no larger capacity (island.cuh).
    case Algo::kIslandTwoShot: start(island_twoshot_kernel<T, Unit>, blocks, stream, args, dependent); break;
    case Algo::kIslandOneShot: start(island_oneshot_kernel<T, Unit>, blocks, stream, args, dependent); break;
    case Algo::kOneShotPull: start(oneshot_pull_kernel<T, Unit, kCap>, blocks, stream, args, dependent); break;
    case Algo::kTwoShotPull: start(twoshot_pull_kernel<T, Unit, kCap>, blocks, stream, args, dependent); break;
    case Algo::kTwoShotSymm: start(twoshot_symm_kernel<T, Unit, kCap>, blocks, stream, args, dependent); break;
    // Element-wise whatever the alignment (fp8_twoshot.cuh, Q1): one instance per dtype and capacity.
    case Algo::kTwoShotFp8: start(twoshot_fp8_kernel<T, kCap>, blocks, stream, args, dependent); break;
    default: PCIE_AR_HOST_ASSERT(false, "unknown algorithm id " + std::to_string(static_cast<int>(algo)));
  }
}

template <typename T, typename Unit>
void launch_with_capacity(Algo algo, const KernelArgs& args, int blocks, cudaStream_t stream, bool dependent) {
  with_capacity(args.world, [&](auto cap) { launch_typed<T, Unit, decltype(cap)::value>(algo, args, blocks, stream, dependent); });
}

template <typename T>
void launch_low_latency(const KernelArgs& args, int blocks, cudaStream_t stream, bool dependent) {
  // 8-byte payload words need 8-byte aligned input and output; line slots are always aligned.
  const bool aligned = ((reinterpret_cast<uintptr_t>(args.input) | reinterpret_cast<uintptr_t>(args.output)) & 7u) == 0;
  with_world(args.world, [&](auto w) {
    if (aligned) {
      start(oneshot_ll_kernel<T, true, decltype(w)::value>, blocks, stream, args, dependent);
    } else {
      start(oneshot_ll_kernel<T, false, decltype(w)::value>, blocks, stream, args, dependent);
    }
  });
}

template <typename T>
void launch_aligned_or_not(Algo algo, const KernelArgs& args, int blocks, cudaStream_t stream, bool dependent) {
  if (algo == Algo::kOneShotLL) {
    launch_low_latency<T>(args, blocks, stream, dependent);
    return;
  }
  // Vectors need 16-byte aligned input and output; slots are always 256-byte aligned.
  const bool aligned = ((reinterpret_cast<uintptr_t>(args.input) | reinterpret_cast<uintptr_t>(args.output)) & 15u) == 0;
  if (aligned) {
    launch_with_capacity<T, uint4>(algo, args, blocks, stream, dependent);
  } else {
    launch_with_capacity<T, T>(algo, args, blocks, stream, dependent);
  }
}

}  // namespace

void launch_all_reduce(Algo algo, int dtype, const KernelArgs& args, int blocks, cudaStream_t stream,
                       bool dependent) {
  PCIE_AR_HOST_ASSERT(blocks >= 1 && blocks <= kMaxLaunchBlocks,
                      "blocks must be in [1, " + std::to_string(kMaxLaunchBlocks) + "], got " + std::to_string(blocks));
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: launch_aligned_or_not<float>(algo, args, blocks, stream, dependent); break;
    case DType::kFloat16: launch_aligned_or_not<__half>(algo, args, blocks, stream, dependent); break;
    case DType::kBFloat16: launch_aligned_or_not<__nv_bfloat16>(algo, args, blocks, stream, dependent); break;
    default: PCIE_AR_HOST_ASSERT(false, "unsupported dtype id " + std::to_string(dtype));
  }
  PCIE_AR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace pcie_ar
