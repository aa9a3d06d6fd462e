"""``Communicator.warm_up_fused``: the fused kernels of many call shapes compiled ahead of their first
calls, the work shared out among the ranks, on CPU ranks with a fake extension.

Each rank must compile only its share (every W-th new call shape) before the shapes' compile
meetings, every shape must then be met (and so ready) on every rank, shapes already compiled are
skipped, a share that fails to compile is raised on every rank, and a bad shape is refused before
anything is compiled.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.plan.tables import default_table
from pcie_allreduce.tools import ranks
from tests._creation_fakes import _fake_cuda

SHAPES = [(1, 7168), (4, 7168), (8, 4096), (32, 2050), (128, 8192)]


def _warm_up(ctx: ranks.RankContext, case: str) -> dict[str, Any]:
    from pcie_allreduce.fused import path as fused_path

    _fake_cuda("none", ctx.rank)
    comm = pcie_allreduce.Communicator(ctx.group, "cuda:0", max_bytes=1 << 22, timeout_s=5.0,
                                       algo_table=default_table())
    comm._closed = True  # no CUDA here: skip close()'s synchronize
    comm.device = torch.device("cpu")  # the tensors warm-up makes to describe each shape
    compiled: list[tuple[Any, ...]] = []  # (call shape, whether at its meeting) per compile

    def fake_run(view, plan, x, residual, weight, eps, normed, new_residual, *, compile_only=False, dependent=False):
        assert compile_only and tuple(x.shape) == plan.call[1] and x.dtype == plan.call[2]
        assert weight.dtype == plan.call[3] and normed.shape == x.shape and new_residual.shape == residual.shape
        if case == "share_fails" and ctx.rank == 1 and plan.call[1] == (4, 7168):
            raise RuntimeError("ptxas: out of resources")
        compiled.append((plan.call[1], in_meeting[0]))

    fused_path._run = fake_run
    comm._closed = False
    in_meeting = [False]  # inside a call shape's compile meeting (else: the shared-out compiles before them)
    meet = comm._fused._compile_everywhere

    def compile_everywhere(*args: Any) -> None:
        in_meeting[0] = True
        try:
            meet(*args)
        finally:
            in_meeting[0] = False

    comm._fused._compile_everywhere = compile_everywhere

    def warm_up(shapes: list[tuple[int, int]]) -> int:
        return comm.warm_up_fused(shapes, torch.bfloat16, algo="unfused")

    result: dict[str, Any] = {"error": None}
    try:
        if case == "bad_shape":
            warm_up([(4, 7168), (0, 7168)])
        result["new"] = warm_up(SHAPES)
        result["again"] = warm_up(SHAPES[:2] + [(2, 7168)])
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        result.update(error=type(exc).__name__, message=str(exc))
    comm._closed = True
    result["shared"] = [shape for shape, met in compiled if not met]
    result["at_meetings"] = [shape for shape, met in compiled if met]
    result["ready"] = sorted(call[1] for call in comm._fused._compiled)
    return result


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_compiles_its_share_then_every_shape_is_met(world: int) -> None:
    results = ranks.run_ranks(_warm_up, world, "ok", gpu=False, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["error"] is None, r
        assert r["new"] == len(SHAPES) and r["again"] == 1  # only (2, 7168) was new the second time
        assert r["shared"] == [s for i, s in enumerate(SHAPES) if i % world == rank] + \
            ([(2, 7168)] if rank == 0 else [])
        # each shape's meeting loads it on every rank (from the cache its sharer filled)
        assert r["at_meetings"] == SHAPES + [(2, 7168)]
        assert r["ready"] == sorted(SHAPES + [(2, 7168)])
    assert sorted(s for r in results for s in r["shared"]) == sorted(SHAPES + [(2, 7168)])


def test_a_share_that_fails_to_compile_raises_on_every_rank() -> None:
    results = ranks.run_ranks(_warm_up, 2, "share_fails", gpu=False, timeout_s=120)
    assert [r["error"] for r in results] == ["RuntimeError", "RuntimeError"]
    assert "ptxas: out of resources" in results[1]["message"]
    assert "rank(s) [1]" in results[0]["message"] and "[4, 7168]" in results[0]["message"]
    for r in results:  # the shape before it is ready; the failed one and those after it are not
        assert r["ready"] == [(1, 7168)]


def test_a_bad_shape_is_refused_before_anything_compiles() -> None:
    results = ranks.run_ranks(_warm_up, 2, "bad_shape", gpu=False, timeout_s=120)
    for r in results:
        assert r["error"] == "ValueError" and "(0, 7168)" in r["message"] and "two positive ints" in r["message"]
        assert r["shared"] == [] and r["at_meetings"] == [] and r["ready"] == []
