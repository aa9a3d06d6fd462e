"""The fused Triton kernels under TRITON_INTERPRET=1, one rank at a time, on the CPU (a run without
it runs this file in an interpreted child process: tests/_interpreted.py).

The interpreter runs programs one after another, so a real wait would hang: the test plays the
peers by writing their pushes and flags into the rank's workspace before launching, exactly as
the peers' kernels would, and then checks what the rank wrote into the peers' workspaces.
"""

from __future__ import annotations

import types

import pytest
import torch

from pcie_allreduce import layout as lay
from pcie_allreduce.constants import FLAG_ROWS, NOTICE_KIND, WRAP_SEAL_MIX
from pcie_allreduce.plan import fused_shapes as shapes
from pcie_allreduce.fused.protocol import next_epoch_of, sealed_word_of
from tests import _reference as ref
from tests._interpreted import interpreted

kernels = pytest.importorskip("pcie_allreduce.fused.rmsnorm")
path = pytest.importorskip("pcie_allreduce.fused.path")
ll = pytest.importorskip("pcie_allreduce.fused.oneshot_ll")
pytestmark = interpreted

MAX_BYTES = 256 << 10
COMPLETED = 41  # calls already done on the workspace; this call is epoch 42


def signed64(word: int) -> int:
    """A uint64 word as the int64 value the tests' workspace views hold."""
    return word - (1 << 64) if word >= 1 << 63 else word


class FakeRanks:
    """W workspaces in CPU memory with the real layout, and a view for one rank."""

    def __init__(self, world: int, rank: int, completed: int = COMPLETED) -> None:
        self.world, self.rank, self.completed = world, rank, completed
        self.layout = lay.Layout.make(MAX_BYTES, world)
        self.buffers = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8) for _ in range(world)]
        self.error = torch.zeros(lay.ERROR_WORDS, dtype=torch.int32)
        self.epochs(rank)[:] = signed64(completed)
        self.view = lay.WorkspaceView(rank, world, tuple(b.data_ptr() for b in self.buffers), self.layout,
                                      self.error.data_ptr(), 10**9)

    @property
    def epoch(self) -> int:
        """This call's 64-bit epoch (wrap count << 32 | low word)."""
        return next_epoch_of(self.completed)

    def control(self, owner: int) -> torch.Tensor:
        """The control record as 32-bit words (ABORT_WORD, CLAIM_WORD index it)."""
        off = self.layout.control_offset
        return self.buffers[owner][off:off + 4 * lay.CONTROL_WORDS].view(torch.int32)

    def epochs(self, owner: int) -> torch.Tensor:
        """The control record's 64-bit epoch copies, as int64."""
        return self.control(owner)[:2 * lay.EPOCH_COPIES].view(torch.int64)

    def flags(self, owner: int) -> torch.Tensor:
        """[row, sender, block]: row 2 * kind + parity (a call notice is block 0 of its row)."""
        off = self.layout.flags_offset
        n = FLAG_ROWS * lay.MAX_RANKS * lay.MAX_FLAG_BLOCKS
        return self.buffers[owner][off:off + 8 * n].view(torch.int64).view(FLAG_ROWS, lay.MAX_RANKS,
                                                                             lay.MAX_FLAG_BLOCKS)

    def row(self, kind: int) -> int:
        """The flag row of ``kind`` this call reads and writes (its epoch's parity)."""
        return 2 * kind + (self.epoch & 1)

    def slot(self, owner: int, sender: int, dtype: torch.dtype) -> torch.Tensor:
        off = (self.epoch & 1) * self.layout.parity_bytes + sender * self.layout.slot_bytes
        return self.buffers[owner][off:off + self.layout.slot_bytes].view(dtype)

    def post_flag(self, kind: int, sender: int, programs: int, signature: int, epoch: int | None = None) -> None:
        """``sender``'s flags of ``kind`` as sealed for (epoch, signature), in the row this call polls."""
        word = sealed_word_of(self.epoch if epoch is None else epoch, signature)
        self.flags(self.rank)[self.row(kind), sender, :programs] = signed64(word)

    def post_notice(self, sender: int, signature: int, epoch: int | None = None) -> None:
        """``sender``'s call notice (unsealed) of this call's parity, as its kernel posts it."""
        epoch = self.epoch if epoch is None else epoch
        self.flags(self.rank)[self.row(NOTICE_KIND), sender, 0] = signed64(((epoch & 0xFFFFFFFF) << 32) | signature)

    def posted_flag(self, owner: int, kind: int, block: int = 0) -> int:
        """The flag of ``kind`` this rank posted in ``owner`` for program ``block``, as uint64."""
        return int(self.flags(owner)[self.row(kind), self.rank, block]) & 0xFFFFFFFFFFFFFFFF

    def advanced(self) -> bool:
        """Every epoch copy holds this call's epoch."""
        return bool((self.epochs(self.rank) == signed64(self.epoch)).all())


