"""Multi-rank GPU tests of the all-reduce kernels when a peer is late, missing or issued another
call (W ranks; on one GPU under MPS): epoch wraps with a late rank, a flag slot a cycle old, a rank
that skips a call, a replay that gives up (NaN and an exception naming the peer), and mismatched
sizes or kinds of kernel named as a mismatch, not a timeout.

Skipped with a reason on a machine without a GPU or without the built extension.
"""

from __future__ import annotations

import time

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from pcie_allreduce.errors import CollectiveMismatch, CollectiveTimeout
from tests import _reference as ref
from tests._allreduce_gpu import (ALGOS, MAX_BYTES, SKIP_REASON, TRANSPORTS, WIDE_WORLDS, WORLDS, algos_of, skip_one_call,
                                  timed_out_peer)

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def _next_epoch(epoch: int) -> int:
    """next_epoch of csrc/protocol.cuh: the low 32 bits skip 0 and 1 when they wrap, the high 32
    bits count the wraps."""
    return (((epoch >> 32) + 1) << 32) | 2 if epoch & 0xFFFFFFFF == 0xFFFFFFFF else epoch + 1


def _across_epoch_boundaries(ctx: ranks.RankContext, completed: int) -> dict:
    """Every algorithm, plain and fused, across a boundary of the epoch's low 32 bits with one rank
    late by about a second. debug_set_epoch sets the local counter only: flag slots keep what
    earlier calls (or nobody) wrote, so never-written and long-unused slots are what they would be
    in production, and each waiter must hold out for the real flag."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    comm._workspace().debug_set_epoch(completed)
    torch.distributed.barrier(group=ctx.group)
    fused_algos = ("oneshot", "twoshot", "oneshot_ll", "oneshot_full")
    for i in range(32):
        if ctx.rank == ctx.world_size - 1 and i in (5, 15, 21):  # 15: the data-as-flag fused kernel
            time.sleep(1.0)
        hidden = 7168 + 2 * i
        inputs = ref.all_inputs(300 + i, ctx.world_size, 4 * hidden, torch.bfloat16)
        x = inputs[ctx.rank].to(ctx.device)
        if i % 4 == 3:
            residual = ref.rank_input(900 + i, 0, 4 * hidden, torch.bfloat16).view(4, hidden)
            weight = (1 + 0.1 * ref.rank_input(901 + i, 0, hidden, torch.float32)).to(torch.bfloat16).to(ctx.device)
            normed, new_residual = (torch.full((4, hidden), float("nan"), dtype=torch.bfloat16, device=ctx.device)
                                    for _ in range(2))
            comm.all_reduce_rmsnorm(x.view(4, hidden), residual.to(ctx.device), weight, 1e-6, out=normed,
                                    residual_out=new_residual, algo=fused_algos[(i // 4) % len(fused_algos)])
            want = residual + ref.exact(inputs).view(4, hidden)
            assert torch.equal(new_residual.cpu(), want), f"fused call {i} across epoch {completed:#x}"
            ref.check_rmsnorm(normed, new_residual, weight, 1e-6, f"fused call {i} across epoch {completed:#x}")
        else:
            out = comm.all_reduce(x, out=torch.full_like(x, float("nan")), algo=ALGOS[i % len(ALGOS)])
            ref.check(out, inputs, f"call {i} ({ALGOS[i % len(ALGOS)]}) across epoch {completed:#x}")
    epoch = comm._workspace().debug_epoch()
    comm.close()
    return {"epoch": epoch}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
@pytest.mark.parametrize("completed", [(1 << 31) - 16, (1 << 32) - 16, (7 << 32) | 0xFFFFFFF0])
def test_every_algorithm_across_epoch_boundaries_with_a_late_rank(completed: int, world: int) -> None:
    results = ranks.run_ranks(_across_epoch_boundaries, world, completed, timeout_s=300)
    epoch = completed
    for _ in range(32):
        epoch = _next_epoch(epoch)
    assert [r["epoch"] for r in results] == [epoch] * world


def _a_cycle_later(ctx: ranks.RankContext, transport: str) -> dict:
    """Each algorithm makes one call of epoch L, then the counter jumps to one wrap later, to the
    call before (wraps 1, low L): its next call uses the same low epoch, parity, slots and signature
    as that first one, while the last rank comes a second late. Each waiter must hold out for the
    late rank's flag instead of taking the first call's, still in its slot, for this call's (a
    32-bit epoch could not tell them apart)."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    late = ctx.rank == ctx.world_size - 1
    checked = []
    for i, algo in enumerate(algos_of(comm)):
        low = 1000 + 2 * i
        numel = 4 * 7168 + 2 * i + 1
        comm._workspace().debug_set_epoch(low - 1)
        torch.distributed.barrier(group=ctx.group)
        first = ref.all_inputs(500 + i, ctx.world_size, numel, torch.bfloat16)
        out = comm.all_reduce(first[ctx.rank].to(ctx.device), out=torch.full((numel,), float("nan"),
                              dtype=torch.bfloat16, device=ctx.device), algo=algo)
        ref.check(out, first, f"{algo}: the call of epoch {low}")
        torch.distributed.barrier(group=ctx.group)
        comm._workspace().debug_set_epoch((1 << 32) | (low - 1))
        torch.distributed.barrier(group=ctx.group)
        if late:
            time.sleep(1.0)
        again = ref.all_inputs(600 + i, ctx.world_size, numel, torch.bfloat16)
        out = comm.all_reduce(again[ctx.rank].to(ctx.device), out=torch.full((numel,), float("nan"),
                              dtype=torch.bfloat16, device=ctx.device), algo=algo)
        ref.check(out, again, f"{algo}: the call of epoch {low} one wrap later, with rank {ctx.world_size - 1} late")
        checked.append(algo)
    epoch = comm._workspace().debug_epoch()
    comm.close()
    return {"checked": checked, "epoch": epoch}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_flag_slot_a_whole_epoch_cycle_old_is_not_taken_for_this_calls(transport: str) -> None:
    results = ranks.run_ranks(_a_cycle_later, 2, transport, timeout_s=300)
    assert results[0]["checked"] == results[1]["checked"] and results[0]["checked"]
    assert {r["epoch"] >> 32 for r in results} == {1}


