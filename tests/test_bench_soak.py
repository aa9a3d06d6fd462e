"""Tests of ``python -m bench soak``: options, the schedule, the exact sums, the report, and the
rank loop on CPU ranks with a fake communicator (the CUDA calls it makes stubbed), including a
wrong result and a failed communicator. One GPU test runs a short soak at W=2."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import pcie_allreduce
from pcie_allreduce.tools import ranks
from pcie_allreduce.plan.algorithms import (ALGORITHMS, HOST_ONLY_ALGORITHMS, ISLAND_ALGORITHMS,
                                            SYMMETRIC_INPUT_ALGORITHMS, fits_capacity)
from pcie_allreduce.errors import CollectiveTimeout
from pcie_allreduce.layout import Layout
from pcie_allreduce.plan import fused_shapes as shapes
from pcie_allreduce.sizes import DTYPE_SIZES

from bench import __main__ as bench_cli
from bench import soak, soak_rank
from bench.norm_ops import torch_rmsnorm
from bench.soak_schedule import (
    FUSED_ALIGN, FUSED_HIDDENS, FUSED_SHAPES, LATE_S, MAX_TOKENS, Call, GraphEpisode, Schedule, ScheduleParams,
    buffer_elements, steps, weight_elements,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason()
MAX_BYTES = 2 << 20
PARAMS = ScheduleParams(world=8, max_bytes=MAX_BYTES, ll_capacity=Layout.make(MAX_BYTES, 8).ll_capacity,
                        block_cap=16, graph_every=500)


def _parse(argv: list[str], gpu_count: int = 1) -> soak.SoakConfig:
    args = bench_cli.build_parser().parse_args(["soak", *argv])
    return soak.config_from_args(args, args.parser, gpu_count)


# ---- options ------------------------------------------------------------------------------------


def test_defaults() -> None:
    from pcie_allreduce.rendezvous import DEFAULT_TIMEOUT_S

    cfg = _parse([])
    assert (cfg.world, cfg.calls, cfg.minutes, cfg.seed, cfg.max_bytes) == (8, 1_000_000, 10.0, 0, 2 << 20)
    assert cfg.timeout_s == DEFAULT_TIMEOUT_S and cfg.limit_s == 60 * 40
    assert cfg.out.endswith(os.path.join("bench", "results", "soak"))
    assert _parse([], gpu_count=4).world == 4


def test_explicit_options() -> None:
    cfg = _parse(["--world", "2", "--calls", "2000", "--minutes", "0.5", "--seed", "7", "--max-bytes", "64K",
                  "--timeout-s", "20", "--limit-minutes", "3", "--check-every", "100", "--graph-every", "0",
                  "--progress", "5", "--out", "x"])
    assert cfg == soak.SoakConfig(world=2, calls=2000, minutes=0.5, seed=7, max_bytes=64 << 10, timeout_s=20.0,
                                  limit_minutes=3.0, check_every=100, graph_every=0, progress_s=5.0, out="x")
    assert json.loads(json.dumps(cfg.to_dict()))["max_bytes"] == 64 << 10


@pytest.mark.parametrize("argv, fragment", [
    (["--world", "17"], "--world"), (["--world", "1"], "--world"), (["--calls", "0"], "--calls"),
    (["--minutes", "-1"], "--minutes"), (["--max-bytes", "1K"], "--max-bytes"), (["--max-bytes", "1G"], "--max-bytes"),
    (["--timeout-s", "1"], "--timeout-s"), (["--minutes", "10", "--limit-minutes", "5"], "--limit-minutes"),
])
def test_bad_options_are_usage_errors(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err


def test_help_lists_the_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_cli.main(["--help"])
    assert "soak" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_cli.main(["soak", "--help"])
    assert "--graph-every" in capsys.readouterr().out


# ---- the schedule -------------------------------------------------------------------------------


def test_schedule_is_a_function_of_the_seed() -> None:
    first = steps(11, PARAMS, 5000)
    assert first == steps(11, PARAMS, 5000)  # what every rank draws
    assert first != steps(12, PARAMS, 5000)
    # Drawn step by step as a rank does, the same again.
    schedule, done = Schedule(11, PARAMS), 0
    for step in first:
        assert schedule.next_step(done) == step
        done += step.replayed_calls + len(step.calls) if isinstance(step, GraphEpisode) else 1


def _check_legal(call: Call, params: ScheduleParams) -> None:
    size = DTYPE_SIZES[call.dtype]
    n = buffer_elements(params.max_bytes, call.dtype)
    assert 1 <= call.count and call.nbytes <= params.max_bytes
    for offset in (call.in_offset, call.out_offset, call.res_offset, call.res_out_offset):
        assert 0 <= offset <= n - call.count
    if call.kind == "plain":
        assert call.algo in ("auto", *ALGORITHMS)
        assert fits_capacity(call.algo, call.nbytes, params.ll_capacity)
        return
    assert call.count == call.tokens * call.hidden and 1 <= call.tokens <= MAX_TOKENS
    assert call.hidden in FUSED_HIDDENS and call.dtype in ("bfloat16", "float16")
    assert call.weight_dtype in (call.dtype, "float32") and 0 <= call.w_offset <= weight_elements() - call.hidden
    assert call.algo in ("auto", "oneshot", "twoshot", "oneshot_ll", "oneshot_full", "unfused")
    if call.algo in ("oneshot_ll", "oneshot_full"):
        assert call.tokens * call.hidden * size <= params.ll_capacity
        assert shapes.data_as_flag(call.tokens, call.hidden, params.world, params.block_cap,
                                   full=call.algo == "oneshot_full") is not None


def test_schedule_draws_legal_and_varied_calls() -> None:
    drawn = steps(3, PARAMS, 20000)
    eager = [s for s in drawn if isinstance(s, Call)]
    episodes = [s for s in drawn if isinstance(s, GraphEpisode)]
    for call in eager + [c for e in episodes for c in e.calls]:
        _check_legal(call, PARAMS)
    plain = [c for c in eager if c.kind == "plain"]
    fused = [c for c in eager if c.kind == "fused"]
    # PARAMS: a P2P communicator without islands
    # (the in-place algorithms need the symmetric input area, which the soak's tensors are not in)
    p2p_algos = [a for a in ALGORITHMS if a not in HOST_ONLY_ALGORITHMS + ISLAND_ALGORITHMS + SYMMETRIC_INPUT_ALGORITHMS]
    assert {(c.dtype, c.algo) for c in plain} == {(d, a) for d in DTYPE_SIZES for a in ("auto", *p2p_algos)}
    host = [c for c in steps(3, dataclasses.replace(PARAMS, transport="host"), 5000)
            if isinstance(c, Call) and c.kind == "plain"]
    assert "host_oneshot" in {c.algo for c in host}
    assert {c.algo for c in fused} == {"auto", "oneshot", "twoshot", "oneshot_ll", "oneshot_full", "unfused"}
    assert any(c.count % 2 for c in plain) and any(c.hidden % 2 for c in fused) and any(c.inplace for c in plain)
    assert any(c.in_offset % 2 for c in eager) and any(c.in_offset % 8 == 4 for c in eager)  # misaligned views
    assert any(c.nbytes > PARAMS.ll_capacity for c in plain) and any(c.count < 16 for c in plain)
    # Fused calls: a bounded set of shapes (Triton compiles per shape), all tensors in one alignment class.
    assert len({(c.tokens, c.hidden, c.dtype, c.weight_dtype) for c in fused}) <= FUSED_SHAPES
    assert (4, 7168) in {(c.tokens, c.hidden) for c in fused}
    for c in fused:
        classes = {o % FUSED_ALIGN for o in (c.in_offset, c.out_offset, c.res_offset, c.res_out_offset, c.w_offset)}
        assert classes in ({0}, {1})
    assert {c.in_offset % FUSED_ALIGN for c in fused} == {0, 1}
    late = [c.straggler for c in eager if c.straggler]
    assert any(s.host_s and s.host_s < 0.1 for s in late) and any(s.stream_s for s in late)
    assert all(0 <= s.rank < PARAMS.world and s.host_s <= max(LATE_S) and s.stream_s <= 5e-3 for s in late)
    assert 30 <= len(episodes) <= 50  # about every 500 calls
    for e in episodes:
        assert 3 <= len(e.calls) <= 6 and 3 <= len(e.replays) <= 6
        assert all(len(r.in_offsets) == len(r.res_offsets) == len(e.calls) for r in e.replays)
        assert all(c.straggler is None for c in e.calls)


def test_warmup_issues_every_fused_kernel_variant_once() -> None:
    """Before the clock: each fused shape with each kernel it may take, aligned and one element
    off, the same list on every rank, and without changing the schedule that follows."""
    from bench.soak_schedule import FUSED_ALIGN, Schedule, steps

    first, second = Schedule(11, PARAMS), Schedule(11, PARAMS)
    warmup = first.warmup_calls()
    assert warmup == second.warmup_calls()
    variants = {(c.tokens, c.hidden, c.dtype, c.weight_dtype, c.algo, c.in_offset % FUSED_ALIGN) for c in warmup}
    assert len(variants) == len(warmup), "a variant twice"
    shapes = {(c.tokens, c.hidden, c.dtype, c.weight_dtype) for c in warmup}
    assert shapes == set(first.fused_shapes)
    assert {c.algo for c in warmup} >= {"oneshot", "twoshot"} and "auto" not in {c.algo for c in warmup}
    assert {c.in_offset % FUSED_ALIGN for c in warmup} == {0, 1}
    drawn = [first.next_step(i) for i in range(50)]
    assert drawn == steps(11, PARAMS, 50)[:50], "the warm-up changed the schedule"


def test_schedule_late_rank_rate() -> None:
    params = dataclasses.replace(PARAMS, late_rate=1 / 1000, graph_every=0)
    late = [s for s in steps(5, params, 20000) if s.straggler and s.straggler.host_s >= min(LATE_S)]
    assert 5 <= len(late) <= 40


# ---- exact sums -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 8])
def test_exact_sum_formula(world: int) -> None:
    per_rank, total = soak_rank.exact_inputs(50_000, world, soak_rank.dtype_seed(5, "bfloat16"))
    assert len(per_rank) == world and total.dtype == torch.int64
    assert torch.equal(total.double(), torch.stack([v.double() for v in per_rank]).sum(0))
    assert int(total.abs().max()) <= 7 * world and len(set(per_rank[0][:100].tolist())) > 5
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # every value exact in every dtype
        for values in (*per_rank, total):
            assert torch.equal(values.to(dtype).to(torch.int64), values)
    # Each rank computes every rank's inputs from the formula: the same on every rank.
    assert torch.equal(soak_rank.exact_inputs(100, world, 9)[1], soak_rank.exact_inputs(100, world, 9)[1])
    assert soak_rank.dtype_seed(5, "bfloat16") != soak_rank.dtype_seed(5, "float16")


# ---- report ----------------------------------------------------------------------------------------


def _rank_result(rank: int, **kw: Any) -> dict[str, Any]:
    base = {"rank": rank, "calls": 2000, "plain": 1500, "fused": 500, "in_graphs": 40, "graphs": 2,
            "stragglers": 9, "elapsed_s": 31.0, "wrong": 0, "wrong_calls": [],
            "counts": {"plain bfloat16 oneshot": 1500, "fused float16 auto(oneshot)": 500}}
    return {**base, **kw}


def test_summary_and_exit_status() -> None:
    cfg = soak.SoakConfig(world=2, calls=2000, minutes=0.5)
    summary = soak.summarize(cfg, [_rank_result(0), _rank_result(1)])
    assert (summary["calls"], summary["wrong"], summary["hung"], summary["targets_met"]) == (2000, 0, 0, True)
    text = soak.format_summary(summary)
    assert text.startswith("soak: W=2 calls=2000 (plain 1500, fused 500, in graphs 40) calls/s=65 wrong=0 hung=0 "
                           "elapsed=31 s\n")
    assert "fused float16 auto(oneshot)" in text and soak.exit_status(summary) == 0
    short = soak.summarize(dataclasses.replace(cfg, calls=3000), [_rank_result(0), _rank_result(1)])
    assert soak.exit_status(short) == 1 and "not met" in soak.format_summary(short)
    bad = soak.summarize(cfg, [_rank_result(0), _rank_result(1, wrong=3, wrong_calls=["rank 1: 3 wrong elements"])])
    assert bad["wrong"] == 3 and soak.exit_status(bad) == 1 and "# wrong: rank 1" in soak.format_summary(bad)
    hung = soak.summarize(cfg, [_rank_result(0, calls=1000, failure="hung", error="CollectiveTimeout: late"),
                                _rank_result(1, calls=1800, failure="hung", error="CollectiveTimeout: x")])
    assert hung["hung"] == 2 and soak.exit_status(hung) == 1 and len(hung["errors"]) == 2  # no "disagree" noise
    died = soak.summarize(cfg, [], failure="rank 1 was killed by SIGSEGV")
    assert soak.exit_status(died) == 1 and died["errors"] == ["rank 1 was killed by SIGSEGV"]


# ---- the rank loop on CPU ranks ----------------------------------------------------------------------

_CAPTURING: list[Any] | None = None  # the calls a fake capture records, in a CPU rank


class FakeGraph:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def replay(self) -> None:
        for call in self.calls:
            call()


@contextlib.contextmanager
def fake_graph(graph: FakeGraph, stream: Any = None) -> Any:
    global _CAPTURING
    _CAPTURING = graph.calls
    try:
        yield
    finally:
        _CAPTURING = None


class FakeStream:
    def wait_stream(self, other: Any) -> None:
        pass


class FakeComm:
    """The part of Communicator the soak uses, on gloo, with scripted faults: ``("wrong", rank, k)``
    rank corrupts call k's output; ``("timeout", rank, k)``: rank raises at call k, the other ranks'
    call k gives up (NaN) and their next call or check() raises, as the real kernels do."""

    max_bytes = 1 << 16
    ll_capacity = Layout.make(1 << 16, 2).ll_capacity
    block_cap = 4
    timeout_s = 10.0

    def __init__(self, ctx: ranks.RankContext, fault: tuple[str, int, int] | None) -> None:
        self.ctx, self.fault, self.calls, self.failed = ctx, fault, 0, False

    def _begin(self) -> bool:
        """Count the call; False when it gives up (fills NaN) instead of communicating."""
        if self.failed:
            raise CollectiveTimeout("rank waited too long", rank=self.ctx.rank, peer=1)
        self.calls += 1
        if self.fault and self.fault[0] == "timeout" and self.calls == self.fault[2]:
            if self.ctx.rank == self.fault[1]:
                raise CollectiveTimeout("the stuck rank", rank=self.ctx.rank, peer=0)
            self.failed = True
            return False
        return True

    def _sum(self, x: torch.Tensor, out: torch.Tensor, corrupt: bool) -> None:
        total = x.float().clone()
        dist.all_reduce(total, group=self.ctx.group)
        out.copy_(total)
        if corrupt:
            out.view(-1)[0] += 1

    def _corrupt(self) -> bool:
        return bool(self.fault and self.fault[0] == "wrong" and self.fault[1:] == (self.ctx.rank, self.calls))

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor, algo: str = "auto") -> torch.Tensor:
        def run() -> None:
            if self._begin():
                self._sum(x, out, self._corrupt())
            else:
                out.fill_(float("nan"))

        _CAPTURING.append(run) if _CAPTURING is not None else run()
        return out

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                           out: torch.Tensor, residual_out: torch.Tensor, algo: str = "auto") -> tuple:
        def run() -> None:
            if not self._begin():
                out.fill_(float("nan"))
                return
            y = torch.empty_like(x)
            self._sum(x, y, self._corrupt())
            torch.add(residual, y, out=residual_out)
            out.copy_(torch_rmsnorm(residual_out, weight, eps))

        _CAPTURING.append(run) if _CAPTURING is not None else run()
        return out, residual_out

    def select_algo(self, nbytes: int, dtype: torch.dtype) -> str:
        return "oneshot"

    def select_fused_algo(self, tokens: int, hidden: int, dtype: torch.dtype) -> str:
        return "twoshot"

    def prepare_stream(self, stream: int | None = None) -> None:
        pass

    def check(self) -> None:
        if self.failed:
            raise CollectiveTimeout("rank waited too long", rank=self.ctx.rank, peer=1)

    def close(self) -> None:
        pass


def cpu_soak_rank(ctx: ranks.RankContext, cfg: soak.SoakConfig, fault: tuple[str, int, int] | None) -> dict:
    """soak_rank in a CPU rank: the CUDA calls stubbed, the communicator a :class:`FakeComm`."""
    from bench import environment

    torch.cuda.Stream = lambda *a, **k: FakeStream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: FakeStream()
    torch.cuda._sleep = lambda cycles: None
    torch.cuda.CUDAGraph = FakeGraph
    torch.cuda.graph = fake_graph
    environment.rank_environment = lambda c: {"mps": False, "shared_gpu": True}
    soak_rank.make_communicator = lambda c, conf: FakeComm(c, fault)
    return soak_rank.soak_rank(ctx, cfg)


CPU_CFG = soak.SoakConfig(world=2, calls=600, minutes=0.001, seed=4, max_bytes=1 << 16, check_every=50,
                          graph_every=150, progress_s=0.5)


def _run_cpu(fault: tuple[str, int, int] | None = None, cfg: soak.SoakConfig = CPU_CFG) -> dict[str, Any]:
    results = ranks.run_ranks(cpu_soak_rank, cfg.world, cfg, fault, gpu=False, timeout_s=240)
    return soak.summarize(cfg, results)


def test_rank_loop_on_cpu_ranks() -> None:
    summary = _run_cpu()
    assert summary["wrong"] == 0 and summary["hung"] == 0 and not summary["errors"], summary
    assert summary["targets_met"] and summary["calls"] >= 600 and summary["calls"] % 50 < 50
    assert summary["graphs"] >= 2 and 0 < summary["in_graphs"] < summary["calls"]
    assert summary["plain"] + summary["fused"] == summary["calls"] and summary["fused"] > 0
    assert sum(summary["counts"].values()) == summary["calls"] and "plain float32 auto(oneshot)" in summary["counts"]
    assert soak.exit_status(summary) == 0


def test_rank_loop_counts_a_wrong_result() -> None:
    summary = _run_cpu(("wrong", 1, 77))
    assert summary["wrong"] >= 1 and summary["hung"] == 0 and soak.exit_status(summary) == 1
    assert summary["wrong_calls"] and summary["wrong_calls"][0].startswith("rank 1: ")


def test_rank_loop_stops_every_rank_when_a_communicator_fails() -> None:
    summary = _run_cpu(("timeout", 1, 120))
    assert summary["hung"] == 2 and summary["wrong"] == 0 and soak.exit_status(summary) == 1
    assert summary["calls"] < 600 and all("CollectiveTimeout" in e for e in summary["errors"])


def test_command_writes_the_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from bench import environment

    real_run_ranks = ranks.run_ranks

    def cpu_run_ranks(fn: Any, world: int, cfg: soak.SoakConfig, **kw: Any) -> Any:
        cfg = dataclasses.replace(cfg, check_every=50, graph_every=150)
        return real_run_ranks(cpu_soak_rank, world, cfg, None, gpu=False, timeout_s=240)

    monkeypatch.setattr(soak, "unavailable_reason", lambda: None)
    monkeypatch.setattr(ranks, "run_ranks", cpu_run_ranks)
    monkeypatch.setattr(environment, "host_environment", lambda: {"gpus": []})
    status = bench_cli.main(["soak", "--world", "2", "--calls", "300", "--minutes", "0.001", "--max-bytes", "64K",
                             "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0 and out.startswith("soak: W=2 calls=") and " wrong=0 hung=0 " in out
    document = json.loads((tmp_path / soak.JSON_NAME).read_text())
    assert document["summary"]["wrong"] == 0 and document["config"]["world"] == 2
    assert document["environment"]["placements"]["2"].startswith("emulation: 2 ranks on one GPU")
    assert (tmp_path / soak.TEXT_NAME).read_text() == out


# ---- without a GPU, and with one ---------------------------------------------------------------------


@pytest.mark.skipif(not NO_GPU, reason="this machine can run the soak")
def test_soak_without_gpu_exits_with_one_line(tmp_path: Any) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "soak", "--minutes", "0.5", "--calls", "2000",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m bench soak: cannot run here: "), proc.stderr
    assert proc.stdout == "" and not os.listdir(tmp_path)


@pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
def test_short_soak_on_gpu(tmp_path: Any) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "soak", "--world", "2", "--minutes", "0.2", "--calls", "500",
                           "--graph-every", "200", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    summary = json.loads((tmp_path / soak.JSON_NAME).read_text())["summary"]
    assert summary["wrong"] == 0 and summary["hung"] == 0 and not summary["errors"], proc.stdout + proc.stderr
    assert summary["graphs"] >= 1 and summary["calls"] >= 500
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_transport_reaches_the_communicator() -> None:
    assert _parse([]).transport == "auto" and _parse(["--transport", "host"]).transport == "host"
    with pytest.raises(SystemExit):
        _parse(["--transport", "nvlink"])


def test_summary_lists_each_fused_variant_compile_time_of_the_slowest_rank() -> None:
    cfg = soak.SoakConfig(world=2, calls=2000, minutes=0.5)
    variant, other = "oneshot [4, 7168] torch.bfloat16 (weight torch.bfloat16)", "twoshot [1, 96] torch.float16 (weight x)"
    results = [_rank_result(0, warmup={"calls": 2, "seconds": 9.0, "compile_s": {variant: 1.5, other: 0.4}}),
               _rank_result(1, warmup={"calls": 2, "seconds": 9.5, "compile_s": {variant: 2.25, other: 12.0}})]
    text = soak.format_summary(soak.summarize(cfg, results))
    assert "2 variants, longest 12.0 s (over 10.0 s)" in text
    assert f"compile {variant}" in text and "2.25 s" in text and "1.50 s" not in text
