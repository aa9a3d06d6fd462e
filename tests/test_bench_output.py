"""CPU tests of the optional outputs: the PNG plot (its data is pure; the drawing needs matplotlib)
and the tqdm progress bar (only on a terminal)."""

from __future__ import annotations

import builtins
import io
import sys

import pytest

from bench import command, plot
from bench.progress_bar import Bar
from bench.results import Report
from pcie_allreduce.settings import SettingsError

from tests.test_bench_fused import fake_fused_report
from tests.test_bench_verify import fake_verify_report
from tests._bench_cli_support import _fake_report


def test_series_of_a_sweep() -> None:
    data = plot.series(_fake_report())
    assert sorted(data) == [2, 4, 8]
    assert data[4]["ours oneshot"] == [(14336.0, 4.0), (57344.0, 5.0)]
    assert data[4]["ours auto(oneshot)"] == [(14336.0, 4.2)]
    assert "ours twoshot" not in data[4]  # failed rows are not plotted
    assert "torch_symm one_shot" not in data[8]


def test_series_of_fused_uses_tokens_and_bars_of_verify() -> None:
    fused = plot.series(fake_fused_report())
    assert fused[4]["ours fused(oneshot)"][0] == (4.0, 11.0)
    bars = plot.bars(fake_verify_report())
    assert bars[8][0] == ("kimi-k2.5 T=4 ours auto(oneshot)", pytest.approx(1.22))
    assert plot.series(fake_verify_report()) == {}


def test_plot_without_matplotlib(monkeypatch, tmp_path) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    monkeypatch.delitem(sys.modules, "matplotlib.pyplot", raising=False)
    problem = plot.write_plot(_fake_report(), str(tmp_path / "bench.png"))
    assert problem.startswith("matplotlib is not importable") and "pip install matplotlib" in problem
    lines: list[str] = []
    command.write_plot(_fake_report(), str(tmp_path), lines.append)
    assert lines == [f"plot skipped: {problem}"] and not (tmp_path / "bench.png").exists()


