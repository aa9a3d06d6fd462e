// What the workspace's translation units share and nothing else includes: the state behind
// Workspace (its memory, the peers' mappings, the launch template) and the host-side helpers that
// let creation, the transfer test and teardown run inside a caller's graph capture.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>

#include "checks.cuh"
#include "host_segment.h"
#include "launch.cuh"
#include "protocol.cuh"
#include "workspace.h"

namespace pcie_ar {
namespace workspace_detail {

// Allocation, IPC and host-mapped memory are not stream work; when the caller is inside a CUDA
// graph capture (a workspace created lazily for a capture stream), relaxed mode lets them run.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() : mode_(cudaStreamCaptureModeRelaxed) { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_;
};

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    PCIE_AR_CUDA_CHECK(cudaGetDevice(&previous_));
    changed_ = previous_ != device;
    if (changed_) PCIE_AR_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

inline uint64_t seconds_to_ns(double seconds) {
  PCIE_AR_HOST_ASSERT(seconds > 0 && std::isfinite(seconds) && seconds <= static_cast<double>(kMaxTimeoutSeconds),
                      "timeout must be a positive number of seconds, at most " + std::to_string(kMaxTimeoutSeconds));
  return static_cast<uint64_t>(seconds * 1e9);
}

// A non-blocking stream of our own, destroyed on every path (a throw included). Destroying a
// stream whose work still runs does not wait for it: the driver releases it when that work ends.
class PrivateStream {
 public:
  PrivateStream() { PCIE_AR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~PrivateStream() { cudaStreamDestroy(stream_); }
  PrivateStream(const PrivateStream&) = delete;
  PrivateStream& operator=(const PrivateStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Enqueue work on a private non-blocking stream and wait for it: the legacy stream would
// synchronize with a stream the caller may be capturing. `enqueue(stream)` returns its first error.
template <typename Enqueue>
void run_on_private_stream(Enqueue enqueue) {
  PrivateStream stream;
  const cudaError_t queued = enqueue(stream.get());
  const cudaError_t done = cudaStreamSynchronize(stream.get());
  PCIE_AR_CUDA_CHECK(queued);
  PCIE_AR_CUDA_CHECK(done);
}

// Poll `event` until it completes or `timeout_ns` pass; cudaErrorNotReady when it did not.
inline cudaError_t wait_for_event(cudaEvent_t event, uint64_t timeout_ns) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  cudaError_t done = cudaEventQuery(event);
  while (done == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    done = cudaEventQuery(event);
  }
  return done;
}

// The last call's shape and its signature. Eager callers repeat one shape call after call (a
// decode step's hidden size), so the FNV hash over the shape runs once per change of shape
// instead of on every call; call_signature stays the one definition of the value.
class SignatureMemo {
 public:
  uint32_t of(Algo algo, int dtype, uint64_t nbytes, int blocks) {
    if (!valid_ || algo != algo_ || dtype != dtype_ || nbytes != nbytes_ || blocks != blocks_) {
      signature_ = call_signature(algo, dtype, nbytes, blocks);
      valid_ = true;
      algo_ = algo;
      dtype_ = dtype;
      nbytes_ = nbytes;
      blocks_ = blocks;
    }
    return signature_;
  }

 private:
  bool valid_ = false;
  Algo algo_ = Algo::kOneShot;
  int dtype_ = 0;
  uint64_t nbytes_ = 0;
  int blocks_ = 0;
  uint32_t signature_ = 0;
};

}  // namespace workspace_detail

struct Workspace::State {
  using SignatureMemo = workspace_detail::SignatureMemo;
  Transport transport = Transport::kP2P;
  char* local = nullptr;
  // Host transport: this rank's segment and the peers' (local is own.device_pointer()).
  HostSegment own;
  HostSegment peer_segments[kMaxRanks];
  std::string segment_name;  // own's name in /dev/shm, made by the caller
  // Host transport: device memory for the local-only words (control, row statistics).
  char* local_only = nullptr;

  // The base the local-only offsets of the layout apply to (KernelArgs::local).
  char* local_base() const { return local_only != nullptr ? local_only - layout.control_offset : local; }
  Control* control() const { return reinterpret_cast<Control*>(local_base() + layout.control_offset); }
  ErrorRecord* error_host = nullptr;
  ErrorRecord* error_device = nullptr;
  char* peers[kMaxRanks] = {};
  // `peers` in device memory, for the Triton kernels (one pointer argument at any world size):
  // written once by open_peers, so no caller ever copies it, not even inside a graph capture.
  uint64_t* peers_table = nullptr;
  Layout layout{};
  uint64_t timeout_ns = 0;
  int island_ranks = 0;
  bool dependent_launch = false;  // launch as the previous kernel's programmatic dependent
  bool peers_open = false;
  bool captured = false;  // a graph capture recorded a call: retire(), never close()
  bool retired = false;
  // The transfer test's end, recorded after its kernel, while write_probes gave up waiting for it
  // (abandon_if_probes_run); null otherwise.
  cudaEvent_t probes_pending = nullptr;
  bool abandoned = false;  // close() left the memory allocated for such a kernel
  uint64_t debug_probe_delay_ns = 0;
  // Every field of a launch's arguments that is not the call's own (bases, layout, error record,
  // timeout, rank, world), kept current by open_peers and set_timeout: a call copies it and fills
  // in its pointers, size and signature instead of rebuilding the rest each time.
  KernelArgs launch_template{};
  SignatureMemo signatures;

  void refresh_launch_template(int rank, int world) {
    KernelArgs& t = launch_template;
    t = KernelArgs{};
    for (int r = 0; r < world; ++r) t.bases[r] = peers[r];
    t.local = local_base();
    t.layout = layout;
    t.error = error_device;
    t.timeout_ns = timeout_ns;
    t.rank = rank;
    t.world = world;
    t.island_ranks = island_ranks;
  }
};

}  // namespace pcie_ar