# (world, rank, tokens, hidden, dtype) for one rank's one-shot call, flag-based here and over
# low-latency lines in test_fused_ll_interpreter.py: odd worlds and hidden sizes, both dtypes, and
# worlds above 8 up to MAX_RANKS (the kernels read the peers' bases from one array, whatever W),
# one with fewer columns than ranks.
ONE_SHOT_CASES = [
    (2, 0, 1, 4096, torch.bfloat16),
    (4, 2, 4, 7168, torch.bfloat16),
    (3, 1, 5, 100, torch.float16),
    (8, 7, 3, 96, torch.bfloat16),
    (12, 9, 2, 192, torch.bfloat16),
    (16, 15, 3, 64, torch.float16),
    (16, 4, 2, 10, torch.bfloat16),
]


def _inputs(world: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    xs = [ref.rank_input(seed, r, tokens * hidden, dtype).view(tokens, hidden) for r in range(world)]
    residual = ref.rank_input(seed, 99, tokens * hidden, dtype).view(tokens, hidden)
    weight = (1 + 0.1 * ref.rank_input(seed, 98, hidden, torch.float32)).to(dtype)
    return xs, residual, weight


def _expected(xs, residual):
    """The new residual: torch's own bf16/fp16 add of the rank-order sum (the bitwise contract).
    The normed output is checked against the fp64 RMSNorm of it (``ref.check_rmsnorm``)."""
    reduced = ref.exact([x.reshape(-1) for x in xs]).view_as(residual)
    return residual + reduced


def _shard(tokens: int, world: int, owner: int) -> range:
    per = -(-tokens // world)
    begin = min(per * owner, tokens)
    return range(begin, min(begin + per, tokens))


@pytest.mark.parametrize("world, rank, tokens, hidden, dtype", ONE_SHOT_CASES)
def test_oneshot_one_rank(world, rank, tokens, hidden, dtype) -> None:
    fake = FakeRanks(world, rank)
    xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=world * 10 + tokens)
    programs, *_ = shapes.flag_based("oneshot", tokens, world, hidden)
    sig = shapes.flag_based_signature("oneshot", dtype, tokens, hidden, programs)
    for peer in range(world):
        if peer != rank:
            fake.slot(rank, peer, dtype)[:tokens * hidden] = xs[peer].reshape(-1)
            fake.post_flag(0, peer, programs, sig)
    normed = torch.full_like(residual, float("nan"))
    res_out = torch.full_like(residual, float("nan"))
    path.launch(fake.view, "oneshot", xs[rank], residual, weight, 1e-6, normed, res_out, interpret=True)

    want_res = _expected(xs, residual)
    assert torch.equal(res_out, want_res), "new residual must be bitwise residual + all_reduce(x)"
    ref.check_rmsnorm(normed, res_out, weight, 1e-6, "oneshot normed")
    for peer in range(world):  # what this rank pushed, and its flags
        if peer != rank:
            assert torch.equal(fake.slot(peer, rank, dtype)[:tokens * hidden], xs[rank].reshape(-1))
            assert fake.posted_flag(peer, 0) == sealed_word_of(fake.epoch, sig)
    assert fake.advanced(), "every epoch copy advances"
    assert int(fake.error[0]) == 0


@pytest.mark.parametrize("world, rank, tokens, hidden, dtype", [
    (2, 1, 4, 4096, torch.bfloat16),
    (4, 0, 9, 7168, torch.bfloat16),
    (3, 2, 7, 130, torch.float16),
    (12, 11, 29, 64, torch.bfloat16),
    (16, 6, 13, 10, torch.float16),  # fewer tokens than ranks (empty shards), fewer columns than ranks
    (3, 0, 101, 72, torch.bfloat16),  # 34 rows a shard: two rows a program, the last program's second past it
])
def test_twoshot_one_rank(world, rank, tokens, hidden, dtype) -> None:
    fake = FakeRanks(world, rank)
    xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=world * 100 + tokens)
    want_res = _expected(xs, residual)
    programs, *_ = shapes.flag_based("twoshot", tokens, world, hidden)
    sig = shapes.flag_based_signature("twoshot", dtype, tokens, hidden, programs)
    mine = _shard(tokens, world, rank)
    for peer in range(world):
        if peer == rank:
            continue
        slot = fake.slot(rank, peer, dtype).view(-1)
        for row in mine:  # reduce-scatter: the peer's x rows that we own
            slot[row * hidden:(row + 1) * hidden] = xs[peer][row]
        for row in _shard(tokens, world, peer):  # all-gather: the peer's finished residual rows
            slot[row * hidden:(row + 1) * hidden] = want_res[row]
        fake.post_flag(0, peer, programs, sig)
        fake.post_flag(1, peer, programs, sig)
    normed = torch.full_like(residual, float("nan"))
    res_out = torch.full_like(residual, float("nan"))
    path.launch(fake.view, "twoshot", xs[rank], residual, weight, 1e-5, normed, res_out, interpret=True)

    assert torch.equal(res_out, want_res)
    ref.check_rmsnorm(normed, res_out, weight, 1e-5, "twoshot normed")
    for peer in range(world):
        if peer == rank:
            continue
        pushed = fake.slot(peer, rank, dtype).view(-1)
        for row in _shard(tokens, world, peer):
            assert torch.equal(pushed[row * hidden:(row + 1) * hidden], xs[rank][row])
        for row in mine:
            assert torch.equal(pushed[row * hidden:(row + 1) * hidden], want_res[row])
    assert fake.advanced()


