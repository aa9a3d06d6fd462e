"""The full-payload data-as-flag one-shot (``oneshot_full``) moving 16-byte quads: the same wire,
headers, grid and row statistics as :mod:`pcie_allreduce.fused.oneshot_ll`'s full-payload kernel,
with each thread pushing, polling and re-poisoning four 4-byte words (eight 2-byte elements) in one
16-byte access, as csrc/oneshot_full.cuh moves its units.

Why: the word kernel gives each thread one 4-byte word, so a chunk's push, every spin of its poll
and its re-poison each take four times the instructions (and L2 requests) of the CUDA kernel's.
A word arrives as it does there (F1 of csrc/oneshot_full.cuh: no 16-bit lane is poison, checked
lane by lane, so how a 16-byte store is split on its way does not matter), so the two kernels'
slots are the same bytes and either may run beside the other's calls on one workspace.

The choice between the two is a function of the call's shape and world alone (where every chunk is
whole quads and the quads were measured faster:
:func:`pcie_allreduce.plan.fused_shapes.takes_quads`), never of a rank's tensors: a row's sum of
squares is summed in a thread mapping of its own, and every rank must sum it the same way to agree
bitwise on the norm. Tensors that do not start on a 16-byte boundary are read and
written element by element (VECTOR off), with the same quads on the wire and the same sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pcie_allreduce import constants
from pcie_allreduce.fused.oneshot_ll import (ABORTED, ARRIVED, NOT_YET, POISON_LANE, header_arrivals,
                                             poisoned_lanes, post_row_partial, rank_order_sums,
                                             record_gather_failure, row_sum_of_squares, verdict_state)
from pcie_allreduce.fused.protocol import (FUSED_TENSOR_ARGS, allow_dependent_launch, begin_call, end_call,
                                            my_notices, now_ns, pause_ns, peer_bases, post_notices, round_to,
                                            sealed_word, spin_verdict, store_volatile, wait_for_previous_kernel)

_MAX_RANKS: tl.constexpr = tl.constexpr(constants.MAX_RANKS)
_MAX_FLAG_BLOCKS: tl.constexpr = tl.constexpr(constants.MAX_FLAG_BLOCKS)
_POISON: tl.constexpr = tl.constexpr(constants.POISON_WORD)


# ---- 16-byte accesses ------------------------------------------------------------------------


@triton.jit
def _load_volatile_quad(ptr, mask, INTERPRET: tl.constexpr):
    """The four u32 words at each 16-byte aligned ``ptr`` (u32 pointers), where ``mask`` (0
    elsewhere): one ld.volatile.global.v4.u32 per element, side-effecting inline asm, so a poll is
    neither hoisted out of its loop nor re-issued after the words were re-poisoned."""
    if INTERPRET:
        m = mask != 0
        w0 = tl.load(ptr, mask=m, other=0, volatile=True)
        w1 = tl.load(ptr + 1, mask=m, other=0, volatile=True)
        w2 = tl.load(ptr + 2, mask=m, other=0, volatile=True)
        w3 = tl.load(ptr + 3, mask=m, other=0, volatile=True)
    else:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; "
            "@p ld.volatile.global.v4.u32 {$0, $1, $2, $3}, [$4]; }",
            "=r,=r,=r,=r,l,r", [ptr, mask.to(tl.int32)], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=False, pack=1)
    return w0, w1, w2, w3


@triton.jit
def _store_volatile_quad(ptr, w0, w1, w2, w3, mask, INTERPRET: tl.constexpr):
    """st.volatile.global.v4.u32 of (w0, w1, w2, w3) at each 16-byte aligned ``ptr`` where ``mask``."""
    if INTERPRET:
        m = mask != 0
        tl.store(ptr, w0, mask=m)
        tl.store(ptr + 1, w1, mask=m)
        tl.store(ptr + 2, w2, mask=m)
        tl.store(ptr + 3, w3, mask=m)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $6, 0; @p st.volatile.global.v4.u32 [$1], {$2, $3, $4, $5}; "
            "mov.u32 $0, 0; }",
            "=r,l,r,r,r,r,r", [ptr, w0, w1, w2, w3, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _element_bits(ptr, i, mask):
    return tl.load(ptr + i, mask=mask, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _load_quad(ptr, quad, mask, VECTOR: tl.constexpr, INTERPRET: tl.constexpr):
    """Elements 8 * quad .. 8 * quad + 7 of a 2-byte tensor as four u32 words (word k: elements 2k
    low, 2k + 1 high): one 16-byte load each with VECTOR (the tensor 16-byte aligned), else eight
    2-byte loads."""
    if VECTOR and not INTERPRET:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; "
            "@p ld.global.v4.u32 {$0, $1, $2, $3}, [$4]; }",
            "=r,=r,=r,=r,l,r", [ptr.to(tl.pointer_type(tl.uint32)) + 4 * quad, mask.to(tl.int32)],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=False, pack=1)
    else:
        e = 8 * quad
        w0 = _element_bits(ptr, e, mask) | (_element_bits(ptr, e + 1, mask) << 16)
        w1 = _element_bits(ptr, e + 2, mask) | (_element_bits(ptr, e + 3, mask) << 16)
        w2 = _element_bits(ptr, e + 4, mask) | (_element_bits(ptr, e + 5, mask) << 16)
        w3 = _element_bits(ptr, e + 6, mask) | (_element_bits(ptr, e + 7, mask) << 16)
    return w0, w1, w2, w3


@triton.jit
def _store_word_elements(ptr, i, word, mask):
    DT: tl.constexpr = ptr.dtype.element_ty
    tl.store(ptr + i, (word & 0xFFFF).to(tl.uint16).to(DT, bitcast=True), mask=mask)
    tl.store(ptr + i + 1, (word >> 16).to(tl.uint16).to(DT, bitcast=True), mask=mask)


@triton.jit
def _store_quad(ptr, quad, w0, w1, w2, w3, mask, VECTOR: tl.constexpr, INTERPRET: tl.constexpr):
    """The inverse of :func:`_load_quad`: four u32 words into elements 8 * quad .. 8 * quad + 7."""
    if VECTOR and not INTERPRET:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $6, 0; @p st.global.v4.u32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0; }",
            "=r,l,r,r,r,r,r", [ptr.to(tl.pointer_type(tl.uint32)) + 4 * quad, w0, w1, w2, w3, mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        e = 8 * quad
        _store_word_elements(ptr, e, w0, mask)
        _store_word_elements(ptr, e + 2, w1, mask)
        _store_word_elements(ptr, e + 4, w2, mask)
        _store_word_elements(ptr, e + 6, w3, mask)


# ---- words and their values ------------------------------------------------------------------


@triton.jit
def _lanes(word, DT: tl.constexpr):
    """(low, high) element of u32 words as fp32 values of the 2-byte dtype DT."""
    lo = (word & 0xFFFF).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
    hi = (word >> 16).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pack(lo, hi, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 (low, high) rounded to DT (round-to-nearest-even) as one u32 word."""
    lo16 = round_to(lo, DT, INTERPRET).to(tl.uint16, bitcast=True).to(tl.uint32)
    hi16 = round_to(hi, DT, INTERPRET).to(tl.uint16, bitcast=True).to(tl.uint32)
    return lo16 | (hi16 << 16)


