"""The fused data-as-flag one-shots (pcie_allreduce.fused.oneshot_ll) under TRITON_INTERPRET=1.

As in test_fused_interpreter.py the test plays the peers: it writes their words into the rank's
workspace before launching (lines: the wire format of csrc/oneshot_ll.cuh, 8-byte words {4
payload bytes, flag}; full payload: csrc/oneshot_full.cuh's poisoned slots and headers), then
checks what the rank wrote into the peers' workspaces and what it left behind.
"""

from __future__ import annotations

import pytest
import torch

from pcie_allreduce import constants
from pcie_allreduce import layout as lay
from pcie_allreduce.constants import NOTICE_KIND, WRAP_SEAL_MIX
from pcie_allreduce.plan import fused_shapes as shapes
from pcie_allreduce.fused.protocol import line_flag_of, sealed_word_of
from tests import _reference as ref
from tests._interpreted import interpreted
from tests.test_fused_interpreter import ONE_SHOT_CASES, WRAPPED, FakeRanks, _expected, _inputs, signed64

path = pytest.importorskip("pcie_allreduce.fused.path")
ll = pytest.importorskip("pcie_allreduce.fused.oneshot_ll")
pytestmark = interpreted


def _lines(fake: FakeRanks, owner: int, sender: int) -> torch.Tensor:
    """`sender`'s line slot in `owner`'s workspace for this call's parity, as int64 words."""
    lay_ = fake.layout
    off = lay_.ll_offset + (fake.epoch & 1) * fake.world * lay_.ll_slot_bytes + sender * lay_.ll_slot_bytes
    return fake.buffers[owner][off:off + lay_.ll_slot_bytes].view(torch.int64)


def _encode(x: torch.Tensor, flag: int) -> torch.Tensor:
    """The words a rank pushes for message x (2-byte elements, even count)."""
    payload = x.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    signed_flag = flag - (1 << 32) if flag >= 1 << 31 else flag  # int64 words: the flag is the high half
    return payload + (signed_flag << 32)


def _stats(fake: FakeRanks) -> torch.Tensor:
    off = fake.layout.stats_offset
    return fake.buffers[fake.rank][off:off + 8 * lay.ROW_STATS_SLOTS].view(torch.int64)


def _call(fake: FakeRanks, tokens: int, hidden: int, dtype: torch.dtype) -> tuple[int, int]:
    programs, chunks, *_ = shapes.data_as_flag(tokens, hidden, fake.world, 64, interpret=True)
    return programs, shapes.data_as_flag_signature(dtype, tokens, hidden, programs, chunks)


def _run_one_rank(fake: FakeRanks, algo: str, xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                  misaligned: bool, quads: bool | None = None) -> None:
    """Launch this rank's call (``misaligned``: every tensor 2 bytes past a 4-byte boundary;
    ``quads``: the full payload's kernel forced) and check its outputs against the reference: the
    new residual bitwise, the norm within tolerance."""
    normed = torch.full_like(residual, float("nan"))
    res_out = torch.full_like(residual, float("nan"))
    x, res = xs[fake.rank], residual
    if misaligned:
        x, res, normed, res_out = (ref.misaligned_copy(t) for t in (x, res, normed, res_out))
    path.launch(fake.view, algo, x, res, weight, 1e-6, normed, res_out, interpret=True, quads=quads)

    assert int(fake.error[0]) == 0, f"error record {fake.error.tolist()}"
    want_res = _expected(xs, residual)
    assert torch.equal(res_out, want_res), "new residual must be bitwise residual + all_reduce(x)"
    ref.check_rmsnorm(normed, res_out, weight, 1e-6, f"{algo} normed")


@pytest.mark.parametrize("world, rank, tokens, hidden, dtype, misaligned",
                         [case + (False,) for case in ONE_SHOT_CASES] + [ONE_SHOT_CASES[2] + (True,)])
