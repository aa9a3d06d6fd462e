// The signalling protocol shared by every algorithm (one-shot, staged, two-shot, and the Triton
// fused kernels, which mirror it in Python).
//
// Invariants
//  1. Push, don't pull. A rank only ever WRITES to peers' workspaces (data, then a flag) and only
//     ever SPINS on its own workspace. Reads of peer memory never happen, except in the pull
//     forms (pull.cuh), for fabrics whose peer reads beat their writes: they read what a peer
//     staged in its own workspace, and flag and spin as every other kernel does.
//  2. Flag after data. A block writes its data to a peer, then `__syncthreads()`, then one thread
//     stores the flag with st.release.sys. The receiver's ld.acquire.sys of that flag, then
//     `__syncthreads()`, makes the data visible to the whole receiving block. No peer atomics.
//     Exact for every dtype and bit pattern and costs one extra small write per block and peer,
//     but the system-scope release is a fence on the critical path. Small messages can instead
//     take the data-as-flag exchange of oneshot_ll.cuh (flag words inside every 16-byte line, no
//     sentinel values, no fence), which keeps invariants 1 and 3-6; its own invariants are there.
//  3. Flags carry this call's sealed word. The epoch is the call number of this workspace, 64 bits
//     (next_epoch below): its low 32 bits run 1, 2, ..., 2^32-1, then 2, 3, ... (never 0, the value
//     of a flag slot that was never written), its high 32 bits count those wraps. Every rank's
//     n-th call has the same epoch because every rank's counter advances once per call, inside
//     the kernel (graph replays advance it too). The word a waiter matches (flags, and the headers
//     of the full-payload and host kernels) is (low << 32 | signature ^ wraps * kWrapSealMix),
//     and a waiter takes exactly its own call's word: anything else is "not yet". So a slot left
//     unwritten for any number of calls (slots only wide launches or the two-shot use) is not
//     taken for a go: its word can equal this call's only if it sat unwritten for a whole number
//     of cycles of the low word AND its call's signature differs from this one's by exactly the
//     difference of the two seals (odds about 2^-32 even then), or after 2^32 wraps. A word of this call's
//     epoch with another signature is not read as a mismatch either (it may be a slot's word from
//     a wrap ago): the call notices of invariant 7 name a peer that issued another call
//     (size/dtype/algorithm/launch shape); nothing of such a call is ever reduced.
//  4. Double buffering by epoch parity. Call e writes into parity e%2 of the peer's data region
//     and of its flag rows. A rank reaches call e only after it saw every peer's flags of call
//     e-1, i.e. after every peer STARTED call e-1, i.e. after every peer FINISHED call e-2
//     (kernels on one stream run in order): so nobody still reads the parity we overwrite. A
//     sender is therefore at most one epoch ahead of any receiver, and writes the other parity's
//     rows then: the flag a waiter reads is this call's or an older one, never a newer one.
//  5. Bounded spins. Every wait checks the global timer; past the timeout it records
//     (kind, rank, peer, stage, block, epoch) in host-mapped memory, raises the workspace's local
//     abort flag, and leaves. Kernels that find the abort flag set skip all work, so a queue of
//     captured calls drains in microseconds instead of hanging; the host raises at the next call.
//     A block that gives up (or skips its work) fills the call's whole output with NaN, so a
//     failed call, eager or replayed from a graph, never leaves data that could pass for a sum.
//  6. Deterministic sums: every element is reduced in fp32 as ((x0 + x1) + x2) + ... in rank order
//     0..W-1 and rounded once to the output dtype, in every algorithm and launch shape.
//  7. Call notices. Each kernel's wire format has its own way to catch some of a peer's
//     different calls (a line flag of this epoch with another signature; a sealed word that
//     never matches and so times out), but a peer running another KIND of kernel (another size
//     class, algorithm or transport format: plain one-shot against full-payload, fused against
//     plain) writes where this kernel never looks. So every kernel, CUDA and Triton, also posts
//     (low epoch << 32 | signature) into every peer's notice word for (itself, epoch parity)
//     when it starts (block 0, one relaxed store per peer, nothing waits for it), and every
//     bounded wait reads its own peers' notices whenever it checks its bound (every 64th spin): a
//     notice of this epoch with another signature is a mismatch, named with that peer, within
//     the first exchange instead of a timeout. Parity keeps it exact: a peer is at most one epoch
//     ahead (invariant 4), so the notice of this parity is this call's or an older one's, and
//     every call rewrites it (no notice idles long enough to alias, so notices are not sealed).
//  8. Same-numbered blocks. A block waits only on what the same-numbered block of a peer
//     published: flags (a sender stores into the slot of its own blockIdx.x, a waiter reads the
//     slot of its own), headers, and data that is its own flag (lines, unpoisoned units). Every
//     rank cuts a message among its blocks the same way (partition.cuh: 16-byte granules), so
//     block k of each rank sends, in every phase, exactly what block k of the receivers waits
//     for. Why: ranks that share one GPU (MPS) may find only some blocks of their grids
//     resident, and a wait on another block number may wait on a block that cannot start until
//     the waiting one ends; with same-numbered waits the blocks resident on every rank (blocks
//     are dispatched in index order) can always finish and make room for the others.
#pragma once