@triton.jit
def _wire(word):
    """A word as it goes on the wire: each -0.0 lane (0x8000, the poison pattern) sent as +0.0
    (H1 of csrc/host_wire.cuh)."""
    lo = word & 0xFFFF
    hi = word >> 16
    return tl.where(lo == POISON_LANE, 0, lo) | (tl.where(hi == POISON_LANE, 0, hi) << 16)


@triton.jit
def _new_residual(tile, own, res, peers, rank, W: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """(low, high) of ``residual + all_reduce(x)`` for word k of every quad, as fp32 values of DT:
    the peers' words (``tile``, [peers, quads]) and ours (``own``) summed in fp32 in rank order,
    rounded once, then the residual (``res``) added and rounded once: the plain path's bits."""
    lo, hi = _lanes(tile, DT)
    own_lo, own_hi = _lanes(own, DT)
    acc_lo, acc_hi = rank_order_sums(lo, hi, own_lo, own_hi, peers, rank, W)
    res_lo, res_hi = _lanes(res, DT)
    nr_lo = round_to(round_to(acc_lo, DT, INTERPRET).to(tl.float32) + res_lo, DT, INTERPRET).to(tl.float32)
    nr_hi = round_to(round_to(acc_hi, DT, INTERPRET).to(tl.float32) + res_hi, DT, INTERPRET).to(tl.float32)
    return nr_lo, nr_hi


@triton.jit
def _weights(w_ptr, col, mask):
    """The weights of columns ``col`` and ``col + 1`` (any weight dtype) as fp32."""
    return (tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32),
            tl.load(w_ptr + col + 1, mask=mask, other=0.0).to(tl.float32))