@pytest.mark.parametrize("world", [2, 4, *WIDE_WORLDS])
def test_rank_that_skips_a_call_makes_the_others_raise(world: int) -> None:
    skipper = world - 1
    results = ranks.run_ranks(skip_one_call, world, skipper, timeout_s=300)
    for rank, r in enumerate(results):
        if rank == skipper:
            continue
        assert r["raised"] is not None, f"rank {rank} did not raise"
        assert r["raised"]["rank"] == rank
        assert r["raised"]["peer"] == skipper, r["raised"]["message"]
        assert r["elapsed"] < 15, r
        assert r["all_nan"], f"rank {rank}: the call that timed out left data in its output"


def _replay_with_a_missing_rank(ctx: ranks.RankContext, algo: str, dtype: torch.dtype) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=2.0)
    inputs = ref.all_inputs(11, ctx.world_size, 3 * 7168 + 5, dtype)
    x = inputs[ctx.rank].to(ctx.device)
    outs = [torch.full_like(x, 7.0) for _ in range(2)]
    stream = torch.cuda.Stream(ctx.device)
    with torch.cuda.stream(stream):
        comm.all_reduce(x, out=outs[0], algo=algo)  # the capture stream's workspace, made eagerly
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for out in outs:
                comm.all_reduce(x, out=out, algo=algo)
    graph.replay()
    torch.cuda.synchronize()
    for out in outs:
        ref.check(out, inputs, f"{algo} replay")
    for out in outs:
        out.fill_(7.0)
    torch.distributed.barrier(group=ctx.group)
    late = ctx.rank == ctx.world_size - 1
    if not late:
        graph.replay()  # the last rank never replays: every call of this replay gives up
    torch.cuda.synchronize()
    raised = timed_out_peer(comm)
    result = {"late": late, "raised": raised, "all_nan": [bool(torch.isnan(out).all()) for out in outs]}
    del graph
    comm.close()
    return result


GIVE_UP_DTYPES = {"oneshot": torch.float32, "twoshot": torch.bfloat16, "oneshot_ll": torch.float16,
                  "oneshot_full": torch.bfloat16, "twoshot_full": torch.float16, "oneshot_pull": torch.float16,
                  "twoshot_pull": torch.bfloat16, "twoshot_staged": torch.float32}


@pytest.mark.parametrize("world", [2, *WIDE_WORLDS])
@pytest.mark.parametrize("algo", sorted(GIVE_UP_DTYPES))
def test_a_replay_that_gives_up_leaves_nan_and_raises(algo: str, world: int) -> None:
    dtype = GIVE_UP_DTYPES[algo]
    results = ranks.run_ranks(_replay_with_a_missing_rank, world, algo, dtype, timeout_s=300)
    late = world - 1
    for rank, r in enumerate(results):
        if r["late"]:
            continue
        # Each rank names the peer it stopped waiting for: the late rank, or (in a two-exchange
        # algorithm) a peer that gave up on it first and so never sent its second exchange.
        assert r["raised"] is not None and r["raised"] != rank and 0 <= r["raised"] < world, (
            f"rank {rank}: check() after the failed replay did not raise naming a peer: {r}")
        assert r["all_nan"] == [True, True], f"rank {rank}: a call that gave up left data in its output: {r}"
    assert any(r["raised"] == late for r in results if not r["late"]), results


def _failure_of(comm: pcie_allreduce.Communicator, call) -> tuple | None:
    """Run ``call``, wait for it and check: ("mismatch", peer), ("timeout", None), or None."""
    try:
        call()
        torch.cuda.synchronize()
        comm.check()
    except CollectiveMismatch as exc:
        return ("mismatch", exc.peer)
    except CollectiveTimeout:
        return ("timeout", None)
    return None