#include <cstdint>

#include "memory_order.cuh"
#include "protocol_constants.h"

namespace pcie_ar {

// Sizes, ids, ErrorRecord, Control and Layout: protocol_constants.h (exported to Python from there).

// Everything a kernel needs, passed by value (no device-side tables to keep in sync).
struct KernelArgs {
  const void* input;
  void* output;
  uint64_t nbytes;
  char* bases[kMaxRanks];  // every rank's workspace base as mapped in THIS process (own included)
  // Base of this rank's local-only words (control at layout.control_offset, row statistics at
  // layout.stats_offset): bases[rank] on p2p; on the host transport a device allocation placed
  // so the same offsets apply, since those words must not live in host memory (latency, and
  // their device atomics would become PCIe atomics).
  char* local;
  Layout layout;
  ErrorRecord* error;      // device alias of the host-mapped record
  uint64_t timeout_ns;
  uint32_t signature;
  int rank;
  int world;
  // Ranks per island for island_twoshot (island_twoshot.cuh): the islands are the world's
  // consecutive runs of this many ranks. 0 where the communicator has no equal islands.
  int island_ranks;
};

// A call's number (invariant 3): the low 32 bits go on the wire, the high 32 bits count wraps.
using Epoch = uint64_t;

__device__ __forceinline__ uint32_t low_epoch(Epoch e) { return static_cast<uint32_t>(e); }

// The epoch after `e` (invariant 3). Past low 2^32-1 the low word goes to 2, not 0 (never-written
// flags) or 1 (which would repeat the odd parity of 2^32-1 and break the double buffering of
// invariant 4), and the wrap count advances.
__device__ __forceinline__ Epoch next_epoch(Epoch e) {
  return low_epoch(e) == 0xFFFFFFFFu ? (((e >> 32) + 1u) << 32) | 2u : e + 1u;
}

__device__ __forceinline__ uint32_t parity_of(Epoch e) { return static_cast<uint32_t>(e) & 1u; }

__device__ __forceinline__ Control* control_of(const KernelArgs& a) {
  return reinterpret_cast<Control*>(a.local + a.layout.control_offset);
}

// `sender`'s flag of `kind` for `block` and `epoch`'s parity in `owner`'s workspace (invariant 4).
__device__ __forceinline__ uint64_t* flag_slot(const KernelArgs& a, int owner, int kind, int sender, int block, Epoch epoch) {
  uint64_t* flags = reinterpret_cast<uint64_t*>(a.bases[owner] + a.layout.flags_offset);
  const uint64_t row = 2u * static_cast<uint64_t>(kind) + parity_of(epoch);
  return flags + (row * kMaxRanks + sender) * kMaxFlagBlocks + block;
}

// `sender`'s call notice of `epoch`'s parity in `owner`'s workspace (invariant 7).
__device__ __forceinline__ uint64_t* notice_slot(const KernelArgs& a, int owner, int sender, Epoch epoch) {
  return flag_slot(a, owner, kNoticeKind, sender, 0, epoch);
}

// Where `sender`'s data lands inside `owner`'s workspace for this call's parity.
__device__ __forceinline__ char* slot_of(const KernelArgs& a, int owner, int sender, Epoch epoch) {
  return a.bases[owner] + parity_of(epoch) * a.layout.parity_bytes + static_cast<uint64_t>(sender) * a.layout.slot_bytes;
}

// The word a waiter matches for the call of `epoch` and `signature` (invariant 3).
__device__ __forceinline__ uint64_t flag_word(Epoch epoch, uint32_t signature) {
  const uint32_t seal = static_cast<uint32_t>(epoch >> 32) * kWrapSealMix;
  return (static_cast<uint64_t>(low_epoch(epoch)) << 32) | (signature ^ seal);
}

// The call notice of `epoch` and `signature` (invariant 7: not sealed).
__device__ __forceinline__ uint64_t notice_word(Epoch epoch, uint32_t signature) {
  return (static_cast<uint64_t>(low_epoch(epoch)) << 32) | signature;
}

static __device__ __noinline__ void record_error(const KernelArgs& a, ErrorKind kind, int peer, Stage stage, Epoch epoch,
                                          uint32_t observed_signature) {
  Control* ctl = control_of(a);
  atomicExch(&ctl->abort, 1u);  // local memory: an ordinary device atomic
  if (atomicCAS(&ctl->error_claim, 0u, 1u) == 0u) {
    volatile ErrorRecord* rec = a.error;
    rec->rank = a.rank;
    rec->peer = peer;
    rec->stage = static_cast<uint32_t>(stage);
    rec->block = static_cast<int32_t>(blockIdx.x);
    rec->epoch = low_epoch(epoch);
    rec->expected_signature = a.signature;
    rec->observed_signature = observed_signature;
    __threadfence_system();
    rec->kind = static_cast<uint32_t>(kind);  // written last: the host keys on it
    __threadfence_system();
  }
}

// Tell `peer` that this block's data for `kind` has landed. Call after __syncthreads().
__device__ __forceinline__ void signal_peer(const KernelArgs& a, int peer, int kind, Epoch epoch) {
  store_release_sys(flag_slot(a, peer, kind, a.rank, blockIdx.x, epoch), flag_word(epoch, a.signature));
}

enum class SpinVerdict { kSpin, kAborted, kTimedOut };

// A peer's call notice of this epoch with another signature (invariant 7): recorded as a mismatch
// in `stage`, named with that peer. Out of line: it runs once per 64 spins, off the fast path.
static __device__ __noinline__ bool foreign_notice(const KernelArgs& a, Epoch epoch, Stage stage) {
  for (int p = 0; p < a.world; ++p) {
    if (p == a.rank) continue;
    const uint64_t word = load_relaxed_sys(notice_slot(a, a.rank, p, epoch));
    if (static_cast<uint32_t>(word >> 32) == low_epoch(epoch) && static_cast<uint32_t>(word) != a.signature) {
      record_error(a, ErrorKind::kMismatch, p, stage, epoch, static_cast<uint32_t>(word));
      return true;
    }
  }
  return false;
}

// The bound of every spin, checked every 64th spin: kAborted once any wait of this workspace
// failed (the abort flag) or a peer's notice shows it makes another call (recorded here as a
// mismatch in `stage`), kTimedOut after timeout_ns of spinning (the clock starts at the first
// check), else kSpin. The caller records the timeout with its own peer and stage.
__device__ __forceinline__ SpinVerdict spin_verdict(const KernelArgs& a, uint32_t spins, uint64_t& started,
                                                    Epoch epoch, Stage stage) {
  if ((spins & 63u) != 63u) return SpinVerdict::kSpin;
  if (load_volatile(&control_of(a)->abort)) return SpinVerdict::kAborted;
  if (foreign_notice(a, epoch, stage)) return SpinVerdict::kAborted;
  const uint64_t now = global_timer_ns();
  if (started == 0) {
    started = now;
    return SpinVerdict::kSpin;
  }
  return now - started > a.timeout_ns ? SpinVerdict::kTimedOut : SpinVerdict::kSpin;
}

// Bounded wait for `peer`'s flag of this call in our own workspace (exactly this call's word:
// invariant 3). False on timeout, mismatch (a peer's notice) or abort.
static __device__ __noinline__ bool wait_peer(const KernelArgs& a, int peer, int kind, Epoch epoch, Stage stage) {
  const uint64_t* flag = flag_slot(a, a.rank, kind, peer, blockIdx.x, epoch);
  const uint64_t want = flag_word(epoch, a.signature);
  uint64_t started = 0;
  for (uint32_t spins = 0;; ++spins) {
    if (load_acquire_sys(flag) == want) return true;
    const SpinVerdict verdict = spin_verdict(a, spins, started, epoch, stage);
    if (verdict == SpinVerdict::kTimedOut) record_error(a, ErrorKind::kTimeout, peer, stage, epoch, 0);
    if (verdict != SpinVerdict::kSpin) return false;
  }
}

// Threads 0..W-1 each wait for one peer; true for the whole block only if every wait succeeded.
__device__ __forceinline__ bool wait_all_peers(const KernelArgs& a, int kind, Epoch epoch, Stage stage) {
  bool ok = true;
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < a.world && peer != a.rank) ok = wait_peer(a, peer, kind, epoch, stage);
  return __syncthreads_and(ok) != 0;
}

