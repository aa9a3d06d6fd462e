"""Multi-rank GPU tests of the CUDA all-reduce kernels (W ranks; on one GPU under MPS).

Skipped with a reason on a machine without a GPU or without the built extension.
Each test spawns W ranks once and runs a whole scenario inside them, because spawning is the
expensive part.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from pcie_allreduce.plan import algorithms
from pcie_allreduce.constants import SMALL_WORLD
from pcie_allreduce.plan.algorithms import ALGO_IDS
from pcie_allreduce.errors import CollectiveMismatch, CollectiveTimeout
from tests import _reference as ref

SKIP_REASON = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

WORLDS = [int(w) for w in os.environ.get("PCIE_AR_TEST_WORLDS", "2,3,4,8").split(",")]
# Both transports run the same kernels over different memory (device memory through CUDA IPC, or
# pinned host memory in /dev/shm): the matrix and graph tests run on each.
TRANSPORTS = os.environ.get("PCIE_AR_TEST_TRANSPORTS", "p2p,host").split(",")
# Worlds above SMALL_WORLD run the kernels' 16-rank-capacity instances: the failure tests cover them too.
WIDE_WORLDS = [w for w in WORLDS if w > SMALL_WORLD]
MAX_BYTES = 2 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The algorithms of every transport and fabric; the host transport adds its own (HOST_ALGOS). The
# island algorithms need islands: tests/test_island_gpu.py.
# The in-place algorithms (SYMMETRIC_INPUT_ALGORITHMS) read the symmetric input area: their own
# checks (_symmetric_results), on p2p.
ALGOS = tuple(a for a in algorithms.ALGORITHMS
              if a not in algorithms.HOST_ONLY_ALGORITHMS + algorithms.ISLAND_ALGORITHMS
              + algorithms.SYMMETRIC_INPUT_ALGORITHMS)
HOST_ALGOS = ALGOS + algorithms.HOST_ONLY_ALGORITHMS


def _algos_of(comm: pcie_allreduce.Communicator) -> tuple[str, ...]:
    return HOST_ALGOS if comm.transport == "host" else ALGOS


def _sizes(dtype: torch.dtype, seed: int) -> list[int]:
    es = torch.empty((), dtype=dtype).element_size()
    rng = random.Random(seed)
    fixed = [1, 7, 4096, 7168, 4 * 7168, 32 * 7168, (1 << 20) // es, MAX_BYTES // es]
    odd = [rng.randrange(1, 4096) | 1, rng.randrange(4096, MAX_BYTES // es) | 1]
    return fixed + odd


def _symmetric_results(comm: pcie_allreduce.Communicator, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x`` all-reduced from the symmetric input area (p2p): every in-place algorithm forced and
    auto, out of place and in place, with the area rewritten before each call (in place overwrites
    it); forcing one on an ordinary tensor is refused. Empty on the host transport."""
    if comm.transport != "p2p":
        with pytest.raises(ValueError, match="p2p transport"):
            comm.symmetric_input(x.shape, x.dtype)
        return {}
    results = {}
    area = comm.symmetric_input(x.shape, x.dtype)
    for algo in algorithms.SYMMETRIC_INPUT_ALGORITHMS + ("auto",):
        area.copy_(x)
        out = torch.full_like(x, float("nan"))
        comm.all_reduce(area, out=out, algo=algo)
        results[f"symmetric-{algo}"] = out
        area.copy_(x)
        comm.all_reduce(area, out=area, algo=algo)
        results[f"symmetric-{algo}-in-place"] = area.clone()
    for algo in algorithms.SYMMETRIC_INPUT_ALGORITHMS:
        with pytest.raises(ValueError, match="symmetric_input"):
            comm.all_reduce(x, algo=algo)
    return results


