"""The signalling protocol of csrc/protocol.cuh (and the low-latency lines of csrc/ll_line.cuh),
for Triton kernels on the same workspace: epochs per program, flags, bounded spins that record
(kind, rank, peer, stage, program, epoch) and raise the abort flag, and the line flag.

Epochs are 64-bit (invariant 3 of csrc/protocol.cuh): the low 32 bits are the call number that
words carry, the high 32 bits count its wraps. Every word a waiter matches (flags, full-payload
headers) is :func:`sealed_word`, matched exactly; flags live in a row per epoch parity
(:func:`flag_addr`), so a peer one call ahead never overwrites the word this call waits for.

Memory ordering without inline PTX where possible: the CPU interpreter (TRITON_INTERPRET=1)
runs programs one after another and cannot execute inline assembly, so the acquire load,
release store and global timer have an interpreter path (volatile load, plain store, a spin
count) selected by the INTERPRET constexpr. On the GPU they are ld.acquire.sys /
st.release.sys / %globaltimer, the same instructions the CUDA kernels use (Triton has no
system-scope release store without an atomic, and PCIe may not support peer atomics). The
low-latency lines use st.volatile / ld.volatile u64 through inline PTX on the GPU as well: a
plain tl.load(volatile=True) poll may be hoisted or re-issued by the compiler.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pcie_allreduce.constants import (ABORT_WORD, CLAIM_WORD, EPOCH_COPIES, LINE_FLAG_MIX, MAX_FLAG_BLOCKS, MAX_RANKS,
                                      NOTICE_KIND, WRAP_SEAL_MIX)

# The interpreter has no clock, so its waits give up after this many polls. It runs a launch's
# programs one after another and the tests write the peers' flags before launching, so the first
# poll already decides: the limit only needs a few verdict checks (every 64th spin: abort,
# mismatch, then expiry), and each poll costs the interpreter milliseconds.
INTERPRETER_SPIN_LIMIT = 128

# The fused kernels' tensor arguments, never specialised on their alignment: a fused kernel's
# compile key is then a function of the call's shapes and dtypes alone, the same on every rank, so
# the communicator can compile each new shape on every rank before any rank launches it
# (Communicator.all_reduce_rmsnorm). Their element offsets are runtime values, so an aligned base
# could not widen an access anyway.
FUSED_TENSOR_ARGS = ("x_ptr", "res_ptr", "w_ptr", "normed_ptr", "res_out_ptr")
_EPOCH_COPIES: tl.constexpr = tl.constexpr(EPOCH_COPIES)
_ABORT: tl.constexpr = tl.constexpr(ABORT_WORD)
_CLAIM: tl.constexpr = tl.constexpr(CLAIM_WORD)
_MIX: tl.constexpr = tl.constexpr(LINE_FLAG_MIX)
_SEAL: tl.constexpr = tl.constexpr(WRAP_SEAL_MIX)
_MAX_RANKS: tl.constexpr = tl.constexpr(MAX_RANKS)
_NOTICE_KIND: tl.constexpr = tl.constexpr(NOTICE_KIND)
_MAX_FLAG_BLOCKS: tl.constexpr = tl.constexpr(MAX_FLAG_BLOCKS)
_SPIN_LIMIT: tl.constexpr = tl.constexpr(INTERPRETER_SPIN_LIMIT)


# ---- memory-order primitives -------------------------------------------------------------


@triton.jit
def interpreter_mask(mask, INTERPRET: tl.constexpr):
    """``mask`` as a load or store takes it: unchanged on the GPU; under Triton's interpreter
    compared with 0. The interpreter can hand a combined mask (a tensor & a scalar's comparison, or
    & a loaded value's) over as int32 data, and from Triton 3.9 on its loads and stores refuse a
    mask that is not boolean."""
    if INTERPRET:
        mask = mask != 0
    return mask


@triton.jit
def load_acquire(ptr, INTERPRET: tl.constexpr):
    if INTERPRET:
        value = tl.load(ptr, volatile=True)
    else:
        value = tl.inline_asm_elementwise("ld.acquire.sys.global.u64 $0, [$1];", "=l,l", [ptr],
                                          dtype=tl.uint64, is_pure=False, pack=1)
    return value


@triton.jit
def load_acquire_where(ptr, mask, INTERPRET: tl.constexpr):
    """ld.acquire.sys of each u64 word of ``ptr`` where ``mask`` (0 elsewhere, nothing loaded):
    the batched form of :func:`load_acquire`, for a poll of several peers' flags at once."""
    if INTERPRET:
        value = tl.load(ptr, mask=interpreter_mask(mask, INTERPRET), other=0, volatile=True)
    else:
        value = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u64 $0, 0; @p ld.acquire.sys.global.u64 $0, [$1]; }",
            "=l,l,r", [ptr, mask.to(tl.int32)], dtype=tl.uint64, is_pure=False, pack=1)
    return value


