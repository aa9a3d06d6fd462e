"""Fused all-reduce + residual add + RMSNorm with the data as its own flag, for small messages:
over lines (``oneshot_ll``) or at full payload (``oneshot_full``, half the bytes on the wire).

Lines: the wire format and invariants of csrc/oneshot_ll.cuh (L1-L5 there): the message travels
as 8-byte words {4 payload bytes, 32-bit flag}; a word has arrived when its flag equals
``line_flag(epoch, signature)``; the receiver clears every word it consumed; a non-zero flag
that is not ours means a peer issued a different call (mismatch, never reduced).
Full payload: the slots, headers and invariants of csrc/oneshot_full.cuh (F1-F2): 4-byte words of
two elements, -0.0 sent as +0.0 so that no 16-bit lane is ever the poison pattern 0x8000; a word
has arrived when no lane is poison and its sender's header for this program is exactly this
call's sealed word (protocol.sealed_word; any other header is "not yet": a peer's call
notice names a mismatch); the receiver re-poisons every word it consumed. Either way fused and
plain calls of the same format interleave on one workspace, and there is no fence and no flag
round trip: the fused call costs about what the plain all-reduce costs.

Grid: T rows x C column chunks, one program each.
 1. Push: every program pushes its own chunk to every peer (chunks are near-equal, so all
    programs share the push whatever the row count; owning the chunk it pushes keeps in place safe).
 2. Gather: program (row, c) polls its chunk's words from every peer as one [peers, chunk] tile,
    reduces in rank order (fp32, rounded once: the CUDA kernels' formula) and adds the residual:
    the new residual is bitwise the plain path's ``residual + all_reduce(x)``.
 3. Row statistics: each program sends its chunk's sum of squares to the C programs of its row
    through local stats words (tag | fp32 bits in one 8-byte word; the reader clears them, as
    lines are cleared), and every program sums the C partials the same way: all programs of a
    row, on every rank, get the same rstd.
 4. normed = new_residual * rstd * weight.

Needs an even hidden size (a word never straddles two chunks), T*C programs that can all be
resident at once and a message within the line slots' capacity;
:func:`~pcie_allreduce.plan.fused_shapes.data_as_flag` says None otherwise and the caller takes the flag-based one-shot. "Resident at once" is the communicator's
block cap (one program per SM when ranks share a GPU): step 3 waits for the other programs of
the row, so a program that never got an SM would stall its row until the timeout.
Under the interpreter (programs run one after another) C is 1, so no program waits for another.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pcie_allreduce import constants
from pcie_allreduce.constants import MAX_RANKS, ROW_STATS_SLOTS
from pcie_allreduce.fused.protocol import (FUSED_TENSOR_ARGS, allow_dependent_launch, begin_call,
                                            end_call, wait_for_previous_kernel,
                                            foreign_notice, line_flag, line_signature, load_volatile, my_notices,
                                            now_ns, pause_ns, peer_base, peer_bases, post_notices, record_error,
                                            round_to, sealed_word, spin_verdict, store_volatile)

STAGE_LOW_LATENCY_GATHER: tl.constexpr = tl.constexpr(constants.STAGE_LOW_LATENCY_GATHER)
STAGE_FULL_GATHER: tl.constexpr = tl.constexpr(constants.STAGE_FULL_GATHER)
_MAX_RANKS: tl.constexpr = tl.constexpr(MAX_RANKS)
_MAX_FLAG_BLOCKS: tl.constexpr = tl.constexpr(constants.MAX_FLAG_BLOCKS)
_POISON: tl.constexpr = tl.constexpr(constants.POISON_WORD)
POISON_LANE: tl.constexpr = tl.constexpr(constants.POISON_WORD & 0xFFFF)  # -0.0's bits: a lane never sent (F1)
STAGE_ROW_STATS: tl.constexpr = tl.constexpr(constants.STAGE_FUSED_ROW_STATS)


# The worst state a program's wait has seen, ordered so that a block-wide max decides: its words
# arrived < not yet < the workspace aborted < this wait timed out < a foreign call's word. The
# verdicts of this thread's spin (abort flag, timer) ride in the same reduction as the words, so
# every thread of the program leaves the wait in the same spin, whatever each one read.
ARRIVED: tl.constexpr = tl.constexpr(0)
NOT_YET: tl.constexpr = tl.constexpr(1)
ABORTED: tl.constexpr = tl.constexpr(2)
TIMED_OUT: tl.constexpr = tl.constexpr(3)
FOREIGN: tl.constexpr = tl.constexpr(4)


@triton.jit
def verdict_state(verdict):
    """spin_verdict's 0 / 1 (aborted) / 2 (timed out) / 3 (a peer's notice of another call) as a
    wait state."""
    return tl.where(verdict == 1, ABORTED, tl.where(verdict == 2, TIMED_OUT, tl.where(verdict == 3, FOREIGN, ARRIVED)))


@triton.jit
def _word_states(live, words, flag, FULL: tl.constexpr):
    """Per word of the [peers, words] tile: ARRIVED (or not ours to wait for), NOT_YET, or
    FOREIGN (a mismatch, never reduced).

    Lines (L1, L3): a word has arrived when its flag is ours; a non-zero flag that is not ours is
    foreign (lines are cleared after use, so none is left from an earlier call). Full payload (F1,
    F2 of csrc/oneshot_full.cuh): a word has arrived when neither of its 16-bit lanes is the
    poison pattern, and its sender's header of this program is ``flag`` (:func:`header_arrivals`)."""
    if FULL:
        states = tl.where(poisoned_lanes(words), NOT_YET, ARRIVED)
    else:
        seen = words >> 32
        states = tl.where((seen != 0) & (seen != flag), FOREIGN, tl.where(seen == 0, NOT_YET, ARRIVED))
    return tl.where(live, states, ARRIVED)