def _matrix(ctx: ranks.RankContext, transport: str) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    assert comm.transport == transport
    checks = 0
    for dtype in DTYPES:
        for seed, numel in enumerate(_sizes(dtype, 17)):
            inputs = ref.all_inputs(seed, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            results = {}
            algos = tuple(a for a in _algos_of(comm)
                          if algorithms.fits_capacity(a, numel * x.element_size(), comm.ll_capacity))
            for algo in algos + ("auto",):
                out = torch.full_like(x, float("nan"))
                comm.all_reduce(x, out=out, algo=algo)
                results[algo] = out
            inplace = x.clone()
            comm.all_reduce(inplace, out=inplace, algo="auto")
            results["in-place"] = inplace
            # A view that is not 16-byte aligned takes the element-wise path; same bytes, same result.
            unaligned_buf = torch.empty(numel + 1, dtype=dtype, device=ctx.device)
            unaligned = unaligned_buf[1:]
            unaligned.copy_(x)
            for algo in algos:
                out = torch.full_like(x, float("nan"))
                comm.all_reduce(unaligned, out=out, algo=algo)
                results[f"unaligned-{algo}"] = out
            results.update(_symmetric_results(comm, x))
            for capped in algorithms.CAPPED_ALGORITHMS:
                if capped not in algos:
                    with pytest.raises(ValueError, match=capped):
                        comm.all_reduce(x, algo=capped)
            torch.cuda.synchronize()
            assert torch.equal(x.cpu(), inputs[ctx.rank]), "out-of-place call modified its input"
            for name, out in results.items():
                ref.check(out, inputs, f"W={ctx.world_size} rank {ctx.rank} {dtype} numel={numel} {name}")
                checks += 1
    comm.check()
    comm.close()
    return {"checks": checks}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
def test_matrix_every_algorithm_dtype_and_size(world: int, transport: str) -> None:
    results = ranks.run_ranks(_matrix, world, transport, timeout_s=600)
    assert all(r["checks"] == results[0]["checks"] > 0 for r in results)


def _graph(ctx: ranks.RankContext, captured: int, replays: int, transport: str) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    # dependent launch: on by default where the GPU has it, off under PCIE_AR_PDL=0
    assert comm.dependent_launch == (os.environ.get("PCIE_AR_PDL") != "0"
                                     and torch.cuda.get_device_capability(ctx.device)[0] >= 9)
    rng = random.Random(5)
    algos = _algos_of(comm) + ("auto",)
    shapes = [(rng.choice([1, 7, 4 * 7168, 7168 * 3 + 5, 100_000]), rng.choice(DTYPES), algos[i % len(algos)])
              for i in range(8)]
    static_in = [torch.empty(n, dtype=d, device=ctx.device) for n, d, _ in shapes]
    outs = [torch.full((shapes[i % 8][0],), float("nan"), dtype=shapes[i % 8][1], device=ctx.device)
            for i in range(captured)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the capture stream's workspace is created inside the capture
        for i in range(captured):
            comm.all_reduce(static_in[i % 8], out=outs[i], algo=shapes[i % 8][2])
    # Every replay's every output is compared bitwise on the GPU with the rank-order sum (one op
    # per input shape, no synchronization; counts read at the end); every 20th is also checked
    # against fp64 on the CPU, with messages naming the call.
    bad = torch.zeros(replays, 8, dtype=torch.int64, device=ctx.device)
    for rep in range(replays):
        inputs = [ref.all_inputs(1000 + rep, ctx.world_size, n, d) for n, d, _ in shapes]
        wants = [ref.exact(per_rank).to(ctx.device) for per_rank in inputs]
        for buf, per_rank in zip(static_in, inputs):
            buf.copy_(per_rank[ctx.rank])
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        for k in range(8):
            got = torch.stack(outs[k::8])
            bad[rep, k] = ref.bitwise_mismatches(got, wants[k]).sum()
        if rep % 20 == 0 or rep == replays - 1:
            torch.cuda.synchronize()
            for i, out in enumerate(outs):
                ref.check(out, inputs[i % 8], f"graph replay {rep} call {i}")
    torch.cuda.synchronize()
    comm.check()
    bad = bad.cpu()
    failed = bad.nonzero().tolist()
    assert not failed, (f"W={ctx.world_size} rank {ctx.rank}: wrong elements in {len(failed)} (replay, shape) pairs; "
                        f"first: replay {failed[0][0]}, the calls on input {failed[0][1]} {shapes[failed[0][1]]}: "
                        f"{int(bad[failed[0][0], failed[0][1]])} elements differ from the rank-order fp32 sum")
    comm.close()
    return {"checked": replays * captured}


LARGE_BYTES = 16 << 20


def _large(ctx: ranks.RankContext, transport: str) -> dict:
    """Every uncapped algorithm of the transport at 5 MiB - 16 MiB (odd sizes among them), bitwise
    the plain two-shot's result and within the fp64 reference."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=LARGE_BYTES, timeout_s=30, transport=transport)
    checks = 0
    for dtype in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dtype).element_size()
        for seed, numel in enumerate((LARGE_BYTES // es, LARGE_BYTES // es - 3, (5 << 20) // es + 1)):
            inputs = ref.all_inputs(300 + seed, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            outs = {}
            for algo in ("twoshot",) + tuple(a for a in _algos_of(comm) if a not in algorithms.CAPPED_ALGORITHMS):
                out = torch.full_like(x, float("nan"))
                comm.all_reduce(x, out=out, algo=algo)
                outs[algo] = out
            outs.update(_symmetric_results(comm, x))
            torch.cuda.synchronize()
            what = f"W={ctx.world_size} rank {ctx.rank} {transport} {dtype} numel={numel}"
            ref.check(outs["twoshot"], inputs, f"{what} twoshot")  # the others: bitwise this checked result
            bits = torch.int16 if es == 2 else torch.int32
            for algo, got in outs.items():
                assert torch.equal(got.view(bits), outs["twoshot"].view(bits)), f"{what} {algo}: not bitwise twoshot's"
                checks += 1
    comm.check()
    comm.close()
    return {"checks": checks}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 8)] or WORLDS[:1])
def test_large_messages_up_to_16_mib_through_every_uncapped_algorithm(world: int, transport: str) -> None:
    results = ranks.run_ranks(_large, world, transport, timeout_s=600)
    assert all(r["checks"] == results[0]["checks"] > 0 for r in results)



def _symmetric_graph(ctx: ranks.RankContext, replays: int) -> dict:
    """Calls from the symmetric input area captured on one stream (out of place, then in place),
    the area rewritten with fresh inputs before every replay; every output checked."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    stream = torch.cuda.Stream(ctx.device)
    numel, dtype = (3 << 20) // 4 + 5, torch.bfloat16  # past the one-shots' sizes: auto takes twoshot_symm
    area = comm.symmetric_input(numel, dtype, stream=stream)
    assert comm._choice(numel * 2, dtype, "auto", symmetric=True)[0] == ALGO_IDS["twoshot_symm"]
    outs = [torch.empty(numel, dtype=dtype, device=ctx.device) for _ in range(3)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        comm.all_reduce(area, out=outs[0], algo="twoshot_symm")
        comm.all_reduce(area, out=outs[1])  # auto
        comm.all_reduce(area, out=area)  # in place, last: it overwrites the input
        outs[2].copy_(area)
    for rep in range(replays):
        inputs = ref.all_inputs(2000 + rep, ctx.world_size, numel, dtype)
        area.copy_(inputs[ctx.rank])
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        for i, out in enumerate(outs):
            ref.check(out, inputs, f"W={ctx.world_size} symmetric graph replay {rep} call {i}")
    comm.check()
    comm.close()
    return {"checked": replays * len(outs)}


@pytest.mark.parametrize("world", WORLDS)
def test_symmetric_input_calls_in_a_cuda_graph(world: int) -> None:
    results = ranks.run_ranks(_symmetric_graph, world, 12, timeout_s=300)
    assert all(r["checked"] == 36 for r in results)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
def test_cuda_graph_128_calls_replayed_100_times(world: int, transport: str) -> None:
    results = ranks.run_ranks(_graph, world, 128, 100, transport, timeout_s=600)
    assert all(r["checked"] == 128 * 100 for r in results)


# The test above launches every call as the previous kernel's programmatic dependent (the default
# on Hopper and later: each kernel waits for the one before it before it reads anything); this one
# the ordinary way ($PCIE_AR_PDL=0), the same checks, every algorithm.
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 8)] or WORLDS[:1])
def test_calls_launched_the_ordinary_way(world: int, transport: str) -> None:
    results = ranks.run_ranks(_graph, world, 128, 30, transport, timeout_s=600, env={"PCIE_AR_PDL": "0"})
    assert all(r["checked"] == 128 * 30 for r in results)


