// One rank's share of a communicator on one CUDA stream: an IPC-exported device buffer (two
// parities of W data slots and of W line slots, flags, local control words), the peers' buffers
// mapped into this process, and a host-mapped error record. Plain C++ interface (no CUDA
// headers) so the binding file compiles with the host compiler; pointers and streams are integers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pcie_ar {

struct CallError {
  uint32_t kind = 0;  // an ErrorKind (protocol_constants.h); 0: none
  int rank = -1;
  int peer = -1;
  uint32_t stage = 0;
  int block = -1;
  uint32_t epoch = 0;
  uint32_t expected_signature = 0;
  uint32_t observed_signature = 0;
};

class Workspace {
 public:
  // transport: a Transport id (protocol_constants.h): device memory shared through CUDA IPC, or
  // pinned host memory shared through /dev/shm (host_segment.h), created under `segment_name`
  // (the host transport needs one; pcie_allreduce/transport.py makes them).
  Workspace(int device, int rank, int world, uint64_t max_bytes, double timeout_s, int transport = 0,
            const std::string& segment_name = "");
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // What peers need to map the local buffer, to be all-gathered: the IPC handle and the
  // allocation's size (p2p, see p2p_export) or the shared-memory segment's name (host).
  std::string ipc_handle() const;
  // Map every peer's buffer; handles[rank] is ignored. Refuses a peer whose workspace is not
  // exactly this rank's total_bytes (the segment's size on host, the exported size on p2p).
  void open_peers(const std::vector<std::string>& handles);
  // Host transport: remove the segment's name from /dev/shm once every rank has mapped it (the
  // memory stays), so a rank killed later leaves nothing there. No-op for p2p.
  void release_name();
  int transport() const;
  // The creation-time transfer test, in two collective halves: write_probes stores a pattern
  // (kProbeBytes, from `seed` and this rank) into this rank's data slot of every peer with SM
  // stores, as the kernels do, and waits for them; after every rank has written,
  // probe_failures reads the local slots and returns the ranks whose pattern did not arrive
  // (then clears the slots). Host-synchronous; never called while kernels run. write_probes waits
  // at most the timeout; when its kernel has not ended by then it throws, and close() / retire()
  // release nothing while that kernel may still run (see abandoned()).
  void write_probes(uint32_t seed);
  std::vector<int> probe_failures(uint32_t seed);

  // Enqueue one all-reduce on `stream`. Returns the recorded error kind (non-zero: nothing was
  // launched, the communicator is broken) so the caller can raise without another call.
  uint32_t all_reduce(int algo, uint64_t input, uint64_t output, uint64_t nbytes, int dtype, int blocks,
                      uint64_t stream);

  CallError error() const;
  uint32_t failed() const;  // the recorded error kind, 0 when none (one host memory read)
  uint32_t signature(int algo, int dtype, uint64_t nbytes, int blocks) const;

  void set_timeout(double seconds);
  double timeout() const;
  // Ranks per island for island_twoshot: the world as consecutive islands of this many ranks
  // (>= 2 of them, >= 2 ranks each); 0 (the default): no islands, island_twoshot refused. Every
  // rank must set the same value before its next call.
  void set_island_ranks(int ranks);
  int island_ranks() const;
  // Launch every call as the previous kernel's programmatic dependent (Hopper and later; the
  // caller checks the GPU): its launch overlaps that kernel's end. Off by default.
  void set_dependent_launch(bool on);
  bool dependent_launch() const;