@triton.jit
def poisoned_lanes(words):
    """Whether either 16-bit lane of each u32 full-payload word is still the poison pattern (F1 of
    csrc/oneshot_full.cuh: the word has not arrived, lane by lane, however a store was split)."""
    return ((words & 0xFFFF) == POISON_LANE) | ((words >> 16) == POISON_LANE)


@triton.jit
def header_arrivals(headers_ptr, header_live, flag, INTERPRET: tl.constexpr):
    """Full payload: per peer (one element each, ``headers_ptr`` [BLOCK_W] with peer q's header of
    this program at element q), ARRIVED where its header is ``flag``, this call's sealed word, or
    where it is not ours to wait for, else NOT_YET. Any other header is not yet ours, never foreign
    (it may be a slot left from an earlier wrap): only the peers' call notices name a mismatch.
    One element per peer instead of one per word: the W loads of a spin are independent, where a
    [peers, words] tile of headers (the same address along a row) made them one chain."""
    headers = load_volatile(headers_ptr, header_live, INTERPRET)
    return tl.where(header_live & (headers != flag), NOT_YET, ARRIVED)


@triton.jit
def _poll_once(words_ptr, headers_ptr, pending, header_pending, flag, words, FULL: tl.constexpr,
               INTERPRET: tl.constexpr):
    """One look at the words of the tile still ``pending`` (live, not arrived at the last look; an
    arrived word keeps the value it arrived with, which no peer rewrites before this call clears or
    re-poisons it) and, with FULL, the headers still ``header_pending``: (words, their states, the
    headers' states, the worst state per word column), the peers axis reduced within each thread
    first and, with FULL, joined with the headers' states element by element (without FULL the
    headers' states are the words'). Arrived words are not loaded again, so a spin's L2 traffic
    shrinks as the peers arrive."""
    fresh = load_volatile(words_ptr, pending, INTERPRET)
    states = _word_states(pending, fresh, flag, FULL)
    words = tl.where(pending, fresh, words)
    if FULL:
        header_states = header_arrivals(headers_ptr, header_pending, flag, INTERPRET)
        worst = tl.maximum(tl.max(states, axis=0), header_states)
    else:
        header_states = states
        worst = states
    return words, states, header_states, worst