# Rounds of the back-to-back test between two checks: each size has a ring of this many outputs.
RING = 8


def _back_to_back(ctx: ranks.RankContext, calls: int) -> dict:
    """``calls`` all-reduces of alternating sizes, issued in groups of RING rounds with no
    synchronization, every call checked: each has fresh integer inputs whose exact sum the rank
    computes with one tensor op (``ref.AffinePools``); the outputs of RING rounds sit in a ring per
    size, poisoned (NaN) before each reuse and compared on the GPU with the sums after the group,
    the mismatch counts accumulating on the GPU and read once at the end."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    if not ctx.mps and ctx.shared_gpu:
        calls = min(calls, 500)  # time-sliced contexts: milliseconds per call
    sizes = [1, 4 * 7168, 7168 * 3 + 5, 262_143, 1 << 19]
    dtype = torch.bfloat16
    rounds = -(-calls // len(sizes))
    groups = -(-rounds // RING)
    pools = [ref.AffinePools(7, ctx.world_size, n, dtype) for n in sizes]
    mine = [p.pools[ctx.rank].to(ctx.device) for p in pools]
    totals = [p.total.to(ctx.device) for p in pools]

    def ring(n: int) -> torch.Tensor:  # RING rows of n, each 16-byte aligned like a tensor of its own
        return torch.empty(RING, -(-n // 8) * 8, dtype=dtype, device=ctx.device)[:, :n]

    ins, outs = [ring(n) for n in sizes], [ring(n) for n in sizes]
    wants = [torch.empty(RING, n, dtype=dtype, device=ctx.device) for n in sizes]
    bad = torch.zeros(groups, len(sizes), dtype=torch.int64, device=ctx.device)
    rng = random.Random(11)  # the same draws on every rank
    made = 0
    for g in range(groups):
        count = min(RING, rounds - g * RING)
        for k, n in enumerate(sizes):
            outs[k].fill_(float("nan"))
            for j in range(count):
                params = pools[k].draw(rng)
                ref.AffinePools.apply(mine[k], n, params, out=ins[k][j])
                ref.AffinePools.apply(totals[k], n, params, ctx.world_size, out=wants[k][j])
        for j in range(count):
            for k in range(len(sizes)):
                comm.all_reduce(ins[k][j], out=outs[k][j])
        made += count * len(sizes)
        for k in range(len(sizes)):
            bad[g, k] = ref.value_mismatches(outs[k][:count], wants[k][:count])
    torch.cuda.synchronize()
    comm.check()
    bad = bad.cpu()
    failed = bad.nonzero().tolist()
    if failed:
        g, k = failed[0]
        raise AssertionError(f"W={ctx.world_size} rank {ctx.rank}: {len(failed)} of {groups * len(sizes)} checks "
                             f"(RING={RING} calls of one size each) found wrong elements ({int(bad.sum())} in all); "
                             f"first: size {sizes[k]}, rounds {g * RING}..{g * RING + RING - 1}: {int(bad[g, k])} "
                             f"elements differ from the exact sum")
    # After the run, one more round with random normal inputs: bitwise the rank-order fp32 sum.
    inputs = [ref.all_inputs(7, ctx.world_size, n, dtype) for n in sizes]
    finals = []
    for per_rank in inputs:
        x = per_rank[ctx.rank].to(ctx.device)
        finals.append(comm.all_reduce(x, out=torch.full_like(x, float("nan"))))
    torch.cuda.synchronize()
    for n, out, per_rank in zip(sizes, finals, inputs):
        ref.check(out, per_rank, f"after {made} back-to-back calls, size {n}")
    comm.check()
    comm.close()
    return {"calls": made}


@pytest.mark.parametrize("world", WORLDS)
def test_10000_back_to_back_calls_of_alternating_sizes(world: int) -> None:
    results = ranks.run_ranks(_back_to_back, world, 10_000, timeout_s=600)
    assert all(r["calls"] == results[0]["calls"] >= 500 for r in results)


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
        if ctx.rank == ctx.world_size - 1 and i in (5, 21):
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
                                    residual_out=new_residual, algo=fused_algos[(i // 4) % 3])
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
    for i, algo in enumerate(_algos_of(comm)):
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


def _skip_one_call(ctx: ranks.RankContext, skipper: int, algo: str = "auto", numel: int = 4 * 7168) -> dict:
    """Six calls of ``algo``, rank ``skipper`` leaving out the fourth: what each rank raised."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=2.0)
    x = torch.randn(numel, device=ctx.device).to(torch.bfloat16)
    out = torch.full_like(x, 7.0)
    torch.distributed.barrier(group=ctx.group)
    start = time.monotonic()
    raised = None
    try:
        for i in range(6):
            if ctx.rank == skipper and i == 3:
                continue
            comm.all_reduce(x, out=out, algo=algo)
        torch.cuda.synchronize()
        comm.check()
    except CollectiveTimeout as exc:
        raised = {"type": "timeout", "rank": exc.rank, "peer": exc.peer, "stage": exc.stage, "message": str(exc)}
    elapsed = time.monotonic() - start
    torch.cuda.synchronize()
    all_nan = bool(torch.isnan(out).all())
    comm.close()
    return {"raised": raised, "elapsed": elapsed, "all_nan": all_nan}


