// Workspace: creation (memory of either transport, the peers' mappings), calls, and teardown. The
// creation-time transfer test is in workspace_probes.cu; the state both share in workspace_state.h.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "workspace_state.h"

namespace pcie_ar {

using workspace_detail::DeviceGuard;
using workspace_detail::RelaxedCaptureMode;
using workspace_detail::run_on_private_stream;
using workspace_detail::seconds_to_ns;

namespace {

// The full-payload one-shot's slots (after its headers), which start as poison.
uint64_t full_slots_offset(const Layout& l) { return l.full_offset + kFullHeaderBytes; }
uint64_t full_slots_bytes(const Layout& l, int world) { return 2 * static_cast<uint64_t>(world) * l.ll_capacity; }

__global__ void fill_words_kernel(uint32_t* words, uint64_t n, uint32_t value) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    words[i] = value;
  }
}

}  // namespace

Workspace::Workspace(int device, int rank, int world, uint64_t max_bytes, double timeout_s, int transport,
                     const std::string& segment_name)
    : state_(std::make_unique<State>()), device_(device), rank_(rank), world_(world), max_bytes_(max_bytes) {
  PCIE_AR_HOST_ASSERT(transport == static_cast<int>(Transport::kP2P) || transport == static_cast<int>(Transport::kHost),
                      "unknown transport id " + std::to_string(transport));
  state_->transport = static_cast<Transport>(transport);
  PCIE_AR_HOST_ASSERT(state_->transport != Transport::kHost || !segment_name.empty(),
                      "the host transport needs a segment name");
  state_->segment_name = segment_name;
  PCIE_AR_HOST_ASSERT(world >= kMinRanks && world <= kMaxRanks, "world size must be in [" + std::to_string(kMinRanks) +
                                                                      ", " + std::to_string(kMaxRanks) + "], got " +
                                                                      std::to_string(world));
  PCIE_AR_HOST_ASSERT(rank >= 0 && rank < world, "rank out of range");
  PCIE_AR_HOST_ASSERT(max_bytes > 0 && max_bytes <= kMaxMessageBytes,
                      "max_bytes must be in [1, " + std::to_string(kMaxMessageBytes) + "], got " +
                          std::to_string(max_bytes));
  state_->timeout_ns = seconds_to_ns(timeout_s);
  state_->layout = Layout::make(max_bytes, world, state_->transport);

  RelaxedCaptureMode relaxed;
  DeviceGuard guard(device);
  try {
    allocate();
  } catch (...) {
    close();  // all or nothing: a failed construction keeps no device or pinned memory
    throw;
  }
}

void Workspace::allocate() {
  if (state_->transport == Transport::kHost) {
    state_->own.create(state_->segment_name, state_->layout.total_bytes);  // zero-filled: flags at epoch 0
    state_->local = state_->own.device_pointer();
    // The host one-shot's buffers start unwritten: poison everywhere (host_oneshot.cuh, H1).
    uint32_t* shared = reinterpret_cast<uint32_t*>(state_->own.host_pointer() + state_->layout.shared_offset +
                                                   kSharedHeaderBytes);
    std::fill(shared, shared + kSharedBuffers * kSharedAreas * state_->layout.slot_bytes / sizeof(uint32_t), kPoisonWord);
    uint32_t* full = reinterpret_cast<uint32_t*>(state_->own.host_pointer() + full_slots_offset(state_->layout));
    std::fill(full, full + full_slots_bytes(state_->layout, world_) / sizeof(uint32_t), kPoisonWord);
    const uint64_t local_bytes = state_->layout.shared_offset - state_->layout.control_offset;
    PCIE_AR_CUDA_CHECK(cudaMalloc(&state_->local_only, local_bytes));
    run_on_private_stream([&](cudaStream_t s) { return cudaMemsetAsync(state_->local_only, 0, local_bytes, s); });
  } else {
    allocate_device_memory();
  }
  PCIE_AR_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&state_->error_host), sizeof(ErrorRecord),
                                   cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(state_->error_host, 0, sizeof(ErrorRecord));
  PCIE_AR_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&state_->error_device), state_->error_host, 0));
  PCIE_AR_CUDA_CHECK(cudaMalloc(&state_->peers_table, kMaxRanks * sizeof(uint64_t)));
  run_on_private_stream([&](cudaStream_t s) {
    return cudaMemsetAsync(state_->peers_table, 0, kMaxRanks * sizeof(uint64_t), s);
  });
  state_->peers[rank_] = state_->local;
}