def test_oneshot_ll_one_rank(world, rank, tokens, hidden, dtype, misaligned) -> None:
    """``misaligned``: x, residual and both outputs start 2 bytes past a 4-byte boundary, so the
    kernel moves elements one by one instead of as 4-byte pairs."""
    fake = FakeRanks(world, rank)
    xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=world * 10 + tokens)
    _, sig = _call(fake, tokens, hidden, dtype)
    flag = line_flag_of(fake.epoch, sig)
    words = tokens * hidden // 2
    for peer in range(world):
        if peer != rank:
            _lines(fake, rank, peer)[:words] = _encode(xs[peer], flag)
    _run_one_rank(fake, "oneshot_ll", xs, residual, weight, misaligned)
    for peer in range(world):
        if peer != rank:
            assert torch.equal(_lines(fake, peer, rank)[:words], _encode(xs[rank], flag)), "pushed words"
            assert not _lines(fake, rank, peer).any(), "consumed lines are cleared (invariant L2)"
    assert not _stats(fake).any(), "row statistics are cleared by their reader"
    assert fake.advanced(), "every epoch copy advances"


# A missing peer: test_fused_interpreter.py's timeout test covers this kernel too (parametrized).


def test_oneshot_ll_peer_with_another_call_records_mismatch() -> None:
    fake = FakeRanks(2, 1)
    xs, residual, weight = _inputs(2, 2, 64, torch.bfloat16, seed=4)
    _, theirs = _call(fake, 2, 128, torch.bfloat16)  # the peer thinks the call is [2, 128]
    _lines(fake, 1, 0)[:64] = _encode(xs[0], line_flag_of(fake.epoch, theirs))
    normed, res_out = torch.empty_like(residual), torch.empty_like(residual)
    path.launch(fake.view, "oneshot_ll", xs[1], residual, weight, 1e-6, normed, res_out, interpret=True)
    assert int(fake.error[0]) == 2 and int(fake.error[2]) == 0
    assert int(fake.error[7]) & 0xFFFFFFFF == theirs, "the report names the peer's call signature"


def test_a_forced_chunk_count_is_launched_only_where_its_programs_are_resident() -> None:
    """The harness's chunk sweep: the shape with C chunks, or None past the cap (or its crowded half)."""
    assert shapes.with_chunks_if_resident(16, 7168, 1, 16) == shapes.shape_with_chunks(16, 7168, 1)
    assert shapes.with_chunks_if_resident(16, 7168, 1, 16)[:2] == (16, 1)
    assert shapes.with_chunks_if_resident(4, 7168, 4, 16) == (16, 4, 1792, 1024, 32)
    assert shapes.with_chunks_if_resident(17, 7168, 1, 16) is None, "17 programs past a cap of 16"
    assert shapes.with_chunks_if_resident(8, 7168, 1, 8) is None, "a crowded share keeps half: 4"
    assert shapes.with_chunks_if_resident(4, 7167, 1, 64) is None and shapes.with_chunks_if_resident(4, 7168, 0, 64) is None