@pytest.mark.parametrize("make", [_fake_report, fake_fused_report, fake_verify_report])
def test_plot_with_matplotlib(make, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "out.png"
    assert plot.write_plot(make(), str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_nothing() -> None:
    problem = plot.write_plot(Report({}, {}, {}, []), "/nonexistent/x.png")
    assert problem == "no successful measurements to plot" or problem.startswith("matplotlib is not importable")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _FakeTqdm:
    made: list["_FakeTqdm"] = []

    def __init__(self, **kw) -> None:
        self.kw, self.n, self.lines, self.closed = kw, 0, [], False
        _FakeTqdm.made.append(self)

    def update(self, n: int) -> None:
        self.n += n

    def write(self, line: str, file=None) -> None:
        self.lines.append(line)

    def close(self) -> None:
        self.closed = True


def test_bar_on_a_terminal_uses_tqdm() -> None:
    with Bar(10, "bench", stream=_Tty(), factory=_FakeTqdm) as bar:
        assert bar.active
        bar.advance(3)
        bar.advance(0)
        bar.write("[W=2 ours] running 4 cases ...")
    made = _FakeTqdm.made[-1]
    assert made.n == 3 and made.kw["total"] == 10 and made.kw["desc"] == "bench" and made.closed
    assert made.lines == ["[W=2 ours] running 4 cases ..."]


def test_bar_elsewhere_prints_lines_only() -> None:
    stream = io.StringIO()  # not a terminal (a log file, CI): no bar, the lines as they come
    bar = Bar(10, "bench", stream=stream, factory=_FakeTqdm)
    bar.advance(5)
    bar.write("hello")
    bar.close()
    assert not bar.active and stream.getvalue() == "hello\n"
    assert not Bar(0, "x", stream=_Tty(), factory=_FakeTqdm).active  # nothing to count


@pytest.mark.parametrize("make", [_fake_report, fake_fused_report, fake_verify_report])
def test_json_round_trip_and_plot_command(make, tmp_path, capsys) -> None:
    from bench import __main__ as bench_cli
    from bench import report

    rep = make()
    back = report.from_json_obj(__import__("json").loads(report.to_json(rep)))
    from bench.results import sort_key

    assert back.results == sorted(rep.results, key=sort_key)  # the JSON keeps table order
    assert back.placements == rep.placements and back.notes == rep.notes
    assert report.format_report(back) == report.format_report(rep)
    path = tmp_path / "run.json"
    path.write_text(report.to_json(rep))
    status = bench_cli.main(["plot", str(path), "--text"])
    captured = capsys.readouterr()
    assert captured.out == report.format_report(rep)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert status == 3 and "matplotlib is not importable" in captured.err
    else:
        assert status == 0 and (tmp_path / "run.png").exists()


def test_plot_command_bad_file(tmp_path, capsys) -> None:
    from bench import __main__ as bench_cli

    with pytest.raises(SystemExit) as info:
        bench_cli.main(["plot", str(tmp_path / "missing.json")])
    assert info.value.code == 2 and "cannot read" in capsys.readouterr().err


def test_island_rows_carry_their_wire_bytes_once_the_islands_are_known() -> None:
    from bench.results import Result
    from pcie_allreduce.plan.algorithms import wire_bytes

    row = Result(world=8, backend="ours", algo="island_twoshot", size_bytes=57344, count=28672, dtype="bfloat16",
                 p50_us=10.0)
    assert row.wire is None  # islands unknown: no accounting, not a wrong one
    known = Result(world=8, backend="ours", algo="island_twoshot", size_bytes=57344, count=28672, dtype="bfloat16",
                   p50_us=10.0, island_ranks=4)
    assert known.wire == wire_bytes("island_twoshot", 57344, 8, 4) and known.wire_gbps is not None
    assert Result.from_dict(known.to_dict()).island_ranks == 4  # survives the JSON round trip


def test_hierarchy_rows_carry_the_inter_node_bytes_beside_a_flat_ring() -> None:
    """ours_hier's wire is the inter-node link: 1/L of the message out of each rank (its fp32
    shard, or its result shard), the whole fp32 partial into a later node's first rank; the
    report puts a flat ring's 2(W-1)/W beside it."""
    from bench.report import format_inter_node_bytes
    from bench.results import Result

    row = Result(world=8, backend="ours_hier", algo="auto", size_bytes=57344, count=28672, dtype="bfloat16",
                 p50_us=40.0, nodes=2)
    assert (row.wire.out, row.wire.into) == (4 * 7168, 4 * 28672)
    assert Result.from_dict(row.to_dict()).nodes == 2
    four = Result(world=8, backend="ours_hier", algo="auto", size_bytes=2000, count=1000, dtype="bfloat16",
                  p50_us=40.0, nodes=4)
    assert (four.wire.out, four.wire.into) == (3 * 500 * 2, 4 * 1000 + 500 * 2)
    assert Result(world=8, backend="ours_hier", algo="auto", size_bytes=2000, count=1000, dtype="bfloat16",
                  p50_us=1.0).wire is None  # nodes unknown: no accounting
    text = format_inter_node_bytes([row, four])
    assert "inter-node bytes per rank and call" in text
    assert text.splitlines()[2].split() == ["2000", "8", "4", "3000", "5000", "3500"]
    assert text.splitlines()[3].split() == ["57344", "8", "2", "28672", "114688", "100352"]
    assert format_inter_node_bytes([Result(world=8, backend="ours", algo="auto", size_bytes=2000, count=1000,
                                           dtype="bfloat16", p50_us=1.0)]) == ""


def test_hierarchy_backend_needs_two_nodes_of_two_ranks(monkeypatch) -> None:
    from bench import backends
    from bench.backend_ours_hier import OursHierBackend

    assert backends.backend_class("ours_hier") is OursHierBackend
    monkeypatch.setattr("pcie_allreduce.unavailable_reason", lambda: None)
    monkeypatch.delenv("PCIE_AR_NODES", raising=False)
    assert OursHierBackend.runtime_problem(4, 1) is None and OursHierBackend.rank_env(4, 1) == {"PCIE_AR_NODES": "2"}
    assert "2 or more nodes of 2 or more ranks" in OursHierBackend.runtime_problem(2, 1)
    monkeypatch.setenv("PCIE_AR_NODES", "4")
    assert OursHierBackend.runtime_problem(8, 1) is None and OursHierBackend.rank_env(8, 1) == {"PCIE_AR_NODES": "4"}
    assert "$PCIE_AR_NODES=4 does not" in OursHierBackend.runtime_problem(6, 1)
    monkeypatch.setenv("PCIE_AR_NODES", "\u00b2")  # passes str.isdigit(), is no number int() takes
    with pytest.raises(SettingsError, match="PCIE_AR_NODES='\u00b2': expected a whole number"):
        OursHierBackend.runtime_problem(4, 1)
    with pytest.raises(SettingsError, match="PCIE_AR_NODES"):
        OursHierBackend.rank_env(4, 1)
