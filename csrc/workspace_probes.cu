// The creation-time transfer test: every rank writes a pattern into each peer's workspace, with
// the same kind of posted store the algorithms make, and checks what the peers wrote into its own;
// a platform that drops or stalls peer writes is found at creation, before any call
// (pcie_allreduce/workspaces.py raises, naming the pairs). Its kernel may never end on such a
// platform, so the wait for it is bounded and a workspace whose kernel still runs is abandoned
// rather than released.
#include <cstring>
#include <stdexcept>
#include <vector>

#include "workspace_state.h"

namespace pcie_ar {

using workspace_detail::DeviceGuard;
using workspace_detail::PrivateStream;
using workspace_detail::RelaxedCaptureMode;
using workspace_detail::run_on_private_stream;
using workspace_detail::seconds_to_ns;
using workspace_detail::wait_for_event;

namespace {

// The probe pattern rank `sender` writes for `seed`: no word is 0, so a slot never written (zeroed
// at creation) never passes.
__host__ __device__ inline uint32_t probe_word(uint32_t seed, int sender, int i) {
  return (seed ^ (0x9E3779B9u * static_cast<uint32_t>(sender + 1) + 0x7F4A7C15u * static_cast<uint32_t>(i))) | 1u;
}

constexpr int kProbeWords = static_cast<int>(kProbeBytes / sizeof(uint32_t));

struct ProbeTargets {
  char* peers[kMaxRanks];
};

// One thread per (peer, word): the same kind of posted SM store the algorithms make. It waits for
// no flag, so it needs no timeout of its own: only `delay_ns` (a test hook, 0 otherwise; bounded
// by the GPU clock) holds it before its stores. What can hold it longer is the platform, a store
// or the fence stalled in hardware, which no code on the GPU can interrupt; so write_probes
// bounds its wait on the host, and close() never waits for a kernel that may never end.
__global__ void write_probes_kernel(ProbeTargets targets, uint64_t offset, uint32_t seed, int rank, int world,
                                    uint64_t delay_ns) {
  if (delay_ns != 0) {
    const uint64_t started = global_timer_ns();
    while (global_timer_ns() - started < delay_ns) __nanosleep(1000);
  }
  const int peer = threadIdx.x / kProbeWords;
  const int word = threadIdx.x % kProbeWords;
  if (peer >= world || peer == rank) return;
  reinterpret_cast<volatile uint32_t*>(targets.peers[peer] + offset)[word] = probe_word(seed, rank, word);
  __threadfence_system();
}

// The probes use the parity-1 data slots: before the first call nothing reads them, and a call
// reads a data slot only after the sender's flag for that call, so leftovers could never pass
// for data; they are cleared anyway.
uint64_t probe_offset(const Layout& layout, int sender) {
  return layout.parity_bytes + static_cast<uint64_t>(sender) * layout.slot_bytes;
}

}  // namespace

void Workspace::write_probes(uint32_t seed) {
  PCIE_AR_HOST_ASSERT(state_->peers_open, "write_probes before open_peers");
  PCIE_AR_HOST_ASSERT(state_->probes_pending == nullptr, "write_probes after a transfer test that did not complete");
  RelaxedCaptureMode relaxed;
  DeviceGuard guard(device_);
  ProbeTargets targets{};
  for (int r = 0; r < world_; ++r) targets.peers[r] = state_->peers[r];
  PrivateStream stream;
  cudaEvent_t done;
  PCIE_AR_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  write_probes_kernel<<<1, kMaxRanks * kProbeWords, 0, stream.get()>>>(
      targets, probe_offset(state_->layout, rank_), seed, rank_, world_, state_->debug_probe_delay_ns);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaEventRecord(done, stream.get());
  // Bounded like every other wait: a platform that stalls peer writes makes this rank report it
  // within the timeout (its peers learn it from the creation step's gather) instead of hanging.
  if (err == cudaSuccess) err = wait_for_event(done, state_->timeout_ns);
  if (err == cudaErrorNotReady) {
    state_->probes_pending = done;  // close() asks it before releasing anything the kernel writes
    const char* writes = state_->transport == Transport::kHost ? "writes into the shared pinned host memory"
                                                              : "peer-to-peer writes";
    throw std::runtime_error("rank " + std::to_string(rank_) + ": the creation-time transfer test's writes into the "
                             "peers' workspaces did not complete within " + std::to_string(timeout()) + " s: " +
                             writes + " stall on this platform. That kernel may never end, so closing this "
                             "workspace leaves its memory and its mappings of the peers' workspaces allocated "
                             "until the process exits (releasing them would wait for the kernel)");
  }
  cudaEventDestroy(done);
  PCIE_AR_CUDA_CHECK(err);
}

void Workspace::debug_delay_probes(double seconds) {
  PCIE_AR_HOST_ASSERT(seconds == 0 || (seconds > 0 && seconds <= static_cast<double>(kMaxTimeoutSeconds)),
                      "the probe delay must be 0 or positive seconds, at most " + std::to_string(kMaxTimeoutSeconds));
  state_->debug_probe_delay_ns = seconds == 0 ? 0 : seconds_to_ns(seconds);
}

// cudaFree and cudaFreeHost wait for the device's running kernels, and cudaIpcCloseMemHandle and
// cudaHostUnregister may. After write_probes gave up on its kernel, one stalled in the platform
// would make them, and so the caller's cleanup after the failed creation, hang forever. So while that
// kernel runs, this workspace releases nothing it maps or owns: the whole state is leaked on
// purpose (the driver reclaims it when the process exits) and replaced by a closed one. Only the
// host segment's /dev/shm name goes, which takes no CUDA call. True when it did so.
bool Workspace::abandon_if_probes_run() {
  cudaEvent_t pending = state_->probes_pending;
  if (pending == nullptr) return false;
  state_->probes_pending = nullptr;
  const cudaError_t status = cudaEventQuery(pending);
  cudaEventDestroy(pending);  // never waits: a pending event is released once it completes
  if (status != cudaErrorNotReady) {
    if (status != cudaSuccess) cudaGetLastError();  // the release that follows reports its own errors
    return false;  // the kernel ended since: release as usual
  }
  state_->own.release_name();
  auto closed = std::make_unique<State>();
  closed->transport = state_->transport;
  closed->layout = state_->layout;
  closed->timeout_ns = state_->timeout_ns;
  closed->abandoned = true;
  static_cast<void>(state_.release());  // deliberately leaked, see above
  state_ = std::move(closed);
  return true;
}

std::vector<int> Workspace::probe_failures(uint32_t seed) {
  PCIE_AR_HOST_ASSERT(state_->peers_open, "probe_failures before open_peers");
  RelaxedCaptureMode relaxed;
  DeviceGuard guard(device_);
  std::vector<uint32_t> got(static_cast<size_t>(world_) * kProbeWords, 0);
  run_on_private_stream([&](cudaStream_t stream) {
    cudaError_t err = cudaSuccess;
    for (int sender = 0; sender < world_ && err == cudaSuccess; ++sender) {
      if (sender == rank_) continue;
      uint32_t* into = &got[static_cast<size_t>(sender) * kProbeWords];
      if (state_->transport == Transport::kHost) {  // host memory: read and clear it from here
        volatile uint32_t* slot = reinterpret_cast<volatile uint32_t*>(state_->own.host_pointer() +
                                                                       probe_offset(state_->layout, sender));
        for (int i = 0; i < kProbeWords; ++i) {
          into[i] = slot[i];
          slot[i] = 0;
        }
        continue;
      }
      char* slot = state_->local + probe_offset(state_->layout, sender);
      err = cudaMemcpyAsync(into, slot, kProbeBytes, cudaMemcpyDeviceToHost, stream);
      if (err == cudaSuccess) err = cudaMemsetAsync(slot, 0, kProbeBytes, stream);
    }
    return err;
  });
  std::vector<int> failed;
  for (int sender = 0; sender < world_; ++sender) {
    if (sender == rank_) continue;
    for (int i = 0; i < kProbeWords; ++i) {
      if (got[static_cast<size_t>(sender) * kProbeWords + i] != probe_word(seed, sender, i)) {
        failed.push_back(sender);
        break;
      }
    }
  }
  return failed;
}

}  // namespace pcie_ar