def test_launch_shape_rules() -> None:
    assert shapes.data_as_flag(4, 7167, 4, 32) is None, "odd hidden sizes take the flag-based one-shot"
    programs, chunks, width, block_w, num_warps = shapes.data_as_flag(4, 7168, 4, 64)
    assert programs == 4 * chunks <= 64 and width % 2 == 0 and chunks * width >= 7168
    assert block_w >= width // 2 and block_w == 32 * num_warps, "one word per thread covers the chunk"
    # W=4 sharing one GPU (cap 33): 1024-column programs, within the cap, one word per thread
    assert shapes.data_as_flag(4, 7168, 4, 33) == (28, 7, 1024, 512, 16)
    # W=8 sharing one GPU (cap 16): 16 programs of 1792 columns, 32 warps
    assert shapes.data_as_flag(4, 7168, 8, 16) == (16, 4, 1792, 1024, 32)
    # one token: 7 1024-column programs would leave the push to too few SMs; 512-column ones instead
    assert shapes.data_as_flag(1, 7168, 8, 16) == (14, 14, 512, 256, 8)
    # a cap that forces wider chunks: as few programs as their power-of-two width covers (12 ranks
    # sharing one GPU: 11 chunks of 326 words would fill 512-thread programs two thirds)
    assert shapes.data_as_flag(1, 7168, 12, 11) == (7, 7, 1024, 512, 16)
    assert shapes.data_as_flag(1, 8192, 12, 11) == (8, 8, 1024, 512, 16)
    # a crowded share (cap <= CROWDED_SHARE: a dozen or more ranks on one GPU): at most half of it,
    # since a row's programs must all run at once (16 ranks on an H200, cap 8: 7 programs hung)
    assert [shapes.resident_programs(c) for c in (1, 8, 10, 11, 16, 64, 100)] == [1, 4, 5, 11, 16, 64, 64]
    assert shapes.data_as_flag(1, 7168, 16, 8) == (4, 4, 1792, 1024, 32)
    assert shapes.data_as_flag(1, 8192, 16, 8) == (4, 4, 2048, 1024, 32)
    assert shapes.data_as_flag(1, 4096, 16, 8) == (4, 4, 1024, 512, 16)
    assert shapes.data_as_flag(1, 7168, 12, 10) == (4, 4, 1792, 1024, 32)
    assert shapes.data_as_flag(2, 7168, 16, 8) is None, "two rows of four programs exceed half the share"
    # never more programs than the cap, however small the cap
    assert shapes.data_as_flag(2, 7168, 8, 16) == (14, 7, 1024, 512, 16)
    # many tokens: the regular shape within the cap, or none
    programs, chunks, *_ = shapes.data_as_flag(16, 7168, 8, 64)
    assert programs == 64 and chunks == 4
    assert shapes.data_as_flag(8, 7168, 8, 16) is None, "more programs than the block cap allows"
    # the full payload's kernel tries two 4096-column quads programs per row where the word shape
    # has too many programs (16-warp programs: the quads kernel takes them at any W)
    assert shapes.data_as_flag(4, 7168, 8, 15) is None
    assert shapes.data_as_flag(4, 7168, 8, 15, full=True) == (8, 2, 3584, 2048, 32)
    assert shapes.data_as_flag(4, 8192, 8, 15, full=True) == (8, 2, 4096, 2048, 32)
    assert shapes.data_as_flag(8, 7168, 8, 16, full=True) == (16, 2, 3584, 2048, 32)
    assert shapes.data_as_flag(8, 7168, 8, 15, full=True) is None, "16 programs past a cap of 15"
    assert shapes.data_as_flag(4, 7166, 8, 15, full=True) is None, "rows of 7166: not whole quads"
    assert shapes.data_as_flag(4, 7168, 8, 16, full=True) == shapes.data_as_flag(4, 7168, 8, 16), "the word shape first"
    assert shapes.data_as_flag(4, 7168, 8, 15, interpret=True, full=True)[1] == 1
    assert shapes.takes_quads(shapes.data_as_flag(4, 7168, 8, 15, full=True), 7168, 8)
    assert shapes.data_as_flag(3, 96, 8, 16, interpret=True)[1] == 1, "the interpreter runs one program per row"
    # every shape the rule can give stays within a 1024-thread program and a 2048-column chunk
    for tokens in (1, 2, 4, 8, 32):
        for hidden in (96, 4096, 7168, 8192, 16384):
            for cap in (8, 16, 33, 64):
                shape = shapes.data_as_flag(tokens, hidden, 8, cap)
                if shape is not None:
                    assert shape[0] <= cap and shape[2] <= shapes.MAX_CHUNK and shape[4] <= shapes.MAX_WARPS
                    assert shape[3] == 32 * shape[4], (tokens, hidden, cap, shape)
                    words = hidden // 2
                    assert (shape[1] - 1) * shape[3] < words, f"a program fewer would do: {shape}"


