"""CPU tests of ``pcie-allreduce tune`` (pcie_allreduce.tools.tune): options, picking shapes, deriving an
AlgoTable that launches exactly the picks, the cache path and fingerprint, one shape's check and
timing in a one-rank gloo group with the CUDA calls faked, and the command end to end."""

from __future__ import annotations

import contextlib
import json
import os
import random
import types

import pytest
import torch
import torch.distributed as dist

import pcie_allreduce
from pcie_allreduce.plan import algorithms, rules, tables
from pcie_allreduce.plan import cache as plan_cache
from pcie_allreduce.tools import cli, ranks, timing
from pcie_allreduce.tools.tune import cli as tune_cli
from pcie_allreduce.tools.tune import derive, measure, report
from pcie_allreduce.tools.tune.cache import write_table
from pcie_allreduce.tools.tune.derive import Measurement, Pick
from tests._bench_fakes import FakeEvent

NO_GPU = ranks.skip_reason_no_gpu() is not None or not pcie_allreduce.is_available()


def _parse(argv: list[str]):
    parser = cli.build_parser(["tune"])
    args = parser.parse_args(["tune", *argv])
    return args, tune_cli.job_from_args(args, args.parser)


def test_tune_options() -> None:
    args, job = _parse([])
    assert job.algos == derive.ALGORITHMS and job.blocks == tune_cli.DEFAULT_BLOCKS
    assert job.sizes[0] == 1024 and job.sizes[-1] == 8 << 20 and len(job.sizes) == 14
    assert (job.iters, job.warmup, job.calls_per_graph, job.time_budget_s) == (30, 5, 16, 0.2)
    assert args.world is None and not args.dry_run and args.cache_dir is None
    args, job = _parse(["--sizes", "56K", "14K", "--blocks", "8", "2", "--algos", "oneshot", "--world", "4",
                        "--dtype", "float16", "--iters", "7"])
    assert job.sizes == (14336, 57344) and job.blocks == (2, 8) and job.algos == ("oneshot",)
    assert args.world == [4] and job.dtype == "float16" and job.iters == 7
    assert tune_cli.default_worlds(1) == (2, 4, 8) and tune_cli.default_worlds(4) == (4,) and tune_cli.default_worlds(16) == (16,) and tune_cli.default_worlds(24) == (16,)


@pytest.mark.parametrize("argv", [["--blocks", "65"], ["--blocks", "0"], ["--tolerance", "1.5"], ["--world", "17"],
                                  ["--algos", "auto"], ["--sizes", "1K", "--max-bytes", "2K"], ["--sizes", "12x"],
                                  ["--dtype", "float32", "--sizes", "6"]])
