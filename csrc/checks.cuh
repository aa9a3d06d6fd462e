// Host and device assertions that carry file and line.
//
// Host failures become C++ exceptions, which pybind11 turns into Python RuntimeError with the
// message intact; device assertions trap, which surfaces as a sticky CUDA error naming the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <stdexcept>
#include <string>

namespace pcie_ar {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + expr + " failed: " +
                           cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

[[noreturn]] inline void throw_host_assert(const char* cond, const std::string& msg, const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + msg + " [" + cond + "]");
}

}  // namespace pcie_ar

#define PCIE_AR_CUDA_CHECK(expr)                                              \
  do {                                                                        \
    cudaError_t pcie_ar_err_ = (expr);                                        \
    if (pcie_ar_err_ != cudaSuccess) {                                        \
      ::pcie_ar::throw_cuda_error(pcie_ar_err_, #expr, __FILE__, __LINE__);   \
    }                                                                         \
  } while (0)

#define PCIE_AR_HOST_ASSERT(cond, msg)                                        \
  do {                                                                        \
    if (!(cond)) ::pcie_ar::throw_host_assert(#cond, (msg), __FILE__, __LINE__); \
  } while (0)

#define PCIE_AR_DEVICE_ASSERT(cond)                                                          \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      printf("%s:%d: device assertion failed: %s\n", __FILE__, __LINE__, #cond);             \
      __trap();                                                                              \
    }                                                                                        \
  } while (0)