def test_the_full_payload_kernel_moves_quads_where_every_chunk_is_whole_quads() -> None:
    """16-byte quads (oneshot_quads) can move a call whose row and every chunk are multiples of 8
    elements, one quad per thread (else None), and do where measured faster: programs of 4 warps
    or more up to four ranks, of 16 or more from five. A function of the shape and world alone:
    every rank runs the same kernel, so every rank sums a row's squares in the same order."""
    for world in (2, 3, 4):
        assert [shapes.takes_quads(shapes.data_as_flag(t, 7168, world, 66), 7168, world) for t in (1, 2, 4, 8, 16)] == [
            False, False, True, True, True], "2-warp programs of 512 columns at 1 and 2 tokens keep the word kernel"
    assert shapes.takes_quads(shapes.data_as_flag(2, 7168, 4, 16), 7168, 4), "4-warp programs at W = 4"
    assert not any(shapes.takes_quads(shapes.data_as_flag(t, 7168, w, 16), 7168, w) for t in (1, 2, 4) for w in (5, 8))
    assert not shapes.takes_quads(shapes.data_as_flag(16, 7168, 8, 64), 7168, 8), "8-warp programs at W = 8"
    assert shapes.takes_quads(shapes.shape_with_chunks(4, 7168, 2), 7168, 8), "16-warp programs at W = 8"
    assert not shapes.takes_quads(shapes.data_as_flag(4, 7166, 2, 66), 7166, 2), "rows of 7166: not whole quads"
    assert shapes.quad_warps(shapes.data_as_flag(4, 7168, 8, 16), 7168) == 8  # 1792 columns, 1024 words
    assert shapes.quad_warps(shapes.data_as_flag(4, 7168, 4, 33), 7168) == 4  # 1024 columns
    assert shapes.quad_warps(shapes.data_as_flag(1, 7168, 8, 16), 7168) == 2  # 512 columns
    assert shapes.quad_warps(shapes.shape_with_chunks(2, 96, 3), 96) == 1  # 32 columns: one warp still
    assert shapes.shape_with_chunks(3, 200, 4)[2] == 56, "chunks of whole quads where the row is"
    assert shapes.quad_warps(shapes.shape_with_chunks(3, 202, 4), 202) is None, "rows of 202 elements: 52-column chunks"
    assert shapes.quad_warps(shapes.data_as_flag(2, 100, 3, 64), 100) is None, "rows of 100 elements"
    assert shapes.quad_warps(shapes.shape_with_chunks(1, 8192, 1), 8192) == 32  # forced: a whole row per program
    for tokens in (1, 2, 4, 8, 16):
        for hidden in (1024, 2048, 4096, 5120, 7168, 8192):
            for cap in (8, 16, 33, 66, 132):
                shape = shapes.data_as_flag(tokens, hidden, 8, cap)
                if shape is not None:
                    warps = shapes.quad_warps(shape, hidden)
                    assert warps is not None and 32 * warps * 4 == shape[3], (tokens, hidden, cap, shape)