# ---- the wait --------------------------------------------------------------------------------


@triton.jit
def _poll_once(lines, headers_ptr, pending, header_pending, flag, t0, t1, t2, t3, INTERPRET: tl.constexpr):
    """One look at the quads of the [peers, quads] tile still ``pending`` (live, not arrived at the
    last look) and the headers still ``header_pending``: the tile's four words (an arrived quad
    keeps the words it arrived with: no peer rewrites it before this call re-poisons it), the
    states per quad (NOT_YET while a lane of any of its words is poison), the headers' states and
    the worst state per quad column. Arrived quads are not loaded again, so a spin's L2 traffic
    shrinks as the peers arrive (a 16-warp program's whole tile at W = 8 is 57 KB a spin)."""
    n0, n1, n2, n3 = _load_volatile_quad(lines, pending, INTERPRET)
    poisoned = poisoned_lanes(n0) | poisoned_lanes(n1) | poisoned_lanes(n2) | poisoned_lanes(n3)
    states = tl.where(pending & poisoned, NOT_YET, ARRIVED)
    header_states = header_arrivals(headers_ptr, header_pending, flag, INTERPRET)
    return (tl.where(pending, n0, t0), tl.where(pending, n1, t1), tl.where(pending, n2, t2),
            tl.where(pending, n3, t3), states, header_states, tl.maximum(tl.max(states, axis=0), header_states))


@triton.jit
def _poll_quads(lines, headers_ptr, live, header_live, peers, flag, aborted, ctrl, err_addr, epoch, sig, timeout_ns,
                rank, pid, notices, W: tl.constexpr, BACKOFF: tl.constexpr, INTERPRET: tl.constexpr):
    """(the tile's four words, ok): :func:`pcie_allreduce.fused.oneshot_ll._poll_words` with FULL,
    over quads: one block-wide reduction per spin, the verdicts riding in it; each spin loads only
    what has not arrived."""
    none = tl.zeros(live.shape, tl.uint32)
    t0, t1, t2, t3, states, header_states, worst = _poll_once(lines, headers_ptr, live, header_live, flag, none, none,
                                                              none, none, INTERPRET)
    state = tl.max(tl.maximum(worst, tl.where(aborted != 0, ABORTED, ARRIVED)))
    spins = 0
    start = now_ns(INTERPRET)
    while state == NOT_YET:
        spins += 1
        verdict = spin_verdict(ctrl, start, spins, timeout_ns, notices, epoch, sig, rank, W, INTERPRET)
        pause_ns(BACKOFF, INTERPRET)
        t0, t1, t2, t3, states, header_states, worst = _poll_once(lines, headers_ptr, states == NOT_YET,
                                                                  header_states == NOT_YET, flag, t0, t1, t2, t3,
                                                                  INTERPRET)
        state = tl.max(tl.maximum(worst, verdict_state(verdict)))
    record_gather_failure(state, states, header_states, peers, None, ctrl, err_addr, epoch, sig, rank, pid, notices,
                          W, True, INTERPRET)
    return t0, t1, t2, t3, (state == ARRIVED).to(tl.int32)