void Workspace::write_peers_table() {
  const std::vector<uint64_t> table = bases();
  run_on_private_stream([&](cudaStream_t s) {
    return cudaMemcpyAsync(state_->peers_table, table.data(), table.size() * sizeof(uint64_t), cudaMemcpyHostToDevice, s);
  });
}

void Workspace::allocate_device_memory() {
  PCIE_AR_CUDA_CHECK(cudaMalloc(&state_->local, state_->layout.total_bytes));
  // Zeroed flags are "epoch 0", older than any call. Zero and wait, so the buffer is clean
  // before its handle ever leaves this process.
  run_on_private_stream([&](cudaStream_t s) {
    const cudaError_t zeroed = cudaMemsetAsync(state_->local, 0, state_->layout.total_bytes, s);
    if (zeroed != cudaSuccess) return zeroed;
    // The full-payload slots start unwritten: poison (oneshot_full.cuh, F1).
    fill_words_kernel<<<64, 256, 0, s>>>(reinterpret_cast<uint32_t*>(state_->local + full_slots_offset(state_->layout)),
                                         full_slots_bytes(state_->layout, world_) / sizeof(uint32_t), kPoisonWord);
    return cudaGetLastError();
  });
}

Workspace::~Workspace() {
  try {
    close();
  } catch (...) {
    // Destructors must not throw; close() already released what it could.
  }
}

std::string Workspace::ipc_handle() const {
  PCIE_AR_HOST_ASSERT(state_->local != nullptr, "workspace is closed");
  if (state_->transport == Transport::kHost) return state_->own.name();
  cudaIpcMemHandle_t handle;
  PCIE_AR_CUDA_CHECK(cudaIpcGetMemHandle(&handle, state_->local));
  return p2p_export(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)), state_->layout.total_bytes);
}

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "the p2p export's handle size");

std::string p2p_export(const std::string& ipc_handle, uint64_t bytes) {
  PCIE_AR_HOST_ASSERT(ipc_handle.size() == kIpcHandleBytes,
                      "an IPC handle is " + std::to_string(kIpcHandleBytes) + " bytes, got " +
                          std::to_string(ipc_handle.size()));
  std::string blob = ipc_handle;
  blob.append(reinterpret_cast<const char*>(&bytes), sizeof(bytes));
  return blob;
}

std::string p2p_import(const std::string& blob, uint64_t expected_bytes, int rank, int peer) {
  const std::string who = "rank " + std::to_string(rank) + " refuses the workspace of rank " + std::to_string(peer);
  const uint64_t export_bytes = kIpcHandleBytes + sizeof(uint64_t);
  if (blob.size() != export_bytes) {
    throw std::runtime_error(who + ": its export is " + std::to_string(blob.size()) + " bytes, this build's are " +
                             std::to_string(export_bytes) + "; every rank must run the same pcie_allreduce build");
  }
  uint64_t bytes = 0;
  std::memcpy(&bytes, blob.data() + kIpcHandleBytes, sizeof(bytes));
  if (bytes != expected_bytes) {
    throw std::runtime_error(who + ": it is " + std::to_string(bytes) + " bytes, this rank's layout needs " +
                             std::to_string(expected_bytes) + " (a smaller one would let the kernels write past its "
                             "end); every rank must run the same pcie_allreduce build with the same max_bytes and "
                             "world size");
  }
  return blob.substr(0, kIpcHandleBytes);
}