@pytest.mark.parametrize("algo, quads", [("oneshot_ll", None), ("oneshot_full", False), ("oneshot_full", True)])
@pytest.mark.parametrize("world, rank, tokens, hidden, chunks, backoff_ns", [
    (2, 0, 2, 96, 3, 0),  # chunks of 32 columns: whole quads
    (4, 3, 3, 200, 4, 64),  # the poll back-off knob (a no-op here) must not change the result
    (16, 9, 2, 96, 3, 0),
    (3, 1, 2, 202, 4, 0),  # 52-column chunks: no quads
])
def test_programs_of_a_row_share_their_statistics(algo, quads, world, rank, tokens, hidden, chunks,
                                                  backoff_ns) -> None:
    """C > 1 programs per row, which the interpreter otherwise never runs: programs execute one
    after another here, so the statistics of the chunks to the right of each program (sent by
    programs that run later) are posted by the test first, as those programs would. The full
    payload with each of its kernels (``quads``); quads forced on chunks that are not whole quads
    are refused before anything is launched."""
    fake = FakeRanks(world, rank)
    if algo == "oneshot_full":
        _poisoned(fake)
    dtype = torch.bfloat16
    xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=7 * world + tokens)
    programs, c_count, width, *_ = shapes.shape_with_chunks(tokens, hidden, chunks)
    sig = shapes.data_as_flag_signature(dtype, tokens, hidden, programs, c_count, full=algo == "oneshot_full")
    for peer in range(world):
        if peer != rank:
            _play_peer_words(fake, algo, peer, xs[peer], programs, sig)
    want_res = _expected(xs, residual)
    tag = (fake.epoch & 0x7FFFFFFF) | 0x80000000
    stats = _stats(fake)
    later = set()  # slot (row, to a, from b) with b > a: read before its sender runs
    for row in range(tokens):
        for a in range(c_count):
            for b in range(a + 1, c_count):
                part = want_res[row, b * width:(b + 1) * width].float().pow(2).sum().reshape(1)
                bits = int(part.view(torch.int32).item()) & 0xFFFFFFFF
                stats[(row * c_count + a) * c_count + b] = ((tag << 32) | bits) - (1 << 64)
                later.add((row * c_count + a) * c_count + b)
    normed = torch.full_like(residual, float("nan"))
    res_out = torch.full_like(residual, float("nan"))
    if quads and hidden % 8:
        with pytest.raises(ValueError, match=f"chunks of {width} columns is not whole 16-byte quads"):
            path.launch(fake.view, algo, xs[rank], residual, weight, 1e-6, normed, res_out, interpret=True,
                        max_programs=64, chunks=chunks, quads=quads)
        assert bool(normed.isnan().all()) and not fake.advanced(), "nothing launched"
        return
    path.launch(fake.view, algo, xs[rank], residual, weight, 1e-6, normed, res_out, interpret=True,
                max_programs=64, chunks=chunks, backoff_ns=backoff_ns, quads=quads)

    assert int(fake.error[0]) == 0, f"error record {fake.error.tolist()}"
    assert torch.equal(res_out, want_res)
    ref.check_rmsnorm(normed, res_out, weight, 1e-6, f"{algo} normed")
    if algo == "oneshot_full":
        for peer in range(world):
            if peer != rank:
                assert torch.equal(_full_slot(fake, peer, rank)[:tokens * hidden // 2], _full_words(xs[rank]))
                assert bool((_full_slot(fake, rank, peer) == POISON).all()), "consumed words re-poisoned (F1)"
    # Every slot a program read was cleared; the ones listed in `later` were written again by
    # their sender after their reader had consumed the test's copy (so they hold that sender's word).
    left = {i for i in range(lay.ROW_STATS_SLOTS) if int(stats[i]) != 0}
    assert left == later
    assert all((int(stats[i]) >> 32) & 0xFFFFFFFF == tag for i in left)


# ---- full payload (oneshot_full) -------------------------------------------------------------

POISON = constants.POISON_WORD - (1 << 32)  # as an int32 word


def _full_slot(fake: FakeRanks, owner: int, sender: int) -> torch.Tensor:
    """`sender`'s full-payload slot in `owner`'s workspace for this call's parity, as int32 words."""
    lay_ = fake.layout
    off = lay_.full_offset + lay.FULL_HEADER_BYTES + ((fake.epoch & 1) * fake.world + sender) * lay_.ll_capacity
    return fake.buffers[owner][off:off + lay_.ll_capacity].view(torch.int32)


def _full_headers(fake: FakeRanks, owner: int) -> torch.Tensor:
    """`owner`'s header words [parity, sender, program] (csrc/oneshot_full.cuh, F2)."""
    off = fake.layout.full_offset
    return fake.buffers[owner][off:off + lay.FULL_HEADER_BYTES].view(torch.int64).view(2, lay.MAX_RANKS,
                                                                                      lay.MAX_FLAG_BLOCKS)


def _poisoned(fake: FakeRanks) -> FakeRanks:
    """Every full-payload slot poisoned, as a new workspace's are (F1)."""
    for owner in range(fake.world):
        for parity in range(2):
            off = fake.layout.full_offset + lay.FULL_HEADER_BYTES + parity * fake.world * fake.layout.ll_capacity
            fake.buffers[owner][off:off + fake.world * fake.layout.ll_capacity].view(torch.int32).fill_(POISON)
    return fake


def _full_words(x: torch.Tensor) -> torch.Tensor:
    """The int32 words a rank pushes for message x (2-byte elements, even count): -0.0 as +0.0."""
    lanes = x.reshape(-1).view(torch.int16).clone()
    lanes[lanes == -0x8000] = 0
    return lanes.view(torch.int32)


def _header(epoch: int, sig: int) -> int:
    """A header word (sealed, F2) as the int64 the headers view holds."""
    return signed64(sealed_word_of(epoch, sig))


def _full_call(fake: FakeRanks, tokens: int, hidden: int, dtype: torch.dtype) -> tuple[int, int]:
    programs, chunks, *_ = shapes.data_as_flag(tokens, hidden, fake.world, 64, interpret=True)
    return programs, shapes.data_as_flag_signature(dtype, tokens, hidden, programs, chunks, full=True)


@pytest.mark.parametrize("world, rank, tokens, hidden, dtype, misaligned, quads",
                         [case + (False, None) for case in ONE_SHOT_CASES] + [ONE_SHOT_CASES[2] + (True, None)]
                         + [case + (False, True) for case in ONE_SHOT_CASES if case[3] % 8 == 0 and case[0] > 2]
                         + [ONE_SHOT_CASES[3] + (True, True)])
def test_oneshot_full_one_rank(world, rank, tokens, hidden, dtype, misaligned, quads) -> None:
    """The peers' words and headers are there before the launch; zeros of both signs among the
    inputs (-0.0 travels as +0.0 and the sum must still match). ``quads``: the 16-byte quads
    kernel forced where the shape's choice is the word kernel (the same wire either way)."""
    fake = _poisoned(FakeRanks(world, rank))
    xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=world * 10 + tokens + 1)
    for r in range(world):  # a few exact zeros of either sign in every rank's message
        flat = xs[r].view(-1)
        flat[r::7] = -0.0 if r % 2 else 0.0
    programs, sig = _full_call(fake, tokens, hidden, dtype)
    words = tokens * hidden // 2
    for peer in range(world):
        if peer != rank:
            _full_slot(fake, rank, peer)[:words] = _full_words(xs[peer])
            _full_headers(fake, rank)[fake.epoch & 1, peer, :programs] = _header(fake.epoch, sig)
    _run_one_rank(fake, "oneshot_full", xs, residual, weight, misaligned, quads)
    for peer in range(world):
        if peer != rank:
            assert torch.equal(_full_slot(fake, peer, rank)[:words], _full_words(xs[rank])), "pushed words"
            assert bool((_full_headers(fake, peer)[fake.epoch & 1, rank, :programs] == _header(fake.epoch, sig)).all())
            assert bool((_full_slot(fake, rank, peer) == POISON).all()), "consumed words re-poisoned (F1)"
    assert fake.advanced(), "every epoch copy advances"


@pytest.mark.parametrize("world, late, missing", [(2, 1, "header"), (5, 3, "header"), (5, 2, "words")])
def test_oneshot_full_waits_for_every_peers_words_and_header_of_this_call(world: int, late: int,
                                                                          missing: str) -> None:
    """Every peer but ``late`` has its words and its header of this call in place. ``late`` has
    its words but a header of the call before (not taken, however complete the data looks), or
    this call's header over poisoned words: the wait ends in a timeout naming ``late`` (not the
    highest rank, nor the last one polled), with NaN in both outputs."""
    fake = _poisoned(FakeRanks(world, 0))
    xs, residual, weight = _inputs(world, 1, 64, torch.bfloat16, seed=5 + world + late)
    programs, sig = _full_call(fake, 1, 64, torch.bfloat16)
    for peer in range(1, world):
        if not (peer == late and missing == "words"):
            _full_slot(fake, 0, peer)[:32] = _full_words(xs[peer])
        stale = peer == late and missing == "header"
        _full_headers(fake, 0)[fake.epoch & 1, peer, :programs] = _header(fake.epoch - 2 if stale else fake.epoch, sig)
    normed, res_out = torch.zeros_like(residual), torch.zeros_like(residual)
    path.launch(fake.view, "oneshot_full", xs[0], residual, weight, 1e-6, normed, res_out, interpret=True)
    record = (int(fake.error[0]), int(fake.error[2]), int(fake.error[3]))
    assert record == (1, late, ll.STAGE_FULL_GATHER.value), f"error record {fake.error.tolist()}"
    assert bool(torch.isnan(normed).all()) and bool(torch.isnan(res_out).all())


def test_oneshot_full_peer_with_another_call_records_mismatch() -> None:
    fake = _poisoned(FakeRanks(2, 1))
    xs, residual, weight = _inputs(2, 2, 64, torch.bfloat16, seed=4)
    programs, _ = _full_call(fake, 2, 64, torch.bfloat16)
    _, theirs = _full_call(fake, 2, 128, torch.bfloat16)  # the peer thinks the call is [2, 128]
    _full_slot(fake, 1, 0)[:64] = _full_words(xs[0])
    _full_headers(fake, 1)[fake.epoch & 1, 0, :programs] = _header(fake.epoch, theirs)
    fake.post_notice(0, theirs)  # a header of another call alone is only "not yet"
    normed, res_out = torch.empty_like(residual), torch.empty_like(residual)
    path.launch(fake.view, "oneshot_full", xs[1], residual, weight, 1e-6, normed, res_out, interpret=True)
    assert int(fake.error[0]) == 2 and int(fake.error[2]) == 0
    assert int(fake.error[7]) & 0xFFFFFFFF == theirs, "the report names the peer's call signature"
    assert bool(torch.isnan(normed).all()), "a mismatch is never reduced"


def test_full_and_line_signatures_differ() -> None:
    assert shapes.data_as_flag_signature(torch.bfloat16, 4, 7168, 28, 7) != shapes.data_as_flag_signature(torch.bfloat16, 4, 7168, 28, 7, full=True)


# ---- the 64-bit epoch and sealed headers (invariant 3 of csrc/protocol.cuh) ------------------


def _play_peer_words(fake: FakeRanks, algo: str, peer: int, x: torch.Tensor, programs: int, sig: int) -> None:
    """``peer``'s words of this call in our workspace: its lines, or its full-payload words and
    (sealed) headers."""
    words = x.numel() // 2
    if algo == "oneshot_ll":
        _lines(fake, fake.rank, peer)[:words] = _encode(x, line_flag_of(fake.epoch, sig))
    else:
        _full_slot(fake, fake.rank, peer)[:words] = _full_words(x)
        _full_headers(fake, fake.rank)[fake.epoch & 1, peer, :programs] = _header(fake.epoch, sig)


@pytest.mark.parametrize("algo", ["oneshot_ll", "oneshot_full"])
def test_data_as_flag_calls_across_the_wrap(algo: str) -> None:
    """Three calls from (wrap 0, low 2^32 - 2): each completes and every epoch copy ends at
    (wrap 1, low 3). Full payload: the headers this rank posts are sealed (signature ^
    WRAP_SEAL_MIX in wrap 1); lines keep the low word's line flag; notices are not sealed."""
    world, rank, tokens, hidden, dtype = 2, 0, 2, 64, torch.bfloat16
    fake = FakeRanks(world, rank, completed=0xFFFFFFFE)
    if algo == "oneshot_full":
        _poisoned(fake)
    programs, sig = (_full_call if algo == "oneshot_full" else _call)(fake, tokens, hidden, dtype)
    words = tokens * hidden // 2
    for call in range(3):
        epoch = fake.epoch
        xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=40 + call)
        _play_peer_words(fake, algo, 1, xs[1], programs, sig)
        _run_one_rank(fake, algo, xs, residual, weight, misaligned=False)
        assert fake.advanced(), f"call {call}: the epoch copies hold {epoch:#x}"
        if algo == "oneshot_full":
            posted = _full_headers(fake, 1)[epoch & 1, rank, :programs]
            assert bool((posted == signed64(sealed_word_of(epoch, sig))).all()), f"call {call}"
            if epoch >> 32:
                assert int(posted[0]) & 0xFFFFFFFF == sig ^ WRAP_SEAL_MIX, "wrap 1 seals the signature"
        else:
            flag = line_flag_of(epoch & 0xFFFFFFFF, sig)
            assert torch.equal(_lines(fake, 1, rank)[:words], _encode(xs[rank], flag)), f"call {call}"
        assert fake.posted_flag(1, NOTICE_KIND) == ((epoch & 0xFFFFFFFF) << 32) | sig, "notices are not sealed"
        fake.completed = epoch
    assert bool((fake.epochs(rank) == (1 << 32) | 3).all())