  // For the Triton kernels, which follow the same protocol on the same memory.
  std::vector<uint64_t> bases() const;
  uint64_t peers_table_device_ptr() const;  // bases() as uint64[kMaxRanks] in device memory, from open_peers
  uint64_t error_record_device_ptr() const;
  uint64_t slot_bytes() const;
  uint64_t parity_bytes() const;
  uint64_t ll_capacity() const;    // largest message the low-latency algorithm takes
  uint64_t ll_slot_bytes() const;
  uint64_t ll_offset() const;
  uint64_t flags_offset() const;
  uint64_t control_offset() const;
  // Address the control and statistics offsets apply to (the workspace base, except on the host
  // transport, whose local-only words live in device memory).
  uint64_t local_base() const;
  uint64_t stats_offset() const;
  uint64_t shared_offset() const;  // the host one-shot's headers and buffers (host transport)
  uint64_t shared_bytes() const;
  uint64_t full_offset() const;  // the full-payload one-shot's headers and slots
  uint64_t full_bytes() const;
  uint64_t input_offset() const;  // the symmetric input area (p2p; input_bytes 0 on the host transport)
  uint64_t input_bytes() const;
  uint64_t total_bytes() const;

  // Test hook: make this workspace believe `completed` calls already happened (wrap-around tests).
  // Collective in spirit: every rank must call it with the same value before the next call.
  void debug_set_epoch(uint64_t completed);
  uint64_t debug_epoch() const;
  // Test hook: from now on write_probes' kernel waits `seconds` (on the GPU clock, so it ends by
  // itself) before its stores, as a platform whose peer writes stall would hold it; 0: no wait.
  void debug_delay_probes(double seconds);
  // Whether close() (or retire()) left this workspace's memory and mappings allocated, leaked on
  // purpose, because a transfer test's kernel that write_probes gave up on was still running.
  bool abandoned() const;

  // Whether `stream` is being captured into a CUDA graph; once one is seen, captured() stays
  // true. all_reduce notes it itself; the Triton kernels' launcher calls this.
  bool note_capture(uint64_t stream);
  bool captured() const;

  // Free everything. Only when no CUDA graph can replay a call on this workspace any more. After
  // a write_probes that timed out, while its kernel still runs: free nothing (abandoned()).
  void close();
  // close() for a workspace a captured graph may still replay: raise the abort word (a replayed
  // kernel then touches no peer memory and fills its output with NaN), unmap the peers, and keep
  // this rank's own memory and error record allocated (the caller keeps the object alive).
  void retire();

  int device() const { return device_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  uint64_t max_bytes() const { return max_bytes_; }

 private:
  void allocate();  // the workspace memory (device or shared host) and the error record
  void allocate_device_memory();
  void write_peers_table();  // bases() into the device table the Triton kernels read
  void unmap_peers();
  bool abandon_if_probes_run();

  struct State;
  std::unique_ptr<State> state_;
  int device_, rank_, world_;
  uint64_t max_bytes_;
};

// The p2p transport's export of a workspace (what Workspace::ipc_handle returns there): its
// kIpcHandleBytes of cudaIpcMemHandle_t, then the allocation's byte size (8 bytes, host order:
// every rank runs on this host). A mapping does not tell its size, so without it a peer whose
// workspace is smaller (another build, another max_bytes) would let the kernels write past its
// end. Plain byte handling, no CUDA call: usable without a GPU.
constexpr uint64_t kIpcHandleBytes = 64;
std::string p2p_export(const std::string& ipc_handle, uint64_t bytes);
// The IPC handle in `blob`, rank `peer`'s export as rank `rank` received it. Throws, naming both
// ranks and both sizes, unless it is an export (of this build's format) of exactly
// `expected_bytes`, the size this rank's layout gives every rank's workspace.
std::string p2p_import(const std::string& blob, uint64_t expected_bytes, int rank, int peer);

// Runtime facts, each safe to call on a machine without a GPU or driver.
int device_count();             // 0 when no driver / no GPU
std::string runtime_status();   // "" when usable, otherwise why not
int runtime_version();
int driver_version();           // 0 when no driver
std::string pci_bus_id(int device);
int device_by_pci_bus_id(const std::string& bus_id);  // -1 when not visible in this process
bool can_access_peer(int device, int peer_device);
std::vector<int> compiled_archs();  // SM versions embedded in this build (from the nvcc flags)

}  // namespace pcie_ar