@pytest.mark.parametrize("world", [2, 4, *WIDE_WORLDS])
def test_rank_that_skips_a_call_makes_the_others_raise(world: int) -> None:
    skipper = world - 1
    results = ranks.run_ranks(_skip_one_call, world, skipper, timeout_s=300)
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
    try:
        comm.check()
        raised = None
    except CollectiveTimeout as exc:
        raised = exc.peer
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


def _compiled(ctx: ranks.RankContext) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pcie_allreduce.all_reduce(x * 2, comm.handle, "auto") + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    inputs = ref.all_inputs(9, ctx.world_size, 7168, torch.float32)
    got = compiled(inputs[ctx.rank].to(ctx.device))
    want = ref.exact([x * 2 for x in inputs]) + 1
    assert torch.equal(got.cpu(), want)
    y = inputs[ctx.rank].to(ctx.device)
    torch.ops.pcie_allreduce.all_reduce_(y, comm.handle, "twoshot")
    ref.check(y, inputs, "in-place custom op")
    # The fused all-reduce + residual + RMSNorm as one opaque op of a compiled graph.
    hidden = 7168
    fused_inputs = ref.all_inputs(10, ctx.world_size, 4 * hidden, torch.bfloat16)
    x = fused_inputs[ctx.rank].to(ctx.device).view(4, hidden)
    residual = ref.rank_input(11, 0, 4 * hidden, torch.bfloat16).to(ctx.device).view(4, hidden)
    weight = (1 + 0.1 * ref.rank_input(12, 0, hidden, torch.float32)).to(torch.bfloat16).to(ctx.device)

    def fused_step(x: torch.Tensor, residual: torch.Tensor,
                   weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.pcie_allreduce.all_reduce_rmsnorm(x, residual, weight, 1e-6, comm.handle)

    normed, got = torch.compile(fused_step, backend="aot_eager", fullgraph=True)(x, residual, weight)
    assert torch.equal(got.cpu(), residual.cpu() + ref.exact(fused_inputs).view(4, hidden))
    ref.check_rmsnorm(normed, got, weight, 1e-6, "fused custom op under torch.compile")
    comm.close()
    return {}


def test_torch_library_op_under_torch_compile() -> None:
    ranks.run_ranks(_compiled, 2, timeout_s=300)


def _creation_fails_on_one_rank(ctx: ranks.RankContext) -> dict:
    from pcie_allreduce import constants

    max_bytes = constants.MAX_MESSAGE_BYTES + 1 if ctx.rank == ctx.world_size - 1 else MAX_BYTES
    start = time.monotonic()
    try:
        pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=max_bytes, timeout_s=5.0)
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = (None, "")
    # A communicator made afterwards works: the failed one left nothing behind (and its
    # creation-time transfer test, a real P2P write from every rank to every other, passes).
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    inputs = ref.all_inputs(5, ctx.world_size, 7168, torch.bfloat16)
    ref.check(comm.all_reduce(inputs[ctx.rank].to(ctx.device)), inputs, "after a failed creation")
    comm.close()
    ext = pcie_allreduce._ext.require()
    bounds = []
    for args in ((constants.MAX_MESSAGE_BYTES + 1, 1.0), (MAX_BYTES, constants.MAX_TIMEOUT_S * 2.0)):
        try:
            ext.Workspace(ctx.device.index, ctx.rank, ctx.world_size, *args).close()
            bounds.append("accepted")
        except Exception as exc:  # noqa: BLE001
            bounds.append(str(exc))
    return {"outcome": outcome, "elapsed": time.monotonic() - start, "bounds": bounds}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_creation_failing_on_one_rank_raises_on_every_rank(world: int) -> None:
    results = ranks.run_ranks(_creation_fails_on_one_rank, world, timeout_s=300)
    last = world - 1
    for rank, r in enumerate(results):
        kind, message = r["outcome"]
        if rank == last:
            assert kind == "ValueError" and "max_bytes must be an int" in message, r
        else:
            assert kind == "UnavailableError" and f"rank {last}: ValueError" in message, r
        assert r["elapsed"] < 60, r
        assert "max_bytes must be in [1, " in r["bounds"][0] and "timeout must be" in r["bounds"][1], r