def test_oneshot_full_header_from_the_last_wrap_is_not_taken() -> None:
    """The peer's header slot holds the word this call's header had in the 32-bit encoding (the
    same low epoch and signature, sealed with the previous wrap's count: a header left 2^32 calls
    ago) and its slot holds unpoisoned words (they could be any call's): not taken, however
    complete the data looks; the wait times out naming that peer, with NaN in both outputs."""
    fake = _poisoned(FakeRanks(2, 0, completed=WRAPPED))
    xs, residual, weight = _inputs(2, 1, 64, torch.bfloat16, seed=10)
    programs, sig = _full_call(fake, 1, 64, torch.bfloat16)
    _full_slot(fake, 0, 1)[:32] = _full_words(xs[1])
    _full_headers(fake, 0)[fake.epoch & 1, 1, :programs] = _header(fake.epoch - (1 << 32), sig)
    assert _header(fake.epoch - (1 << 32), sig) == signed64((42 << 32) | sig), "wrap 0's is the 32-bit encoding"
    normed, res_out = torch.zeros_like(residual), torch.zeros_like(residual)
    path.launch(fake.view, "oneshot_full", xs[0], residual, weight, 1e-6, normed, res_out, interpret=True)
    kind, _, peer, stage, _, epoch = (int(v) for v in fake.error[:6])
    assert (kind, peer, stage, epoch) == (1, 1, ll.STAGE_FULL_GATHER.value, 42), f"error record {fake.error.tolist()}"
    assert bool(torch.isnan(normed).all()) and bool(torch.isnan(res_out).all())
    assert fake.advanced()