@pytest.mark.parametrize("algo, stage", [("oneshot", kernels.STAGE_FUSED_GATHER),
                                         ("twoshot", kernels.STAGE_FUSED_REDUCE_SCATTER)])
@pytest.mark.parametrize("world, hidden", [(8, 4), (8, 1), (3, 1), (12, 8), (16, 8)])
def test_the_last_peer_is_waited_for_when_rows_are_narrower_than_the_world(algo: str, stage: int, world: int,
                                                                           hidden: int) -> None:
    """Rows narrower than the world (odd tiny rows take the flag-based kernels): every peer but the
    last has pushed and flagged, and the call must wait for the last one (the waits poll one peer
    per element of the row-wide tensor, so it must span the ranks too) and time out naming it,
    leaving NaN in both outputs."""
    rank, tokens, dtype = 0, world, torch.bfloat16
    fake = FakeRanks(world, rank)
    xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=world + hidden)
    programs, *_ = shapes.flag_based(algo, tokens, world, hidden)
    sig = shapes.flag_based_signature(algo, dtype, tokens, hidden, programs)
    for peer in range(1, world - 1):
        fake.slot(rank, peer, dtype)[:tokens * hidden] = xs[peer].reshape(-1)
        fake.post_flag(0, peer, programs, sig)
    normed, res_out = torch.zeros_like(residual), torch.zeros_like(residual)
    path.launch(fake.view, algo, xs[rank], residual, weight, 1e-6, normed, res_out, interpret=True)
    kind, _, peer, got_stage, _, epoch = (int(v) for v in fake.error[:6])
    assert (kind, peer, got_stage, epoch) == (1, world - 1, stage, fake.epoch), f"error record {fake.error.tolist()}"
    assert bool(torch.isnan(normed).all()) and bool(torch.isnan(res_out).all())