def _peer_of_another_size(ctx: ranks.RankContext) -> dict:
    """The last rank's workspace is larger (another max_bytes, as another build or setting would
    make it): no rank maps a peer's workspace of another size than its own layout's."""
    import torch.distributed as dist

    ext = pcie_allreduce._ext.require()
    last = ctx.world_size - 1
    max_bytes = MAX_BYTES + (4096 if ctx.rank == last else 0)
    workspace = ext.Workspace(ctx.device.index, ctx.rank, ctx.world_size, max_bytes, 5.0)
    exported = [None] * ctx.world_size
    dist.all_gather_object(exported, (workspace.ipc_handle(), workspace.total_bytes), group=ctx.group)
    try:
        workspace.open_peers([handle for handle, _ in exported])
        outcome = None
    except RuntimeError as exc:
        outcome = str(exc)
    dist.barrier(group=ctx.group)  # every rank is done mapping before any frees its memory
    workspace.close()
    return {"outcome": outcome, "sizes": [size for _, size in exported]}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_a_peer_workspace_of_another_size_is_refused(world: int) -> None:
    last = world - 1
    for rank, r in enumerate(ranks.run_ranks(_peer_of_another_size, world, timeout_s=300)):
        peer = 0 if rank == last else last
        assert r["outcome"] is not None, f"rank {rank} mapped a workspace of another size: {r}"
        assert (f"rank {rank} refuses the workspace of rank {peer}: it is {r['sizes'][peer]} bytes, this rank's "
                f"layout needs {r['sizes'][rank]}") in r["outcome"], r