void Workspace::open_peers(const std::vector<std::string>& handles) {
  PCIE_AR_HOST_ASSERT(static_cast<int>(handles.size()) == world_, "need one IPC handle per rank");
  PCIE_AR_HOST_ASSERT(!state_->peers_open, "peers already opened");
  RelaxedCaptureMode relaxed;
  DeviceGuard guard(device_);
  if (state_->transport == Transport::kHost) {
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      try {
        state_->peer_segments[r].open(handles[r], state_->layout.total_bytes);
      } catch (const std::exception& e) {
        throw std::runtime_error("rank " + std::to_string(rank_) + " could not map the host workspace of rank " +
                                 std::to_string(r) + ": " + e.what());
      }
      state_->peers[r] = state_->peer_segments[r].device_pointer();
    }
    write_peers_table();
    state_->refresh_launch_template(rank_, world_);
    state_->peers_open = true;
    return;
  }
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    // Checked before mapping: a peer's allocation of another size is never mapped at all.
    const std::string raw = p2p_import(handles[r], state_->layout.total_bytes, rank_, r);
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, raw.data(), sizeof(handle));
    void* ptr = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      throw std::runtime_error("rank " + std::to_string(rank_) + " could not map the workspace of rank " +
                               std::to_string(r) + " (cudaIpcOpenMemHandle: " + cudaGetErrorString(err) +
                               "); the GPUs need CUDA peer access (P2P) and the ranks must run on one host");
    }
    state_->peers[r] = static_cast<char*>(ptr);
  }
  write_peers_table();
  state_->refresh_launch_template(rank_, world_);
  state_->peers_open = true;
}

bool Workspace::abandoned() const { return state_->abandoned; }

uint32_t Workspace::all_reduce(int algo, uint64_t input, uint64_t output, uint64_t nbytes, int dtype, int blocks,
                               uint64_t stream) {
  // close() frees the error record, retire() unmaps the peers
  PCIE_AR_HOST_ASSERT(state_->local != nullptr && !state_->retired, "workspace is closed");
  // The host reads the record with no CUDA call: it is pinned, mapped memory the kernels write.
  const uint32_t failed = reinterpret_cast<volatile ErrorRecord*>(state_->error_host)->kind;
  if (failed != 0) return failed;
  PCIE_AR_HOST_ASSERT(state_->peers_open, "all_reduce before open_peers");
  if (!state_->captured) note_capture(stream);
  PCIE_AR_HOST_ASSERT(nbytes <= max_bytes_, "message larger than the workspace's max_bytes");
  if (nbytes == 0) return 0;
  // What the algorithm's record (kAlgorithms, protocol_constants.h) asks of this workspace and call.
  const AlgoRecord* record = algo_record(algo);
  PCIE_AR_HOST_ASSERT(record != nullptr, "unknown algorithm id " + std::to_string(algo));
  PCIE_AR_HOST_ASSERT(!record->has(kAlgoHostOnly) || state_->transport == Transport::kHost,
                      std::string(record->name) + " runs on the host transport only");
  PCIE_AR_HOST_ASSERT(!record->has(kAlgoCapped) || nbytes + record->capacity_margin <= state_->layout.ll_capacity,
                      "message larger than " + std::string(record->name) + "'s capacity (" +
                          std::to_string(state_->layout.ll_capacity - record->capacity_margin) +
                          " bytes, from the low-latency capacity); use another algorithm");
  PCIE_AR_HOST_ASSERT(!record->has(kAlgoIsland) || state_->island_ranks != 0,
                      std::string(record->name) + " needs islands: the workspace has none (set_island_ranks)");
  PCIE_AR_HOST_ASSERT(!record->has(kAlgoSymmetricInput) ||
                          (state_->layout.input_bytes != 0 &&
                           input == reinterpret_cast<uint64_t>(state_->launch_template.bases[rank_]) +
                                        state_->layout.input_offset),
                      std::string(record->name) +
                          " reads every rank's input in place: the input must start at this workspace's "
                          "symmetric input area (Communicator.symmetric_input)");
  PCIE_AR_HOST_ASSERT(!record->has(kAlgoFp8Wire) ||
                          fp8_wire_bytes(nbytes / dtype_bytes(dtype)) <= state_->layout.slot_bytes,
                      std::string(record->name) + ": the coded message (" +
                          std::to_string(fp8_wire_bytes(nbytes / dtype_bytes(dtype))) + " bytes) does not fit the workspace's slot (" + std::to_string(state_->layout.slot_bytes) +
                          " bytes); use a larger max_bytes");
  KernelArgs args = state_->launch_template;
  args.input = reinterpret_cast<const void*>(input);
  args.output = reinterpret_cast<void*>(output);
  args.nbytes = nbytes;
  args.signature = state_->signatures.of(static_cast<Algo>(algo), dtype, nbytes, blocks);
  DeviceGuard guard(device_);  // sets the device only when the caller's current one differs
  launch_all_reduce(static_cast<Algo>(algo), dtype, args, blocks, reinterpret_cast<cudaStream_t>(stream),
                    state_->dependent_launch);
  return 0;
}