def _mismatched_sizes(ctx: ranks.RankContext, algo: str) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=5.0)
    x = torch.randn(1000 + ctx.rank, device=ctx.device)
    kind = _failure_of(comm, lambda: comm.all_reduce(x, algo=algo))
    comm.close()
    return {"kind": kind}


# The full-payload kernels learn of a mismatch from their headers alone: every unit rank 0 polls
# arrives (rank 1's message is larger) and must not be reduced; rank 1 waits for an element rank 0
# never sends, and must hear of the mismatch rather than time out.
@pytest.mark.parametrize("algo", ["auto", "oneshot_full", "twoshot_full"])
def test_mismatched_sizes_across_ranks_raise_mismatch(algo: str) -> None:
    results = ranks.run_ranks(_mismatched_sizes, 2, algo, timeout_s=300)
    assert [r["kind"] for r in results] == [("mismatch", 1), ("mismatch", 0)]


def _different_kernels(ctx: ranks.RankContext, transport: str, cases: list) -> list:
    """For each case, rank r makes the call cases[i][r] on a new communicator: ("plain", numel,
    algo) or ("fused", tokens, algo), bf16, hidden 7168. Every fused call of a case is made
    first by every rank (its kernels compile, and the ranks meet, before any rank runs it)."""
    import time

    hidden = 7168
    outcomes = []
    for calls in cases:
        comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=5.0,
                                           transport=transport)
        gen = torch.Generator(device=ctx.device).manual_seed(1000 + ctx.rank)
        weight = torch.randn(hidden, device=ctx.device, dtype=torch.bfloat16, generator=gen)
        for kind, size, algo in calls:
            if kind == "fused":
                x = torch.randn(size, hidden, device=ctx.device, dtype=torch.bfloat16, generator=gen)
                comm.all_reduce_rmsnorm(x, torch.randn_like(x), weight, 1e-6, algo=algo)
        torch.cuda.synchronize()
        comm.check()
        kind, size, algo = calls[ctx.rank]
        x = torch.randn(size * (hidden if kind == "fused" else 1), device=ctx.device, dtype=torch.bfloat16,
                        generator=gen)
        torch.distributed.barrier(group=ctx.group)
        if kind == "fused":
            x = x.view(size, hidden)
            residual = torch.randn_like(x)

            def call() -> None:
                comm.all_reduce_rmsnorm(x, residual, weight, 1e-6, algo=algo)
        else:
            def call() -> None:
                comm.all_reduce(x, algo=algo)
        started = time.perf_counter()
        outcome = _failure_of(comm, call)
        outcomes.append((outcome, time.perf_counter() - started))
        comm.close()
    return outcomes


# Ranks whose calls take different KINDS of kernel (another size class, algorithm, wire format, or
# fused against plain) poll where the other never writes: their call notices say so at once.
DIFFERENT_KERNELS = {
    "p2p": [
        (("plain", 1000, "auto"), ("plain", 300_000, "auto")),           # both sides of a size boundary
        (("plain", 4096, "oneshot_ll"), ("plain", 4096, "oneshot")),
        (("plain", 20_000, "oneshot_full"), ("plain", 20_000, "twoshot")),
        (("plain", 20_000, "twoshot_full"), ("plain", 20_000, "oneshot_ll")),
        (("plain", 20_000, "staged"), ("plain", 20_000, "oneshot_full")),
        (("fused", 4, "auto"), ("plain", 4 * 7168, "twoshot")),          # fused against plain
        (("fused", 4, "oneshot"), ("fused", 4, "oneshot_full")),         # flags against data as flag
        (("plain", 20_000, "oneshot_pull"), ("plain", 20_000, "oneshot")),  # pull against push: both flag kind 0
        (("plain", 300_000, "twoshot_pull"), ("plain", 300_000, "twoshot")),
        (("plain", 300_001, "twoshot_staged"), ("plain", 300_001, "twoshot")),  # staged flags peer by peer
    ],
    "host": [
        (("plain", 1000, "auto"), ("plain", 300_000, "auto")),
        (("plain", 20_000, "host_oneshot"), ("plain", 20_000, "host_twoshot")),
        (("plain", 20_000, "host_oneshot"), ("plain", 20_000, "oneshot")),
        (("plain", 20_000, "twoshot_pull"), ("plain", 20_000, "oneshot_pull")),
        (("plain", 20_000, "twoshot_staged"), ("plain", 20_000, "host_twoshot")),
        (("fused", 4, "oneshot"), ("plain", 4 * 7168, "host_oneshot")),
    ],
}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_running_different_kinds_of_kernel_raise_mismatch(transport: str) -> None:
    cases = DIFFERENT_KERNELS[transport]
    results = ranks.run_ranks(_different_kernels, 2, transport, cases, timeout_s=400)
    for i, calls in enumerate(cases):
        got = [r[i][0] for r in results]
        assert got == [("mismatch", 1), ("mismatch", 0)], f"{calls}: {got}"
        assert all(r[i][1] < 2.5 for r in results), f"{calls}: found after {[r[i][1] for r in results]} s"
