"""Fused all-reduce + residual add + RMSNorm in Triton, on the CUDA kernels' workspace.

    new_residual = residual + all_reduce(x)             (bitwise equal to the plain path)
    normed       = new_residual * rsqrt(mean(new_residual^2) + eps) * weight   (fp32 math)

Same protocol as csrc/protocol.cuh, so fused and plain calls interleave on one workspace:
push into peers' slots, then a release store of this call's sealed word (the epoch's low 32 bits
over the signature sealed with the wrap count: protocol.sealed_word) into the peer's flag
for this program and epoch parity; spin only on our own flags with acquire loads until each holds
exactly that word, bounded by the timeout; the epoch lives in the workspace's control words, one
copy per program slot, and each program advances the copies it owns (CUDA graph safe).
Reduction: fp32, rank order 0..W-1, rounded once to the dtype, exactly like the CUDA kernels;
then the residual add is rounded once more, exactly like ``residual + y`` in torch.

Two kernels here:
- one-shot: each program pushes its rows of x to every peer, waits, reduces its rows and
  finishes them (add + norm). For few tokens.
- token-split two-shot: rank o owns rows split(T, W, o). Programs push the rows each owner
  owns (reduce-scatter), owners reduce + add their rows and push the NEW RESIDUAL rows to all
  (all-gather); every rank then computes the norm of every row itself. Pushing the residual
  only (not the normed rows) halves the all-gather and needs one slot region per sender; the
  norm is a deterministic function of the residual row, so all ranks still agree bitwise.

Both kernels start with one prologue (:func:`_prologue`) and take every rank's workspace base as
one pointer to a device array (``bases``), so they serve any world size. Memory-order primitives
and the protocol helpers shared with other Triton kernels live in
:mod:`pcie_allreduce.fused.protocol`; the low-latency (data-as-flag) one-shot for small messages
in :mod:`pcie_allreduce.fused.oneshot_ll`; their launches in :mod:`pcie_allreduce.fused.path`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pcie_allreduce import constants
from pcie_allreduce.fused.add_rmsnorm import finish_row, typed_pointer
from pcie_allreduce.fused.oneshot_ll import ARRIVED, FOREIGN, NOT_YET, TIMED_OUT, verdict_state
from pcie_allreduce.fused.protocol import (allow_dependent_launch, begin_call, block_any, end_call, flag_addr,
                                            foreign_notice, interpreter_mask, load_acquire_where, my_notices, now_ns,
                                            peer_bases, post_notices, record_error, release_fence, round_to,
                                            sealed_word, spin_verdict, store_flag, wait_for_previous_kernel)

_ALIGN: tl.constexpr = tl.constexpr(constants.ALIGN)
_MAX_RANKS: tl.constexpr = tl.constexpr(constants.MAX_RANKS)
STAGE_FUSED_GATHER = constants.STAGE_FUSED_GATHER
STAGE_FUSED_REDUCE_SCATTER = constants.STAGE_FUSED_REDUCE_SCATTER
STAGE_FUSED_ALL_GATHER = constants.STAGE_FUSED_ALL_GATHER


@triton.jit
def _reduce_row(x_row_ptrs, slot_ptr_of_rank0, slot_elems, row_off, cols, mask, rank, W: tl.constexpr,
                DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 sum over ranks in rank order, rounded once to DT (the CUDA kernels' formula)."""
    acc = tl.zeros(cols.shape, tl.float32)
    for r in tl.static_range(W):
        # the address picked, not the load: with a branch per rank each load waited for the sum
        # before it (W dependent trips); selected addresses leave the W loads free to issue at once
        src = tl.where(r == rank, x_row_ptrs, slot_ptr_of_rank0 + r * slot_elems + row_off + cols)
        v = tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
        if r == 0:
            acc = v.to(tl.float32)
        else:
            acc += v.to(tl.float32)
    return round_to(acc, DT, INTERPRET)


@triton.jit
def _row_mask(cols_ok, row, end, INTERPRET: tl.constexpr):
    """The columns of ``row`` to touch: ``cols_ok`` where ``row < end``, else none."""
    return interpreter_mask(cols_ok & (row < end), INTERPRET)


@triton.jit
def _all_bases(bases, W: tl.constexpr):
    """Every rank's workspace base as one [MAX_RANKS] vector (element p: rank p; 0 past W), loaded
    at once: a kernel picks peer p's with :func:`_base_of` instead of a load of its own."""
    return peer_bases(bases, tl.arange(0, _MAX_RANKS), W)


