"""CPU tests of ``python -m bench``: options, the result model and its formats, the
machinery that survives failing or hanging backends, and the one-line exit without a GPU.

Nothing here needs a GPU: formatting is tested on FAKE result sets, and the rank-side loop runs
on CPU ranks with a fake gloo "backend" and the CUDA calls it makes stubbed out.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import pcie_allreduce
from pcie_allreduce import sizes
from pcie_allreduce.tools import ranks, timing
from pcie_allreduce.tools.ranks import placement_label

from bench import __main__ as bench_cli
from bench import (
    backends, command, environment, options, outcome, pattern, progress, report, runner, topo, watchdog,
)
from bench.backends import Buffers
from bench.plan import make_cases
from bench.results import FAILED, NOT_RUN, OK, SKIPPED, WRONG, Note, Report, Result, add_speedups

from tests import _bench_fakes
from tests._bench_fakes import QuietBackendHooks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = ranks.skip_reason_no_gpu() is not None or not pcie_allreduce.is_available()
NO_GPU_TOPO = NO_GPU

# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("1K", 1024), ("14k", 14336), ("56KiB", 57344), ("448KB", 448 << 10), ("64M", 64 << 20),
    ("2MiB", 2 << 20), ("1G", 1 << 30), (" 7 ", 7), ("16B", 16),
])
def test_parse_size(text: str, expected: int) -> None:
    assert sizes.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "1.5M", "-1K", "0", "12x", "1 K B", "1e6"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        sizes.parse_size(text)


def test_format_size_and_doubling() -> None:
    assert [sizes.format_size(n) for n in (1024, 14336, 1000, 64 << 20, 3 << 30)] == ["1K", "14K", "1000", "64M", "3G"]
    default = sizes.doubling_sizes(1024, 64 << 20)
    assert default[0] == 1024 and default[-1] == 64 << 20 and len(default) == 17
    assert sizes.doubling_sizes(3, 20) == [3, 6, 12]
    with pytest.raises(ValueError):
        sizes.doubling_sizes(8, 4)


# ----------------------------------------------------------------------------- options


def _config(argv: list[str], gpu_count: int = 1) -> options.BenchConfig:
    parser = bench_cli.build_parser()
    args = parser.parse_args(argv)
    return options.config_from_args(args, args.parser, gpu_count)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str], gpu_count: int = 1) -> str:
    with pytest.raises(SystemExit) as info:
        _config(argv, gpu_count)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_defaults() -> None:
    cfg = _config([])
    assert cfg.worlds == (2, 4, 8)  # one GPU: MPS emulation
    assert cfg.sizes == tuple(1 << p for p in range(10, 27))
    assert cfg.dtype == "bfloat16" and cfg.mode == "graph" and cfg.calls_per_graph == 16
    assert cfg.algos == ("oneshot", "staged", "twoshot", "oneshot_ll", "oneshot_full", "twoshot_full",
                         "oneshot_pull", "twoshot_pull", "twoshot_staged", "twoshot_symm", "auto")
    assert cfg.backends == ("ours", "torch_symm", "nccl", "nccl_ll", "flashinfer", "vllm", "sgl_kernel")
    assert not cfg.backends_explicit
    assert _config([], gpu_count=4).worlds == (4,)
    assert _config([], gpu_count=16).worlds == (16,) and _config([], gpu_count=24).worlds == (16,)


def test_explicit_options() -> None:
    cfg = _config(["--world", "4", "2", "4", "--sizes", "56K", "14K", "448KiB", "--dtype", "float16",
                   "--algos", "oneshot", "auto", "--backends", "ours", "torch_symm", "--iters", "50",
                   "--warmup", "0", "--calls-per-graph", "8", "--eager", "--out", "/tmp/x", "--case-timeout", "20"])
    assert cfg.worlds == (4, 2)
    assert cfg.sizes == (14336, 57344, 458752)
    assert cfg.dtype == "float16" and cfg.algos == ("oneshot", "auto")
    assert cfg.backends == ("ours", "torch_symm") and cfg.backends_explicit
    assert (cfg.iters, cfg.warmup, cfg.calls_per_graph, cfg.eager, cfg.mode) == (50, 0, 8, True, "eager")
    assert cfg.out == "/tmp/x" and cfg.case_timeout_s == 20.0 and cfg.max_bytes == 458752
    assert json.loads(json.dumps(cfg.to_dict()))["sizes"] == [14336, 57344, 458752]


def test_min_max_sweep() -> None:
    assert _config(["--min-bytes", "4K", "--max-bytes", "32K"]).sizes == (4096, 8192, 16384, 32768)
    assert _config(["--max-bytes", "4K"]).sizes == (1024, 2048, 4096)


@pytest.mark.parametrize("argv, fragment", [
    (["--sizes", "12x"], "unknown unit"),
    (["--sizes", "0"], "--sizes"),
    (["--world", "1"], "--world"),
    (["--world", "17"], "--world"),
    (["--world", "two"], "is not an integer"),
    (["--iters", "0"], "--iters"),
    (["--calls-per-graph", "-3"], "--calls-per-graph"),
    (["--time-budget", "0"], "--time-budget"),
    (["--dtype", "int8"], "invalid choice"),
    (["--algos", "ring"], "invalid choice"),
    (["--backends", "mpi"], "invalid choice"),
    (["--sizes", "1K", "--min-bytes", "1K"], "not both"),
    (["--min-bytes", "64M", "--max-bytes", "1K"], "smaller than"),
    (["--dtype", "float32", "--sizes", "6"], "multiple of the float32 element size"),
])
def test_bad_options_are_usage_errors(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(argv, capsys)
    assert fragment in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- results and formats


def _row(world: int, backend: str, algo: str, size: int, p50: float | None, status: str = OK, **kw) -> Result:
    return Result(world=world, backend=backend, algo=algo, size_bytes=size, count=size // 2, dtype="bfloat16",
                  status=status, p50_us=p50, p99_us=None if p50 is None else p50 * 1.5,
                  rank0_p50_us=p50, replays=100 if p50 else 0, calls_per_graph=16, **kw)


def _fake_report() -> Report:
    rows = [
        _row(4, "ours", "oneshot", 14336, 4.0),
        _row(4, "ours", "auto", 14336, 4.2, resolved_algo="oneshot"),
        _row(4, "ours", "twoshot", 14336, None, status=FAILED, error="rank 1: CollectiveTimeout: boom"),
        _row(4, "torch_symm", "one_shot", 14336, 6.0),
        _row(4, "torch_symm", "two_shot", 14336, 8.0),
        _row(4, "ours", "oneshot", 57344, 5.0),
        _row(4, "torch_symm", "one_shot", 57344, 7.5),
        _row(4, "torch_symm", "two_shot", 57344, None, status=WRONG, error="rank 0: 3 of 28672 elements wrong"),
        _row(2, "ours", "oneshot", 14336, 2.0),
        _row(2, "nccl", "default", 14336, 20.0),
        _row(2, "torch_symm", "one_shot", 14336, 4.0),
        _row(8, "ours", "oneshot", 14336, 6.0),
        _row(8, "torch_symm", "one_shot", 14336, None, status=NOT_RUN, error="not run: hung: rank 3 ..."),
    ]
    notes = [Note(4, "nccl", "skipped", "NCCL refuses two ranks on one GPU (4 ranks on 1 GPU)"),
             Note(8, "torch_symm", "failed", "hung: rank 3 ...", detail="stacks ...")]
    env = {"gpus": ["NVIDIA H200"], "driver": "580.1", "torch": "2.11.0", "cuda_runtime": "13.0",
           "date": "2026-11-29T00:00:00+00:00", "command": "python -m bench"}
    placements = {2: "2 ranks on 2 GPUs", 4: placement_label(4, 1, True),
                  8: placement_label(8, 1, True)}
    return Report(env, options.BenchConfig(worlds=(2, 4, 8), sizes=(14336, 57344)).to_dict(), placements,
                  add_speedups(rows), notes)


def test_bandwidths_and_label() -> None:
    r = _row(4, "ours", "auto", 1 << 20, 10.0, resolved_algo="twoshot")
    assert r.algbw_gbps == pytest.approx((1 << 20) / 10e-6 / 1e9)
    assert r.busbw_gbps == pytest.approx(r.algbw_gbps * 2 * 3 / 4)
    assert r.label == "auto(twoshot)"
    assert _row(4, "ours", "oneshot", 1024, 1.0, resolved_algo="oneshot").label == "oneshot"
    failed = _row(4, "ours", "oneshot", 1024, None, status=FAILED)
    assert failed.algbw_gbps is None and failed.busbw_gbps is None and not failed.ok
    with pytest.raises(ValueError):
        _row(2, "ours", "oneshot", 1024, 1.0, status="great")


def test_speedups_reference_nccl_then_torch_symm() -> None:
    rep = _fake_report()
    by = {(r.world, r.backend, r.algo, r.size_bytes): r for r in rep.results}
    # W=2: NCCL ran, so it is the reference even though torch_symm is faster.
    assert by[(2, "ours", "oneshot", 14336)].reference == "nccl"
    assert by[(2, "ours", "oneshot", 14336)].speedup == pytest.approx(10.0)
    assert by[(2, "torch_symm", "one_shot", 14336)].speedup == pytest.approx(5.0)
    # W=4: no NCCL; torch_symm's best (one_shot 6.0) is the reference.
    assert by[(4, "ours", "oneshot", 14336)].speedup == pytest.approx(1.5)
    assert by[(4, "torch_symm", "two_shot", 14336)].speedup == pytest.approx(0.75)
    assert by[(4, "ours", "twoshot", 14336)].speedup is None
    # W=8: torch_symm has no ok row: no reference.
    assert by[(8, "ours", "oneshot", 14336)].speedup is None and by[(8, "ours", "oneshot", 14336)].reference == ""


def test_table_columns_and_rows() -> None:
    rep = _fake_report()
    text = report.format_report(rep)
    header = next(line for line in text.splitlines() if "size(B)" in line and "count" in line)
    names = header.lstrip("#").split()
    assert names == ["size(B)", "count", "dtype", "backend", "algo", "p50(us)", "p99(us)", "algbw(GB/s)",
                     "busbw(GB/s)", "wire(B)", "wire(GB/s)", "speedup", "status"]
    assert "# W=4 | emulation: 4 ranks on one GPU under MPS | bfloat16" in text
    assert "# W=2 | 2 ranks on 2 GPUs" in text
    assert "CUDA-graph replay, 16 calls per graph" in text
    world4 = report.format_world(rep, 4)
    rows = [line for line in world4.splitlines() if not line.startswith("#")]
    assert len(rows) == 8
    ok = next(line.split() for line in rows if "auto(oneshot)" in line)
    assert ok[:5] == ["14336", "7168", "bfloat16", "ours", "auto(oneshot)"]
    assert ok[5] == "4.20" and ok[6] == "6.30" and ok[11] == "1.43x"
    assert float(ok[7]) == pytest.approx(14336 / 4.2e3, abs=0.01)
    # one-shot at W=4: the message to each of 3 peers, theirs to us; the rate of the busier direction
    assert ok[9] == "43008/43008" and float(ok[10]) == pytest.approx(43008 / 4.2e3, abs=0.01)
    failed = next(line.split() for line in rows if "twoshot" in line)
    assert failed[5:7] == ["-", "-"] and failed[7:9] == ["-", "-"] and failed[10] == "-" and failed[12] == "failed"
    assert failed[9] == str(2 * 3 * 14336 // 4) + "/" + str(2 * 3 * 14336 // 4)  # bytes are known without a time
    assert "# skipped: nccl: NCCL refuses two ranks on one GPU" in world4
    # W=8: torch_symm never got past set-up: no not-run rows, the note says why.
    world8 = report.format_world(rep, 8)
    assert "torch_symm" not in "\n".join(line for line in world8.splitlines() if not line.startswith("#"))
    assert "# failed: torch_symm: hung: rank 3" in world8
    assert "# error: W=4 ours [14336/twoshot]: rank 1: CollectiveTimeout: boom" in text
    assert "stacks ..." not in text  # details go to the JSON only


def test_summary_ratio_of_our_best_to_reference() -> None:
    summary = report.format_summary(_fake_report())
    head = next(line for line in summary.splitlines() if "size(B)" in line).split()
    assert head[-2:] == ["ours/torch_symm", "ours/nccl"]
    line = next(line for line in summary.splitlines() if line.split()[:2] == ["14336", "4"])
    assert "4.00 (oneshot)" in line and "6.00 (one_shot)" in line
    assert line.split()[-2:] == ["0.67", "-"]
    line2 = next(line for line in summary.splitlines() if line.split()[:2] == ["14336", "2"])
    assert line2.split()[-2:] == ["0.50", "0.10"]



def test_summary_columns_stay_apart_with_long_cells() -> None:
    """A best time of two digits before the point with a long algorithm name is wider than the
    default column: the W column and the cell must still read as two fields."""
    rows = [_row(8, "ours", "twoshot_pull", 4194304, 53.19), _row(8, "torch_symm", "two_shot", 4194304, 60.0)]
    rep = Report({}, options.BenchConfig(worlds=(8,), sizes=(4194304,)).to_dict(), {}, add_speedups(rows), [])
    line = next(line for line in report.format_summary(rep).splitlines() if line.split()[:1] == ["4194304"])
    assert line.split()[:4] == ["4194304", "8", "53.19", "(twoshot_pull)"]
    assert line.split()[-1] == f"{53.19 / 60.0:.2f}"

def test_csv_contents() -> None:
    rep = _fake_report()
    rows = list(csv.DictReader(io.StringIO(report.to_csv(rep.results))))
    assert tuple(rows[0].keys()) == report.CSV_COLUMNS
    assert len(rows) == len(rep.results)
    auto = next(r for r in rows if r["algo"] == "auto")
    assert auto["resolved_algo"] == "oneshot" and auto["world"] == "4" and auto["mode"] == "graph"
    assert float(auto["p50_us"]) == 4.2 and float(auto["busbw_gbps"]) == pytest.approx(14336 / 4.2e3 * 1.5)
    assert auto["reference"] == "torch_symm" and float(auto["speedup"]) == pytest.approx(6.0 / 4.2)
    wrong = next(r for r in rows if r["status"] == WRONG)
    assert wrong["p50_us"] == "" and wrong["speedup"] == "" and "elements wrong" in wrong["error"]
    assert [int(r["world"]) for r in rows] == sorted(int(r["world"]) for r in rows)


def test_json_contents_and_files(tmp_path) -> None:
    rep = _fake_report()
    data = json.loads(report.to_json(rep))
    assert data["environment"]["gpus"] == ["NVIDIA H200"] and data["environment"]["command"]
    assert data["placements"]["4"] == "emulation: 4 ranks on one GPU under MPS"
    assert data["config"]["calls_per_graph"] == 16 and data["config"]["mode"] == "graph"
    assert len(data["results"]) == len(rep.results)
    first = data["results"][0]
    assert {"algbw_gbps", "busbw_gbps", "speedup", "reference", "status", "p99_us"} <= set(first)
    assert data["notes"][1]["detail"] == "stacks ..."
    paths = report.write_outputs(rep, str(tmp_path / "out"))
    assert sorted(os.path.basename(p) for p in paths) == ["bench.csv", "bench.json", "bench.txt"]
    assert (tmp_path / "out" / "bench.txt").read_text() == report.format_report(rep)


def test_exit_status() -> None:
    rep = _fake_report()
    assert command.exit_status(rep) == 1  # ours has a failed case and torch_symm a wrong one
    fine = Report({}, {}, {}, [_row(2, "ours", "oneshot", 1024, 1.0),
                               _row(2, "torch_symm", "one_shot", 1024, None, status=FAILED)])
    assert command.exit_status(fine) == 0  # another backend failing is reported, not our failure
    skipped = Report({}, {}, {}, [_row(8, "ours", "oneshot_ll", 1 << 20, None, status=SKIPPED)])
    assert command.exit_status(skipped) == 0  # skipped by design (over the low-latency capacity)
    not_run = Report({}, {}, {}, [_row(8, "ours", "oneshot", 1024, None, status=NOT_RUN)])
    assert command.exit_status(not_run) == 1


def test_environment_lists_only_the_gpus_the_run_can_see() -> None:
    rows = [{"index": "0", "uuid": "GPU-aaaa-1111", "name": "H200"},
            {"index": "1", "uuid": "GPU-bbbb-2222", "name": "H200"},
            {"index": "2", "uuid": "GPU-cccc-3333", "name": "L40S"}]
    assert environment.visible_gpus(rows, None) == rows
    assert environment.visible_gpus(rows, "0") == rows[:1]
    assert environment.visible_gpus(rows, "2,0") == [rows[2], rows[0]]
    assert environment.visible_gpus(rows, "GPU-bbbb") == [rows[1]]
    assert environment.visible_gpus(rows, "1,7,0") == [rows[1]], "CUDA stops at the first unknown entry"
    assert environment.visible_gpus(rows, "") == []


def test_placement_labels() -> None:
    assert placement_label(4, 1, True) == "emulation: 4 ranks on one GPU under MPS"
    assert placement_label(8, 2, True) == "emulation: 8 ranks on 2 GPUs under MPS"
    assert "time-sliced" in placement_label(2, 1, False)
    assert placement_label(4, 8, None) == "4 ranks on 4 GPUs"


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
               "replays": 40, "resolved_algo": "a"},
              {"event": "start", "index": 1}]
    rows = runner.rows_from_events(events, cases, _cfg(), 2, "ours")
    assert list(rows) == [0] and rows[0].p50_us == 2.0 and rows[0].replays == 40 and rows[0].world == 2
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


# ----------------------------------------------------------------------------- topo


class _FakeExt:
    """Four GPUs on two NUMA nodes; GPUs 0 and 3 have no peer access to each other."""

    def pci_bus_id(self, device: int) -> str:
        return f"00000000:{0x19 + device * 0x20:02X}:00.0"

    def can_access_peer(self, device: int, peer: int) -> bool:
        return {device, peer} != {0, 3}


def test_topo_probe_and_format(tmp_path) -> None:
    for device, node in enumerate(("0", "0", "1", "-1")):
        path = tmp_path / topo.sysfs_bus_id(_FakeExt().pci_bus_id(device))
        path.mkdir()
        (path / "numa_node").write_text(node + "\n")
    found = topo.probe(_FakeExt(), ["RTX PRO 6000"] * 4, sysfs_root=str(tmp_path), smi_topo="GPU0 X PIX")
    assert [g.pci_bus_id for g in found.gpus] == ["0000:19:00.0", "0000:39:00.0", "0000:59:00.0", "0000:79:00.0"]
    assert [g.numa_node for g in found.gpus] == [0, 0, 1, None]
    assert found.peer_access[0] == (True, True, True, False) and found.peer_access[3][0] is False
    text = topo.format_topology(found)
    assert "\nGPU0  X     Y     Y     N\n" in text and "\n      GPU0  GPU1  GPU2  GPU3\n" in text
    assert "2 pairs without peer access" in text and "nvidia-smi topo -m" in text
    data = json.loads(json.dumps(found.to_dict()))
    assert data["gpus"][2]["numa_node"] == 1 and data["peer_access"][3] == [False, True, True, True]
    assert topo.numa_node("0000:ff:00.0", str(tmp_path)) is None
    assert topo.sysfs_bus_id("0000:19:00.0") == "0000:19:00.0"


@pytest.mark.skipif(not NO_GPU_TOPO, reason="this machine has a GPU and the extension")
def test_topo_without_gpu_exits_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "topo"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- the command itself



@pytest.mark.skipif(not NO_GPU, reason="this machine can run the benchmark")
@pytest.mark.parametrize("argv", [[], ["--sizes", "14K"], ["--out", "{tmp}"]])
def test_bench_without_gpu_exits_with_one_line(argv: list[str], tmp_path) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "bench", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("python -m bench: cannot run here: ")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.skipif(not NO_GPU, reason="this machine can run the benchmark")
@pytest.mark.parametrize("argv, prefix", [(["--fused"], "python -m bench: "),
                                          (["verify", "--fused"], "python -m bench verify: ")])
def test_modes_without_gpu_exit_with_one_line(argv: list[str], prefix: str, capsys) -> None:
    assert bench_cli.main(argv) == 3
    captured = capsys.readouterr()
    assert captured.err.startswith(prefix + "cannot run here: ") and captured.err.count("\n") == 1
    assert captured.out == ""


def test_help_works_everywhere() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--calls-per-graph" in proc.stdout and "--eager" in proc.stdout
    assert "--fused" in proc.stdout and all(mode in proc.stdout for mode in ("verify", "topo", "plot"))


@pytest.mark.parametrize("argv, fragment", [(["verify", "--help"], "--draft-tokens"),
                                            (["topo", "--help"], "--no-probe"), (["plot", "--help"], "JSON")])
def test_subcommand_help(argv: list[str], fragment: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        bench_cli.main(argv)
    assert info.value.code == 0 and fragment in capsys.readouterr().out


def test_main_reports_unavailable_in_one_line(monkeypatch, capsys) -> None:
    from pcie_allreduce.errors import UnavailableError

    def refuse(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        raise UnavailableError("no GPU\nat all")

    monkeypatch.setattr(command, "run", refuse)
    assert bench_cli.main([]) == 3
    assert capsys.readouterr().err == "python -m bench: cannot run here: no GPU at all\n"


def test_bench_command_prints_report_and_writes_files(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(command, "unavailable_reason", lambda cfg: None)
    monkeypatch.setattr(environment, "host_environment", lambda: {})
    monkeypatch.setattr(runner, "run_sweep", lambda cfg, gpus, env, echo, bar: _fake_report())
    assert bench_cli.main(["--sizes", "14K", "--out", str(tmp_path)]) == 1  # the fake has a failed case of ours
    captured = capsys.readouterr()
    assert captured.out == report.format_report(_fake_report())
    assert {"bench.csv", "bench.json", "bench.txt"} <= set(os.listdir(tmp_path))
    assert f"wrote {tmp_path}" in captured.err
    # The PNG when matplotlib imports, else one line saying why not.
    assert ("bench.png" in os.listdir(tmp_path)) != ("plot skipped: matplotlib is not importable" in captured.err)


def test_bench_command_with_nothing_runnable(monkeypatch, capsys) -> None:
    monkeypatch.setattr(command, "unavailable_reason", lambda cfg: None)
    monkeypatch.setattr(environment, "host_environment", lambda: {})
    monkeypatch.setattr(backends, "skip_reason", lambda b, w, g: "NCCL refuses two ranks on one GPU")
    assert bench_cli.main(["--backends", "nccl", "--world", "2", "4"]) == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("python -m bench: cannot run here: no requested backend can run here "
                    "(nccl: NCCL refuses two ranks on one GPU)")


def test_nccl_ll_is_the_tuned_nccl_row() -> None:
    from bench import backends

    assert backends.algos_for("nccl_ll", ("auto",)) == backends.algos_for("nccl", ("auto",)) == ("default",)
    assert backends.rank_env("nccl_ll", 8, 8) == {"NCCL_PROTO": "LL"}
    assert backends.rank_env("nccl", 8, 8) == {}
    assert "refuses two ranks on one GPU" in backends.skip_reason("nccl_ll", 8, 1)
    assert _config(["--backends", "nccl_ll"], gpu_count=8).backends == ("nccl_ll",)


def test_result_files_record_the_command_as_typed() -> None:
    from bench.environment import command_line

    assert command_line(["/any/checkout/bench/__main__.py", "--out", "a b"]) == "python -m bench --out 'a b'"
    assert command_line(["/usr/local/bin/pcie-allreduce", "tune"]) == "pcie-allreduce tune"


def test_rows_for_boxes_without_p2p_run_when_named() -> None:
    """ours_host (our kernels over pinned host memory) and nccl_shm (NCCL with P2P disabled) are
    the comparison for boxes without usable P2P: registered, off by default, and set up so."""
    from bench import backends, options
    from bench.backend_nccl import NcclSharedMemoryBackend
    from bench.backend_ours import OursBackend, OursHostBackend

    assert set(backends.OPT_IN) == {"ours_host", "nccl_shm", "ours_hier"} <= set(backends.BACKENDS)
    assert not set(backends.OPT_IN) & set(backends.DEFAULT_BACKENDS)
    assert options.BenchConfig(worlds=(2,), sizes=(1024,)).backends == backends.DEFAULT_BACKENDS
    assert backends.backend_class("ours_host") is OursHostBackend and OursHostBackend.transport == "host"
    assert OursBackend.transport is None  # the Communicator's default: auto
    assert backends.rank_env("nccl_shm", 2, 2)["NCCL_P2P_DISABLE"] == "1"
    assert backends.algos_for("ours_host", ["oneshot", "auto"]) == ("oneshot", "auto", "host_oneshot", "host_twoshot")


def test_graph_loop_parses_sizes_and_exits_3_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import graph_loop

    if ranks.skip_reason_no_gpu() is None:
        pytest.skip("a GPU is present: the no-GPU exit is not reachable here")
    assert graph_loop.main(["--world", "2", "--sizes", "14K", "56K", "--algos", "oneshot_full"]) == 3
    assert graph_loop.main(["--world", "2", "--transport", "host", "--algos", "host_oneshot"]) == 3
    assert "python -m bench.graph_loop:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        graph_loop.main(["--sizes", "fourteen"])
