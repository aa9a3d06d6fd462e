// Runtime facts for the Python side (pcie_allreduce._C), each safe to call on a machine without
// a GPU or driver: what is visible, what this build was compiled for.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "checks.cuh"
#include "workspace.h"

namespace pcie_ar {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

std::string runtime_status() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("CUDA runtime reports ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
  }
  if (n == 0) return "no CUDA device is visible";
  return "";
}

int runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

int driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

std::string pci_bus_id(int device) {
  char buf[64] = {0};
  PCIE_AR_CUDA_CHECK(cudaDeviceGetPCIBusId(buf, sizeof(buf), device));
  return std::string(buf);
}

int device_by_pci_bus_id(const std::string& bus_id) {
  int device = -1;
  if (cudaDeviceGetByPCIBusId(&device, bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

bool can_access_peer(int device, int peer_device) {
  if (device == peer_device) return true;
  int ok = 0;
  PCIE_AR_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, device, peer_device));
  return ok != 0;
}

std::vector<int> compiled_archs() {
#ifdef __CUDA_ARCH_LIST__
  return {__CUDA_ARCH_LIST__};
#else
  return {};
#endif
}

}  // namespace pcie_ar