def _mapped_workspace(ctx: ranks.RankContext, transport: str, timeout_s: float):
    """One ``_C.Workspace`` per rank with every peer mapped, as creation makes it before its probes."""
    import torch.distributed as dist
    from pcie_allreduce import constants, transport as transport_mod

    ext = pcie_allreduce._ext.require()
    name = transport_mod.new_segment_name() if transport == "host" else ""
    workspace = ext.Workspace(ctx.device.index, ctx.rank, ctx.world_size, MAX_BYTES, timeout_s,
                              constants.TRANSPORT_IDS[transport], name)
    handles = [None] * ctx.world_size
    dist.all_gather_object(handles, workspace.ipc_handle(), group=ctx.group)
    workspace.open_peers(handles)
    dist.barrier(group=ctx.group)
    workspace.release_name()
    return workspace


PROBE_TIMEOUT_S = 0.25
PROBE_STALL_S = 4.0


def _stalled_transfer_test(ctx: ranks.RankContext, transport: str) -> dict:
    """Rank 0's creation-time transfer test is held past its timeout (the test hook delays its
    kernel, as peer writes stalled in the platform would): write_probes raises within about the
    timeout, and close() returns at once instead of waiting for that kernel, leaving the memory
    allocated; a kernel that ended before close() is freed as usual."""
    import torch.distributed as dist

    result = {}
    for case, delay in (("running at close", PROBE_STALL_S), ("ended before close", 1.0)):
        workspace = _mapped_workspace(ctx, transport, PROBE_TIMEOUT_S)
        if ctx.rank == 0:
            workspace.debug_delay_probes(delay)
            start = time.monotonic()
            try:
                workspace.write_probes(1)
                raised = None
            except RuntimeError as exc:
                raised = str(exc)
            gave_up_s = time.monotonic() - start
            if case == "ended before close":
                torch.cuda.synchronize(ctx.device)  # the hook's delay is bounded: the kernel ends by itself
            start = time.monotonic()
            workspace.close()
            result[case] = {"raised": raised, "gave_up_s": gave_up_s, "close_s": time.monotonic() - start,
                            "abandoned": workspace.abandoned}
            torch.cuda.synchronize(ctx.device)  # the delayed kernel ends within its delay
        else:
            workspace.write_probes(1)
        dist.barrier(group=ctx.group)  # rank 0's kernel has written into the peers: only now may they free
        if ctx.rank != 0:
            workspace.close()
    return result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_transfer_test_that_times_out_never_blocks_close(transport: str) -> None:
    rank0 = ranks.run_ranks(_stalled_transfer_test, 2, transport, timeout_s=300)[0]
    stalled, ended = rank0["running at close"], rank0["ended before close"]
    for r in (stalled, ended):
        assert r["raised"] is not None and "did not complete within 0.25" in r["raised"], r
        assert "until the process exits" in r["raised"], r
        assert PROBE_TIMEOUT_S <= r["gave_up_s"] < PROBE_TIMEOUT_S + 1.5, r
    # Releasing its memory would have waited the rest of PROBE_STALL_S for the kernel.
    assert stalled["close_s"] < 1.0 and stalled["abandoned"], stalled
    assert not ended["abandoned"], ended