@triton.jit
def _poll_words(words_ptr, headers_ptr, live, header_live, peers, flag, aborted, ctrl, err_addr, epoch, sig,
                timeout_ns, rank, pid, notices, W: tl.constexpr, FULL: tl.constexpr, BACKOFF: tl.constexpr,
                INTERPRET: tl.constexpr):
    """(words, ok): bounded wait until every live word of the tile has arrived (_word_states) and,
    with FULL, every peer's header of this call (header_arrivals; ``headers_ptr`` and
    ``header_live`` are [BLOCK_W], peer q at element q); 0 on mismatch/timeout/abort (``aborted``:
    this thread found the workspace aborted at the start), the same in every thread. ``flag``: the
    line flag of this call, or with FULL its sealed header word.

    One block-wide reduction per spin (the worst state of :func:`_poll_once`). Each block-wide
    reduction is a block barrier, and the first version's two per spin (waiting?,
    foreign?) made 16-warp programs notice the last arrival later. Each spin loads only what has
    not arrived."""
    none = tl.zeros(live.shape, words_ptr.dtype.element_ty)
    words, states, header_states, worst = _poll_once(words_ptr, headers_ptr, live, header_live, flag, none, FULL,
                                                     INTERPRET)
    state = tl.max(tl.maximum(worst, tl.where(aborted != 0, ABORTED, ARRIVED)))
    spins = 0
    start = now_ns(INTERPRET)
    while state == NOT_YET:
        spins += 1
        verdict = spin_verdict(ctrl, start, spins, timeout_ns, notices, epoch, sig, rank, W, INTERPRET)
        pause_ns(BACKOFF, INTERPRET)
        words, states, header_states, worst = _poll_once(words_ptr, headers_ptr, states == NOT_YET,
                                                         header_states == NOT_YET, flag, words, FULL, INTERPRET)
        state = tl.max(tl.maximum(worst, verdict_state(verdict)))
    record_gather_failure(state, states, header_states, peers, words, ctrl, err_addr, epoch, sig, rank, pid, notices,
                          W, FULL, INTERPRET)
    return words, (state == ARRIVED).to(tl.int32)


@triton.jit
def record_gather_failure(state, states, header_states, peers, words, ctrl, err_addr, epoch, sig, rank, pid, notices,
                          W: tl.constexpr, FULL: tl.constexpr, INTERPRET: tl.constexpr):
    """After a gather's wait ended in ``state`` (uniform in the program): record a mismatch or a
    timeout, naming the peer. ``states``: the [peers, words] tile's last states; with FULL
    ``header_states`` the headers' ([BLOCK], peer q at element q), and ``words`` unused (a line's
    flag names its sender's call; a header never reads as foreign, so with FULL the peer's notice
    does)."""
    STAGE: tl.constexpr = STAGE_FULL_GATHER if FULL else STAGE_LOW_LATENCY_GATHER
    if state == FOREIGN:
        if FULL:  # headers never read as foreign: the peer's notice of another call (spin_verdict)
            culprit, their_sig = foreign_notice(notices, epoch, sig, rank, W, INTERPRET)
        else:
            culprit = tl.max(tl.where(states == FOREIGN, peers, -1))
            if culprit >= 0:  # a line of another call (uniform: a block-wide max)
                observed = tl.max(tl.where((states == FOREIGN) & (peers == culprit), words >> 32, 0))
                their_sig = line_signature(observed, epoch)
            else:  # a peer's notice of another call (spin_verdict): it runs another kind of kernel
                culprit, their_sig = foreign_notice(notices, epoch, sig, rank, W, INTERPRET)
        record_error(ctrl, err_addr, 2, rank, culprit, STAGE, pid, epoch, sig, their_sig, INTERPRET)
    elif state == TIMED_OUT:
        late = tl.max(tl.where(states == NOT_YET, peers, -1))
        if FULL:
            late = tl.maximum(late, tl.max(tl.where(header_states == NOT_YET, tl.arange(0, header_states.shape[0]),
                                                    -1)))
        record_error(ctrl, err_addr, 1, rank, late, STAGE, pid, epoch, sig, 0, INTERPRET)


