"""CPU tests of ``pcie-allreduce tune --fused-tokens``: choosing between the fused kernels and the
unfused pair per (W, tokens), the fused rules that make those choices, one fused call's check and
timing in a one-rank gloo group with the CUDA calls faked, and the command end to end."""

from __future__ import annotations

import json
import os
import random
import types

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.plan import algorithms, tables
from pcie_allreduce.plan.algorithms import UNFUSED
from pcie_allreduce.tools import cli, ranks, timing
from pcie_allreduce.tools.tune import cli as tune_cli
from pcie_allreduce.tools.tune import derive, measure
from pcie_allreduce.tools.tune.derive import FusedMeasurement, FusedPick
from tests import test_tune as plain_tune

KERNELS = algorithms.FUSED_KERNELS
# The plain tune tests' fixtures: a one-rank gloo group with the CUDA calls faked, and a machine
# whose plain measurement is scripted.
one_rank = plain_tune.one_rank
fake_machine = plain_tune.fake_machine


def _f(world: int, tokens: int, algo: str, p50: float | None, status: str = derive.OK) -> FusedMeasurement:
    return FusedMeasurement(world, tokens, 7168, algo, status, p50, p50, 30 if p50 else 0)


def test_a_fused_kernel_is_taken_only_where_it_beats_the_pair_by_more_than_the_tolerance() -> None:
    rows = [_f(4, 1, UNFUSED, 10.0), _f(4, 1, "oneshot_full", 8.0), _f(4, 1, "oneshot", 9.0),
            _f(4, 8, UNFUSED, 10.0), _f(4, 8, "oneshot_full", 9.8),                     # within 3%: a tie
            _f(4, 64, UNFUSED, 20.0), _f(4, 64, "twoshot", 12.0, status=derive.WRONG),  # wrong: never taken
            _f(4, 64, "oneshot", 25.0),
            _f(4, 128, "oneshot", 5.0)]                                                 # no pair measured
    picks = derive.pick_fused(rows, tolerance=0.03)
    assert [(p.tokens, p.algo, p.fastest_algo) for p in picks] == [
        (1, "oneshot_full", "oneshot_full"), (8, UNFUSED, "oneshot_full"), (64, UNFUSED, "oneshot")]
    assert derive.pick_fused(rows, tolerance=0.0)[1].algo == "oneshot_full"
    only_pair = derive.pick_fused([_f(2, 4, UNFUSED, 3.0), _f(2, 4, "oneshot_ll", None, status=derive.SKIPPED)])
    assert only_pair == [FusedPick(2, 4, UNFUSED, 3.0, None, None, 7168)]


def test_the_fused_rules_make_the_picks_and_leave_other_worlds_to_the_built_in_rules() -> None:
    picks = [FusedPick(8, t, a, 10.0, None, None) for t, a in
             ((1, "oneshot_full"), (2, "oneshot_full"), (4, UNFUSED), (16, UNFUSED), (128, "twoshot"))]
    rules = derive.fused_rules_for_world(8, picks)
    assert [(r.algo, r.max_tokens, r.world) for r in rules] == [
        ("oneshot_full", 2, (8,)), (UNFUSED, 16, (8,)), ("twoshot", None, (8,))]
    table = derive.with_fused_rules(tables.default_table(), picks)
    assert [table.select_fused(t, 8) for t in (1, 2, 3, 4, 16, 17, 128, 4096)] == [
        "oneshot_full", "oneshot_full", UNFUSED, UNFUSED, UNFUSED, "twoshot", "twoshot", "twoshot"]
    default = tables.default_table()
    for world in (2, 4, 16):
        assert [table.select_fused(t, world) for t in (1, 4, 64)] == [default.select_fused(t, world) for t in (1, 4, 64)]
    assert tables.AlgoTable.from_json(table.to_json()) == table


def test_fused_rules_from_a_measured_width_hold_for_that_width_alone() -> None:
    """Tuned at 7168 columns: calls of 7168 take the picks; rows of another width, and a choice
    asked without a width, keep the built-in rules (the width-bounded 8192 rules of W = 5-8 too)."""
    rows = [_f(8, t, algo, p50) for t, algo, p50 in
            ((4, UNFUSED, 10.0), (4, "oneshot_full", 7.0), (64, UNFUSED, 40.0), (64, "oneshot", 45.0))]
    picks = derive.pick_fused(rows)
    assert [(p.tokens, p.algo, p.hidden) for p in picks] == [(4, "oneshot_full", 7168), (64, UNFUSED, 7168)]
    rules = derive.fused_rules_for_world(8, picks)
    assert [(r.algo, r.max_tokens, r.min_hidden, r.max_hidden) for r in rules] == [
        ("oneshot_full", 4, 7168, 7168), (UNFUSED, None, 7168, 7168)]
    table, default = derive.with_fused_rules(tables.default_table(), picks), tables.default_table()
    assert [table.select_fused(t, 8, hidden=7168) for t in (1, 4, 5, 64, 128)] == [
        "oneshot_full", "oneshot_full", UNFUSED, UNFUSED, UNFUSED]
    for hidden in (4096, 8192, None):
        assert [table.select_fused(t, 8, hidden=hidden) for t in (1, 4, 32, 128)] == [
            default.select_fused(t, 8, hidden=hidden) for t in (1, 4, 32, 128)], hidden
    assert tables.AlgoTable.from_json(table.to_json()) == table