def test_a_views_bases_table_holds_every_ranks_base() -> None:
    """The fused kernels take one address, of an int64 array of every rank's base, up to MAX_RANKS:
    made in host memory where the view is given none (a workspace gives its own device table)."""
    import ctypes
    fake = FakeRanks(lay.MAX_RANKS, 3)
    table = (ctypes.c_int64 * lay.MAX_RANKS).from_address(fake.view.bases_ptr)
    assert list(table) == list(fake.view.bases)
    given = lay.WorkspaceView(0, lay.MAX_RANKS, fake.view.bases, fake.layout, fake.error.data_ptr(), 10**9,
                              bases_ptr=12345)
    assert given.bases_ptr == 12345 and given._host_bases is None
    closed = types.SimpleNamespace(rank=1, peers_table_ptr=0)
    with pytest.raises(RuntimeError, match="rank 1's workspace is closed"):
        lay.WorkspaceView.of(closed)
    with pytest.raises(ValueError, match="one base per rank"):
        lay.WorkspaceView(0, 3, fake.view.bases[:2], fake.layout, fake.error.data_ptr(), 10**9)


@pytest.mark.parametrize("algo, gather_stage", [("oneshot", kernels.STAGE_FUSED_GATHER),
                                                 ("oneshot_ll", ll.STAGE_LOW_LATENCY_GATHER.value),
                                                 ("oneshot_full", ll.STAGE_FULL_GATHER.value)])
def test_missing_peer_records_timeout_instead_of_hanging(algo: str, gather_stage: int) -> None:
    fake = FakeRanks(2, 0)
    xs, residual, weight = _inputs(2, 1, 64, torch.bfloat16, seed=3)
    normed, res_out = torch.empty_like(residual), torch.empty_like(residual)
    path.launch(fake.view, algo, xs[0], residual, weight, 1e-6, normed, res_out, interpret=True)
    kind, rank, peer, stage, block, epoch = (int(v) for v in fake.error[:6])
    assert (kind, rank, peer, stage, block, epoch) == (1, 0, 1, gather_stage, 0, fake.epoch)
    assert int(fake.control(0)[lay.ABORT_WORD]) == 1, "abort flag raised so queued calls drain"


@pytest.mark.parametrize("algo, cause, in_place", [
    ("oneshot", "timeout", False), ("twoshot", "timeout", True), ("oneshot_ll", "timeout", True),
    ("oneshot", "mismatch", True), ("twoshot", "mismatch", False),
    ("oneshot", "aborted", False), ("twoshot", "aborted", True), ("oneshot_ll", "aborted", False),
    ("oneshot_full", "timeout", False), ("oneshot_full", "aborted", True)])
def test_a_call_that_gives_up_leaves_nan(algo: str, cause: str, in_place: bool) -> None:
    """Timeout, mismatch, or a workspace already aborted by an earlier failure: both outputs hold
    NaN in every element afterwards (in place too), never the old contents or a partial result.
    The two-shot's peers did send the first exchange in the mismatch case, so its own shard's rows
    were finished before the second wait gave up: those are overwritten too. The mismatch is the
    peer's notice (a flag of another signature alone is only "not yet")."""
    world, rank, tokens, hidden = 3, 1, 5, 96
    fake = FakeRanks(world, rank)
    xs, residual, weight = _inputs(world, tokens, hidden, torch.bfloat16, seed=7)
    if cause == "aborted":
        fake.control(rank)[lay.ABORT_WORD] = 1
    elif cause == "mismatch":
        programs, *_ = shapes.flag_based(algo, tokens, world, hidden)
        sig = shapes.flag_based_signature(algo, torch.bfloat16, tokens, hidden, programs)
        for peer in range(world):
            if peer != rank:
                fake.slot(rank, peer, torch.bfloat16)[:tokens * hidden] = xs[peer].reshape(-1)
                fake.post_flag(0, peer, programs, sig)
                fake.post_flag(1, peer, programs, sig ^ 1 if algo == "twoshot" else sig)
        if algo == "oneshot":
            fake.post_flag(0, 0, programs, sig ^ 1)
        fake.post_notice(0, sig ^ 1)
    x = xs[rank].clone()
    if in_place:
        normed, res_out = x, residual.clone()
    else:
        normed, res_out = torch.zeros_like(residual), residual.clone()  # old contents that are not NaN
    path.launch(fake.view, algo, x, res_out if in_place else residual, weight, 1e-6, normed, res_out,
                 interpret=True)
    assert int(fake.error[0]) == {"timeout": 1, "mismatch": 2, "aborted": 0}[cause]
    assert bool(torch.isnan(normed).all()), f"normed holds {int((~torch.isnan(normed)).sum())} non-NaN elements"
    assert bool(torch.isnan(res_out).all()), f"new residual holds {int((~torch.isnan(res_out)).sum())} non-NaN elements"
    assert fake.advanced(), "the epoch advances all the same"


