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
from pcie_allreduce import ranks
from pcie_allreduce.errors import CollectiveMismatch, CollectiveTimeout
from tests import _reference as ref

SKIP_REASON = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

WORLDS = [int(w) for w in os.environ.get("PCIE_AR_TEST_WORLDS", "2,3,4,8").split(",")]
MAX_BYTES = 2 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALGOS = pcie_allreduce.ALGORITHMS


def _sizes(dtype: torch.dtype, seed: int) -> list[int]:
    es = torch.empty((), dtype=dtype).element_size()
    rng = random.Random(seed)
    fixed = [1, 7, 4096, 7168, 4 * 7168, 32 * 7168, (1 << 20) // es, MAX_BYTES // es]
    odd = [rng.randrange(1, 4096) | 1, rng.randrange(4096, MAX_BYTES // es) | 1]
    return fixed + odd


def _matrix(ctx: ranks.RankContext) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    checks = 0
    for dtype in DTYPES:
        for seed, numel in enumerate(_sizes(dtype, 17)):
            inputs = ref.all_inputs(seed, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            results = {}
            algos = tuple(a for a in ALGOS if a != "oneshot_ll" or numel * x.element_size() <= comm.ll_capacity)
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
            if len(algos) < len(ALGOS):
                with pytest.raises(ValueError, match="oneshot_ll"):
                    comm.all_reduce(x, algo="oneshot_ll")
            torch.cuda.synchronize()
            assert torch.equal(x.cpu(), inputs[ctx.rank]), "out-of-place call modified its input"
            for name, out in results.items():
                ref.check(out, inputs, f"W={ctx.world_size} rank {ctx.rank} {dtype} numel={numel} {name}")
                checks += 1
    comm.check()
    comm.close()
    return {"checks": checks}


@pytest.mark.parametrize("world", WORLDS)
def test_matrix_every_algorithm_dtype_and_size(world: int) -> None:
    results = ranks.run_ranks(_matrix, world, timeout_s=600)
    assert all(r["checks"] == results[0]["checks"] > 0 for r in results)


def _graph(ctx: ranks.RankContext, captured: int, replays: int) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    rng = random.Random(5)
    algos = ALGOS + ("auto",)
    shapes = [(rng.choice([1, 7, 4 * 7168, 7168 * 3 + 5, 100_000]), rng.choice(DTYPES), algos[i % len(algos)])
              for i in range(8)]
    static_in = [torch.empty(n, dtype=d, device=ctx.device) for n, d, _ in shapes]
    outs = [torch.full((shapes[i % 8][0],), float("nan"), dtype=shapes[i % 8][1], device=ctx.device)
            for i in range(captured)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the capture stream's workspace is created inside the capture
        for i in range(captured):
            comm.all_reduce(static_in[i % 8], out=outs[i], algo=shapes[i % 8][2])
    checked = 0
    for rep in range(replays):
        inputs = [ref.all_inputs(1000 + rep, ctx.world_size, n, d) for n, d, _ in shapes]
        for buf, per_rank in zip(static_in, inputs):
            buf.copy_(per_rank[ctx.rank])
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        if rep % 20 == 0 or rep == replays - 1:
            torch.cuda.synchronize()
            for i, out in enumerate(outs):
                ref.check(out, inputs[i % 8], f"graph replay {rep} call {i}")
                checked += 1
    comm.check()
    comm.close()
    return {"checked": checked}


@pytest.mark.parametrize("world", WORLDS)
def test_cuda_graph_128_calls_replayed_100_times(world: int) -> None:
    results = ranks.run_ranks(_graph, world, 128, 100, timeout_s=600)
    assert all(r["checked"] > 0 for r in results)


def _back_to_back(ctx: ranks.RankContext, calls: int) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    if not ctx.mps and ctx.shared_gpu:
        calls = min(calls, 500)  # time-sliced contexts: milliseconds per call
    sizes = [1, 4 * 7168, 7168 * 3 + 5, 262_143, 1 << 19]
    inputs = [ref.all_inputs(7, ctx.world_size, n, torch.bfloat16) for n in sizes]
    xs = [i[ctx.rank].to(ctx.device) for i in inputs]
    outs = [torch.empty_like(x) for x in xs]
    for i in range(calls):
        k = i % len(sizes)
        comm.all_reduce(xs[k], out=outs[k])
    torch.cuda.synchronize()
    for k, out in enumerate(outs):
        ref.check(out, inputs[k], f"after {calls} back-to-back calls, size {sizes[k]}")
    comm.check()
    comm.close()
    return {"calls": calls}


@pytest.mark.parametrize("world", WORLDS)
def test_10000_back_to_back_calls_of_alternating_sizes(world: int) -> None:
    ranks.run_ranks(_back_to_back, world, 10_000, timeout_s=600)


def _wraparound(ctx: ranks.RankContext) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    comm.workspace().debug_set_epoch(0xFFFFFFF0)
    torch.distributed.barrier(group=ctx.group)
    for i in range(40):
        inputs = ref.all_inputs(300 + i, ctx.world_size, 7168 + i, torch.bfloat16)
        out = comm.all_reduce(inputs[ctx.rank].to(ctx.device), algo=ALGOS[i % len(ALGOS)])
        ref.check(out, inputs, f"call {i} across the 32-bit epoch wrap")
    epoch = comm.workspace().debug_epoch()
    comm.close()
    return {"epoch": epoch}


def test_epoch_counter_wraps_around() -> None:
    results = ranks.run_ranks(_wraparound, 2, timeout_s=300)
    assert results[0]["epoch"] == (0xFFFFFFF0 + 40) % (1 << 32)


def _skip_one_call(ctx: ranks.RankContext, skipper: int) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=2.0)
    x = torch.randn(4 * 7168, device=ctx.device).to(torch.bfloat16)
    torch.distributed.barrier(group=ctx.group)
    start = time.monotonic()
    raised = None
    try:
        for i in range(6):
            if ctx.rank == skipper and i == 3:
                continue
            comm.all_reduce(x)
        torch.cuda.synchronize()
        comm.check()
    except CollectiveTimeout as exc:
        raised = {"type": "timeout", "rank": exc.rank, "peer": exc.peer, "stage": exc.stage, "message": str(exc)}
    elapsed = time.monotonic() - start
    comm.close()
    return {"raised": raised, "elapsed": elapsed}


@pytest.mark.parametrize("world", [2, 4])
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


def _mismatched_sizes(ctx: ranks.RankContext) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=5.0)
    x = torch.randn(1000 + ctx.rank, device=ctx.device)
    kind = None
    try:
        comm.all_reduce(x)
        torch.cuda.synchronize()
        comm.check()
    except CollectiveMismatch as exc:
        kind = ("mismatch", exc.peer)
    except CollectiveTimeout:
        kind = ("timeout", None)
    comm.close()
    return {"kind": kind}


def test_mismatched_sizes_across_ranks_raise_mismatch() -> None:
    results = ranks.run_ranks(_mismatched_sizes, 2, timeout_s=300)
    assert [r["kind"] for r in results] == [("mismatch", 1), ("mismatch", 0)]


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
    comm.close()
    return {}


def test_torch_library_op_under_torch_compile() -> None:
    ranks.run_ranks(_compiled, 2, timeout_s=300)