uint32_t Workspace::failed() const {
  if (state_->error_host == nullptr) return 0;
  return reinterpret_cast<volatile ErrorRecord*>(state_->error_host)->kind;
}

CallError Workspace::error() const {
  CallError e;
  if (state_->error_host == nullptr) return e;
  const volatile ErrorRecord* rec = state_->error_host;
  e.kind = rec->kind;
  if (e.kind == 0) return e;
  e.rank = rec->rank;
  e.peer = rec->peer;
  e.stage = rec->stage;
  e.block = rec->block;
  e.epoch = rec->epoch;
  e.expected_signature = rec->expected_signature;
  e.observed_signature = rec->observed_signature;
  return e;
}

uint32_t Workspace::signature(int algo, int dtype, uint64_t nbytes, int blocks) const {
  return call_signature(static_cast<Algo>(algo), dtype, nbytes, blocks);
}

void Workspace::set_timeout(double seconds) {
  state_->timeout_ns = seconds_to_ns(seconds);
  state_->launch_template.timeout_ns = state_->timeout_ns;  // the next launch's wait bound too
}
double Workspace::timeout() const { return static_cast<double>(state_->timeout_ns) * 1e-9; }

void Workspace::set_island_ranks(int ranks) {
  PCIE_AR_HOST_ASSERT(ranks == 0 || (ranks >= 2 && world_ % ranks == 0 && world_ / ranks >= 2),
                      "island_ranks must be 0 or divide the world (" + std::to_string(world_) +
                          ") into >= 2 islands of >= 2 ranks, got " + std::to_string(ranks));
  state_->island_ranks = ranks;
  state_->launch_template.island_ranks = ranks;  // the next launch's islands too
}
int Workspace::island_ranks() const { return state_->island_ranks; }

void Workspace::set_dependent_launch(bool on) { state_->dependent_launch = on; }
bool Workspace::dependent_launch() const { return state_->dependent_launch; }

std::vector<uint64_t> Workspace::bases() const {
  std::vector<uint64_t> out(world_);
  for (int r = 0; r < world_; ++r) out[r] = reinterpret_cast<uint64_t>(state_->peers[r]);
  return out;
}
uint64_t Workspace::error_record_device_ptr() const { return reinterpret_cast<uint64_t>(state_->error_device); }
uint64_t Workspace::peers_table_device_ptr() const { return reinterpret_cast<uint64_t>(state_->peers_table); }
uint64_t Workspace::slot_bytes() const { return state_->layout.slot_bytes; }
uint64_t Workspace::parity_bytes() const { return state_->layout.parity_bytes; }
uint64_t Workspace::ll_capacity() const { return state_->layout.ll_capacity; }
uint64_t Workspace::ll_slot_bytes() const { return state_->layout.ll_slot_bytes; }
uint64_t Workspace::ll_offset() const { return state_->layout.ll_offset; }
uint64_t Workspace::flags_offset() const { return state_->layout.flags_offset; }
uint64_t Workspace::control_offset() const { return state_->layout.control_offset; }
uint64_t Workspace::local_base() const { return reinterpret_cast<uint64_t>(state_->local_base()); }
uint64_t Workspace::stats_offset() const { return state_->layout.stats_offset; }
uint64_t Workspace::shared_offset() const { return state_->layout.shared_offset; }
uint64_t Workspace::shared_bytes() const { return state_->layout.shared_bytes; }
uint64_t Workspace::full_offset() const { return state_->layout.full_offset; }
uint64_t Workspace::full_bytes() const { return state_->layout.full_bytes; }
uint64_t Workspace::input_offset() const { return state_->layout.input_offset; }
uint64_t Workspace::input_bytes() const { return state_->layout.input_bytes; }
uint64_t Workspace::total_bytes() const { return state_->layout.total_bytes; }

