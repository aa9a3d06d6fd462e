"""Multi-rank GPU tests of the island algorithms (``island_twoshot``, ``island_oneshot``): islands
set by ``$PCIE_AR_ISLANDS`` (W ranks; on one GPU under MPS, where islands are only a grouping:
the test is of the protocol and the sums).

Every split of W = 4, 6 and 8 into two or more equal islands, both transports: bitwise equal to
the flat two-shot and to the rank-order fp32 sum, close to fp64, for odd and misaligned sizes up
to 16 MiB, every dtype, in place; CUDA-graph replays with fresh inputs; a rank that skips a call
makes the others raise with NaN in their outputs, whichever island's role it has.
Skipped with a reason on a machine without a GPU or without the built extension.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.plan import algorithms
from pcie_allreduce.tools import ranks
from pcie_allreduce.fabric import topology
from tests import _reference as ref
from tests._allreduce_gpu import SKIP_REASON, TRANSPORTS, skip_one_call

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

MAX_BYTES = 16 << 20
ISLAND_ALGOS = algorithms.ISLAND_ALGORITHMS
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (world, ranks per island): every split into >= 2 equal islands of >= 2 ranks up to W = 8, and
# where $PCIE_AR_TEST_WORLDS names 16, the splits of 16 ranks (the 16-rank kernel instances).
SPLITS = [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)]
if "16" in os.environ.get("PCIE_AR_TEST_WORLDS", "").split(","):
    SPLITS += [(16, 2), (16, 4), (16, 8)]


def _islands_env(world: int, size: int) -> dict[str, str]:
    groups = tuple(tuple(range(g * size, (g + 1) * size)) for g in range(world // size))
    return {topology.ISLANDS_ENV: topology.format_islands(groups)}


def _sizes(dtype: torch.dtype, seed: int) -> list[int]:
    es = torch.empty((), dtype=dtype).element_size()
    rng = random.Random(seed)
    fixed = [1, 3, 7, 4096, 7168, 4 * 7168, 32 * 7168, (1 << 20) // es, MAX_BYTES // es]
    odd = [rng.randrange(1, 4096) | 1, rng.randrange(4096, (2 << 20) // es) | 1]
    return fixed + odd


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _matrix(ctx: ranks.RankContext, transport: str, size: int) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    assert comm.transport == transport and comm.island_ranks == size, (comm.islands, comm.island_ranks)
    checks = 0
    for dtype in DTYPES:
        for seed, numel in enumerate(_sizes(dtype, 23 + size)):
            inputs = ref.all_inputs(seed, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            outs = {}
            for algo in ("twoshot", *ISLAND_ALGOS):
                out = _poisoned(x)
                comm.all_reduce(x, out=out, algo=algo)
                outs[algo] = out
            for algo in ISLAND_ALGOS:
                inplace = x.clone()
                comm.all_reduce(inplace, out=inplace, algo=algo)
                outs[f"{algo} in place"] = inplace
                unaligned = torch.empty(numel + 1, dtype=dtype, device=ctx.device)[1:]  # element-wise path
                unaligned.copy_(x)
                out = _poisoned(x)
                comm.all_reduce(unaligned, out=out, algo=algo)
                outs[f"{algo} unaligned"] = out
            torch.cuda.synchronize()
            assert torch.equal(x.cpu(), inputs[ctx.rank]), "out-of-place call modified its input"
            what = f"W={ctx.world_size} islands of {size} rank {ctx.rank} {transport} {dtype} numel={numel}"
            ref.check(outs["twoshot"], inputs, f"{what} twoshot")  # the others: bitwise this checked result
            for name, got in outs.items():
                assert torch.equal(_bits(got), _bits(outs["twoshot"])), f"{what} {name}: not bitwise the flat two-shot"
                checks += 1
    comm.check()
    comm.close()
    return {"checks": checks}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("world", "size"), SPLITS)
def test_island_algorithms_are_bitwise_the_flat_sum(world: int, size: int, transport: str) -> None:
    results = ranks.run_ranks(_matrix, world, transport, size, timeout_s=600, env=_islands_env(world, size))
    assert all(r["checks"] == results[0]["checks"] > 0 for r in results)


def _graph(ctx: ranks.RankContext, transport: str, replays: int) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    shapes = [(7, torch.bfloat16, "island_twoshot"), (4 * 7168, torch.bfloat16, "island_twoshot"),
              (100_001, torch.float16, "island_twoshot"), (4 * 7168, torch.bfloat16, "auto"),
              (3 * 7168 + 5, torch.float32, "island_twoshot"), (7, torch.float16, "island_oneshot"),
              (4 * 7168, torch.bfloat16, "island_oneshot"), (3 * 7168 + 5, torch.float32, "island_oneshot")]
    static_in = [torch.empty(n, dtype=d, device=ctx.device) for n, d, _ in shapes]
    outs = [torch.empty(n, dtype=d, device=ctx.device) for n, d, _ in shapes]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for (_, _, algo), x, out in zip(shapes, static_in, outs):
            comm.all_reduce(x, out=out, algo=algo)
    checks = 0
    for replay in range(replays):
        inputs = [ref.all_inputs(1000 + replay, ctx.world_size, n, d) for n, d, _ in shapes]
        for x, out, inp in zip(static_in, outs, inputs):
            x.copy_(inp[ctx.rank].to(ctx.device))
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for (n, d, algo), out, inp in zip(shapes, outs, inputs):
            ref.check(out, inp, f"replay {replay} rank {ctx.rank} {algo} {n} {d}")
            checks += 1
    comm.check()
    comm.close()
    return {"checks": checks}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_island_algorithms_in_a_cuda_graph_replayed_with_fresh_inputs(transport: str) -> None:
    results = ranks.run_ranks(_graph, 8, transport, 6, timeout_s=300, env=_islands_env(8, 2))
    assert all(r["checks"] == 48 for r in results)


# W = 8 in four islands of 2: the skipper is in the first island, a middle one, or the last (whose
# ranks finish every shard, or every chain), as an owner of shard 0 or of shard 1 (which carries
# the tail).
@pytest.mark.parametrize("algo", ISLAND_ALGOS)
@pytest.mark.parametrize("skipper", [0, 3, 4, 7])
def test_a_rank_that_skips_an_island_call_makes_every_other_rank_raise(skipper: int, algo: str) -> None:
    results = ranks.run_ranks(skip_one_call, 8, skipper, algo, 4 * 7168 + 3, timeout_s=300,
                              env=_islands_env(8, 2))
    stages = set()
    for rank, r in enumerate(results):
        if rank == skipper:
            continue
        assert r["raised"] is not None, f"rank {rank} did not raise"
        assert r["raised"]["rank"] == rank, r["raised"]["message"]
        assert r["elapsed"] < 15, r
        assert r["all_nan"], f"rank {rank}: the call that timed out left data in its output"
        stages.add(r["raised"]["stage"])
    island_peer = skipper ^ 1
    assert results[island_peer]["raised"]["peer"] == skipper, results[island_peer]["raised"]["message"]
    assert stages <= {"reduce-scatter", "island gather", "island chain", "island result", "all-gather"}, stages


def _without_islands(ctx: ranks.RankContext) -> list[str]:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=1 << 20)
    messages = []
    try:
        assert comm.island_ranks == 0
        for algo in ISLAND_ALGOS:
            with pytest.raises(ValueError, match=algo) as info:
                comm.all_reduce(torch.ones(16, device=ctx.device), algo=algo)
            messages.append(str(info.value))
        return messages
    finally:
        comm.close()


def test_island_algorithms_are_refused_by_name_without_islands() -> None:
    messages = ranks.run_ranks(_without_islands, 2, timeout_s=120, env={topology.ISLANDS_ENV: "0,1"})
    assert all(len(m) == len(ISLAND_ALGOS) and all("islands" in x for x in m) for m in messages)