def test_oneshot_full_mismatch_is_named_from_the_notice_not_the_header() -> None:
    """The peer's header carries this epoch with another signature and its call notice a third:
    the mismatch names the peer with the notice's signature (the record keeps the epoch's low
    word), and nothing is reduced."""
    fake = _poisoned(FakeRanks(2, 1, completed=WRAPPED))
    xs, residual, weight = _inputs(2, 2, 64, torch.bfloat16, seed=11)
    programs, sig = _full_call(fake, 2, 64, torch.bfloat16)
    theirs, in_header = 0x5EED5EED, 0x0BAD0BAD
    _full_slot(fake, 1, 0)[:64] = _full_words(xs[0])
    _full_headers(fake, 1)[fake.epoch & 1, 0, :programs] = _header(fake.epoch, in_header)
    fake.post_notice(0, theirs)
    normed, res_out = torch.zeros_like(residual), torch.zeros_like(residual)
    path.launch(fake.view, "oneshot_full", xs[1], residual, weight, 1e-6, normed, res_out, interpret=True)
    kind, rank, peer, stage, _, epoch, expected, observed = (int(v) & 0xFFFFFFFF for v in fake.error)
    assert (kind, rank, peer, stage, epoch, expected, observed) == (
        2, 1, 0, ll.STAGE_FULL_GATHER.value, 42, sig, theirs), f"error record {fake.error.tolist()}"
    assert bool(torch.isnan(normed).all()) and bool(torch.isnan(res_out).all())