void Workspace::debug_set_epoch(uint64_t completed) {
  // The local counter only: flag slots keep what they hold (zeros, or older calls' flags), as they
  // would after that many real calls, so a test across the wrap sees what production would.
  DeviceGuard guard(device_);
  Control ctl{};
  PCIE_AR_CUDA_CHECK(cudaDeviceSynchronize());
  PCIE_AR_CUDA_CHECK(cudaMemcpy(&ctl, state_->control(), sizeof(ctl), cudaMemcpyDeviceToHost));
  for (uint64_t& e : ctl.epochs) e = completed;  // abort, error claim and the host one-shot's state stay
  PCIE_AR_CUDA_CHECK(cudaMemcpy(state_->control(), &ctl, sizeof(ctl), cudaMemcpyHostToDevice));
  PCIE_AR_CUDA_CHECK(cudaDeviceSynchronize());
}

uint64_t Workspace::debug_epoch() const {
  DeviceGuard guard(device_);
  Control ctl{};
  PCIE_AR_CUDA_CHECK(cudaMemcpy(&ctl, state_->control(), sizeof(ctl), cudaMemcpyDeviceToHost));
  return ctl.epochs[0];
}

void Workspace::release_name() { state_->own.release_name(); }

int Workspace::transport() const { return static_cast<int>(state_->transport); }

// Unmap every peer's memory (IPC mapping or host segment); this rank's own stays.
void Workspace::unmap_peers() {
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    if (state_->transport == Transport::kHost) {
      state_->peer_segments[r].close();
    } else if (state_->peers[r] != nullptr) {
      cudaIpcCloseMemHandle(state_->peers[r]);
    }
    state_->peers[r] = nullptr;
  }
  state_->peers_open = false;
}

bool Workspace::note_capture(uint64_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
    cudaGetLastError();
    // Unknown: count it as captured. The cost is only that close() keeps this memory.
    status = cudaStreamCaptureStatusActive;
  }
  const bool capturing = status != cudaStreamCaptureStatusNone;
  state_->captured = state_->captured || capturing;
  return capturing;
}

bool Workspace::captured() const { return state_->captured; }

void Workspace::retire() {
  if (abandon_if_probes_run()) return;
  if (state_->local == nullptr || state_->retired) return;
  RelaxedCaptureMode relaxed;
  DeviceGuard guard(device_);
  const uint32_t raised = 1;
  run_on_private_stream([&](cudaStream_t s) {
    return cudaMemcpyAsync(&state_->control()->abort, &raised, sizeof(raised), cudaMemcpyHostToDevice, s);
  });
  unmap_peers();
  state_->own.release_name();  // the memory stays mapped for the graph; the name goes
  state_->retired = true;
}

void Workspace::close() {
  if (abandon_if_probes_run()) return;
  if (state_->local == nullptr) {
    state_->own.close();  // a construction that failed between the segment and the rest
    return;
  }
  RelaxedCaptureMode relaxed;
  DeviceGuard guard(device_);
  unmap_peers();
  if (state_->transport == Transport::kHost) {
    state_->own.close();
  } else {
    cudaFree(state_->local);
  }
  if (state_->local_only != nullptr) cudaFree(state_->local_only);
  state_->local_only = nullptr;
  state_->local = nullptr;
  state_->peers[rank_] = nullptr;
  if (state_->error_host != nullptr) cudaFreeHost(state_->error_host);
  state_->error_host = nullptr;
  state_->error_device = nullptr;
  if (state_->peers_table != nullptr) cudaFree(state_->peers_table);
  state_->peers_table = nullptr;
  state_->peers_open = false;
}

}  // namespace pcie_ar