@triton.jit
def _base_of(all_bases, p):
    """Rank ``p``'s base out of :func:`_all_bases`' vector (a select and a reduction within a warp)."""
    return tl.sum(tl.where(tl.arange(0, _MAX_RANKS) == p, all_bases, 0), axis=0)


@triton.jit
def _push_rows(x_ptr, dst, first_row, row_limit, pid, H, cols, cols_ok, ROWS, INTERPRET: tl.constexpr):
    """Copy rows first_row + pid*ROWS + i (i < ROWS, row < row_limit) of x to the same rows at dst."""
    i = 0
    while i < ROWS:  # a while loop: Triton 3.4's interpreter cannot run range() over a tensor
        row = first_row + pid * ROWS + i
        mask = _row_mask(cols_ok, row, row_limit, INTERPRET)
        off = row.to(tl.int64) * H + cols
        tl.store(dst + off, tl.load(x_ptr + off, mask=mask), mask=mask)
        i += 1


@triton.jit
def _fill_rows_with_nan(normed_ptr, res_out_ptr, first_row, row_limit, pid, H, cols, cols_ok, ROWS,
                        INTERPRET: tl.constexpr):
    """A call that gave up (timeout, mismatch, abort) leaves NaN in both outputs, never data that
    could pass for a result (invariant 5 of csrc/protocol.cuh). Only the rows this program owns
    (the ones :func:`_push_rows` reads for it): in place, no other program reads them."""
    nan = tl.full(cols.shape, float("nan"), tl.float32).to(normed_ptr.dtype.element_ty)
    i = 0
    while i < ROWS:  # a while loop: Triton 3.4's interpreter cannot run range() over a tensor
        row = first_row + pid * ROWS + i
        mask = _row_mask(cols_ok, row, row_limit, INTERPRET)
        off = row.to(tl.int64) * H + cols
        tl.store(normed_ptr + off, nan, mask=mask)
        tl.store(res_out_ptr + off, nan, mask=mask)
        i += 1


@triton.jit
def _shard(T, W: tl.constexpr, owner):
    per = (T + W - 1) // W
    begin = tl.minimum(per * owner, T)
    end = tl.minimum(begin + per, T)
    return begin, end


@triton.jit
def _push_to_peers(x_ptr, all_bases, rank, T, H, pid, cols, cols_ok, epoch, sig64, slot_bytes,
                   parity_off, flags_offset, SHARDED: tl.constexpr, ROWS, W: tl.constexpr, ALIGNED: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Push this program's rows of x into our slot of every peer (all rows, or with SHARDED only
    the rows that peer owns), then release every peer's flag of kind 0 (one fence for all).
    Unsharded, each row is loaded once and stored to every peer: loaded per peer, the compiler
    reloaded it after each peer's stores (they might alias x), one trip per peer and row."""
    if SHARDED:
        for p in tl.static_range(W):
            if p != rank:
                dst = typed_pointer(_base_of(all_bases, p) + parity_off + rank.to(tl.int64) * slot_bytes,
                                    x_ptr.dtype.element_ty, ALIGNED)
                begin, end = _shard(T, W, p)
                _push_rows(x_ptr, dst, begin, end, pid, H, cols, cols_ok, ROWS, INTERPRET)
    else:
        own_slot = parity_off + rank.to(tl.int64) * slot_bytes
        i = 0
        while i < ROWS:  # a while loop: Triton 3.4's interpreter cannot run range() over a tensor
            row = pid * ROWS + i
            mask = _row_mask(cols_ok, row, T, INTERPRET)
            off = row.to(tl.int64) * H + cols
            v = tl.load(x_ptr + off, mask=mask)
            for p in tl.static_range(W):
                dst = typed_pointer(_base_of(all_bases, p) + own_slot, x_ptr.dtype.element_ty, ALIGNED)
                tl.store(dst + off, v, mask=interpreter_mask(mask & (rank != p), INTERPRET))
            i += 1
    _release_flags(all_bases, flags_offset, 0, rank, pid, epoch, sig64, W, INTERPRET)


