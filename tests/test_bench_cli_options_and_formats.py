"""CPU tests of ``python -m bench``'s options and of its result model and formats.

Size parsing and the doubling sweep; the options (defaults, explicit values, and bad values as
usage errors without a traceback); the result rows (bandwidths, labels, speedups against NCCL or
torch_symm), the text table, summary, CSV and JSON made of a FAKE result set, the exit status,
the GPUs the environment lists and the placement labels. Nothing here needs a GPU.
"""

from __future__ import annotations

import csv
import io
import json
import os

import pytest

from pcie_allreduce import sizes
from pcie_allreduce.tools.ranks import placement_label

from bench import command, environment, options, report
from bench.results import FAILED, NOT_RUN, SKIPPED, WRONG, Report, add_speedups

from tests._bench_cli_support import _config, _fake_report, _row


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