@triton.jit
def store_release(ptr, value, INTERPRET: tl.constexpr):
    """st.release.sys of a scalar flag, by thread 0 of the program only. Called after a
    tl.debug_barrier, that one release covers the stores every thread made before the barrier
    (invariant 2 of csrc/protocol.cuh, as the CUDA kernels do it); a scalar store from inline asm
    would otherwise be issued by every thread: a system-scope release per thread and flag."""
    if INTERPRET:
        tl.store(ptr, value)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p st.release.sys.global.u64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def release_fence(INTERPRET: tl.constexpr):
    """fence.acq_rel.sys by thread 0 of the program: with the thread's later
    :func:`store_flag` stores, the release of every flag of one exchange at the price of one
    system-scope fence (a st.release.sys per peer fences once per peer: W - 1 fences in a row).
    Called after a tl.debug_barrier, like :func:`store_release`."""
    if not INTERPRET:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; @p fence.acq_rel.sys; "
            "mov.u32 $0, 0; }", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_flag(ptr, value, INTERPRET: tl.constexpr):
    """st.relaxed.sys of a scalar flag by thread 0 of the program, after its :func:`release_fence`
    (fence then strong store in one thread: a release pattern of the PTX memory model)."""
    if INTERPRET:
        tl.store(ptr, value)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p st.relaxed.sys.global.u64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_volatile(ptr, mask, INTERPRET: tl.constexpr):
    """Masked ld.volatile.global of the pointer's word (u64 or u32; 0 where masked off). Inline
    asm with side effects, so the compiler can neither hoist a poll out of its loop nor re-load
    (rematerialise) a value after the word was cleared or re-poisoned; tl.load(volatile=True)
    does not promise either."""
    if INTERPRET:
        value = tl.load(ptr, mask=interpreter_mask(mask, INTERPRET), other=0, volatile=True)
    elif ptr.dtype.element_ty == tl.uint64:
        value = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u64 $0, 0; @p ld.volatile.global.u64 $0, [$1]; }",
            "=l,l,r", [ptr, mask.to(tl.int32)], dtype=tl.uint64, is_pure=False, pack=1)
    else:
        tl.static_assert(ptr.dtype.element_ty == tl.uint32, "load_volatile: u64 or u32 words")
        value = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; @p ld.volatile.global.u32 $0, [$1]; }",
            "=r,l,r", [ptr, mask.to(tl.int32)], dtype=tl.uint32, is_pure=False, pack=1)
    return value


@triton.jit
def store_volatile(ptr, value, mask, INTERPRET: tl.constexpr):
    """Masked st.volatile.global of the pointer's word (u64 or u32): one store per element, never
    torn, merged or delayed behind a spin (the CUDA kernels' store_line)."""
    if INTERPRET:
        tl.store(ptr, value, mask=interpreter_mask(mask, INTERPRET))
    elif ptr.dtype.element_ty == tl.uint64:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.volatile.global.u64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r", [ptr, value.to(tl.uint64), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.static_assert(ptr.dtype.element_ty == tl.uint32, "store_volatile: u64 or u32 words")
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.volatile.global.u32 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptr, value.to(tl.uint32), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pause_ns(NS: tl.constexpr, INTERPRET: tl.constexpr):
    """Between two polls: let other warps on the SM issue for about NS ns (nanosleep); nothing
    when NS is 0 (the default everywhere) or under the interpreter."""
    if NS > 0:
        if not INTERPRET:
            tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r", [tl.full((), NS, tl.uint32)],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def now_ns(INTERPRET: tl.constexpr):
    if INTERPRET:
        t = tl.full((), 0, tl.uint64)
    else:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.uint64, is_pure=False, pack=1)
    return t