def test_mismatched_peer_call_records_mismatch() -> None:
    fake = FakeRanks(2, 1)
    xs, residual, weight = _inputs(2, 2, 64, torch.bfloat16, seed=4)
    programs, *_ = shapes.flag_based("oneshot", 2, 2, 64)
    theirs = shapes.flag_based_signature("oneshot", torch.bfloat16, 2, 128, programs)  # the peer thinks the call is [2, 128]
    fake.post_flag(0, 0, programs, theirs)
    fake.post_notice(0, theirs)
    normed, res_out = torch.empty_like(residual), torch.empty_like(residual)
    path.launch(fake.view, "oneshot", xs[1], residual, weight, 1e-6, normed, res_out, interpret=True)
    assert int(fake.error[0]) == 2 and int(fake.error[2]) == 0
    assert int(fake.error[7]) & 0xFFFFFFFF == theirs, "the report names the peer's call signature"


@pytest.mark.parametrize("algo", ["oneshot", "twoshot", "oneshot_ll", "oneshot_full"])
def test_a_peer_running_another_kind_of_kernel_is_a_mismatch(algo: str) -> None:
    """A peer that runs another kind of kernel at this epoch never writes where this kernel polls
    (its flags, lines or headers); its call notice (invariant 7 of csrc/protocol.cuh) says it
    makes another call: a mismatch naming it, never a timeout. And this rank posts its own notice
    of the call in every peer."""
    world, rank = 3, 1
    fake = FakeRanks(world, rank)
    xs, residual, weight = _inputs(world, 2, 64, torch.bfloat16, seed=5)
    other = 0x5EED5EED
    stale = 0x0BAD0BAD
    fake.post_notice(2, other)
    # peer 0's notice of the call before last (the same parity): old news, never a mismatch
    fake.post_notice(0, stale, epoch=fake.epoch - 2)
    normed, res_out = torch.empty_like(residual), torch.empty_like(residual)
    path.launch(fake.view, algo, xs[rank], residual, weight, 1e-6, normed, res_out, interpret=True)
    kind, _, peer, _, _, epoch, _, observed = (int(v) & 0xFFFFFFFF for v in fake.error)
    assert (kind, peer, epoch, observed) == (2, 2, fake.epoch, other)
    assert bool(torch.isnan(normed).all()) and bool(torch.isnan(res_out).all())
    for peer in (0, 2):
        posted = fake.posted_flag(peer, NOTICE_KIND)
        assert posted >> 32 == fake.epoch and posted & 0xFFFFFFFF != 0, f"no notice of this call in rank {peer}"


@pytest.mark.parametrize("completed", [0xFFFFFFFF, 0x7FFFFFFF])
def test_oneshot_across_the_epoch_wrap(completed: int) -> None:
    """After 2^32-1 calls the low word of the next epoch is 2 (never 0, never a repeated parity)
    and its wrap count 1; after 2^31-1 calls nothing changes. Epoch copies advance to it and the
    call completes."""
    fake = FakeRanks(2, 1, completed=completed)
    assert fake.epoch == ((1 << 32) | 2 if completed == 0xFFFFFFFF else completed + 1)
    xs, residual, weight = _inputs(2, 3, 96, torch.bfloat16, seed=5)
    programs, *_ = shapes.flag_based("oneshot", 3, 2, 96)
    sig = shapes.flag_based_signature("oneshot", torch.bfloat16, 3, 96, programs)
    fake.slot(1, 0, torch.bfloat16)[:3 * 96] = xs[0].reshape(-1)
    fake.post_flag(0, 0, programs, sig)
    normed, res_out = torch.empty_like(residual), torch.empty_like(residual)
    path.launch(fake.view, "oneshot", xs[1], residual, weight, 1e-6, normed, res_out, interpret=True)
    assert int(fake.error[0]) == 0
    assert torch.equal(res_out, _expected(xs, residual))
    assert fake.advanced()