def test_the_fused_rules_reproduce_random_picks() -> None:
    rng = random.Random(11)
    for _ in range(100):
        tokens = sorted(rng.sample(range(1, 300), rng.randint(1, 8)))
        worlds = rng.sample(range(2, 17), rng.randint(1, 3))
        picks = [FusedPick(w, t, rng.choice((UNFUSED, *KERNELS)), 1.0, None, None) for w in worlds for t in tokens]
        table = derive.with_fused_rules(tables.default_table(), picks)
        assert all(table.select_fused(p.tokens, p.world) == p.algo for p in picks), picks
        assert all(len(derive.fused_rules_for_world(w, picks)) <= len(tokens) for w in worlds)


@pytest.mark.parametrize("argv", [["--fused-tokens", "4"], ["--hidden", "7168"],
                                  ["--fused-tokens", "4", "--hidden", "7168", "--dtype", "float32"],
                                  ["--fused-tokens", "0", "--hidden", "7168"],
                                  ["--fused-tokens", "4", "--hidden", "16385"]])
def test_bad_fused_options(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        plain_tune._parse(argv)
    assert info.value.code == 2 and "Traceback" not in capsys.readouterr().err


# ---- one fused call in a one-rank gloo group, the CUDA calls faked --------------------------------


class _FusedComm:
    """One rank: ``all_reduce`` is the identity; ``all_reduce_rmsnorm`` writes what the library
    promises (``corrupt``: one residual element off by that much; ``drift``: the normed rows
    scaled by 1 + drift)."""

    world_size, block_cap, ll_capacity, transport, island_ranks = 1, 16, 512 << 10, "p2p", 0

    def __init__(self, corrupt: float = 0.0, drift: float = 0.0) -> None:
        self.corrupt, self.drift, self.calls = corrupt, drift, []

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return x.clone() if out is None else out

    def all_reduce_rmsnorm(self, x, residual, weight, eps, *, out, residual_out, algo):
        self.calls.append(algo)
        residual_out.copy_(residual + x)
        residual_out[0, 3] += self.corrupt
        rows = residual_out.float()
        normed = rows * torch.rsqrt(rows.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
        out.copy_(normed * (1 + self.drift))

    def check(self) -> None:
        pass


def _fused_call(ctx, comm: _FusedComm, algo: str = "oneshot", tokens: int = 3, hidden: int = 50):
    stream = types.SimpleNamespace(cuda_stream=77, synchronize=lambda: None, wait_stream=lambda other: None)
    plain = measure.TuneJob(sizes=(1024,), algos=("oneshot",), blocks=(1,), iters=12, warmup=1, calls_per_graph=4)
    job = measure.FusedJob(tokens=(tokens,), hidden=hidden, table=tables.default_table(), plain=plain)
    call = measure._FusedCall(ctx, comm, stream, tokens, job, torch.bfloat16)
    return call.measure(algo), call


def test_a_fused_call_is_checked_on_poisoned_outputs_then_timed(one_rank) -> None:
    row, call = _fused_call(one_rank, _FusedComm())
    assert row["status"] == derive.OK and row["replays"] >= timing.MIN_REPLAYS and row["p50_us"] >= 0
    assert call.comm.calls == ["oneshot"] * (1 + 4)  # the check, then the captured calls
    assert torch.equal(call.new_residual, call.residual + call.x)


def test_a_fused_call_with_a_wrong_residual_or_norm_is_not_timed(one_rank) -> None:
    row, call = _fused_call(one_rank, _FusedComm(corrupt=1.0))
    assert row == {"status": derive.WRONG, "error": "rank 0: the new residual is not residual + all_reduce(x)"}
    assert call.comm.calls == ["oneshot"]
    row, _ = _fused_call(one_rank, _FusedComm(drift=0.05))
    assert row["status"] == derive.WRONG and "normed rows" in row["error"]
    row, _ = _fused_call(one_rank, _FusedComm(drift=2 ** -10))  # within a bf16 unit: a kernel's last bit
    assert row["status"] == derive.OK


def test_a_fused_kernel_that_cannot_take_the_shape_is_skipped() -> None:
    """The data-as-flag one-shots need an even hidden size: forced, the plan refuses, and tune
    records why instead of launching."""
    comm = types.SimpleNamespace(world_size=4, table=tables.default_table(), ll_capacity=512 << 10, block_cap=64,
                                 transport="p2p", island_ranks=0)
    assert measure._fused_skip_reason(comm, "oneshot_full", 4, 7168, torch.bfloat16) is None
    assert measure._fused_skip_reason(comm, "oneshot_full", 4, 7167, torch.bfloat16)
    assert measure._fused_skip_reason(comm, "oneshot", 4, 7167, torch.bfloat16) is None


# ---- the command -----------------------------------------------------------------------------------


def _fake_fused_world(world: int, job: measure.FusedJob, timeout_s: float) -> list[FusedMeasurement]:
    """W = 8: the data-as-flag one-shot wins at one token, the pair beyond; the plain table the
    run derived (its measured pick at 14 KiB) reaches the ranks."""
    assert job.table.select(14336, world, "bfloat16").algo == "oneshot" and job.hidden == 7168
    rows = []
    for tokens in job.tokens:
        rows.append(FusedMeasurement(world, tokens, job.hidden, UNFUSED, derive.OK, 10.0 + tokens, 11.0, 30))
        rows.append(FusedMeasurement(world, tokens, job.hidden, "oneshot_full", derive.OK,
                                     8.0 if tokens == 1 else 12.0 + tokens, 13.0, 30))
        rows.append(FusedMeasurement(world, tokens, job.hidden, "twoshot", derive.SKIPPED, error="needs tokens"))
    return rows


def test_tune_writes_fused_rules_into_the_table(fake_machine, monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(tune_cli, "measure_fused_world", _fake_fused_world)
    cache = tmp_path / "cache"
    assert cli.main(["tune", "--world", "8", "--sizes", "1K", "14K", "--blocks", "1", "4", "--fused-tokens", "4", "1",
                     "32", "--hidden", "7168", "--cache-dir", str(cache), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "all_reduce_rmsnorm, hidden 7168" in out and "skip" in out.split("all_reduce_rmsnorm")[1]
    (written,) = os.listdir(cache)
    table = tables.load_table(str(cache / written))
    assert [table.select_fused(t, 8, hidden=7168) for t in (1, 2, 4, 32, 512)] == ["oneshot_full"] + [UNFUSED] * 4
    assert table.select_fused(1, 4) == tables.default_table().select_fused(1, 4)
    assert table.select_fused(32, 8, hidden=8192) == tables.default_table().select_fused(32, 8, hidden=8192) == "oneshot"
    meta = json.loads((cache / written).read_text())["meta"]
    assert meta["fused_picks"]["hidden"] == 7168 and meta["fused_picks"]["picks"][0][:2] == [1, "oneshot_full"]
    document = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert len(document["fused"]["measurements"]) == 3 * 3


def test_a_failed_fused_measurement_keeps_the_plain_table(fake_machine, monkeypatch, capsys, tmp_path) -> None:
    def fails(world: int, job: measure.FusedJob, timeout_s: float):
        raise RuntimeError("rank 2 hung\nin the fused kernel")

    monkeypatch.setattr(tune_cli, "measure_fused_world", fails)
    assert cli.main(["tune", "--world", "2", "--sizes", "1K", "14K", "--fused-tokens", "1", "--hidden", "4096",
                     "--cache-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "# all_reduce_rmsnorm: measurement failed: rank 2 hung in the fused kernel" in out
    (written,) = os.listdir(tmp_path)
    assert tables.load_table(str(tmp_path / written)).fused == tables.default_table().fused


@pytest.mark.skipif(ranks.skip_reason_no_gpu() is not None or not pcie_allreduce.is_available(),
                    reason=ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason() or "")
def test_tune_measures_the_fused_call_on_the_gpu(tmp_path, capsys) -> None:
    """Two ranks (sharing a GPU under MPS where there is one): the pair and every fused kernel
    that takes the shape are checked and timed at an odd token count and at one, nothing is
    wrong, and the table the run would write has fused rules for W = 2 only."""
    out = tmp_path / "out"
    assert cli.main(["tune", "--world", "2", "--sizes", "14K", "--blocks", "4", "--iters", "5", "--time-budget",
                     "0.05", "--fused-tokens", "1", "7", "--hidden", "1000", "--dry-run", "--out", str(out)]) == 0
    document = json.loads((out / "tune.json").read_text())
    rows = document["fused"]["measurements"]
    assert {(r["tokens"], r["algo"]) for r in rows} == {(t, a) for t in (1, 7) for a in (UNFUSED, *KERNELS)}
    assert all(r["status"] in (derive.OK, derive.SKIPPED) for r in rows), rows
    assert all(r["status"] == derive.OK for r in rows if r["algo"] in (UNFUSED, "oneshot")), rows
    assert "all_reduce_rmsnorm, hidden 1000" in capsys.readouterr().out
