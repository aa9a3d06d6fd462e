// System-scope release/acquire on 64-bit flags, and the GPU's global nanosecond timer.
//
// Why system scope: a flag may be written by another GPU across PCIe (or another process on this
// GPU under MPS); only .sys orders those writes. Why no atomics: PCIe peer atomics are optional and
// absent on many root complexes, so every cross-device signal is a plain release store observed by
// an acquire load of local memory.
#pragma once

#include <cstdint>

namespace pcie_ar {

__device__ __forceinline__ void store_release_sys(uint64_t* addr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* addr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t load_relaxed_sys(const uint64_t* addr) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
  return value;
}

// A store that orders nothing (no "memory" clobber): the compiler may move ordinary loads and
// stores across it, so a kernel's first input loads need not wait behind it (call notices).
__device__ __forceinline__ void store_relaxed_sys_unordered(uint64_t* addr, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value));
}

__device__ __forceinline__ uint32_t load_volatile(const uint32_t* addr) {
  return *reinterpret_cast<const volatile uint32_t*>(addr);
}

// Nanoseconds, the same clock on every SM; coarse (microsecond-ish ticks) but plenty for timeouts.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace pcie_ar