@triton.jit
def rank_order_sums(lo, hi, own_lo, own_hi, peers, rank, W: tl.constexpr):
    """fp32 sums in rank order 0..W-1 of each word's (low, high) element, unrounded: the peers'
    values (``lo``, ``hi``: [peers, words] fp32 tiles, peer q in row q) and ours (``own_lo``,
    ``own_hi``) at our rank (the CUDA kernels' order; a -0.0 of ours, where the wire carries +0.0,
    sums alike, since a sum of W >= 2 zeros is +0.0 either way)."""
    for r in tl.static_range(W):
        # -0.0 is the exact neutral element: the sum picks out peer r's value bit for bit
        v_lo = tl.where(r == rank, own_lo, tl.sum(tl.where(peers == r, lo, -0.0), axis=0))
        v_hi = tl.where(r == rank, own_hi, tl.sum(tl.where(peers == r, hi, -0.0), axis=0))
        if r == 0:
            acc_lo = v_lo
            acc_hi = v_hi
        else:
            acc_lo += v_lo
            acc_hi += v_hi
    return acc_lo, acc_hi


@triton.jit
def _load_pairs(ptr, word, mask, PAIRED: tl.constexpr):
    """(low, high) element of each word (elements 2 * word and 2 * word + 1): one 4-byte load per
    word when PAIRED (a 2-byte dtype at a 4-byte aligned base), else two 2-byte loads."""
    if PAIRED:
        bits = tl.load(ptr.to(tl.pointer_type(tl.uint32)) + word, mask=mask, other=0)
        lo = (bits & 0xFFFF).to(tl.uint16).to(ptr.dtype.element_ty, bitcast=True)
        hi = (bits >> 16).to(tl.uint16).to(ptr.dtype.element_ty, bitcast=True)
    else:
        lo = tl.load(ptr + 2 * word, mask=mask, other=0.0)
        hi = tl.load(ptr + 2 * word + 1, mask=mask, other=0.0)
    return lo, hi


@triton.jit
def _store_pairs(ptr, word, lo, hi, mask, PAIRED: tl.constexpr):
    """Store each word's two elements (already of ptr's dtype): as one 4-byte store when PAIRED.
    Two 2-byte stores half-fill the same sectors twice; at the end of the kernel, where nothing
    overlaps them, that cost W=8 about a microsecond (bench/PERF_NOTES.md)."""
    if PAIRED:
        bits = (lo.to(tl.uint16, bitcast=True).to(tl.uint32)
                | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16))
        tl.store(ptr.to(tl.pointer_type(tl.uint32)) + word, bits, mask=mask)
    else:
        tl.store(ptr + 2 * word, lo, mask=mask)
        tl.store(ptr + 2 * word + 1, hi, mask=mask)


@triton.jit
def _stats_tag(epoch):
    return (epoch & 0x7FFFFFFF) | 0x80000000  # never 0: a zero word is "not sent yet"


