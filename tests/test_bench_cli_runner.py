"""CPU tests of ``python -m bench``'s machinery that survives failing or hanging backends.

The rank-side statistics (the slowest rank per replay), the merge of the ranks' outcomes and the
input pattern whose sums are exact in any order; the backends registry; the runner (events to
rows, failures described, restarts after a hang keeping partial results, sweeps that skip
unavailable backends or stop on Ctrl-C); the rank loop on CPU ranks with a fake gloo "backend" and
the CUDA calls it makes stubbed out, through wrong, raising and hanging cases; and the watchdog.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from pcie_allreduce.tools import ranks, timing

from bench import backends, options, outcome, pattern, progress, report, runner, watchdog
from bench.backends import Buffers
from bench.plan import make_cases
from bench.results import FAILED, NOT_RUN, OK, WRONG, Report, Result

from tests import _bench_fakes
from tests._bench_fakes import QuietBackendHooks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- stats, outcomes, pattern


def test_summarize_takes_the_slowest_rank_per_replay() -> None:
    t = timing.summarize([[10.0, 20.0, 30.0], [40.0, 10.0, 30.0]], calls_per_block=10)
    assert t.replays == 3
    assert t.p50_us == pytest.approx(3.0)  # per replay max: 40, 20, 30 -> /10
    assert t.min_us == pytest.approx(2.0) and t.rank0_p50_us == pytest.approx(2.0)
    with pytest.raises(ValueError):
        timing.summarize([[1.0], [1.0, 2.0]], 1)


def test_merge_outcomes() -> None:
    ok = [outcome.rank_outcome(r, OK, times=[16.0, 32.0], resolved="oneshot") for r in range(2)]
    merged = outcome.merge(ok, 16)
    assert merged["status"] == OK and merged["replays"] == 2 and merged["p50_us"] == pytest.approx(1.5)
    assert merged["resolved_algo"] == "oneshot"
    mixed = [outcome.rank_outcome(0, WRONG, error="bad sum"), outcome.rank_outcome(1, FAILED, error="boom")]
    merged = outcome.merge(mixed, 16)
    assert merged["status"] == FAILED and merged["error"] == "rank 1: boom" and "p50_us" not in merged
    assert outcome.one_line(RuntimeError("a\n  b")) == "RuntimeError: a b"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pattern_sums_are_exact_in_any_order(dtype: torch.dtype) -> None:
    count, world = 10_000, 8
    inputs = [pattern.rank_input(count, r, 3, dtype) for r in range(world)]
    expected = pattern.expected_sum(count, world, 3, dtype)
    forward = inputs[0].clone()
    for x in inputs[1:]:
        forward += x  # accumulate in the dtype itself: exact, because values are small integers
    backward = inputs[-1].clone()
    for x in reversed(inputs[:-1]):
        backward += x
    assert pattern.mismatch(forward, expected) is None and pattern.mismatch(backward, expected) is None
    assert not torch.equal(inputs[0], inputs[1])  # ranks differ
    # A missing rank, a doubled rank or a shifted chunk is caught.
    assert pattern.mismatch(expected - inputs[5], expected) is not None
    assert pattern.mismatch(expected + inputs[0], expected) is not None
    assert pattern.mismatch(torch.roll(expected, 8), expected) is not None
    nan = expected.clone()
    nan[7] = float("nan")
    assert "1 of 10000" in pattern.mismatch(nan, expected)


# ----------------------------------------------------------------------------- backends registry


def test_backend_registry() -> None:
    assert backends.algos_for("ours", ("oneshot", "auto")) == ("oneshot", "auto")
    assert backends.algos_for("torch_symm", ("oneshot",)) == ("one_shot", "two_shot")
    assert backends.algos_for("nccl", ()) == ("default",)
    assert "NCCL refuses two ranks on one GPU" in backends.skip_reason("nccl", 4, 1)
    assert backends.rank_env("torch_symm", 4, 1) == {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    assert backends.rank_env("torch_symm", 4, 4) == {} and backends.rank_env("ours", 4, 1) == {}
    if torch.version.cuda is None:
        assert "without CUDA" in backends.skip_reason("torch_symm", 2, 1)
    with pytest.raises(ValueError):
        backends.algos_for("mpi", ())


def test_every_backend_implements_the_rank_interface() -> None:
    import importlib

    wanted = {name for name in vars(backends.RankBackend) if not name.startswith("_")}
    for module, cls in (("backend_ours", "OursBackend"), ("backend_torch_symm", "TorchSymmBackend"),
                        ("backend_nccl", "NcclBackend"),
                        ("norm_ops", "NormAdapter")):
        klass = getattr(importlib.import_module(f"bench.{module}"), cls)
        assert wanted <= set(dir(klass)), (cls, wanted - set(dir(klass)))
    assert {"buffers", "call", "check", "close", "device_sync"} <= wanted
    importlib.import_module("bench.timing")
    importlib.import_module("bench.rank")


def test_make_cases_size_major() -> None:
    cases = make_cases([1024, 4096], ["oneshot", "auto"], "float32")
    assert [(c.index, c.size_bytes, c.count, c.algo) for c in cases] == [
        (0, 1024, 256, "oneshot"), (1, 1024, 256, "auto"), (2, 4096, 1024, "oneshot"), (3, 4096, 1024, "auto")]


# ----------------------------------------------------------------------------- runner pieces


def test_ranks_start_with_third_party_chatter_quieted_unless_the_user_set_it(monkeypatch, tmp_path) -> None:
    """FlashInfer's INFO logs and progress bars would bury the rows: every backend's ranks start with
    them off, a variable the user set keeps its value, and a backend's own variables still apply."""
    seen: list[dict] = []
    monkeypatch.setattr(ranks, "run_ranks", lambda *a, env=None, **kw: seen.append(dict(env)))
    monkeypatch.delenv("FLASHINFER_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("TQDM_DISABLE", "0")
    cases = make_cases([1024], ["one_shot"], "bfloat16")
    cfg = options.BenchConfig(worlds=(4,), sizes=(1024,), backends=("torch_symm",))
    assert runner._launch(cfg, "torch_symm", 4, 1, cases, str(tmp_path), lambda line: None, runner.NoProgress()) is None
    assert seen == [{"FLASHINFER_LOGGING_LEVEL": "WARNING", "TQDM_DISABLE": "0",
                     "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}]
    assert backends.quiet_env() == {"FLASHINFER_LOGGING_LEVEL": "WARNING", "TQDM_DISABLE": "0"}


def _cfg(**kw) -> options.BenchConfig:
    return options.BenchConfig(worlds=(2,), sizes=(1024, 4096), **kw)


def test_rows_from_events_and_unfinished_case() -> None:
    cases = make_cases([1024, 4096], ["a", "b"], "bfloat16")
    events = [{"event": "setup", "mps": True}, {"event": "start", "index": 0},
              {"event": "done", "index": 0, "status": OK, "p50_us": 2.0, "p99_us": 3.0, "rank0_p50_us": 2.0,
               "min_us": 1.7, "replays": 40, "resolved_algo": "a"},
              {"event": "start", "index": 1}]
    rows = runner.rows_from_events(events, cases, _cfg(), 2, "ours")
    assert list(rows) == [0] and rows[0].p50_us == 2.0 and rows[0].replays == 40 and rows[0].world == 2
    assert rows[0].min_us == 1.7  # the fastest replay, kept beside the p50
    assert Result.from_dict(rows[0].to_dict()).min_us == 1.7
    assert runner.unfinished_case(events) == 1
    assert runner.unfinished_case(events[:3]) is None


def test_describe_failure() -> None:
    exc = ranks.RankFailed("rank 1 raised an exception\n\n--- rank 1 ---\n...",
                             {1: "Traceback (most recent call last):\n  ...\nValueError: bad thing\n"})
    f = runner.describe_failure(exc, None)
    assert f.reason == "rank 1 raised an exception: ValueError: bad thing" and "rank 1 raised" in f.detail
    hang = ([3, 5], {"phase": "case", "seconds": 30, "size_bytes": 1024, "algo": "one_shot"}, "Thread 0x1 ...")
    f = runner.describe_failure(exc, hang)
    assert f.reason == ("hung: ranks 3, 5 made no progress for 30 s in case 1024 B / one_shot "
                        "(killed by the bench watchdog)")
    assert "Thread 0x1" in f.detail
    assert runner.describe_failure(OSError("no\nspace"), None).reason == "OSError: no space"


def _fake_launch_factory(script: list[tuple[list[dict], runner.Failure | None]]):
    """A stand-in for runner._launch that replays scripted events and failures, one per attempt."""
    calls = []

    def launch(cfg, backend, world, gpu_count, cases, directory, echo, bar):
        events, failure = script[len(calls)]
        calls.append([c.index for c in cases])
        log = progress.ProgressLog(directory)
        for ev in events:
            log.write(ev.pop("event"), **ev)
        log.close()
        return failure

    return launch, calls


def _done(index: int, status: str = OK, **kw) -> dict:
    return {"event": "done", "index": index, "status": status, "p50_us": 1.0 if status == OK else None, **kw}


def test_run_backend_restarts_after_a_hang_and_keeps_partial_results(monkeypatch) -> None:
    hang = runner.Failure("hung: rank 1 made no progress for 5 s in case 1024 B / staged (killed ...)")
    launch, calls = _fake_launch_factory([
        ([{"event": "setup", "mps": True}, {"event": "start", "index": 0}, _done(0),
          {"event": "start", "index": 1}], hang),
        ([{"event": "setup", "mps": True}, {"event": "start", "index": 2}, _done(2, FAILED, error="rank 0: boom")],
         None),
    ])
    monkeypatch.setattr(runner, "_launch", launch)
    lines: list[str] = []
    out = runner.run_backend(_cfg(algos=("oneshot", "staged"), retries=1), "ours", 2, 1, lines.append)
    assert calls == [[0, 1, 2, 3], [2, 3]]
    assert [r.status for r in out.results] == [OK, FAILED, FAILED, NOT_RUN]
    assert out.results[1].error == hang.reason
    assert out.results[3].error == "not run: rank 0: boom"
    assert out.facts == {"event": "setup", "mps": True}
    assert [n.kind for n in out.notes] == ["failed"] and len(lines) == 2


def test_a_backends_tuning_is_printed_under_its_rows_once(monkeypatch) -> None:
    tuned = "workspace.tune: 2 shapes of 2 sizes in 3.1 s"
    hang = runner.Failure("hung: rank 1 made no progress for 5 s in case 4096 B / pcie_ipc (killed ...)")
    launch, calls = _fake_launch_factory([
        ([{"event": "setup", "baseline_tuning": tuned}, {"event": "start", "index": 0}, _done(0),
          {"event": "start", "index": 1}], hang),
        ([{"event": "setup", "baseline_tuning": tuned}, _done(1)], None),
    ])
    monkeypatch.setattr(runner, "_launch", launch)
    out = runner.run_backend(_cfg(retries=1), "flashinfer", 2, 1, lambda _: None)
    assert [(n.kind, n.reason) for n in out.notes] == [("tuning", tuned), ("failed", hang.reason)]
    text = report.format_world(Report({}, {}, {2: "two GPUs"}, out.results, out.notes), 2)
    assert f"# tuning: flashinfer: {tuned}" in text.splitlines()


def test_untuned_baselines_flag() -> None:
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    assert options.common_fields(parser.parse_args([]), 1)["tune_baselines"] is True
    assert options.common_fields(parser.parse_args(["--untuned-baselines"]), 1)["tune_baselines"] is False
    cfg = _cfg(tune_baselines=False)
    assert runner.make_job(cfg, "flashinfer", (), "/tmp/x").tune_baselines is False


def test_run_backend_setup_failure_is_not_retried(monkeypatch) -> None:
    launch, calls = _fake_launch_factory([([], runner.Failure("rank 0 raised an exception: RuntimeError: no P2P"))])
    monkeypatch.setattr(runner, "_launch", launch)
    out = runner.run_backend(_cfg(algos=("oneshot",), retries=3), "ours", 2, 1, lambda _: None)
    assert len(calls) == 1
    assert {r.status for r in out.results} == {NOT_RUN}
    assert out.notes[0].reason.endswith("no P2P") and out.facts is None


def test_a_baseline_whose_tuning_hangs_runs_untuned_on_the_restart(monkeypatch) -> None:
    """A library's own tuner that hangs (the watchdog's "tuning" phase) costs one restart, which
    runs the library with its shipped launch configurations: its rows are there, untuned, and
    the notes say both what hung and how it then ran."""
    hang = runner.describe_failure(
        ranks.RankFailed("rank 0 was killed", {}),
        ([0, 1], {"phase": "tuning", "seconds": 270.0}, "Thread 0x1 ..."))
    assert hang.phase == "tuning" and "in tuning" in hang.reason
    untuned = "untuned: seed launch configurations"
    tuned_flags: list[bool] = []
    launch, calls = _fake_launch_factory([
        ([], hang),
        ([{"event": "setup", "baseline_tuning": untuned}, _done(0), _done(1)], None),
    ])

    def recording_launch(cfg, *args):
        tuned_flags.append(cfg.tune_baselines)
        return launch(cfg, *args)

    monkeypatch.setattr(runner, "_launch", recording_launch)
    out = runner.run_backend(_cfg(retries=1), "flashinfer", 2, 1, lambda _: None)
    assert tuned_flags == [True, False] and calls == [[0, 1], [0, 1]]
    assert [r.status for r in out.results] == [OK, OK]
    assert [(n.kind, n.reason) for n in out.notes] == [("failed", hang.reason), ("tuning", untuned)]

    # Without a restart left the cases stay not run and say why; a hang in the set-up proper is not retried.
    launch, calls = _fake_launch_factory([([], hang)])
    monkeypatch.setattr(runner, "_launch", launch)
    out = runner.run_backend(_cfg(retries=0), "flashinfer", 2, 1, lambda _: None)
    assert len(calls) == 1 and {r.status for r in out.results} == {NOT_RUN}
    assert all(r.error == f"not run: {hang.reason}" for r in out.results)
    case_hang = runner.Failure("hung: rank 1 made no progress for 5 s in setup (killed ...)", phase="setup")
    launch, calls = _fake_launch_factory([([], case_hang), ([], None)])
    monkeypatch.setattr(runner, "_launch", launch)
    runner.run_backend(_cfg(retries=3), "flashinfer", 2, 1, lambda _: None)
    assert len(calls) == 1, "a set-up that hangs is not retried"


def test_run_sweep_skips_unavailable_backends(monkeypatch) -> None:
    launch, _ = _fake_launch_factory([([{"event": "setup", "mps": True}, *map(_done, range(4))], None)])
    monkeypatch.setattr(runner, "_launch", launch)
    monkeypatch.setattr(backends, "skip_reason", lambda b, w, g: None if b == "torch_symm" else f"no {b} here")
    rep = runner.run_sweep(_cfg(backends=("ours", "torch_symm", "nccl")), 1, {"gpus": []}, lambda _: None)
    assert [(n.backend, n.kind) for n in rep.notes] == [("ours", "skipped"), ("nccl", "skipped")]
    assert [r.backend for r in rep.results] == ["torch_symm"] * 4
    assert rep.placements == {2: "emulation: 2 ranks on one GPU under MPS"}
    assert rep.environment["ranks"]["2"] == {"mps": True}


def test_run_sweep_keeps_finished_runs_on_ctrl_c(monkeypatch) -> None:
    script = [([{"event": "setup", "mps": True}, *map(_done, range(2))], None)]
    launch, calls = _fake_launch_factory(script)

    def launch_then_interrupt(*args, **kw):
        if calls:
            raise KeyboardInterrupt
        return launch(*args, **kw)

    monkeypatch.setattr(runner, "_launch", launch_then_interrupt)
    monkeypatch.setattr(backends, "skip_reason", lambda b, w, g: None)
    cfg = options.BenchConfig(worlds=(2, 4), sizes=(1024,), algos=("oneshot", "auto"), backends=("ours", "torch_symm"))
    rep = runner.run_sweep(cfg, 1, {}, lambda _: None)
    assert rep.environment["interrupted"] is True
    assert [(r.world, r.backend, r.status) for r in rep.results] == [(2, "ours", OK), (2, "ours", OK)]
    assert list(rep.placements) == [2]


# ----------------------------------------------------------------------------- rank loop on CPU


class _GlooBackend(QuietBackendHooks):
    """A CPU "backend": gloo all_reduce. Algo names script failures: wrong / raise / hang."""

    def __init__(self, ctx: ranks.RankContext, job: object) -> None:
        self.ctx = ctx

    def buffers(self, count: int, dtype: torch.dtype, algo: str) -> Buffers:
        inp = torch.empty(count, dtype=dtype)
        return Buffers(inp, torch.empty_like(inp))

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        if algo == "hang" and self.ctx.rank == 1:
            time.sleep(600)
        if algo == "raise":
            raise RuntimeError("scripted\nfailure")
        bufs.out.copy_(bufs.inp)
        dist.all_reduce(bufs.out, group=self.ctx.group)
        if algo == "wrong" and self.ctx.rank == 1:
            bufs.out[3] += 1
        return bufs.out

    def mutates_input(self, algo: str) -> bool:
        return False

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return algo



def test_rank_loop_on_cpu_survives_wrong_raising_and_hanging_cases(monkeypatch) -> None:
    _bench_fakes.use_cpu_ranks(monkeypatch, _GlooBackend)
    monkeypatch.setattr(backends, "algos_for", lambda b, a: ("ok", "wrong", "raise", "hang", "ok2"))
    cfg = options.BenchConfig(worlds=(2,), sizes=(1024,), backends=("ours",), eager=True, iters=5, warmup=1,
                              calls_per_graph=2, case_timeout_s=3.0, setup_timeout_s=60.0, retries=2)
    rep = runner.run_sweep(cfg, 1, {"gpus": []}, lambda _: None)
    by_algo = {r.algo: r for r in rep.results}
    assert by_algo["ok"].status == OK and by_algo["ok"].replays == 5 and by_algo["ok"].p50_us > 0
    assert by_algo["wrong"].status == WRONG and "rank 1: 1 of 512 elements wrong" in by_algo["wrong"].error
    assert by_algo["raise"].status == FAILED and by_algo["raise"].error == "rank 0: RuntimeError: scripted failure"
    assert by_algo["hang"].status == FAILED and by_algo["hang"].error.startswith("hung: rank")
    assert by_algo["ok2"].status == OK  # the third attempt got past the hang
    assert "watchdog stacks" in rep.notes[0].detail


def test_watchdog_kills_a_stuck_process(tmp_path) -> None:
    code = ("import time, sys; from bench.watchdog import Watchdog\n"
            f"w = Watchdog({str(tmp_path)!r}, 0); w.arm(0.5, 'case', index=4)\n"
            "time.sleep(30)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode != 0 and time.monotonic() - start < 20
    ranks, phase, stacks = watchdog.read_hang(str(tmp_path), 2)
    assert ranks == [0] and phase == {"phase": "case", "seconds": 0.5, "index": 4} and "Timeout" in stacks
    assert watchdog.read_hang(str(tmp_path / "none"), 2) is None