// This call's epoch, and whether THIS THREAD found the workspace aborted. Both were written by an
// earlier kernel on this stream, so plain L2 loads (.cg) are enough, and they let the compiler
// overlap them with the first input loads. The abort flag can also be raised by a block of this
// very kernel while this block's threads read it, so `aborted` may differ between threads of a
// block: a thread that saw it skips its own work, and the kernel takes the block's verdict at the
// first barrier it has anyway (AbortVerdict, below), before any flag is sent or any branch holds
// a barrier. (A barrier here for the verdict cost 0.1-0.2 us per call.)
__device__ __forceinline__ Epoch begin_call(const KernelArgs& a, bool* aborted) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as the previous kernel's programmatic dependent (Workspace::dependent_launch): wait
  // for it to finish and its writes (our input, this workspace's epochs) to be visible before
  // reading anything. Launched the ordinary way, this returns at once.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const Control* ctl = control_of(a);
  *aborted = __ldcg(&ctl->abort) != 0;
  const Epoch epoch = next_epoch(__ldcg(reinterpret_cast<const unsigned long long*>(&ctl->epochs[blockIdx.x])));
  const int peer = static_cast<int>(threadIdx.x);
  // This call's notice (invariant 7), unless the workspace is aborted: an aborted call touches no
  // peer memory (after close() the peers may be unmapped while a captured graph still replays).
  if (!*aborted && blockIdx.x == 0 && peer < a.world && peer != a.rank) {
    store_relaxed_sys_unordered(notice_slot(a, peer, a.rank, epoch), notice_word(epoch, a.signature));
  }
  return epoch;
}