@triton.jit
def _release_flags(all_bases, flags_offset, kind: tl.constexpr, rank, pid, epoch, sig64, W: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """After every thread's pushes: one barrier, one system-scope fence, then our flag of ``kind``
    (this call's sealed word, in the row of its parity) in every peer (invariant 2 of
    csrc/protocol.cuh: data before flag)."""
    tl.debug_barrier()
    release_fence(INTERPRET)
    word = sealed_word(epoch, sig64)
    for p in tl.static_range(W):
        if p != rank:
            store_flag(flag_addr(_base_of(all_bases, p), flags_offset, kind, epoch & 1, rank, pid), word, INTERPRET)


@triton.jit
def _new_residual_row(x_ptr, res_ptr, slot0, slot_elems, row_off, cols, mask, rank, W: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """residual + all_reduce(x) for one row: the reduction rounded once, then the add rounded once."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    s = _reduce_row(x_ptr + row_off + cols, slot0, slot_elems, row_off, cols, mask, rank, W, DT, INTERPRET)
    res = tl.load(res_ptr + row_off + cols, mask=mask, other=0.0)
    return round_to(s.to(tl.float32) + res.to(tl.float32), DT, INTERPRET)


@triton.jit
def _wait_all_peers(my_base, flags_offset, kind: tl.constexpr, ctrl, err_addr, epoch, sig64, timeout_ns, rank, pid,
                    stage: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """1 once every peer's flag of ``kind`` for this program holds exactly this call's sealed word
    (invariant 3 of csrc/protocol.cuh); 0 on a mismatch (a peer's call notice of this epoch with
    another signature), a timeout or an abort, the same in every thread of the program. Any other
    flag word is "not yet": one of another signature may be a slot left from an earlier wrap, so
    only the notices name a mismatch.

    Every pending peer's flag is loaded in each spin, one peer per thread (a BLOCK-wide tensor
    masked to the W - 1 peers: each slot is polled by exactly one thread), so a peer whose flag
    comes late costs one round trip, not one per peer before it; the exit test is one block-wide
    reduction of the worst state (oneshot_ll's wait states), so every thread leaves in the
    same spin."""
    peers = tl.arange(0, BLOCK)
    live = (peers < W) & (peers != rank)
    flags = flag_addr(my_base, flags_offset, kind, epoch & 1, peers, pid)
    notices = my_notices(my_base, flags_offset, epoch)
    expected = sealed_word(epoch, sig64)
    words = load_acquire_where(flags, live, INTERPRET)
    states = _flag_states(live, words, expected)
    state = tl.max(states)
    spins = 0
    start = now_ns(INTERPRET)
    while state == NOT_YET:
        spins += 1
        verdict = spin_verdict(ctrl, start, spins, timeout_ns, notices, epoch, sig64, rank, W, INTERPRET)
        fresh = load_acquire_where(flags, live & (states == NOT_YET), INTERPRET)  # arrived ones stay arrived
        words = tl.where(states == NOT_YET, fresh, words)
        states = _flag_states(live, words, expected)
        state = tl.max(tl.maximum(states, verdict_state(verdict)))
    if state == FOREIGN:  # a peer's notice of another call (spin_verdict): name it from there
        culprit, their_sig = foreign_notice(notices, epoch, sig64, rank, W, INTERPRET)
        record_error(ctrl, err_addr, 2, rank, culprit, stage, pid, epoch, sig64, their_sig, INTERPRET)
    elif state == TIMED_OUT:
        late = tl.max(tl.where(states == NOT_YET, peers, -1))
        record_error(ctrl, err_addr, 1, rank, late, stage, pid, epoch, sig64, 0, INTERPRET)
    return (state == ARRIVED).to(tl.int32)


@triton.jit
def _flag_states(live, words, expected):
    """Per peer: ARRIVED (its flag is this call's sealed word ``expected``: a peer one call ahead
    writes the other parity's row, so that word stays until this call has read it) or NOT_YET;
    ARRIVED where not live."""
    return tl.where(live & (words != expected), NOT_YET, ARRIVED)


# ---- kernels -----------------------------------------------------------------------------

# Arguments that vary between workspaces and calls: specialising on them would recompile. The
# tensors come as addresses (x_addr, ...): their alignment is the ALIGNED constexpr's business
# (two variants of each kernel, the same bits: the row statistic is exact), not the compile key's.
# ``bases``: the address of the device array of every rank's workspace base (any W, one pointer).
_RUNTIME_ARGS = ("x_addr", "res_addr", "w_addr", "normed_addr", "res_out_addr", "bases", "my_base", "err_addr", "rank",
                 "T", "ROWS", "sig", "timeout_ns", "slot_bytes", "parity_bytes", "flags_offset", "control_offset")


@triton.jit
def _prologue(x_addr, res_addr, w_addr, normed_addr, res_out_addr, my_base, control_offset, sig, H, slot_bytes,
              parity_bytes, DT: tl.constexpr, WT: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_H: tl.constexpr,
              INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """Both kernels' start: wait for the previous kernel (PDL), the five tensors as typed pointers
    (16-byte aligned ones with ALIGNED), then this program's view of the call: (x, residual,
    weight, normed, new residual, pid, ctrl, epoch, aborted (one verdict for the program: the
    branches on it hold barriers), sig64, cols, cols_ok, slot_elems, parity_off)."""
    wait_for_previous_kernel(PDL)
    x_ptr = typed_pointer(x_addr, DT, ALIGNED)
    ES: tl.constexpr = DT.primitive_bitwidth // 8
    pid = tl.program_id(0)
    ctrl = (my_base + control_offset).to(tl.pointer_type(tl.uint32))
    epoch, aborted = begin_call(ctrl, pid)
    cols = tl.arange(0, BLOCK_H)
    # workspace regions start on ALIGN-byte boundaries (layout.py): facts the compiler needs to
    # widen the slot accesses, since these offsets are runtime values
    parity_off = tl.multiple_of((epoch & 1).to(tl.int64) * parity_bytes, _ALIGN)
    # 64-bit element counts: sender x slot elements is the largest offset a kernel forms
    slot_elems = tl.multiple_of(slot_bytes.to(tl.int64) // ES, _ALIGN // ES)
    return (x_ptr, typed_pointer(res_addr, DT, ALIGNED), typed_pointer(w_addr, WT, ALIGNED),
            typed_pointer(normed_addr, DT, ALIGNED), typed_pointer(res_out_addr, DT, ALIGNED), pid, ctrl, epoch,
            block_any(aborted, INTERPRET), sig.to(tl.uint64), cols, cols < H, slot_elems, parity_off)


@triton.jit(do_not_specialize=_RUNTIME_ARGS)
def _fused_oneshot_kernel(x_addr, res_addr, w_addr, normed_addr, res_out_addr, bases, my_base, err_addr,
                          rank, T, ROWS, eps, sig, timeout_ns, slot_bytes, parity_bytes, flags_offset, control_offset,
                          H: tl.constexpr, DT: tl.constexpr, WT: tl.constexpr, ALIGNED: tl.constexpr, W: tl.constexpr,
                          BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    x_ptr, res_ptr, w_ptr, normed_ptr, res_out_ptr, pid, ctrl, epoch, aborted, sig64, cols, cols_ok, slot_elems, \
        parity_off = _prologue(x_addr, res_addr, w_addr, normed_addr, res_out_addr, my_base, control_offset, sig, H,
                               slot_bytes, parity_bytes, DT, WT, ALIGNED, BLOCK_H, INTERPRET, PDL)
    done = 0
    if aborted == 0:
        # 1. push our rows into our slot of every peer, then flag that peer
        all_bases = _all_bases(bases, W)
        _push_to_peers(x_ptr, all_bases, rank, T, H, pid, cols, cols_ok, epoch, sig64, slot_bytes, parity_off,
                       flags_offset, False, ROWS, W, ALIGNED, INTERPRET)
        post_notices(bases, flags_offset, rank, pid, epoch, sig64, 0, W,
                     INTERPRET)  # after the push; aborted == 0 in this branch
        # 2. wait for every peer's rows
        ok = _wait_all_peers(my_base, flags_offset, 0, ctrl, err_addr, epoch, sig64, timeout_ns, rank, pid, 4, W,
                             BLOCK_H, INTERPRET)
        # 3. reduce, add the residual, normalise
        if ok == 1:
            w = tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
            slot0 = typed_pointer(my_base + parity_off, DT, ALIGNED)
            i = 0
            while i < ROWS:  # a while loop: Triton 3.4's interpreter cannot run range() over a tensor
                row = pid * ROWS + i
                mask = _row_mask(cols_ok, row, T, INTERPRET)
                row_off = row.to(tl.int64) * H
                nr = _new_residual_row(x_ptr, res_ptr, slot0, slot_elems, row_off, cols, mask, rank, W, INTERPRET)
                finish_row(nr, w, cols_ok, H, eps, normed_ptr + row_off + cols, res_out_ptr + row_off + cols, mask, DT,
                           INTERPRET)
                i += 1
            done = 1
    if done == 0:
        _fill_rows_with_nan(normed_ptr, res_out_ptr, 0, T, pid, H, cols, cols_ok, ROWS, INTERPRET)
    allow_dependent_launch(PDL)
    end_call(ctrl, epoch, pid)


@triton.jit(do_not_specialize=_RUNTIME_ARGS)
def _fused_twoshot_kernel(x_addr, res_addr, w_addr, normed_addr, res_out_addr, bases, my_base, err_addr,
                          rank, T, ROWS, eps, sig, timeout_ns, slot_bytes, parity_bytes, flags_offset, control_offset,
                          H: tl.constexpr, DT: tl.constexpr, WT: tl.constexpr, ALIGNED: tl.constexpr, W: tl.constexpr,
                          BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    x_ptr, res_ptr, w_ptr, normed_ptr, res_out_ptr, pid, ctrl, epoch, aborted, sig64, cols, cols_ok, slot_elems, \
        parity_off = _prologue(x_addr, res_addr, w_addr, normed_addr, res_out_addr, my_base, control_offset, sig, H,
                               slot_bytes, parity_bytes, DT, WT, ALIGNED, BLOCK_H, INTERPRET, PDL)
    done = 0
    if aborted == 0:
        # 1. reduce-scatter: the rows each owner owns go to that owner
        all_bases = _all_bases(bases, W)
        _push_to_peers(x_ptr, all_bases, rank, T, H, pid, cols, cols_ok, epoch, sig64, slot_bytes, parity_off,
                       flags_offset, True, ROWS, W, ALIGNED, INTERPRET)
        post_notices(bases, flags_offset, rank, pid, epoch, sig64, 0, W,
                     INTERPRET)  # after the push; aborted == 0 in this branch
        ok = _wait_all_peers(my_base, flags_offset, 0, ctrl, err_addr, epoch, sig64, timeout_ns, rank, pid, 5, W,
                             BLOCK_H, INTERPRET)
        w = tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
        if ok == 1:
            # 2. own rows: reduce + residual; push the new residual rows to everyone
            slot0 = typed_pointer(my_base + parity_off, DT, ALIGNED)
            begin, end = _shard(T, W, rank)
            i = 0
            while i < ROWS:  # a while loop: Triton 3.4's interpreter cannot run range() over a tensor
                row = begin + pid * ROWS + i
                mask = _row_mask(cols_ok, row, end, INTERPRET)
                row_off = row.to(tl.int64) * H
                nr = _new_residual_row(x_ptr, res_ptr, slot0, slot_elems, row_off, cols, mask, rank, W, INTERPRET)
                finish_row(nr, w, cols_ok, H, eps, normed_ptr + row_off + cols, res_out_ptr + row_off + cols, mask, DT,
                           INTERPRET)
                for p in tl.static_range(W):
                    if p != rank:
                        dst = typed_pointer(_base_of(all_bases, p) + parity_off + rank.to(tl.int64) * slot_bytes,
                                            DT, ALIGNED)
                        tl.store(dst + row_off + cols, nr, mask=mask)
                i += 1
            _release_flags(all_bases, flags_offset, 1, rank, pid, epoch, sig64, W, INTERPRET)
            # 3. all-gather: every peer's new residual rows; the norm is computed here
            ok = _wait_all_peers(my_base, flags_offset, 1, ctrl, err_addr, epoch, sig64, timeout_ns, rank, pid, 6, W,
                                 BLOCK_H, INTERPRET)
            if ok == 1:
                for sender in range(W):  # a loop, not unrolled: W copies of the norm would only cost compile time
                    if sender != rank:
                        src = typed_pointer(my_base + parity_off + sender * slot_bytes.to(tl.int64), DT, ALIGNED)
                        begin, end = _shard(T, W, sender)
                        i = 0
                        while i < ROWS:  # a while loop: Triton 3.4's interpreter cannot run range() over a tensor
                            row = begin + pid * ROWS + i
                            mask = _row_mask(cols_ok, row, end, INTERPRET)
                            row_off = row.to(tl.int64) * H
                            nr = tl.load(src + row_off + cols, mask=mask, other=0.0, cache_modifier=".cg")
                            finish_row(nr, w, cols_ok, H, eps, normed_ptr + row_off + cols,
                                       res_out_ptr + row_off + cols, mask, DT, INTERPRET)
                            i += 1
                done = 1
    if done == 0:  # this program's rows of every shard, its own shard's finished rows included
        for owner in range(W):
            begin, end = _shard(T, W, owner)
            _fill_rows_with_nan(normed_ptr, res_out_ptr, begin, end, pid, H, cols, cols_ok, ROWS, INTERPRET)
    allow_dependent_launch(PDL)
    end_call(ctrl, epoch, pid)