@pytest.mark.parametrize("stale", [0, 1, "half a cycle ahead", "one ahead", "two ahead", "another signature"])
def test_a_stale_flag_is_never_a_go(stale: object) -> None:
    """Only this call's sealed word counts, in the row this call polls: a never-written slot's
    epoch (0), epoch 1, a flag 2^31 - 1 epochs "ahead" (which a signed comparison took for a go),
    one or two ahead, or this epoch with another signature and no notice of another call (a slot
    that may be left from an earlier wrap: not a mismatch) all leave the wait to time out, with
    nothing reduced."""
    fake = FakeRanks(2, 0, completed=0xFFFFFFFF)  # this call is epoch 2 of wrap 1
    epoch = {0: 0, 1: 1, "half a cycle ahead": fake.epoch + (1 << 31) - 1, "one ahead": fake.epoch + 1,
             "two ahead": fake.epoch + 2, "another signature": fake.epoch}[stale]
    xs, residual, weight = _inputs(2, 1, 64, torch.bfloat16, seed=6)
    programs, *_ = shapes.flag_based("oneshot", 1, 2, 64)
    sig = shapes.flag_based_signature("oneshot", torch.bfloat16, 1, 64, programs)
    fake.post_flag(0, 1, programs, sig ^ 1 if stale == "another signature" else sig, epoch=epoch)
    normed, res_out = torch.empty_like(residual), torch.empty_like(residual)
    path.launch(fake.view, "oneshot", xs[0], residual, weight, 1e-6, normed, res_out, interpret=True)
    assert int(fake.error[0]) == 1, f"a stale flag was taken for the peer's data (error record {fake.error.tolist()})"


# ---- the 64-bit epoch and sealed words (invariant 3 of csrc/protocol.cuh) --------------------

WRAPPED = (1 << 32) | 41  # calls completed: low word 41 in wrap 1; this call is (wrap 1, low 42)


def _play_peer_flags(fake: FakeRanks, algo: str, peer: int, xs, want_res, tokens: int, hidden: int, dtype,
                     programs: int, sig: int) -> None:
    """``peer``'s share of this rank's call, as its kernel would leave it: its data in our slot
    and its flags (sealed) of every exchange the call has."""
    slot = fake.slot(fake.rank, peer, dtype).view(-1)
    if algo == "oneshot":
        slot[:tokens * hidden] = xs[peer].reshape(-1)
    else:
        for row in _shard(tokens, fake.world, fake.rank):
            slot[row * hidden:(row + 1) * hidden] = xs[peer][row]
        for row in _shard(tokens, fake.world, peer):
            slot[row * hidden:(row + 1) * hidden] = want_res[row]
        fake.post_flag(1, peer, programs, sig)
    fake.post_flag(0, peer, programs, sig)


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_fused_calls_across_the_wrap_carry_the_64_bit_epoch(algo: str) -> None:
    """Three calls from (wrap 0, low 2^32 - 2): epochs (0, 2^32 - 1), (1, 2), (1, 3). Each one
    completes; every epoch copy ends at (1, 3); the flags this rank posts carry the low word over
    the signature sealed with the wrap count (signature ^ WRAP_SEAL_MIX in wrap 1), its notices
    the low word over the bare signature."""
    world, rank, tokens, hidden, dtype = 2, 1, 3, 96, torch.bfloat16
    fake = FakeRanks(world, rank, completed=0xFFFFFFFE)
    programs, *_ = shapes.flag_based(algo, tokens, world, hidden)
    sig = shapes.flag_based_signature(algo, dtype, tokens, hidden, programs)
    for call in range(3):
        epoch = fake.epoch
        xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=30 + call)
        want_res = _expected(xs, residual)
        _play_peer_flags(fake, algo, 0, xs, want_res, tokens, hidden, dtype, programs, sig)
        normed, res_out = torch.full_like(residual, float("nan")), torch.full_like(residual, float("nan"))
        path.launch(fake.view, algo, xs[rank], residual, weight, 1e-6, normed, res_out, interpret=True)
        assert int(fake.error[0]) == 0, f"call {call} (epoch {epoch:#x}): error record {fake.error.tolist()}"
        assert torch.equal(res_out, want_res), f"call {call} (epoch {epoch:#x})"
        assert fake.advanced(), f"call {call}: the epoch copies hold {epoch:#x}"
        for kind in (0, 1) if algo == "twoshot" else (0,):
            for block in range(programs):
                assert fake.posted_flag(0, kind, block) == sealed_word_of(epoch, sig), (call, kind, block)
        if epoch >> 32:
            assert fake.posted_flag(0, 0) & 0xFFFFFFFF == sig ^ WRAP_SEAL_MIX, "wrap 1 seals the signature"
        assert fake.posted_flag(0, NOTICE_KIND) == ((epoch & 0xFFFFFFFF) << 32) | sig, "notices are not sealed"
        fake.completed = epoch
    assert fake.completed == (1 << 32) | 3 == next_epoch_of(next_epoch_of(next_epoch_of(0xFFFFFFFE)))
    assert bool((fake.epochs(rank) == (1 << 32) | 3).all())