def _replay_after_close(ctx: ranks.RankContext) -> dict:
    """A graph of plain and fused calls, replayed once while the communicator is open and once
    after close(): the second replay must touch no freed memory (the workspace is retired, not
    freed) and leave NaN in every output."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=5.0)
    hidden = 7168
    inputs = ref.all_inputs(21, ctx.world_size, 4 * hidden, torch.bfloat16)
    x = inputs[ctx.rank].to(ctx.device)
    residual = ref.rank_input(22, 0, 4 * hidden, torch.bfloat16).view(4, hidden).to(ctx.device)
    weight = (1 + 0.1 * ref.rank_input(23, 0, hidden, torch.float32)).to(torch.bfloat16).to(ctx.device)
    plain_algos = ("oneshot", "twoshot", "oneshot_ll", "staged", "oneshot_full", "twoshot_full")
    outs = [torch.full_like(x, 7.0) for _ in plain_algos]
    normed, new_residual = torch.full_like(residual, 7.0), torch.full_like(residual, 7.0)
    stream = torch.cuda.Stream(ctx.device)
    with torch.cuda.stream(stream):
        comm.all_reduce(x, out=outs[0])  # the capture stream's workspace, made eagerly
        comm.all_reduce_rmsnorm(x.view(4, hidden), residual, weight, 1e-6, out=normed, residual_out=new_residual)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for out, algo in zip(outs, plain_algos):
                comm.all_reduce(x, out=out, algo=algo)
            comm.all_reduce_rmsnorm(x.view(4, hidden), residual, weight, 1e-6, out=normed, residual_out=new_residual)
    eager = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=5.0)
    ref.check(eager.all_reduce(x), inputs, "eager communicator")
    torch.cuda.synchronize()  # the eager calls on `stream` wrote outs[0], normed and new_residual
    for t in (*outs, normed, new_residual):
        t.fill_(float("nan"))  # so only the replay can have written them
    graph.replay()
    torch.cuda.synchronize()
    for out, algo in zip(outs, plain_algos):
        ref.check(out, inputs, f"{algo} in the graph")
    assert torch.equal(new_residual.cpu(), residual.cpu() + ref.exact(inputs).view(4, hidden))
    ref.check_rmsnorm(normed, new_residual, weight, 1e-6, "fused call in the graph")
    comm.close()
    eager.close()
    for t in (*outs, normed, new_residual):
        t.fill_(7.0)
    graph.replay()  # after close(): aborted calls, NaN outputs, no peer memory touched
    torch.cuda.synchronize()
    result = {"retained": comm.retained_bytes, "eager_retained": eager.retained_bytes,
              "all_nan": [bool(torch.isnan(t).all()) for t in (*outs, normed, new_residual)]}
    del graph
    return result


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_a_graph_replayed_after_close_leaves_nan_and_touches_no_freed_memory(world: int) -> None:
    for rank, r in enumerate(ranks.run_ranks(_replay_after_close, world, timeout_s=300)):
        assert r["retained"] > 0, f"rank {rank}: close() freed a workspace a graph captured"
        assert r["eager_retained"] == 0, f"rank {rank}: close() kept a workspace no graph captured"
        assert all(r["all_nan"]), f"rank {rank}: a replay after close() left data in an output: {r}"


def _transports_agree(ctx: ranks.RankContext) -> dict:
    """The same inputs through both transports, plain (every algorithm) and fused: bitwise equal
    outputs, and the host transport's segments gone from /dev/shm once created."""
    from pcie_allreduce import transport

    comms = {name: pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30,
                                               transport=name) for name in ("p2p", "host")}
    leftovers = [p for p in os.listdir(transport.SHM_DIR) if transport.creator_of(p) == transport.current_creator()]
    differ = []
    for dtype in DTYPES:
        for numel in (5, 7168 * 4 + 3, 300_001):
            inputs = ref.all_inputs(numel, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            for algo in ALGOS:  # host_oneshot has no P2P counterpart: compared with the others below
                if not algorithms.fits_capacity(algo, numel * x.element_size(), comms["p2p"].ll_capacity):
                    continue
                outs = {name: comm.all_reduce(x, algo=algo) for name, comm in comms.items()}
                if not torch.equal(outs["p2p"], outs["host"]):
                    differ.append(f"{dtype} numel={numel} {algo}")
                ref.check(outs["host"], inputs, f"host transport {dtype} numel={numel} {algo}")
            for host_algo in algorithms.HOST_ONLY_ALGORITHMS:
                if not torch.equal(comms["host"].all_reduce(x, algo=host_algo), outs["p2p"]):
                    differ.append(f"{dtype} numel={numel} {host_algo} vs p2p {algo}")
    hidden, tokens = 7168, 4
    for call, algo in enumerate(("oneshot", "twoshot", "oneshot_ll", "oneshot_full")):
        # Fresh inputs per call, a weight that is not all ones, outputs poisoned first; each
        # transport's new residual is bitwise residual + the rank-order sum, its normed output
        # within the fp64 RMSNorm's bound, and the two transports bitwise equal.
        inputs = ref.all_inputs(31 + call, ctx.world_size, tokens * hidden, torch.bfloat16)
        x = inputs[ctx.rank].to(ctx.device).view(tokens, hidden)
        residual = ref.rank_input(32 + call, 0, tokens * hidden, torch.bfloat16).view(tokens, hidden).to(ctx.device)
        weight = (1 + 0.1 * ref.rank_input(33 + call, 0, hidden, torch.float32)).to(torch.bfloat16).to(ctx.device)
        want_residual = residual + ref.exact([t.to(ctx.device) for t in inputs]).view(tokens, hidden)
        fused = {}
        for name, comm in comms.items():
            normed, new_residual = torch.full_like(x, float("nan")), torch.full_like(residual, float("nan"))
            comm.all_reduce_rmsnorm(x, residual, weight, 1e-6, out=normed, residual_out=new_residual, algo=algo)
            if not torch.equal(new_residual, want_residual):
                differ.append(f"fused {algo} on {name}: the new residual is not residual + the rank-order sum")
            ref.check_rmsnorm(normed, new_residual, weight, 1e-6, f"fused {algo} on {name}")
            fused[name] = (normed, new_residual)
        if not all(torch.equal(a, b) for a, b in zip(fused["p2p"], fused["host"])):
            differ.append(f"fused {algo}")
    torch.cuda.synchronize()
    for comm in comms.values():
        comm.check()
        comm.close()
    return {"differ": differ, "leftovers": leftovers}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_p2p_and_host_transports_give_bitwise_equal_results(world: int) -> None:
    for rank, r in enumerate(ranks.run_ranks(_transports_agree, world, timeout_s=600)):
        assert r["differ"] == [], f"rank {rank}: the transports disagree on {r['differ']}"
        assert r["leftovers"] == [], f"rank {rank}: segments left in /dev/shm after creation: {r['leftovers']}"


def _wire_edge_values(ctx: ranks.RankContext) -> dict:
    """-0.0, NaN, +-Inf and the poison pattern as data (``ref.edge_inputs``: the bf16/fp16 lane
    0x8000 is -0.0; the fp32 word 0x80008000 a negative subnormal), on every rank at once and
    mixed, through every algorithm and ``auto`` on each transport, at a small and a medium odd
    size. Each call must deliver every element (data taken for the poison would be waited for
    until the timeout) and give, bitwise, what README documents: the rank-order fp32 sum, and for
    the full-payload algorithms the sum of what they send (-0.0 as +0.0 in bf16/fp16, the fp32
    poison word as -0.0); NaN where the sum is NaN. Outputs are poisoned first with a finite value
    no sum here takes, so an element left unwritten shows, NaN positions included."""
    mismatches = []
    for transport in TRANSPORTS:
        comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=10,
                                           transport=transport)
        for dtype in DTYPES:
            es = torch.empty((), dtype=dtype).element_size()
            for numel in (283, 40_001):
                inputs = ref.edge_inputs(numel, ctx.world_size, numel, dtype)
                x = inputs[ctx.rank].to(ctx.device)
                algos = [a for a in _algos_of(comm) if algorithms.fits_capacity(a, numel * es, comm.ll_capacity)]
                results = {}
                for algo in (*algos, "auto"):
                    results[algo] = comm.all_reduce(x, out=torch.full_like(x, 30000.0), algo=algo)
                torch.cuda.synchronize()
                for algo, out in results.items():
                    runs = comm.select_algo(numel * es, dtype) if algo == "auto" else algo
                    want = ref.expected_sum(inputs, runs)
                    got = out.cpu()
                    bad = ref.bitwise_mismatches(got, want).nonzero().view(-1)
                    if len(bad):
                        i, mask = int(bad[0]), (1 << 8 * es) - 1
                        mismatches.append(f"{transport} {dtype} numel={numel} {algo} ({runs}): {len(bad)} elements "
                                          f"differ, first at {i}: got {got[i].item()!r} "
                                          f"(bits {ref.bits(got)[i].item() & mask:#x}), want {want[i].item()!r} "
                                          f"(bits {ref.bits(want)[i].item() & mask:#x})")
        comm.check()
        comm.close()
    return {"mismatches": mismatches}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_every_algorithm_carries_zeros_nan_inf_and_the_poison_word(world: int) -> None:
    for rank, r in enumerate(ranks.run_ranks(_wire_edge_values, world, timeout_s=300)):
        assert r["mismatches"] == [], f"rank {rank}: {r['mismatches']}"
