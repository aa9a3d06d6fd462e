"""CPU tests of ``pcie-allreduce tune``: options, picking shapes, deriving an AlgoTable that launches
exactly the picks, the cache path and fingerprint, the raw-launch backend's arguments, the rank loop
(skipped shapes) on CPU ranks, and the command end to end with a fake result set."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from pcie_allreduce import algo as algo_mod, cli
from pcie_allreduce import tune_cache
from bench import command, environment, plan, runner, tune, tune_table
from bench.backends import OURS_SHAPES
from bench.options import BenchConfig
from bench.results import OK, SKIPPED, TUNE, Report, Result
from tests import _bench_fakes as fakes


def _tune_config(argv: list[str], gpu_count: int = 1) -> BenchConfig:
    parser = cli.build_parser(["tune"])
    args = parser.parse_args(["tune", *argv])
    return tune.config_from_args(args, args.parser, gpu_count)


def test_tune_options() -> None:
    cfg = _tune_config([])
    assert cfg.workload == TUNE and cfg.backends == (OURS_SHAPES,) and cfg.algos == ("oneshot", "staged", "twoshot", "oneshot_ll")
    assert cfg.sizes[0] == 1024 and cfg.sizes[-1] == 8 << 20 and cfg.blocks == (1, 2, 4, 8, 16, 32, 64)
    assert (cfg.iters, cfg.warmup, cfg.time_budget_s) == (30, 5, 0.2)
    cfg = _tune_config(["--sizes", "56K", "14K", "--blocks", "8", "2", "--algos", "oneshot", "--world", "4"])
    assert cfg.sizes == (14336, 57344) and cfg.blocks == (2, 8) and cfg.algos == ("oneshot",) and cfg.worlds == (4,)
    cases = plan.cases_for(cfg, OURS_SHAPES)
    assert [c.algo for c in cases] == ["oneshot/b2", "oneshot/b8"] * 2 and cases[2].size_bytes == 57344
    assert plan.parse_shape_algo("twoshot/b16") == ("twoshot", 16)
    with pytest.raises(ValueError):
        plan.parse_shape_algo("twoshot")


@pytest.mark.parametrize("argv", [["--blocks", "65"], ["--blocks", "0"], ["--tolerance", "1.5"],
                                  ["--algos", "auto"], ["--sizes", "1K", "--max-bytes", "2K"]])
def test_tune_bad_options(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _tune_config(argv)
    assert info.value.code == 2 and "Traceback" not in capsys.readouterr().err


def _row(world: int, size: int, algo: str, blocks: int, p50: float | None, status: str = OK) -> Result:
    return Result(world=world, backend=OURS_SHAPES, algo=plan.shape_algo(algo, blocks), size_bytes=size,
                  count=size // 2, dtype="bfloat16", status=status, p50_us=p50, p99_us=p50, replays=30,
                  calls_per_graph=16, workload=TUNE, resolved_algo=plan.shape_algo(algo, blocks))


def _fake_results() -> list[Result]:
    rows = []
    for world in (2, 8):
        for size, best in ((1024, ("oneshot", 1)), (14336, ("oneshot", 4)), (458752, ("oneshot", 32)),
                           (4 << 20, ("twoshot", 32))):
            for algo in ("oneshot", "staged", "twoshot"):
                for blocks in (1, 2, 4, 8, 16, 32):
                    if world == 8 and blocks > 16:
                        rows.append(_row(world, size, algo, blocks, None, status=SKIPPED))
                        continue
                    distance = abs(blocks.bit_length() - best[1].bit_length()) + (algo != best[0]) * 3
                    rows.append(_row(world, size, algo, blocks, (10.0 + size / 1e5) * (1 + 0.1 * distance)))
    return rows


def test_pick_shapes_prefers_fewer_blocks_within_tolerance() -> None:
    rows = [_row(4, 4096, "oneshot", 8, 10.0), _row(4, 4096, "oneshot", 4, 10.15), _row(4, 4096, "twoshot", 2, 10.5),
            _row(4, 4096, "staged", 16, 9.9), _row(4, 4096, "oneshot", 1, None, status="failed")]
    pick = tune_table.pick_shapes(rows, tolerance=0.03)[0]
    assert (pick.algo, pick.blocks, pick.fastest_us) == ("oneshot", 4, 9.9)
    assert (tune_table.pick_shapes(rows, tolerance=0.0)[0].algo, tune_table.pick_shapes(rows, 0.0)[0].blocks) == (
        "staged", 16)
    assert tune_table.pick_shapes(rows, tolerance=0.1)[0].blocks == 2


def test_derived_table_launches_exactly_the_picks() -> None:
    picks = tune_table.pick_shapes(_fake_results())
    assert [(p.world, p.size_bytes, p.algo, p.blocks) for p in picks if p.world == 8][-1] == (8, 4 << 20, "twoshot", 16)
    table = tune_table.derive_table(picks)
    assert tune_table.check_table(table, picks, "bfloat16") == []
    assert table.select(16 << 20, 2, "bfloat16").algo == "twoshot"  # beyond the largest measured size
    assert table.select(14336, 4, "bfloat16") == algo_mod.default_table().select(14336, 4, "bfloat16")  # untuned W
    reloaded = algo_mod.AlgoTable.from_json(table.to_json())
    assert tune_table.check_table(reloaded, picks, "float16") == []  # tuned rules apply to every dtype


def test_derived_table_on_random_picks() -> None:
    rng = random.Random(7)
    for _ in range(50):
        sizes = sorted(rng.sample([1 << p for p in range(10, 27)], rng.randint(1, 10)))
        picks = [tune_table.Pick(4, s, rng.choice(algo_mod.ALGORITHMS), rng.choice([1, 2, 4, 8, 16, 32, 64]), 1.0, 1.0)
                 for s in sizes]
        table = tune_table.derive_table(picks)
        assert tune_table.check_table(table, picks, "bfloat16") == [], picks
        assert len(tune_table.rules_for_world(4, picks)) <= len(picks)


def test_merged_rules() -> None:
    picks = [tune_table.Pick(2, s, "oneshot", s // 4096, 1.0, 1.0) for s in (16384, 32768, 65536)]
    rules = tune_table.rules_for_world(2, picks)
    assert len(rules) == 1 and rules[0].max_bytes is None and rules[0].bytes_per_block == 4096


def test_cache_paths_and_fingerprint(tmp_path) -> None:
    assert tune_cache.cache_dir({"PCIE_AR_CACHE_DIR": "/x"}) == "/x"
    assert tune_cache.cache_dir({"XDG_CACHE_HOME": "/c", "HOME": "/h"}) == "/c/pcie_allreduce"
    assert tune_cache.cache_dir({"HOME": "/h"}) == "/h/.cache/pcie_allreduce"
    assert tune_cache.gpu_slug("NVIDIA RTX PRO 6000 Blackwell") == "nvidia-rtx-pro-6000-blackwell"
    one_gpu = tune_cache.fingerprint(["0000:00:06.0"] * 4, lambda a, b: True)
    assert len(one_gpu) == 12 and one_gpu == tune_cache.fingerprint(["0000:00:06.0".upper()] * 4, lambda a, b: False)
    four = ["0000:19:00.0", "0000:39:00.0", "0000:59:00.0", "0000:79:00.0"]
    full = tune_cache.fingerprint(four, lambda a, b: True)
    assert full != tune_cache.fingerprint(four, lambda a, b: {a, b} != {four[0], four[3]})
    assert full != tune_cache.fingerprint(four[::-1], lambda a, b: True)  # rank order is part of the placement
    assert full != one_gpu

    class Ext:
        def device_by_pci_bus_id(self, bus: str) -> int:
            return four.index(bus)

        def can_access_peer(self, a: int, b: int) -> bool:
            return True

    assert tune_cache.fingerprint_of(Ext(), four) == full
    path = tune_cache.table_path("NVIDIA H200", 4, full, str(tmp_path))
    assert os.path.basename(path) == f"nvidia-h200-w4-{full}.json"
    tune_cache.write_table(path, algo_mod.default_table().to_json(), {"world": 4})
    loaded = algo_mod.load_table(environ={"PCIE_AR_ALGO_TABLE": path})
    assert loaded == algo_mod.default_table()
    assert json.loads(open(path).read())["meta"] == {"world": 4}


def test_raw_launch_backend_arguments(monkeypatch) -> None:
    from bench import backend_ours_shapes
    from bench.backends import Buffers

    launched = []

    class Workspace:
        def all_reduce(self, *args):
            launched.append(args)
            return 0

    class Comm:
        device = torch.device("cpu")
        block_cap = 16
        ll_capacity = 512 << 10

        def workspace(self, stream):
            assert stream == 77
            return Workspace()

    class Stream:
        cuda_stream = 77

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    backend = backend_ours_shapes.OursShapesBackend.__new__(backend_ours_shapes.OursShapesBackend)
    backend._comm = Comm()
    x = torch.zeros(512, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    assert backend.call(Buffers(x, out), "staged/b8") is out
    assert launched == [(algo_mod.ALGO_IDS["staged"], x.data_ptr(), out.data_ptr(), 1024, 2, 8, 77)]
    case = plan.Case(0, 1024, 512, "twoshot/b32")
    assert "32 blocks > block cap 16" in backend.skip_reason(case)
    assert backend.skip_reason(plan.Case(0, 1024, 512, "twoshot/b16")) is None


def test_tune_rank_loop_on_cpu_skips_shapes_over_the_cap(monkeypatch) -> None:
    fakes.use_cpu_ranks(monkeypatch)
    cfg = BenchConfig(worlds=(2,), sizes=(1024,), algos=("oneshot", "twoshot"), blocks=(2, 8),
                      backends=(OURS_SHAPES,), workload=TUNE, eager=True, iters=3, warmup=1, calls_per_graph=2,
                      setup_timeout_s=60.0, retries=0)
    rep = runner.run_sweep(cfg, 1, {"gpus": []}, lambda _: None)
    status = {r.algo: r.status for r in rep.results}
    assert status == {"oneshot/b2": OK, "oneshot/b8": SKIPPED, "twoshot/b2": OK, "twoshot/b8": SKIPPED}
    assert "blocks > block cap" in next(r.error for r in rep.results if r.status == SKIPPED)
    assert command.exit_status(rep) == 0  # skipped by design is not a failure
    assert rep.environment["ranks"]["2"]["fingerprint"] == "0123456789ab"


def _fake_tune_report() -> Report:
    cfg = BenchConfig(worlds=(2, 8), sizes=(1024, 14336, 458752, 4 << 20), algos=("oneshot", "staged", "twoshot"),
                      blocks=(1, 2, 4, 8, 16, 32), backends=(OURS_SHAPES,), workload=TUNE)
    facts = {"gpu_name": "NVIDIA H200", "fingerprint": "abcdef012345", "block_cap": 16}
    env = {"gpus": ["NVIDIA H200"], "ranks": {"2": dict(facts, block_cap=64), "8": facts}}
    placements = {2: environment.placement_label(2, 1, True), 8: environment.placement_label(8, 1, True)}
    return Report(env, cfg.to_dict(), placements, _fake_results())


def test_tune_command_end_to_end(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(command, "sweep", lambda cfg, gpus, desc: _fake_tune_report())
    cache = tmp_path / "cache"
    assert cli.main(["tune", "--world", "2", "8", "--sizes", "1K", "14K", "448K", "4M", "--blocks", "1", "2", "4",
                     "8", "16", "32", "--cache-dir", str(cache), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    matrix = out.split("# W=2 |")[1]
    assert "b=32" in matrix and "skip" in out.split("# W=8 |")[1]
    written = sorted(os.listdir(cache))
    assert written == ["nvidia-h200-w2-abcdef012345.json", "nvidia-h200-w8-abcdef012345.json"]
    assert f"export PCIE_AR_ALGO_TABLE={cache}/nvidia-h200-w8-abcdef012345.json" in out
    table = algo_mod.load_table(str(cache / written[1]))
    assert table.select(4 << 20, 8, "bfloat16") == algo_mod.Choice("twoshot", 16)
    assert table.select(14336, 8, "bfloat16") == algo_mod.Choice("oneshot", 4)
    meta = json.loads((cache / written[1]).read_text())["meta"]
    assert meta["world"] == 8 and meta["picks"][0][:3] == [1024, "oneshot", 1]
    assert {"tune.csv", "tune.json", "tune.txt"} <= set(os.listdir(tmp_path / "out"))
    assert "tuned" in out and "default" in out and "gain" in out


def test_tune_dry_run_writes_nothing(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(command, "sweep", lambda cfg, gpus, desc: _fake_tune_report())
    assert cli.main(["tune", "--world", "2", "8", "--dry-run", "--cache-dir", str(tmp_path)]) == 0
    assert os.listdir(tmp_path) == [] and "--dry-run: would write" in capsys.readouterr().out
