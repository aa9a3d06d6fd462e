// The low-latency line: 8 bytes of payload travel as one 16-byte line {lo, flag, hi, flag}.
//
// Why two flag words: a 16-byte store may reach the peer as two 8-byte halves (PCIe, NVLink and
// the L2 all keep naturally aligned 8-byte stores whole), so each half carries its own flag and
// a line counts as arrived only when both match. Volatile (relaxed, system-scope) accesses: the
// receiver sees each half exactly as some store wrote it, and no fence is needed anywhere.
#pragma once

#include <cstdint>

#include "protocol_constants.h"

namespace pcie_ar {

// kLinePayloadBytes, kLineBytes and kLineFlagMix live in protocol_constants.h (Python mirrors them).

// The flag of the call with this epoch and signature. Never 0 (a cleared line), and for a fixed
// epoch it differs for different signatures, so a peer that issued another call is detected.
__device__ __forceinline__ uint32_t line_flag(uint32_t epoch, uint32_t signature) {
  const uint32_t f = signature ^ (epoch * kLineFlagMix);
  return f != 0u ? f : kLineFlagMix;
}

// The signature a peer's flag stands for (for the mismatch report).
__device__ __forceinline__ uint32_t line_signature(uint32_t flag, uint32_t epoch) { return flag ^ (epoch * kLineFlagMix); }

__device__ __forceinline__ void store_line(uint4* dst, uint2 payload, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(payload.x), "r"(flag), "r"(payload.y),
               "r"(flag)
               : "memory");
}

__device__ __forceinline__ uint4 load_line(const uint4* src) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(src)
               : "memory");
  return v;
}

__device__ __forceinline__ void clear_line(uint4* p) { *p = make_uint4(0u, 0u, 0u, 0u); }

}  // namespace pcie_ar
