"""``python -m bench.norm_loop``: its check of each kernel against fp64, its options, and its run."""

from __future__ import annotations

import pytest
import torch

from bench import norm_loop
from pcie_allreduce.tools import ranks


def _inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = (4 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    return y, residual, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 7168), (3, 1000), (5, 4095)])
def test_the_check_takes_a_correct_result_and_refuses_a_wrong_one(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    y, residual, weight = _inputs(tokens, hidden, dtype, seed=tokens * hidden)
    want_normed, want_residual = norm_loop.reference(y, residual, weight)
    # a result computed the way the kernels compute it: fp32 math, rounded once
    new_residual = (residual.float() + y.float()).to(dtype)
    assert torch.equal(new_residual, want_residual)
    v = new_residual.float()
    normed = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm_loop.EPS) * weight.float()).to(dtype)
    assert norm_loop.close_enough(normed, want_normed)
    for wrong in (normed * 1.05, torch.full_like(normed, float("nan")), new_residual.to(dtype)):
        assert not norm_loop.close_enough(wrong, want_normed)
    off_by_one_row = normed.clone()
    off_by_one_row[-1, hidden // 2] += 0.5 * want_normed[-1].abs().max().to(dtype)
    assert not norm_loop.close_enough(off_by_one_row, want_normed)


def test_other_libraries_kernels_are_left_out_with_their_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import MappingProxyType

    from bench import norm_ops

    monkeypatch.setattr(norm_ops, "ONE_KERNELS", MappingProxyType(
        {**norm_ops.ONE_KERNELS, "+nowhere": ("no_such_module_for_norm_loop", "f")}))
    monkeypatch.setattr(norm_ops, "IN_PLACE_KERNELS", norm_ops.IN_PLACE_KERNELS | {"+nowhere"})
    found, missing = norm_ops.in_place_kernels()
    assert "nowhere" not in found and "no_such_module_for_norm_loop" in missing["nowhere"]
    assert set(found) | set(missing) == {s.lstrip("+") for s in norm_ops.IN_PLACE_KERNELS}
    assert "addnorm" not in set(found) | set(missing), "ours is the 'ours' row, not another library's"


def test_options_and_the_exit_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        norm_loop.main(["--warps", "3"])
    assert "--warps" in capsys.readouterr().err
    if ranks.skip_reason_no_gpu() is None:
        pytest.skip("a GPU is present: the no-GPU exit is not reachable here")
    assert norm_loop.main(["--tokens", "1", "4", "--hidden", "7168", "--warps", "16"]) == 3
    assert "python -m bench.norm_loop:" in capsys.readouterr().err


def test_every_kernel_checks_out_and_is_timed_on_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    reason = ranks.skip_reason_no_gpu()
    if reason is not None:
        pytest.skip(reason)
    assert norm_loop.main(["--tokens", "1", "5", "--hidden", "1000", "7168", "--warps", "4", "16"]) == 0
    out = capsys.readouterr().out
    assert "wrong" not in out and "ours_w16" in out
    assert len([line for line in out.splitlines() if line and not line.startswith(("#", "    H"))]) >= 4


def test_the_graph_timing_captures_the_calls_once_and_replays_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """time_in_graph (shared with bench.graph_loop) with torch.cuda's graph and events faked: 3
    eager calls, CALLS_PER_GRAPH captured ones, ``before_each`` once per repetition, and the best
    repetition divided by the calls it replayed."""
    import contextlib

    from bench import graph_loop

    log: list[str] = []
    elapsed_ms = iter([9.0, 4.0, 6.0])

    class Graph:
        def replay(self) -> None:
            log.append("replay")

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other: "Event") -> float:
            return next(elapsed_ms)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    us = graph_loop.time_in_graph(lambda: log.append("call"), lambda: log.append("before"))
    calls = graph_loop.CALLS_PER_GRAPH
    assert log.count("call") == 3 + calls
    assert log.count("before") == graph_loop.REPETITIONS
    assert log.count("replay") == 1 + graph_loop.REPETITIONS * graph_loop.REPLAYS
    assert us == pytest.approx(4.0 * 1e3 / (calls * graph_loop.REPLAYS))
    # with untimed replays: all of them before the first repetition, the timing the same
    log.clear()
    elapsed_ms = iter([9.0, 4.0, 6.0])
    us = graph_loop.time_in_graph(lambda: log.append("call"), lambda: log.append("before"), warm_replays=5)
    assert log.count("replay") == 1 + 5 + graph_loop.REPETITIONS * graph_loop.REPLAYS
    assert log[:log.index("before")].count("replay") == 1 + 5
    assert us == pytest.approx(4.0 * 1e3 / (calls * graph_loop.REPLAYS))