@pytest.mark.parametrize("algo, stage", [("oneshot", kernels.STAGE_FUSED_GATHER),
                                         ("twoshot", kernels.STAGE_FUSED_REDUCE_SCATTER)])
def test_a_flag_from_the_last_wrap_is_not_taken(algo: str, stage: int) -> None:
    """The peer's flag slot still holds the word this call's flag had in the 32-bit encoding:
    the same low epoch and signature, sealed with the previous wrap's count (a slot idle for
    2^32 calls). The peer's data is absent: the call must not complete but time out, naming the
    peer, with NaN in both outputs."""
    world, rank, tokens, hidden, dtype = 2, 0, 2, 64, torch.bfloat16
    fake = FakeRanks(world, rank, completed=WRAPPED)
    xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=8)
    programs, *_ = shapes.flag_based(algo, tokens, world, hidden)
    sig = shapes.flag_based_signature(algo, dtype, tokens, hidden, programs)
    last_wrap = fake.epoch - (1 << 32)
    assert sealed_word_of(last_wrap, sig) == (42 << 32) | sig, "wrap 0's sealed word is the 32-bit encoding's"
    fake.post_flag(0, 1, programs, sig, epoch=last_wrap)
    normed, res_out = torch.zeros_like(residual), torch.zeros_like(residual)
    path.launch(fake.view, algo, xs[rank], residual, weight, 1e-6, normed, res_out, interpret=True)
    kind, _, peer, got_stage, _, epoch = (int(v) for v in fake.error[:6])
    assert (kind, peer, got_stage, epoch) == (1, 1, stage, 42), f"error record {fake.error.tolist()}"
    assert bool(torch.isnan(normed).all()) and bool(torch.isnan(res_out).all())
    assert fake.advanced()


def test_a_mismatch_is_named_from_the_notice_not_the_flag() -> None:
    """Peer 2's flag carries this epoch with another signature (a slot it may have left a wrap
    ago) and its call notice a third one: the mismatch names peer 2 with the notice's signature,
    and the record keeps the epoch's low word. Peer 0 plays along."""
    world, rank, tokens, hidden, dtype = 3, 1, 2, 64, torch.bfloat16
    fake = FakeRanks(world, rank, completed=WRAPPED)
    xs, residual, weight = _inputs(world, tokens, hidden, dtype, seed=9)
    programs, *_ = shapes.flag_based("oneshot", tokens, world, hidden)
    sig = shapes.flag_based_signature("oneshot", dtype, tokens, hidden, programs)
    theirs, in_flag = 0x5EED5EED, 0x0BAD0BAD
    _play_peer_flags(fake, "oneshot", 0, xs, None, tokens, hidden, dtype, programs, sig)
    fake.post_flag(0, 2, programs, in_flag)
    fake.post_notice(2, theirs)
    normed, res_out = torch.zeros_like(residual), torch.zeros_like(residual)
    path.launch(fake.view, "oneshot", xs[rank], residual, weight, 1e-6, normed, res_out, interpret=True)
    kind, got_rank, peer, stage, _, epoch, expected, observed = (int(v) & 0xFFFFFFFF for v in fake.error)
    assert (kind, got_rank, peer, stage, epoch, expected, observed) == (
        2, rank, 2, kernels.STAGE_FUSED_GATHER, 42, sig, theirs), f"error record {fake.error.tolist()}"
    assert bool(torch.isnan(normed).all()) and bool(torch.isnan(res_out).all())