// The barrier between a block's first data and its first flag (invariant 2), which also takes the
// block's verdict on the abort flag that begin_call read per thread: true (every thread) when no
// thread of the block saw it, so no flag goes out unless every thread pushed its share.
__device__ __forceinline__ bool verdict_barrier(bool aborted) { return __syncthreads_or(aborted) == 0; }

// Lets a kernel that follows on this stream with programmatic dependent launch (Hopper and
// later: the add + RMSNorm kernel after the all-reduce, PCIE_AR_PDL) start its launch and its
// prologue now; it waits (griddepcontrol.wait) for this grid's completion and memory before it
// reads what this call wrote, so only its launch overlaps. Issued at the end of the call, when
// this block's waits are over: a dependent's waiting blocks then hold SMs only once every peer
// has sent this rank all it needed (their kernels are running), so they can never keep a
// late peer's blocks from starting (ranks sharing a GPU). Without such a dependent: no effect.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Publish the epoch for the next kernel on this stream (see Control). Kernel completion makes
// the stores visible to the next kernel; nothing in this call reads them.
__device__ __forceinline__ void end_call(const KernelArgs& a, Epoch epoch) {
  __syncthreads();  // every thread of this block has read epochs[blockIdx.x]
  allow_dependent_launch();
  Control* ctl = control_of(a);
  for (uint32_t i = blockIdx.x + threadIdx.x * gridDim.x; i < kMaxFlagBlocks; i += blockDim.x * gridDim.x) {
    ctl->epochs[i] = epoch;
  }
}

// Every thread's stores of NaN over the call's whole output (invariant 5; reduce.cuh).
template <typename T>
__device__ __noinline__ void fill_output_with_nan(const KernelArgs& a);

// Where a kernel's body takes its block's verdict on the abort flag (begin_call).
enum class AbortVerdict {
  // body(epoch, aborted) runs in every thread; a thread that saw the flag moves nothing, and the
  // body takes the block's verdict at its first barrier (verdict_barrier), before any flag goes
  // out. It returns whether the block completed, the same in every thread. For kernels with
  // barriers: the flag-based exchanges.
  kFirstBarrier,
  // body(epoch, aborted) runs in every thread and returns that thread's success (false in a
  // thread that saw the flag, which moves nothing); the verdict is the block's AND over every
  // thread after it. For bodies without a barrier: the data-as-flag exchanges (oneshot_ll, the
  // full-payload kernels).
  kAtEnd,
};

// One call of a P2P kernel around its exchange `body` (see AbortVerdict): this call's epoch and
// notice (begin_call), the body, the block's verdict, NaN over the whole output from a block that
// did not complete (invariant 5), the epoch published for the next call either way (end_call).
template <typename T, AbortVerdict kVerdict, typename Body>
__device__ __forceinline__ void p2p_call(const KernelArgs& a, Body body) {
  bool aborted;
  const Epoch epoch = begin_call(a, &aborted);
  bool done = body(epoch, aborted);
  if constexpr (kVerdict == AbortVerdict::kAtEnd) done = __syncthreads_and(done) != 0;
  if (!done) fill_output_with_nan<T>(a);
  end_call(a, epoch);
}

}  // namespace pcie_ar