def test_tune_bad_options(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert info.value.code == 2 and "Traceback" not in capsys.readouterr().err


def _m(world: int, size: int, algo: str, blocks: int, p50: float | None, status: str = derive.OK) -> Measurement:
    return Measurement(world, size, algo, blocks, status, p50, p50, 30 if p50 else 0)


def _fake_rows() -> list[Measurement]:
    rows = []
    for world in (2, 8):
        for size, best in ((1024, ("oneshot", 1)), (14336, ("oneshot", 4)), (458752, ("oneshot", 32)),
                           (4 << 20, ("twoshot", 32))):
            for algo in ("oneshot", "staged", "twoshot"):
                for blocks in (1, 2, 4, 8, 16, 32):
                    if world == 8 and blocks > 16:
                        rows.append(_m(world, size, algo, blocks, None, status=derive.SKIPPED))
                        continue
                    distance = abs(blocks.bit_length() - best[1].bit_length()) + (algo != best[0]) * 3
                    rows.append(_m(world, size, algo, blocks, (10.0 + size / 1e5) * (1 + 0.1 * distance)))
    return rows


def test_pick_shapes_prefers_fewer_blocks_within_tolerance() -> None:
    rows = [_m(4, 4096, "oneshot", 8, 10.0), _m(4, 4096, "oneshot", 4, 10.15), _m(4, 4096, "twoshot", 2, 10.5),
            _m(4, 4096, "staged", 16, 9.9), _m(4, 4096, "oneshot", 1, None, status=derive.WRONG)]
    pick = derive.pick_shapes(rows, tolerance=0.03)[0]
    assert (pick.algo, pick.blocks, pick.fastest_us) == ("oneshot", 4, 9.9)
    assert (derive.pick_shapes(rows, 0.0)[0].algo, derive.pick_shapes(rows, 0.0)[0].blocks) == ("staged", 16)
    assert derive.pick_shapes(rows, tolerance=0.1)[0].blocks == 2


def test_derived_table_launches_exactly_the_picks() -> None:
    picks = derive.pick_shapes(_fake_rows())
    assert [(p.world, p.size_bytes, p.algo, p.blocks) for p in picks if p.world == 8][-1] == (8, 4 << 20, "twoshot", 16)
    table = derive.derive_table(picks)
    assert derive.check_table(table, picks, "bfloat16") == []
    assert table.select(16 << 20, 2, "bfloat16").algo == "twoshot"  # beyond the largest measured size
    assert table.select(14336, 4, "bfloat16") == tables.default_table().select(14336, 4, "bfloat16")  # untuned W
    reloaded = tables.AlgoTable.from_json(table.to_json())
    assert derive.check_table(reloaded, picks, "float16") == []  # tuned rules apply to every dtype


def test_derived_table_on_random_picks() -> None:
    rng = random.Random(7)
    for _ in range(50):
        sizes = sorted(rng.sample([1 << p for p in range(10, 27)], rng.randint(1, 10)))
        picks = [Pick(4, s, rng.choice(derive.ALGORITHMS), rng.choice([1, 2, 4, 8, 16, 32, 64]), 1.0, 1.0)
                 for s in sizes]
        table = derive.derive_table(picks)
        assert derive.check_table(table, picks, "bfloat16") == [], picks
        assert len(derive.rules_for_world(4, picks)) <= len(picks)


def test_merged_rules() -> None:
    picks = [Pick(2, s, "oneshot", s // 4096, 1.0, 1.0) for s in (16384, 32768, 65536)]
    rules = derive.rules_for_world(2, picks)
    assert len(rules) == 1 and rules[0].max_bytes is None and rules[0].bytes_per_block == 4096


def test_the_default_tables_own_shape_is_measured_beside_the_grid() -> None:
    """The default launches 7 blocks at 56 KiB, off the grid of powers of two: it is measured too
    (capped to the block cap), once, and only for an algorithm the job names and that runs here."""
    table = tables.AlgoTable((rules.Rule("oneshot_full", max_bytes=64 << 10, bytes_per_block=8192, max_blocks=32),
                              rules.Rule("twoshot")))
    job = measure.TuneJob(sizes=(57344,), algos=("oneshot_ll", "oneshot_full"), blocks=(1, 2, 4, 8))
    shapes = measure.shapes_of(job, 57344, 2, table, 64, lambda algo: True)
    assert shapes == [(a, b) for a in ("oneshot_ll", "oneshot_full") for b in (1, 2, 4, 8)] + [("oneshot_full", 7)]
    capped = measure.shapes_of(job, 57344, 2, table, 4, lambda algo: True)
    assert len(capped) == 8 and ("oneshot_full", 4) in capped  # capped to 4 blocks: on the grid already
    assert ("oneshot_full", 7) not in measure.shapes_of(job, 57344, 2, table, 64, lambda algo: algo == "oneshot_ll")
    other = measure.TuneJob(sizes=(57344,), algos=("oneshot_ll",), blocks=(1, 2))
    assert measure.shapes_of(other, 57344, 2, table, 64, lambda algo: True) == [("oneshot_ll", 1), ("oneshot_ll", 2)]
    matrix = report.format_matrix([_m(2, 57344, "oneshot_full", 7, 3.5), _m(2, 57344, "oneshot_full", 8, 3.9)], 2, (8,))
    assert "b=7" in matrix and "3.50" in matrix


def test_percentile_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert timing.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        timing.percentile([], 50)


def test_cache_paths_and_fingerprint(tmp_path) -> None:
    assert plan_cache.cache_dir({"PCIE_AR_CACHE_DIR": "/x"}) == "/x"
    assert plan_cache.cache_dir({"XDG_CACHE_HOME": "/c", "HOME": "/h"}) == "/c/pcie_allreduce"
    assert plan_cache.cache_dir({"HOME": "/h"}) == "/h/.cache/pcie_allreduce"
    assert plan_cache.gpu_slug("NVIDIA RTX PRO 6000 Blackwell") == "nvidia-rtx-pro-6000-blackwell"
    one_gpu = plan_cache.fingerprint(["0000:00:06.0"] * 4, lambda a, b: True)
    assert len(one_gpu) == 12 and one_gpu == plan_cache.fingerprint(["0000:00:06.0".upper()] * 4, lambda a, b: False)
    four = ["0000:19:00.0", "0000:39:00.0", "0000:59:00.0", "0000:79:00.0"]
    full = plan_cache.fingerprint(four, lambda a, b: True)
    assert full != plan_cache.fingerprint(four, lambda a, b: {a, b} != {four[0], four[3]})
    assert full != plan_cache.fingerprint(four[::-1], lambda a, b: True)  # rank order is part of the placement
    assert full != one_gpu
    # the fabric: two islands key their own table; one island (or none known) is the flat key
    halves = plan_cache.fingerprint(four, lambda a, b: True, ((0, 1), (2, 3)))
    assert halves != full and halves != plan_cache.fingerprint(four, lambda a, b: True, ((0, 2), (1, 3)))
    assert halves == plan_cache.fingerprint(four, lambda a, b: True, [[3, 2], [1, 0]])  # as sets of ranks
    assert plan_cache.fingerprint(four, lambda a, b: True, ((0, 1, 2, 3),)) == full
    assert plan_cache.fingerprint(four, lambda a, b: True, ()) == full

    class Ext:
        def device_by_pci_bus_id(self, bus: str) -> int:
            return four.index(bus)

        def can_access_peer(self, a: int, b: int) -> bool:
            return True

    assert plan_cache.fingerprint_of(Ext(), four) == full
    path = plan_cache.table_path("NVIDIA H200", 4, full, str(tmp_path))
    assert os.path.basename(path) == f"nvidia-h200-w4-{full}.json"
    write_table(path, tables.default_table().to_json(), {"world": 4})
    loaded = tables.load_table(environ={"PCIE_AR_ALGO_TABLE": path})
    assert loaded == tables.default_table()
    assert json.loads(open(path).read())["meta"] == {"world": 4}


# ---- one shape in a one-rank gloo group, the CUDA calls faked ----------------------------------


class _Workspace:
    """The raw launch: records its arguments and writes ``inp`` (+ ``corrupt``) into ``out``."""

    def __init__(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        self.inp, self.out, self.launched, self.corrupt = inp, out, [], 0.0
        self.events: list[str] = []  # the tune stream's waits and launches, in order

    def all_reduce(self, *args: object) -> int:
        self.launched.append(args)
        self.events.append("launch")
        self.out.copy_(self.inp)
        self.out[3] += self.corrupt
        return 0

    def failed(self) -> bool:
        return False


class _Comm:
    block_cap = 16
    ll_capacity = 512 << 10

    def __init__(self, workspace: _Workspace) -> None:
        self.made = workspace

    def _workspace(self, stream: int) -> _Workspace:
        assert stream == 77
        return self.made

    def check(self) -> None:
        pass

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out


class _Graph:
    def replay(self) -> None:
        pass


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A one-rank gloo group, and torch.cuda's graph / stream / event / sync calls replaced by CPU fakes."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the default stream")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None, raising=False)
    yield types.SimpleNamespace(rank=0, world_size=1, group=dist.group.WORLD, device=torch.device("cpu"), mps=False)
    dist.destroy_process_group()


def _shape(ctx, algo: str, blocks: int, corrupt: float = 0.0, count: int = 512):
    inp = torch.arange(count, dtype=torch.float32).to(torch.bfloat16) % 7
    out = torch.empty_like(inp)
    workspace = _Workspace(inp, out)
    workspace.corrupt = corrupt
    stream = types.SimpleNamespace(cuda_stream=77, synchronize=lambda: None,
                                   wait_stream=lambda other: workspace.events.append(f"wait for {other}"))
    job = measure.TuneJob(sizes=(count * 2,), algos=(algo,), blocks=(blocks,), iters=12, warmup=1, calls_per_graph=4)
    row = measure._measure_shape(ctx, job, _Comm(workspace), stream, inp, out, inp.clone(), algo, blocks)
    return row, workspace


def test_shape_is_checked_then_timed_with_the_raw_launch(one_rank) -> None:
    row, workspace = _shape(one_rank, "staged", 8)
    assert row["status"] == derive.OK and row["replays"] >= timing.MIN_REPLAYS and row["p50_us"] >= 0
    from pcie_allreduce.plan.dispatch import DTYPE_IDS

    assert workspace.launched[0] == (algorithms.ALGO_IDS["staged"], workspace.inp.data_ptr(), workspace.out.data_ptr(),
                                     1024, DTYPE_IDS[torch.bfloat16], 8, 77)
    assert len(workspace.launched) == 1 + 4  # the exact-sum check, then the captured calls


def test_the_raw_launch_waits_for_the_inputs_written_on_the_default_stream(one_rank) -> None:
    """The inputs, the expected sum and the poisoned output are written on the default stream and
    the raw launch runs on the tune's own stream: without a wait between them the launch can read
    unwritten inputs or be overwritten by the poison, and a correct shape is reported wrong."""
    _, workspace = _shape(one_rank, "oneshot", 2)
    assert workspace.events[:2] == ["wait for the default stream", "launch"]


def test_shape_with_a_wrong_sum_is_not_timed(one_rank) -> None:
    row, workspace = _shape(one_rank, "oneshot", 2, corrupt=1.0)
    assert row["status"] == derive.WRONG and row["error"] == "rank 0: 1 of 512 elements wrong"
    assert len(workspace.launched) == 1


def test_shapes_over_the_block_cap_or_the_low_latency_capacity_are_skipped(one_rank) -> None:
    row, workspace = _shape(one_rank, "twoshot", 32)
    assert row["status"] == derive.SKIPPED and "32 blocks > block cap 16" in row["error"]
    assert workspace.launched == []
    row, _ = _shape(one_rank, "oneshot_ll", 4, count=1 << 20)
    assert row["status"] == derive.SKIPPED and "oneshot_ll takes messages up to" in row["error"]


# ---- the command --------------------------------------------------------------------------------


def _fake_measure_world(world: int, job: measure.TuneJob, timeout_s: float):
    rows = [r for r in _fake_rows() if r.world == world]
    cap = 64 if world == 2 else 16
    return ([Measurement(world, r.size_bytes, r.algo, r.blocks, r.status, r.p50_us, r.p99_us, r.replays)
             for r in rows], {"gpu_name": "NVIDIA H200", "fingerprint": "abcdef012345", "block_cap": cap, "mps": True})


@pytest.fixture
def fake_machine(monkeypatch):
    monkeypatch.setattr(tune_cli, "_gpu_count", lambda: 1)
    monkeypatch.setattr(tune_cli, "measure_world", _fake_measure_world)


def test_tune_command_end_to_end(fake_machine, capsys, tmp_path) -> None:
    cache = tmp_path / "cache"
    assert cli.main(["tune", "--world", "2", "8", "--sizes", "1K", "14K", "448K", "4M", "--blocks", "1", "2", "4",
                     "8", "16", "32", "--cache-dir", str(cache), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "b=32" in out.split("# W=2 |")[1] and "skip" in out.split("# W=8 |")[1]
    assert "# W=8 | emulation: 8 ranks on one GPU under MPS" in out
    written = sorted(os.listdir(cache))
    assert written == ["nvidia-h200-w2-abcdef012345.json", "nvidia-h200-w8-abcdef012345.json"]
    table = tables.load_table(str(cache / written[1]))
    assert table.select(4 << 20, 8, "bfloat16") == rules.Choice("twoshot", 16)
    assert table.select(14336, 8, "bfloat16") == rules.Choice("oneshot", 4)
    meta = json.loads((cache / written[1]).read_text())["meta"]
    assert meta["world"] == 8 and meta["picks"][0][:3] == [1024, "oneshot", 1]
    assert sorted(os.listdir(tmp_path / "out")) == ["tune.json", "tune.txt"]
    assert (tmp_path / "out" / "tune.txt").read_text() == out
    document = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert document["facts"]["8"]["block_cap"] == 16 and len(document["measurements"]) == 2 * 4 * 3 * 6
    assert "tuned" in out and "default" in out and "gain" in out and f"wrote {cache}" in err


def test_tune_dry_run_writes_nothing(fake_machine, capsys, tmp_path) -> None:
    assert cli.main(["tune", "--world", "2", "8", "--dry-run", "--cache-dir", str(tmp_path)]) == 0
    assert os.listdir(tmp_path) == [] and "--dry-run: would write" in capsys.readouterr().out


def test_tune_reports_a_failed_world_and_goes_on(fake_machine, monkeypatch, capsys, tmp_path) -> None:
    def measure(world: int, job: measure.TuneJob, timeout_s: float):
        if world == 8:
            raise ranks.RankFailed("rank 3 hung\nstacks ...")
        return _fake_measure_world(world, job, timeout_s)

    monkeypatch.setattr(tune_cli, "measure_world", measure)
    assert cli.main(["tune", "--world", "2", "8", "--cache-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "# W=8: measurement failed: rank 3 hung stacks ..." in out
    assert os.listdir(tmp_path) == ["nvidia-h200-w2-abcdef012345.json"]


@pytest.mark.skipif(not NO_GPU, reason="this machine can run tune")
def test_tune_without_gpu_exits_with_one_line(capsys) -> None:
    assert cli.main(["tune", "--world", "2"]) == 3
    captured = capsys.readouterr()
    assert captured.err.startswith("pcie-allreduce tune: cannot run here: ") and captured.err.count("\n") == 1
    assert captured.out == ""


def test_the_host_transport_is_tuned_and_cached_apart() -> None:
    """--transport reaches the communicator; a host table's file name says so, and its fallback
    rules are the host transport's built-in ones."""
    assert _parse([])[1].transport == "auto"
    assert _parse(["--transport", "host"])[1].transport == "host"
    with pytest.raises(SystemExit):
        _parse(["--transport", "nvlink"])
    assert plan_cache.table_name("NVIDIA H200", 2, "abc").endswith("-w2-abc.json")
    assert plan_cache.table_name("NVIDIA H200", 2, "abc", "host").endswith("-w2-abc-host.json")
    picks = [derive.Pick(2, 1 << 20, "host_oneshot", 8, 1.0, 1.0)]
    table = derive.derive_table(picks, fallback=tables.default_table("host"))
    assert table.rules[-1].algo == "twoshot_pull" and table.availability_problem("host") is None
