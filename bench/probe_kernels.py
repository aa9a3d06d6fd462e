"""Small Triton kernels for ``python -m bench topo``'s measurements between ranks.

They run on raw addresses of the ranks' IPC-mapped workspaces (as the fused kernels do), so they
measure exactly the memory path our all-reduce uses: peer GPUs over PCIe, or under MPS emulation
one GPU's memory shared between processes. The memory-order primitives (system-scope acquire
load, release store, %globaltimer) are the fused kernels'; under TRITON_INTERPRET=1 they fall
back to plain accesses, so the CPU tests can run these kernels on host memory.

- :func:`fill`: zero a rank's own flag words.
- :func:`pingpong`: two ranks bounce a counter through each other's flag word ``iters`` times;
  the kernel times itself with %globaltimer from the end of the first round trip to the last.
- :func:`push`: copy a local buffer into one or several peers' buffers (one grid row per peer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcie_allreduce.fused.protocol import interpreting, load_acquire, now_ns, store_release

INTERPRETER_SPIN_LIMIT = 2_000  # the interpreter has no clock: give up after this many polls
PUSH_BLOCK = 2048               # 8-byte words per program per step


@triton.jit
def _fill_kernel(addr, n_words, BLOCK: tl.constexpr):
    ptr = addr.to(tl.pointer_type(tl.uint64))
    offs = tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.uint64), mask=offs < n_words)


@triton.jit
def _wait_at_least(ptr, value, ok, timeout_ns, INTERPRET: tl.constexpr):
    """Spin until ``*ptr >= value``; returns ``ok``, or 0 after the timeout."""
    start = now_ns(INTERPRET)
    current = load_acquire(ptr, INTERPRET)
    spins = 0
    while (current < value) & (ok == 1):
        current = load_acquire(ptr, INTERPRET)
        spins += 1
        if (current < value) & (spins % 64 == 0):
            if INTERPRET:
                expired = spins > 2000
            else:
                expired = (now_ns(INTERPRET) - start) > timeout_ns
            if expired:
                ok = 0
    return ok


@triton.jit
def _pingpong_kernel(mine_addr, theirs_addr, out_ptr, iters, timeout_ns, INITIATOR: tl.constexpr,
                     INTERPRET: tl.constexpr):
    mine = mine_addr.to(tl.pointer_type(tl.uint64))
    theirs = theirs_addr.to(tl.pointer_type(tl.uint64))
    ok = 1
    first = now_ns(INTERPRET)
    i = 0
    while i < iters:  # while, not range(): see _copy_kernel
        value = (i + 1).to(tl.uint64)
        if INITIATOR:
            if ok == 1:
                store_release(theirs, value, INTERPRET)
            ok = _wait_at_least(mine, value, ok, timeout_ns, INTERPRET)
        else:
            ok = _wait_at_least(mine, value, ok, timeout_ns, INTERPRET)
            if ok == 1:
                store_release(theirs, value, INTERPRET)
        if i == 0:
            first = now_ns(INTERPRET)  # the first round trip absorbs the launch skew between the ranks
        i += 1
    last = now_ns(INTERPRET)
    tl.store(out_ptr, ok.to(tl.int64))
    tl.store(out_ptr + 1, (last - first).to(tl.int64))


@triton.jit
def _copy_kernel(local_ptr, remote_addrs_ptr, words_per_peer, programs, steps, BLOCK: tl.constexpr,
                 PULL: tl.constexpr):
    # Program (pid, peer) copies its part of ``words_per_peer`` int64 words between slice ``peer``
    # of the local tensor and peer's address: into the peer (push) or out of it (PULL, with loads
    # that cache nothing, .cv, as the pull kernels read peers, csrc/pull.cuh: every repetition
    # crosses the fabric). while, not for-range, and steps from the host: the CPU interpreter (with
    # numpy 2) cannot turn its 1-element scalars into range() bounds.
    pid = tl.program_id(0)
    peer = tl.program_id(1)
    # Alignment hints (the host keeps addresses 16-byte aligned and shares even) let Triton use
    # 16-byte accesses, as our kernels do.
    remote = tl.multiple_of(tl.load(remote_addrs_ptr + peer).to(tl.pointer_type(tl.int64)), 16)
    local = local_ptr + tl.multiple_of(peer.to(tl.int64) * words_per_peer, 2)
    k = 0
    while k < steps:
        offs = pid * BLOCK + k * programs * BLOCK + tl.arange(0, BLOCK)
        mask = offs < words_per_peer
        if PULL:
            tl.store(local + offs, tl.load(remote + offs, mask=mask, cache_modifier=".cv"), mask=mask)
        else:
            tl.store(remote + offs, tl.load(local + offs, mask=mask), mask=mask)
        k += 1


def fill(addr: int, n_words: int) -> None:
    """Zero ``n_words`` 8-byte words at ``addr`` (this rank's own memory) on the current stream."""
    _fill_kernel[(1,)](addr, n_words, BLOCK=triton.next_power_of_2(max(n_words, 16)))


def pingpong(mine: int, theirs: int, out: torch.Tensor, iters: int, timeout_ns: int, initiator: bool) -> None:
    """Enqueue one side of a ping-pong; ``out`` (int64[2]) gets (ok, ns from round trip 1 to ``iters``)."""
    _pingpong_kernel[(1,)](mine, theirs, out, iters, timeout_ns, INITIATOR=initiator, INTERPRET=interpreting(),
                           num_warps=1)


def push(src: torch.Tensor, dst_addrs: torch.Tensor, words_per_peer: int, programs_per_peer: int) -> None:
    """Copy ``words_per_peer`` int64 words of ``src`` (slice p for peer p) to each address in ``dst_addrs``."""
    _copy(src, dst_addrs, words_per_peer, programs_per_peer, pull=False)


def pull(dst: torch.Tensor, src_addrs: torch.Tensor, words_per_peer: int, programs_per_peer: int) -> None:
    """Read ``words_per_peer`` int64 words from each address in ``src_addrs`` into slice p of ``dst``."""
    _copy(dst, src_addrs, words_per_peer, programs_per_peer, pull=True)


def _copy(local: torch.Tensor, remote_addrs: torch.Tensor, words_per_peer: int, programs_per_peer: int,
          pull: bool) -> None:
    _copy_kernel[(programs_per_peer, remote_addrs.numel())](local, remote_addrs, words_per_peer, programs_per_peer,
                                                            triton.cdiv(words_per_peer, programs_per_peer * PUSH_BLOCK),
                                                            BLOCK=PUSH_BLOCK, PULL=pull, num_warps=8)