# ---- the kernel ------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["bases", "my_base", "err_addr", "rank", "T", "H", "sig", "timeout_ns", "slot_stride",
                                  "slots_offset", "headers_offset", "control_offset", "stats_offset", "flags_offset"],
            do_not_specialize_on_alignment=FUSED_TENSOR_ARGS)
def _fused_oneshot_full_quads_kernel(x_ptr, res_ptr, w_ptr, normed_ptr, res_out_ptr,
                                     bases, my_base, err_addr, rank, T, H, eps, sig, timeout_ns, slot_stride,
                                     slots_offset, headers_offset, control_offset, stats_offset, flags_offset,
                                     C: tl.constexpr, CW: tl.constexpr, BLOCK_Q: tl.constexpr, W: tl.constexpr,
                                     WP: tl.constexpr, VECTOR: tl.constexpr, INTERPRET: tl.constexpr,
                                     BACKOFF: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Grid T x C (row, chunk), one quad per thread: push, gather, row statistics, norm, as the
    word kernel's steps 1-4 (oneshot_ll's module docstring). H and CW are multiples of 8."""
    tl.static_assert((BLOCK_Q >= W) & (BLOCK_Q >= C), "peer q's header and chunk q's statistic are element q")
    wait_for_previous_kernel(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    row = pid // C
    c = pid % C
    first = (row.to(tl.int64) * H + c * CW) // 8  # in quads
    j = tl.arange(0, BLOCK_Q)
    q_ok = j < tl.minimum(CW, H - c * CW) // 8
    quad = first + j
    col = c * CW + 8 * j  # the quad's first column (weight is per column)
    # every local operand before the first wait (as the word kernel: they overlap the peers' pushes)
    x0, x1, x2, x3 = _load_quad(x_ptr, quad, q_ok, VECTOR, INTERPRET)
    r0, r1, r2, r3 = _load_quad(res_ptr, quad, q_ok, VECTOR, INTERPRET)
    wa0, wb0 = _weights(w_ptr, col, q_ok)
    wa1, wb1 = _weights(w_ptr, col + 2, q_ok)
    wa2, wb2 = _weights(w_ptr, col + 4, q_ok)
    wa3, wb3 = _weights(w_ptr, col + 6, q_ok)
    ctrl = (my_base + control_offset).to(tl.pointer_type(tl.uint32))
    epoch, aborted = begin_call(ctrl, pid)
    sig64 = sig.to(tl.uint64)
    notices = my_notices(my_base, flags_offset, epoch)
    flag = sealed_word(epoch, sig64)  # the headers' word (F2)
    parity = (epoch & 1).to(tl.int64)
    parity_off = parity * W * slot_stride
    done = 0
    sending = aborted == 0  # this thread's reading: masks its stores (no branch holds a barrier on it)
    # 1. this program's header of this call into every peer (peer q's from element q), then its
    #    quads of x as one [peers, quads] tile of 16-byte stores
    to_peer = (j < W) & (j != rank) & sending
    header = peer_bases(bases, j, W) + headers_offset + ((parity * _MAX_RANKS + rank) * _MAX_FLAG_BLOCKS + pid) * 8
    store_volatile(header.to(tl.pointer_type(tl.uint64)), tl.zeros([BLOCK_Q], tl.uint64) + flag, to_peer, INTERPRET)
    peers = tl.arange(0, WP)[:, None]
    push_bases = peer_bases(bases, peers, W)
    dst = (push_bases + slots_offset + parity_off + rank.to(tl.int64) * slot_stride).to(tl.pointer_type(tl.uint32))
    to_peers = (peers < W) & (peers != rank) & (q_ok & sending)[None, :]
    zero = tl.zeros([WP, BLOCK_Q], tl.uint32)
    _store_volatile_quad(dst + 4 * quad[None, :], _wire(x0)[None, :] + zero, _wire(x1)[None, :] + zero,
                         _wire(x2)[None, :] + zero, _wire(x3)[None, :] + zero, to_peers, INTERPRET)
    post_notices(bases, flags_offset, rank, pid, epoch, sig64, aborted, W, INTERPRET)

    # 2. gather this program's quads from every peer, reduce in rank order, add the residual
    live = (peers < W) & (peers != rank) & q_ok[None, :]
    lines = (my_base + slots_offset + parity_off + peers.to(tl.int64) * slot_stride + quad[None, :] * 16
             ).to(tl.pointer_type(tl.uint32))
    header_live = (j < W) & (j != rank)
    headers = (my_base + headers_offset + ((parity * _MAX_RANKS + j) * _MAX_FLAG_BLOCKS + pid) * 8
               ).to(tl.pointer_type(tl.uint64))
    t0, t1, t2, t3, ok = _poll_quads(lines, headers, live, header_live, peers, flag, aborted, ctrl, err_addr, epoch,
                                     sig64, timeout_ns, rank, pid, notices, W, BACKOFF, INTERPRET)
    if ok == 1:
        a0, b0 = _new_residual(t0, x0, r0, peers, rank, W, DT, INTERPRET)
        a1, b1 = _new_residual(t1, x1, r1, peers, rank, W, DT, INTERPRET)
        a2, b2 = _new_residual(t2, x2, r2, peers, rank, W, DT, INTERPRET)
        a3, b3 = _new_residual(t3, x3, r3, peers, rank, W, DT, INTERPRET)
        # 3. the row's sum of squares, shared by its C programs (posted before the stores below)
        squares = a0 * a0 + b0 * b0 + a1 * a1 + b1 * b1 + a2 * a2 + b2 * b2 + a3 * a3 + b3 * b3
        partial = tl.sum(tl.where(q_ok, squares, 0.0), axis=0)
        stats = (my_base + stats_offset).to(tl.pointer_type(tl.uint64))
        post_row_partial(stats, partial, row, c, epoch, C, BLOCK_Q, INTERPRET)
        _store_quad(res_out_ptr, quad, _pack(a0, b0, DT, INTERPRET), _pack(a1, b1, DT, INTERPRET),
                    _pack(a2, b2, DT, INTERPRET), _pack(a3, b3, DT, INTERPRET), q_ok, VECTOR, INTERPRET)
        tl.debug_barrier()  # every thread has read its words before any is re-poisoned
        poison = tl.full([WP, BLOCK_Q], _POISON, tl.uint32)
        _store_volatile_quad(lines, poison, poison, poison, poison, live, INTERPRET)  # F1: re-poisoned
        sumsq, ok = row_sum_of_squares(stats, row, c, epoch, ctrl, err_addr, sig64, timeout_ns, rank, pid, notices,
                                        W, C, BLOCK_Q, BACKOFF, INTERPRET)
        # 4. normalise
        if ok == 1:
            rstd = 1.0 / tl.sqrt_rn(sumsq / H + eps)
            _store_quad(normed_ptr, quad, _pack(a0 * rstd * wa0, b0 * rstd * wb0, DT, INTERPRET),
                        _pack(a1 * rstd * wa1, b1 * rstd * wb1, DT, INTERPRET),
                        _pack(a2 * rstd * wa2, b2 * rstd * wb2, DT, INTERPRET),
                        _pack(a3 * rstd * wa3, b3 * rstd * wb3, DT, INTERPRET), q_ok, VECTOR, INTERPRET)
            done = 1
    if done == 0:
        # Gave up (timeout, mismatch, abort): NaN in this program's quads of both outputs (invariant
        # 5 of csrc/protocol.cuh); only this program touches them, so in place stays safe.
        nan = _pack(tl.full([BLOCK_Q], float("nan"), tl.float32), tl.full([BLOCK_Q], float("nan"), tl.float32), DT,
                    INTERPRET)
        _store_quad(res_out_ptr, quad, nan, nan, nan, nan, q_ok, VECTOR, INTERPRET)
        _store_quad(normed_ptr, quad, nan, nan, nan, nan, q_ok, VECTOR, INTERPRET)
    allow_dependent_launch(PDL)
    end_call(ctrl, epoch, pid)