@triton.jit
def round_to(v, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> DT with round-to-nearest-even. The interpreter truncates fp32 -> bf16, so it
    rounds by integer arithmetic instead (finite values; same bits as the GPU's cvt.rn)."""
    if INTERPRET and DT == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(DT)
    return out


@triton.jit
def peer_base(bases, p):
    """Rank ``p``'s workspace base as mapped here: entry ``p`` of the int64 array of every rank's
    base at address ``bases`` (:attr:`pcie_allreduce.layout.WorkspaceView.bases_ptr`), so one
    kernel argument serves any world size up to MAX_RANKS."""
    return tl.load(bases.to(tl.pointer_type(tl.int64)) + p)


@triton.jit
def peer_bases(bases, peers, W: tl.constexpr):
    """:func:`peer_base` of every rank in the tensor ``peers`` (0 where a rank is W or above), as
    one load: a kernel that reaches several peers loads their bases together rather than each
    behind a branch on the runtime rank, where each load waited for the one before it."""
    return tl.load(bases.to(tl.pointer_type(tl.int64)) + peers, mask=peers < W, other=0)


# Triton picks its interpreter or its compiler when a function is decorated (from TRITON_INTERPRET
# when the module is imported), so whether these kernels run interpreted is fixed here, whatever
# the environment says when they are launched.
_BUILT_FOR_INTERPRETER = not isinstance(load_acquire, triton.runtime.JITFunction)


def interpreting() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1
    when it was imported): launches then take the interpreter's paths (INTERPRET=True)."""
    return _BUILT_FOR_INTERPRETER


# ---- protocol ----------------------------------------------------------------------------


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Launched as the previous kernel's programmatic dependent ($PCIE_AR_PDL, Hopper and later):
    wait for it to finish and its writes (our inputs, the workspace's epochs) to be visible. The
    first thing a fused kernel does, as csrc/protocol.cuh's begin_call."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def allow_dependent_launch(PDL: tl.constexpr):
    """Let a dependent kernel that follows start its launch: after this program's last wait, as
    csrc/protocol.cuh's allow_dependent_launch (a dependent waits for our completion anyway)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _low_word(value):
    """The low 32 bits of an integer (scalar tensor or constexpr) as an int32 operand."""
    wide = tl.zeros((), tl.int64) + value
    return (wide & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)


@triton.jit
def record_error(ctrl, err_addr, kind, rank, peer, stage, pid, epoch, sig, observed, INTERPRET: tl.constexpr):
    """Raise the abort flag; the first failure fills the host-mapped record (kind written last).

    On the GPU every calling thread does this itself, in inline PTX: a bounded spin times out per
    thread, so callers reach here in divergent code. Triton makes a scalar atomic whose result is
    used a single-thread operation broadcast through shared memory behind a bar.sync, and a
    barrier that only some threads of the program reach is undefined (with a block_any's bar.red
    pending elsewhere in the program it is an illegal instruction). Here each thread exchanges the
    abort word and races for the claim word; the one thread in the GPU that wins writes the record
    (csrc/protocol.cuh's record_error, fences included)."""
    if INTERPRET:
        tl.atomic_xchg(ctrl + _ABORT, 1)
        claim = tl.atomic_cas(ctrl + _CLAIM, 0, 1)
        if claim == 0:
            # uint32 fields go through int32 stores: the implicit cast keeps the low 32 bits (of the
            # 64-bit epoch too: the record holds the low word, as csrc/protocol.cuh's does).
            err = err_addr.to(tl.pointer_type(tl.int32))
            tl.store(err + 1, rank)
            tl.store(err + 2, peer)
            tl.store(err + 3, stage)
            tl.store(err + 4, pid)
            tl.store(err + 5, epoch)
            tl.store(err + 6, sig)
            tl.store(err + 7, observed)
            tl.store(err, kind)
    else:
        err = err_addr.to(tl.pointer_type(tl.uint32))  # operands broadcast together: ctrl's pointer type
        tl.inline_asm_elementwise(
            "{ .reg .pred won; .reg .u32 c; "
            "atom.global.exch.b32 c, [$1], 1; "
            "atom.global.cas.b32 c, [$2], 0, 1; setp.eq.u32 won, c, 0; "
            "@won st.volatile.global.u32 [$3+4], $5; @won st.volatile.global.u32 [$3+8], $6; "
            "@won st.volatile.global.u32 [$3+12], $7; @won st.volatile.global.u32 [$3+16], $8; "
            "@won st.volatile.global.u32 [$3+20], $9; @won st.volatile.global.u32 [$3+24], $10; "
            "@won st.volatile.global.u32 [$3+28], $11; @won membar.sys; "
            "@won st.volatile.global.u32 [$3], $4; @won membar.sys; mov.u32 $0, 0; }",
            "=r,l,l,l,r,r,r,r,r,r,r,r",
            [ctrl + _ABORT, ctrl + _CLAIM, err, _low_word(kind), _low_word(rank), _low_word(peer), _low_word(stage),
             _low_word(pid), _low_word(epoch), _low_word(sig), _low_word(observed)],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def flag_addr(base, flags_offset, kind: tl.constexpr, parity, sender, pid):
    """The flag word of (``kind``, epoch ``parity``, ``sender``, program ``pid``) in the workspace
    at ``base``: row 2 * kind + parity of the flag array (csrc/protocol.cuh's flag_slot)."""
    index = ((2 * kind + parity.to(tl.int64)) * _MAX_RANKS + sender) * _MAX_FLAG_BLOCKS + pid
    return (base + flags_offset + index * 8).to(tl.pointer_type(tl.uint64))


def next_epoch_of(epoch: int) -> int:
    """``next_epoch`` of protocol.cuh on the host (tests): after low word 2^32-1 the wrap count
    goes up and the low word restarts at 2."""
    return (((epoch >> 32) + 1) << 32) | 2 if epoch & 0xFFFFFFFF == 0xFFFFFFFF else epoch + 1


def sealed_word_of(epoch: int, signature: int) -> int:
    """Host mirror of :func:`sealed_word` (tests encode peers' flags and headers with it)."""
    return ((epoch & 0xFFFFFFFF) << 32) | ((signature ^ ((epoch >> 32) * WRAP_SEAL_MIX)) & 0xFFFFFFFF)


@triton.jit
def next_epoch(epoch):
    """The epoch after ``epoch`` (uint64): ``next_epoch`` of protocol.cuh. The low word skips 0
    (never-written slots) and 1 (it would repeat the odd parity of 2^32-1) when it wraps."""
    wrapped = (((epoch >> 32) + 1) << 32) | 2
    return tl.where((epoch & 0xFFFFFFFF) == 0xFFFFFFFF, wrapped, epoch + 1).to(tl.uint64)


@triton.jit
def sealed_word(epoch, sig64):
    """The word a waiter matches for this call (invariant 3 of csrc/protocol.cuh): the low 32
    bits of the epoch over the signature sealed with the wrap count, so a slot left idle since
    an earlier wrap never equals this call's word (wrap 0 seals nothing)."""
    seal = ((epoch >> 32) * _SEAL) & 0xFFFFFFFF
    return ((epoch & 0xFFFFFFFF) << 32) | ((sig64 ^ seal) & 0xFFFFFFFF)


@triton.jit
def block_any(flag, INTERPRET: tl.constexpr):
    """1 in every thread of the program if ``flag`` (an integer scalar) is non-zero in any of its
    threads, else 0: one ``bar.red.or`` (CUDA's __syncthreads_or), so call it where every thread
    of the program gets to.

    A scalar a kernel loads or computes is a value per thread: the abort flag can be raised by
    another program between two threads' reads, a timer expire for one thread and not the next.
    A branch that holds a barrier (a reduction, tl.debug_barrier) must be taken by every thread of
    the program or by none, so such a branch tests a value made uniform here."""
    if INTERPRET:
        any_set = (flag != 0).to(tl.int32)
    else:
        any_set = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $1, 0; bar.red.or.pred p, 0, p; selp.s32 $0, 1, 0, p; }",
            "=r,r", [flag.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    return any_set


@triton.jit
def begin_call(ctrl, pid):
    """(epoch of this call (uint64), aborted): this program's 64-bit copy of the epoch (see Control
    in protocol.cuh; ``ctrl`` addresses the control record as 32-bit words), and whether THIS
    THREAD found the workspace aborted (see :func:`block_any` before branching around a barrier
    on it)."""
    epochs = ctrl.to(tl.pointer_type(tl.uint64))
    epoch = next_epoch(tl.load(epochs + pid, cache_modifier=".cg"))
    aborted = tl.load(ctrl + _ABORT, cache_modifier=".cg")
    return epoch, aborted


@triton.jit
def end_call(ctrl, epoch, pid):
    """Publish the epoch: this program writes every 64-bit copy i with i % programs == pid, so no
    program of this call overwrites a copy another one still has to read."""
    tl.debug_barrier()
    idx = tl.arange(0, _EPOCH_COPIES)
    value = tl.zeros(idx.shape, tl.uint64) + epoch
    tl.store(ctrl.to(tl.pointer_type(tl.uint64)) + idx, value, mask=(idx % tl.num_programs(0)) == pid)


@triton.jit
def notice_addr(base, flags_offset, sender, epoch):
    """``sender``'s call notice of ``epoch``'s parity in the workspace at ``base`` (invariant 7
    of csrc/protocol.cuh): word 0 of the sender's notice row of that parity."""
    return flag_addr(base, flags_offset, _NOTICE_KIND, epoch & 1, sender, 0)


@triton.jit(noinline=True)
def post_notices(bases, flags_offset, rank, pid, epoch, sig64, aborted, W: tl.constexpr, INTERPRET: tl.constexpr):
    """This call's notice (the epoch's low 32 bits << 32 | signature, unsealed: every call
    rewrites its parity's notice, so none is left from an earlier wrap) in every peer, from thread
    0 of program 0 (one relaxed store per peer; nothing waits for it). Out of line, like
    :func:`foreign_notice`: W branches on the runtime rank inlined into the widest programs cost
    registers they lack.
    Nothing when ``aborted`` (this thread's reading): an aborted call touches no peer memory
    (after close() the peers may be unmapped while a captured graph still replays)."""
    if (pid == 0) & (aborted == 0):
        for p in tl.static_range(W):
            if p != rank:
                store_flag(notice_addr(peer_base(bases, p), flags_offset, rank, epoch),
                           ((epoch & 0xFFFFFFFF) << 32) | sig64, INTERPRET)


@triton.jit
def my_notices(my_base, flags_offset, epoch):
    """The notices the peers post here for ``epoch``'s parity: sender p's word at ``[p * 128]``
    (one pointer held across a wait instead of the offsets it is made of: registers are what the
    widest fused programs run short of)."""
    return notice_addr(my_base, flags_offset, 0, epoch)


@triton.jit(noinline=True)
def foreign_notice(notices, epoch, sig64, rank, W: tl.constexpr, INTERPRET: tl.constexpr):
    """(the lowest peer whose notice of this epoch carries another signature, or -1; that
    signature): a peer making a different call, whichever kernel it runs. The only evidence of a
    mismatch a flag-based wait has: a flag or header of another signature may be a slot left from
    an earlier wrap, so it only ever reads "not yet". Scalar loads, no barrier.
    Out of line: inlined into the poll loops it cost the fused one-shot at W = 8, 4 tokens (32
    warps, at the 64-register cap) 0.2-0.3 us per call though it runs every 64th spin only."""
    culprit = -1
    observed = tl.zeros((), tl.uint64)
    low = epoch & 0xFFFFFFFF
    for p in tl.static_range(W):
        word = load_volatile(notices + p * _MAX_FLAG_BLOCKS, p != rank, INTERPRET)
        foreign = (culprit < 0) & (p != rank) & (((word >> 32) & 0xFFFFFFFF) == low) & ((word & 0xFFFFFFFF) != sig64)
        culprit = tl.where(foreign, p, culprit)
        observed = tl.where(foreign, word & 0xFFFFFFFF, observed)
    return culprit, observed


@triton.jit
def spin_verdict(ctrl, start, spins, timeout_ns, notices, epoch, sig64, rank, W: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """For a bounded spin, checked every 64th spin: 1 if the workspace was aborted (another wait
    failed), 2 if this wait has timed out, 3 if a peer's call notice (``notices``: my_notices)
    says it makes another call (the caller records the mismatch: :func:`foreign_notice` names the
    peer), else 0. Per thread and barrier-free."""
    verdict = 0
    if spins % 64 == 0:
        aborted = tl.load(ctrl + _ABORT, volatile=True)
        culprit, _ = foreign_notice(notices, epoch, sig64, rank, W, INTERPRET)
        if INTERPRET:
            expired = spins > _SPIN_LIMIT
        else:
            expired = (now_ns(INTERPRET) - start) > timeout_ns
        if aborted != 0:
            verdict = 1
        elif culprit >= 0:
            verdict = 3
        elif expired:
            verdict = 2
    return verdict


def line_flag_of(epoch: int, signature: int) -> int:
    """Host mirror of ``line_flag`` (tests encode peers' lines with it)."""
    flag = (signature ^ (epoch * LINE_FLAG_MIX)) & 0xFFFFFFFF
    return flag if flag != 0 else LINE_FLAG_MIX


@triton.jit
def line_flag(epoch, sig):
    """csrc/ll_line.cuh's flag of this call (uint64 holding 32 bits): never 0, differs per signature.
    Only the epoch's low word counts (the product is kept mod 2^32) and nothing is sealed: lines
    are cleared after use, so none is left from an earlier wrap."""
    flag = (sig.to(tl.uint64) ^ ((epoch * _MIX) & 0xFFFFFFFF)) & 0xFFFFFFFF
    return tl.where(flag == 0, _MIX, flag).to(tl.uint64)


@triton.jit
def line_signature(flag, epoch):
    """The signature a peer's line flag of ``epoch`` stands for (``line_signature`` of
    csrc/ll_line.cuh; the mismatch report)."""
    return (flag ^ ((epoch * _MIX) & 0xFFFFFFFF)) & 0xFFFFFFFF