@triton.jit
def post_row_partial(stats, partial, row, c, epoch, C: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Send this chunk's sum of squares to the C programs of its row (slot (row, to q, from c))."""
    word = (_stats_tag(epoch) << 32) | partial.to(tl.uint32, bitcast=True).to(tl.uint64)
    q = tl.arange(0, BLOCK)
    store_volatile(stats + (row * C + q) * C + c, tl.zeros([BLOCK], tl.uint64) + word, q < C, INTERPRET)


@triton.jit
def row_sum_of_squares(stats, row, c, epoch, ctrl, err_addr, sig, timeout_ns, rank, pid, notices,
                       W: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, BACKOFF: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """(sum over the row's C chunks of their sums of squares, ok) once every program of the row
    has posted its partial; the same value in every program of the row.

    The C slots are handled as a BLOCK-wide tensor masked to its first C entries (BLOCK is at
    least the thread count): every slot is then stored and polled by exactly one thread and the
    wait's exit test is a block-wide reduction, so all warps leave the loop together. A narrow
    [C] tensor would be replicated across warps, each polling its own copy and leaving on its
    own, and the first to leave would clear slots the others still wait for."""
    tag = _stats_tag(epoch)
    q = tl.arange(0, BLOCK)
    q_ok = q < C
    mine = stats + (row * C + c) * C + q               # slot (row, to c, from q)
    got = load_volatile(mine, q_ok, INTERPRET)
    state = tl.max(tl.where(q_ok & ((got >> 32) != tag), NOT_YET, ARRIVED))
    spins = 0
    start = now_ns(INTERPRET)
    while state == NOT_YET:
        spins += 1
        verdict = spin_verdict(ctrl, start, spins, timeout_ns, notices, epoch, sig, rank, W, INTERPRET)
        pause_ns(BACKOFF, INTERPRET)
        got = load_volatile(mine, q_ok, INTERPRET)
        state = tl.max(tl.maximum(tl.where(q_ok & ((got >> 32) != tag), NOT_YET, ARRIVED), verdict_state(verdict)))
    if state == TIMED_OUT:
        record_error(ctrl, err_addr, 1, rank, rank, STAGE_ROW_STATS, pid, epoch, sig, 0, INTERPRET)
    elif state == FOREIGN:
        culprit, their_sig = foreign_notice(notices, epoch, sig, rank, W, INTERPRET)
        record_error(ctrl, err_addr, 2, rank, culprit, STAGE_ROW_STATS, pid, epoch, sig, their_sig, INTERPRET)
    tl.debug_barrier()  # every thread has its final copy before any slot is cleared
    store_volatile(mine, tl.zeros([BLOCK], tl.uint64), q_ok, INTERPRET)
    partials = (got & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.sum(tl.where(q_ok, partials, 0.0), axis=0), (state == ARRIVED).to(tl.int32)


@triton.jit
def _wire_word(lo, hi, flag, FULL: tl.constexpr):
    """The word that carries elements (lo, hi) (2-byte dtype) to a peer. Lines: the two payload
    halves and our flag (u64). Full payload: the two halves alone (u32), each -0.0 (0x8000, the
    poison pattern) sent as +0.0 (H1 of csrc/host_wire.cuh)."""
    lo16 = lo.to(tl.uint16, bitcast=True)
    hi16 = hi.to(tl.uint16, bitcast=True)
    if FULL:
        lo16 = tl.where(lo16 == POISON_LANE, 0, lo16)
        hi16 = tl.where(hi16 == POISON_LANE, 0, hi16)
        word = lo16.to(tl.uint32) | (hi16.to(tl.uint32) << 16)
    else:
        word = lo16.to(tl.uint64) | (hi16.to(tl.uint64) << 16) | (flag << 32)
    return word


@triton.jit(do_not_specialize=["bases", "my_base", "err_addr", "rank", "T", "H", "sig", "timeout_ns", "slot_stride",
                                  "slots_offset", "headers_offset", "control_offset", "stats_offset", "flags_offset"],
            do_not_specialize_on_alignment=FUSED_TENSOR_ARGS)
def _fused_oneshot_ll_kernel(x_ptr, res_ptr, w_ptr, normed_ptr, res_out_ptr,
                             bases, my_base, err_addr, rank, T, H, eps, sig, timeout_ns, slot_stride, slots_offset,
                             headers_offset, control_offset, stats_offset, flags_offset,
                             C: tl.constexpr, CW: tl.constexpr, BLOCK_W: tl.constexpr,
                             W: tl.constexpr, WP: tl.constexpr, PUSH: tl.constexpr, PAIRED: tl.constexpr,
                             FULL: tl.constexpr, INTERPRET: tl.constexpr, BACKOFF: tl.constexpr = 0,
                             PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    WORD: tl.constexpr = tl.uint32 if FULL else tl.uint64  # full payload: 2 elements; lines: 2 elements + flag
    WORD_BYTES: tl.constexpr = 4 if FULL else 8
    pid = tl.program_id(0)
    row = pid // C
    c = pid % C
    first = (row.to(tl.int64) * H + c * CW) // 2  # in words; CW and H are even
    last = first + tl.minimum(CW, H - c * CW) // 2
    # this program's words: word i holds elements 2i (low half) and 2i + 1 (high half)
    j = tl.arange(0, BLOCK_W)
    tl.static_assert(BLOCK_W >= W, "a full-payload program polls peer q's header with its element q")
    w_ok = j < (last - first)
    word = first + j
    cols_lo = c * CW + 2 * j  # the low half's column (weight is per column)
    # Every local operand is loaded before the first wait, so these loads overlap the epoch load
    # and the peers' pushes instead of following them (the waits are side-effecting asm that no
    # load is moved across). In place stays safe: only this program writes these elements, later.
    x_lo, x_hi = _load_pairs(x_ptr, word, w_ok, PAIRED)
    res_lo, res_hi = _load_pairs(res_ptr, word, w_ok, PAIRED)
    res_lo = res_lo.to(tl.float32)
    res_hi = res_hi.to(tl.float32)
    w_lo = tl.load(w_ptr + cols_lo, mask=w_ok, other=0.0).to(tl.float32)
    w_hi = tl.load(w_ptr + cols_lo + 1, mask=w_ok, other=0.0).to(tl.float32)
    ctrl = (my_base + control_offset).to(tl.pointer_type(tl.uint32))
    epoch, aborted = begin_call(ctrl, pid)
    sig64 = sig.to(tl.uint64)
    notices = my_notices(my_base, flags_offset, epoch)
    # what marks this call's words: the line flag inside every line, or with FULL the sealed word
    # of the headers (F2)
    flag = sealed_word(epoch, sig64) if FULL else line_flag(epoch, sig64)
    parity = (epoch & 1).to(tl.int64)
    parity_off = parity * W * slot_stride
    done = 0
    # `aborted` is this thread's reading (begin_call): no branch on it (the program's threads must
    # agree on every branch that holds a barrier, and layout conversions are barriers); a thread
    # that saw it masks its stores off, and the gather's first reduction takes the program's verdict.
    sending = aborted == 0
    # 1. push this program's chunk of x to every peer (the chunk it also reduces and finishes,
    #    so in place, out=x, is safe: nobody overwrites x before its owner has pushed it);
    #    full payload: first this program's header of this call (F2), beside the data
    if FULL:
        # One store per peer, peer q's from the thread holding word q, all at once: a scalar
        # store would be issued by every thread (a transaction per warp and peer on the link, 32x
        # the header's bytes), and one thread storing every peer's waits for each peer's base.
        to_peer = (j < W) & (j != rank) & sending
        header_base = peer_bases(bases, j, W)
        header = header_base + headers_offset + ((parity * _MAX_RANKS + rank) * _MAX_FLAG_BLOCKS + pid) * 8
        store_volatile(header.to(tl.pointer_type(tl.uint64)), tl.zeros([BLOCK_W], tl.uint64) + flag, to_peer, INTERPRET)
    if PUSH >= BLOCK_W:  # the whole chunk in one step: push the words already loaded
        # as one [peers, words] tile: the peers' bases loaded together, then W - 1 stores per
        # thread with no branch between them (per-peer branches made each base load wait for the
        # one before)
        push_peers = tl.arange(0, WP)[:, None]
        push_bases = peer_bases(bases, push_peers, W)
        dst = (push_bases + slots_offset + parity_off + rank.to(tl.int64) * slot_stride).to(tl.pointer_type(WORD))
        payload = _wire_word(x_lo, x_hi, flag, FULL)[None, :] + tl.zeros([WP, BLOCK_W], WORD)
        to_peers = (push_peers < W) & (push_peers != rank) & (w_ok & sending)[None, :]
        store_volatile(dst + word[None, :], payload, to_peers, INTERPRET)
    else:  # wide chunks (C = 1): PUSH words at a time bounds the registers the push needs
        off = first
        while off < last:  # a while loop: Triton 3.6's interpreter cannot run range() over tensors
            k = off + tl.arange(0, PUSH)
            # where, not `&`: Triton 3.9's interpreter turns a tensor & a loaded scalar's compare
            # into int32 data, which tl.load refuses as a mask
            m = tl.where(sending, k < last, False)
            payload = _wire_word(tl.load(x_ptr + 2 * k, mask=m, other=0.0), tl.load(x_ptr + 2 * k + 1, mask=m, other=0.0),
                                 flag, FULL)
            for p in tl.static_range(W):
                if p != rank:
                    base = peer_base(bases, p)
                    dst = (base + slots_offset + parity_off + rank.to(tl.int64) * slot_stride).to(tl.pointer_type(WORD))
                    store_volatile(dst + k, payload, m, INTERPRET)
            off += PUSH

    # this call's notice in every peer (invariant 7 of csrc/protocol.cuh): after the push, which
    # the peers wait for, so that it never delays it (before it, it cost W = 8 0.4 us)
    post_notices(bases, flags_offset, rank, pid, epoch, sig64, aborted, W, INTERPRET)

    # 2. gather this program's chunk from every peer as one [peers, words] tile, each element
    #    reduced in rank order
    peers = tl.arange(0, WP)[:, None]
    live = (peers < W) & (peers != rank) & w_ok[None, :]
    addr = my_base + slots_offset + parity_off + peers.to(tl.int64) * slot_stride + word[None, :] * WORD_BYTES
    lines = addr.to(tl.pointer_type(WORD))
    header_peer = j  # full payload: peer q's header of this program polled by element q (BLOCK_W >= W)
    header_live = (header_peer < W) & (header_peer != rank)
    headers = (my_base + headers_offset + ((parity * _MAX_RANKS + header_peer) * _MAX_FLAG_BLOCKS + pid) * 8
               ).to(tl.pointer_type(tl.uint64))
    words, ok = _poll_words(lines, headers, live, header_live, peers, flag, aborted, ctrl, err_addr, epoch, sig64,
                            timeout_ns, rank, pid, notices, W, FULL, BACKOFF, INTERPRET)
    if ok == 1:
        lo = (words & 0xFFFF).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
        hi = ((words >> 16) & 0xFFFF).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
        acc_lo, acc_hi = rank_order_sums(lo, hi, x_lo.to(tl.float32), x_hi.to(tl.float32), peers, rank, W)
        nr_lo = round_to(round_to(acc_lo, DT, INTERPRET).to(tl.float32) + res_lo, DT, INTERPRET)
        nr_hi = round_to(round_to(acc_hi, DT, INTERPRET).to(tl.float32) + res_hi, DT, INTERPRET)
        # 3. the row's sum of squares, shared by its C programs: posted first, so the residual
        #    stores and line clears below overlap its trip to the other programs of the row
        v_lo = nr_lo.to(tl.float32)
        v_hi = nr_hi.to(tl.float32)
        partial = tl.sum(tl.where(w_ok, v_lo * v_lo + v_hi * v_hi, 0.0), axis=0)
        stats = (my_base + stats_offset).to(tl.pointer_type(tl.uint64))
        post_row_partial(stats, partial, row, c, epoch, C, BLOCK_W, INTERPRET)
        _store_pairs(res_out_ptr, word, nr_lo, nr_hi, w_ok, PAIRED)
        tl.debug_barrier()  # every thread has read its words before any is cleared
        if FULL:
            store_volatile(lines, tl.full(words.shape, _POISON, tl.uint32), live, INTERPRET)  # F1: re-poisoned
        else:
            store_volatile(lines, tl.zeros_like(words), live, INTERPRET)  # L2: cleared
        sumsq, ok = row_sum_of_squares(stats, row, c, epoch, ctrl, err_addr, sig64, timeout_ns, rank, pid, notices,
                                        W, C, BLOCK_W, BACKOFF, INTERPRET)
        # 4. normalise
        if ok == 1:
            rstd = 1.0 / tl.sqrt_rn(sumsq / H + eps)
            _store_pairs(normed_ptr, word, round_to(v_lo * rstd * w_lo, DT, INTERPRET),
                         round_to(v_hi * rstd * w_hi, DT, INTERPRET), w_ok, PAIRED)
            done = 1
    if done == 0:
        # Gave up (timeout, mismatch, abort): NaN in this program's words of both outputs, never
        # data that could pass for a result (invariant 5 of csrc/protocol.cuh); only this
        # program reads or writes these words, so in place stays safe.
        nan = tl.full([BLOCK_W], float("nan"), tl.float32).to(DT)
        _store_pairs(res_out_ptr, word, nan, nan, w_ok, PAIRED)
        _store_pairs(normed_ptr, word, nan, nan, w_ok, PAIRED)
    allow_dependent_launch(PDL)
    end_call(ctrl, epoch, pid)
