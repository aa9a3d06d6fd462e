"""CPU tests of ``python -m bench --fused``: options, cases, the rank loop with the residual add +
RMSNorm checks (on CPU ranks with fake backends), and the report with its acceptance ratios."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from pcie_allreduce.tools.ranks import placement_label

from bench import __main__ as bench_cli
from bench import backends, command, environment, norm_ops, options, pattern, plan, report, report_fused, runner
from bench.backends import Buffers
from bench.norm_ops import torch_rmsnorm
from bench.results import (
    FAILED, FUSED, OK, SKIPPED, WRONG, Report, Result, add_speedups, forced_fused_algo, fused_kernel_name,
    is_norm_algo, is_one_kernel_norm, split_norm,
)

from tests import _bench_fakes as fakes


def _config(argv: list[str], gpu_count: int = 1) -> options.BenchConfig:
    parser = bench_cli.build_parser()
    args = parser.parse_args(argv)
    return options.config_from_args(args, args.parser, gpu_count)


# ----------------------------------------------------------------------------- options and cases


def test_fused_defaults() -> None:
    cfg = _config(["--fused"])
    assert cfg.workload == FUSED and cfg.dtype == "bfloat16" and cfg.mode == "graph"
    assert [(s.tokens, s.hidden) for s in cfg.shapes] == [(1, 7168), (4, 7168), (32, 7168), (128, 7168)]
    assert cfg.sizes == (14336, 57344, 458752, 1835008) and cfg.max_bytes == 1835008
    cfg = _config(["--fused", "--tokens", "32", "4", "4", "--hidden", "4096", "--dtype", "float16", "--eps", "1e-5"])
    assert [(s.tokens, s.hidden) for s in cfg.shapes] == [(4, 4096), (32, 4096)] and cfg.eps == 1e-5
    assert json.loads(json.dumps(cfg.to_dict()))["shapes"][0] == {"tokens": 4, "hidden": 4096, "layers": 0,
                                                                  "model": ""}
    cfg = _config(["--fused", "--tokens", "8", "2", "--hidden", "8192", "4096", "8192"])
    assert [(s.tokens, s.hidden) for s in cfg.shapes] == [(2, 8192), (8, 8192), (2, 4096), (8, 4096)]
    assert cfg.max_bytes == 8 * 8192 * 2
    cases = runner.cases_for(cfg, "ours")
    assert [(c.tokens, c.hidden, c.count) for c in cases if c.algo == "fused"] == [
        (2, 8192, 16384), (8, 8192, 65536), (2, 4096, 8192), (8, 4096, 32768)]


def test_fused_algos_option() -> None:
    assert _config(["--fused"]).fused_algos == ("auto",)
    cfg = _config(["--fused", "--fused-algos", "auto", "oneshot_full", "oneshot", "twoshot", "unfused", "twoshot"])
    assert cfg.fused_algos == ("auto", "oneshot_full", "oneshot", "twoshot", "unfused")
    from pcie_allreduce.plan.algorithms import FUSED_ALGORITHMS

    assert options.fused_algo_names() == ("auto", *FUSED_ALGORITHMS) and "unfused" in FUSED_ALGORITHMS
    assert [c.algo for c in runner.cases_for(cfg, "ours")][:5] == [
        "fused", "fused:oneshot_full", "fused:oneshot", "fused:twoshot", "fused:unfused"]


def test_fused_option_parsing_stays_torch_free() -> None:
    """Without forced kernels the options never import torch (--help and usage errors stay fast)."""
    code = ("import sys; from bench import __main__ as m, options; p = m.build_parser(); "
            "a = p.parse_args(['--fused', '--fused-algos', 'auto']); options.config_from_args(a, p, 1); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("argv, fragment", [
    (["--fused", "--fused-algos", "oneshot", "threeshot"], "--fused-algos: unknown threeshot (choose from auto"),
    (["--fused-algos", "oneshot"], "--fused-algos only applies with --fused"),
    (["--fused", "--sizes", "1K"], "use --tokens/--hidden, not --sizes"),
    (["--fused", "--algos", "oneshot"], "not --algos"),
    (["--fused", "--dtype", "float32"], "needs --dtype bfloat16 or float16"),
    (["--tokens", "4"], "only apply with --fused"),
    (["--fused", "--hidden", "20000"], "--hidden"),
    (["--fused", "--tokens", "0"], "--tokens"),
])
def test_fused_bad_options(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _config(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


NORMS = ("+norm", "+addnorm", "+fi_addnorm", "+sgl_addnorm")


def test_fused_variants_per_backend() -> None:
    assert backends.algos_for("ours", (), FUSED) == ("fused", *(f"auto{n}" for n in NORMS), "auto")
    assert backends.algos_for("torch_symm", (), FUSED) == (
        *(f"one_shot{n}" for n in NORMS), *(f"two_shot{n}" for n in NORMS))
    assert backends.algos_for("nccl", (), FUSED) == tuple(f"default{n}" for n in NORMS)
    forced = backends.algos_for("ours", (), FUSED, fused_algos=("oneshot", "auto", "unfused"))
    assert forced[:3] == ("fused", "fused:oneshot", "fused:unfused") and forced[-1] == "auto"
    assert backends.algos_for("torch_symm", (), FUSED, fused_algos=("oneshot",)) == backends.algos_for(
        "torch_symm", (), FUSED)  # forced kernels are ours only
    cfg = options.BenchConfig(worlds=(2,), sizes=(128, 256), workload=FUSED,
                              shapes=(options.Shape(1, 64), options.Shape(2, 64)), fused_algos=("twoshot",))
    cases = runner.cases_for(cfg, "ours")
    assert [(c.index, c.tokens, c.hidden, c.count, c.size_bytes, c.algo) for c in cases[:3]] == [
        (0, 1, 64, 64, 128, "fused"), (1, 1, 64, 64, 128, "fused:twoshot"), (2, 1, 64, 64, 128, "auto+norm")]
    assert [c.algo for c in cases].count("fused") == 2 and len(cases) == 2 * 7
    assert all(c.calls == 0 for c in cases)
    assert is_norm_algo("fused") and is_norm_algo("fused:oneshot") and is_norm_algo("one_shot+norm")
    assert is_norm_algo("one_shot+sgl_addnorm") and not is_norm_algo("auto")
    assert norm_ops.base_algo("fused") == "auto" and norm_ops.base_algo("two_shot+norm") == "two_shot"
    assert norm_ops.base_algo("fused:twoshot") == "auto" and norm_ops.base_algo("pcie_ipc+fi_addnorm") == "pcie_ipc"


def test_norm_suffixes_and_labels() -> None:
    assert split_norm("auto+addnorm") == ("auto", "+addnorm")
    assert split_norm("auto+fi_addnorm") == ("auto", "+fi_addnorm")
    assert split_norm("custom_ar+sgl_addnorm") == ("custom_ar", "+sgl_addnorm") and split_norm("auto") == ("auto", "")
    assert [is_one_kernel_norm(a) for a in ("a+norm", "a+addnorm", "a+fi_addnorm", "a+sgl_addnorm", "fused")] == [
        False, True, True, True, False]
    assert forced_fused_algo("auto") == "fused" and forced_fused_algo("twoshot") == "fused:twoshot"
    assert fused_kernel_name("fused") == "auto" and fused_kernel_name("fused:oneshot_ll") == "oneshot_ll"
    assert _row("ours", "auto+addnorm", 4, 1.0, resolved_algo="oneshot+addnorm").label == "auto(oneshot)+addnorm"
    assert _row("ours", "fused:twoshot", 4, 1.0, resolved_algo="twoshot").label == "fused:twoshot"
    assert _row("ours", "fused:unfused", 4, 1.0, resolved_algo="oneshot").label == "fused:unfused(oneshot)"
    assert _row("ours", "auto+fi_addnorm", 4, 1.0, resolved_algo="oneshot+fi_addnorm").wire is not None


def test_norm_pattern_is_exact() -> None:
    hidden, tokens, world = 64, 3, 4
    w = pattern.weight_values(hidden, torch.bfloat16)
    assert torch.equal(w.float(), (1 + ((torch.arange(hidden) * 7) % 9 - 4) / 16).float())
    res = pattern.residual_input(tokens * hidden, 0, torch.bfloat16)
    total = pattern.expected_sum(tokens * hidden, world, 0, torch.bfloat16)
    exact = (res.to(torch.int64) + total.to(torch.int64)).view(tokens, hidden)
    assert torch.equal((res + total).view(tokens, hidden).to(torch.int64), exact)  # bf16 add of small integers
    normed = pattern.expected_norm(exact.to(torch.bfloat16), w, 1e-6)
    ref = exact.double() * torch.rsqrt(exact.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert norm_ops.close_enough(normed, ref) is None
    assert "normed: 1 of" in norm_ops.close_enough(normed.index_put((torch.tensor([0]), torch.tensor([0])),
                                                                  torch.tensor(9.0, dtype=torch.bfloat16)), ref)


def test_torch_add_rmsnorm_matches_the_formula() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.randn(4, 32, generator=g).to(torch.bfloat16)
    res = torch.randn(4, 32, generator=g).to(torch.bfloat16)
    w = pattern.weight_values(32, torch.bfloat16)
    normed, new_res = torch.empty_like(y), torch.empty_like(y)
    norm_ops.torch_add_rmsnorm(y, res, w, 1e-6, normed, new_res)
    assert torch.equal(new_res, res + y)
    h = new_res.double()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert norm_ops.close_enough(normed, want) is None


# ----------------------------------------------------------------------------- rank loop on CPU ranks


def test_fused_rank_loop_on_cpu(monkeypatch) -> None:
    fakes.use_cpu_ranks(monkeypatch)
    cfg = options.BenchConfig(worlds=(2,), sizes=(128, 256, 384), backends=("ours", "torch_symm"), workload=FUSED,
                              shapes=tuple(options.Shape(t, 64) for t in (1, 2, 3)), eager=True, iters=3, warmup=1,
                              calls_per_graph=2, setup_timeout_s=60.0, retries=0)
    bar = fakes.RecordingBar()
    rep = runner.run_sweep(cfg, 1, {"gpus": []}, lambda _: None, bar)
    by = {(r.backend, r.algo, r.tokens): r for r in rep.results}
    assert bar.done == runner.total_cases(cfg) == 3 * (6 + 8)
    for tokens in (1, 2, 3):
        for norm in ("+norm", "+addnorm", "+fi_addnorm"):
            assert by[("ours", f"auto{norm}", tokens)].status == OK
            assert by[("torch_symm", f"one_shot{norm}", tokens)].status == OK
            assert by[("torch_symm", f"two_shot{norm}", tokens)].status == OK  # its input was zeroed before timing
        assert by[("ours", "auto", tokens)].status == OK
        sgl = by[("torch_symm", "one_shot+sgl_addnorm", tokens)]
        assert sgl.status == SKIPPED and "sgl_kernel does not import here (ModuleNotFoundError" in sgl.error
    assert by[("ours", "fused", 1)].status == OK and by[("ours", "fused", 1)].p50_us > 0
    assert by[("ours", "fused", 1)].resolved_algo == "oneshot" and by[("ours", "fused", 1)].label == "fused(oneshot)"
    assert by[("ours", "auto+norm", 1)].label == "auto(oneshot)+norm"
    assert by[("ours", "auto+addnorm", 1)].label == "auto(oneshot)+addnorm"
    wrong = by[("ours", "fused", 2)]
    assert wrong.status == WRONG and wrong.error.startswith("rank 1: new_residual: 1 of 128 elements wrong")
    rounding = by[("ours", "fused", 3)]
    assert rounding.status == WRONG and "not bitwise equal to residual + all_reduce(x) on random data" in rounding.error
    assert {r.workload for r in rep.results} == {FUSED} and all(r.hidden == 64 for r in rep.results)
    assert rep.environment["ranks"]["2"]["gpu_name"] == "Fake GPU"  # the backend's facts reach the setup event


def test_forced_fused_kernels_and_in_place_baselines_on_cpu(monkeypatch) -> None:
    """--fused-algos: one row per forced kernel; one that cannot take the shape is skipped with the
    library's message. NCCL's all-reduce is in place, so FlashInfer's in-place norm writes each
    call's output into the next call's input: checked before timing, not after."""
    fakes.use_cpu_ranks(monkeypatch)
    cfg = _config(["--fused", "--world", "2", "--tokens", "1", "4", "--hidden", "64", "--backends", "ours", "nccl",
                   "--fused-algos", "auto", "oneshot_ll", "twoshot", "unfused", "--eager", "--iters", "3",
                   "--warmup", "1", "--calls-per-graph", "2"])
    cfg = dataclasses.replace(cfg, setup_timeout_s=60.0, retries=0)
    rep = runner.run_sweep(cfg, 1, {"gpus": []}, lambda _: None)
    by = {(r.backend, r.algo, r.tokens): r for r in rep.results}
    assert by[("ours", "fused", 4)].status == OK and by[("ours", "fused", 4)].label == "fused(twoshot)"
    assert by[("ours", "fused:oneshot_ll", 1)].status == OK and by[("ours", "fused:oneshot_ll", 1)].label == \
        "fused:oneshot_ll"
    ll = by[("ours", "fused:oneshot_ll", 4)]
    assert ll.status == SKIPPED and "fused:oneshot_ll: fused oneshot_ll cannot take [4, 64]" in ll.error
    assert by[("ours", "fused:twoshot", 4)].status == OK
    assert by[("ours", "fused:unfused", 4)].status == OK and by[("ours", "fused:unfused", 4)].label == \
        "fused:unfused(oneshot)"
    for tokens in (1, 4):
        assert by[("nccl", "default+fi_addnorm", tokens)].status == OK
        assert by[("nccl", "default+addnorm", tokens)].status == OK
        assert by[("nccl", "default+sgl_addnorm", tokens)].status == SKIPPED
    assert command.exit_status(rep) == 0  # skipped rows are no failure


def test_rounds_interleave_cases_and_pool_their_replays(monkeypatch) -> None:
    """--rounds 2: every case is timed twice (half the replays each, pooled into one row); a case
    found wrong in the first round is reported once and not timed again."""
    fakes.use_cpu_ranks(monkeypatch)
    cfg = _config(["--fused", "--world", "2", "--tokens", "1", "2", "--hidden", "64", "--backends", "ours", "--eager",
                   "--iters", "6", "--warmup", "1", "--calls-per-graph", "2", "--rounds", "2"])
    assert cfg.rounds == 2 and runner.make_job(cfg, "ours", (), "/tmp").rounds == 2
    cfg = dataclasses.replace(cfg, setup_timeout_s=60.0, retries=0)
    bar = fakes.RecordingBar()
    rep = runner.run_sweep(cfg, 1, {"gpus": []}, lambda _: None, bar)
    by = {(r.algo, r.tokens): r for r in rep.results}
    assert bar.done == runner.total_cases(cfg) == 12 == len(rep.results)
    assert by[("fused", 1)].status == OK and by[("fused", 1)].replays == 6, "3 + 3 replays pooled"
    assert by[("auto", 2)].status == OK and by[("auto", 2)].replays == 6
    assert by[("fused", 2)].status == WRONG  # the scripted fault at T=2, caught in round 1
    assert "2 interleaved rounds (replays pooled)" in report.format_world(rep, 2)


# ----------------------------------------------------------------------------- report


def _row(backend: str, algo: str, tokens: int, p50: float | None, world: int = 4, status: str = OK, **kw) -> Result:
    return Result(world=world, backend=backend, algo=algo, size_bytes=tokens * 7168 * 2, count=tokens * 7168,
                  dtype="bfloat16", status=status, p50_us=p50, p99_us=None if p50 is None else p50 * 1.2,
                  replays=50, calls_per_graph=16, workload=FUSED, tokens=tokens, hidden=7168, **kw)


def fake_fused_report() -> Report:
    rows = [
        _row("ours", "fused", 4, 11.0, resolved_algo="oneshot"),
        _row("ours", "fused:oneshot", 4, 11.5, resolved_algo="oneshot"),
        _row("ours", "fused:oneshot_ll", 4, None, status=SKIPPED, resolved_algo="oneshot_ll",
             error="rank 0: fused:oneshot_ll: fused oneshot_ll cannot take [4, 7168] torch.bfloat16"),
        _row("ours", "auto+norm", 4, 18.0, resolved_algo="oneshot+norm"),
        _row("ours", "auto+addnorm", 4, 13.0, resolved_algo="oneshot+addnorm"),
        _row("ours", "auto", 4, 10.0, resolved_algo="oneshot"),
        _row("torch_symm", "one_shot+norm", 4, 16.0),
        _row("torch_symm", "one_shot+fi_addnorm", 4, 12.5),
        _row("torch_symm", "two_shot+norm", 4, 20.0),
        _row("ours", "fused", 128, 40.0, resolved_algo="twoshot"),
        _row("ours", "fused:oneshot", 128, 60.0, resolved_algo="oneshot"),
        _row("ours", "auto+norm", 128, 45.0, resolved_algo="twoshot+norm"),
        _row("ours", "auto+addnorm", 128, 42.0, resolved_algo="twoshot+addnorm"),
        _row("ours", "auto", 128, 30.0, resolved_algo="twoshot"),
        _row("torch_symm", "one_shot+norm", 128, None, status=FAILED, error="rank 0: boom"),
        _row("torch_symm", "two_shot+norm", 128, 50.0),
        _row("torch_symm", "two_shot+addnorm", 128, 44.0),
    ]
    config = options.BenchConfig(worlds=(4,), sizes=(57344, 1835008), workload=FUSED,
                                 shapes=(options.Shape(4, 7168), options.Shape(128, 7168))).to_dict()
    return Report({"gpus": ["NVIDIA H200"], "date": "2026-11-30"}, config,
                  {4: placement_label(4, 1, True)}, add_speedups(rows))


def test_fused_speedups_compare_like_with_like() -> None:
    by = {(r.algo, r.tokens): r for r in fake_fused_report().results}
    # against torch_symm's best norm row of any kind: its all-reduce + FlashInfer's one kernel
    assert by[("fused", 4)].reference == "torch_symm" and by[("fused", 4)].speedup == pytest.approx(12.5 / 11)
    assert by[("auto+norm", 4)].speedup == pytest.approx(12.5 / 18)
    assert by[("auto", 4)].speedup is None  # a plain all-reduce is not compared with all-reduce + norm rows
    assert by[("fused", 128)].speedup == pytest.approx(44 / 40)


def test_fused_goals() -> None:
    assert [report_fused.goal_vs_allreduce(t) for t in (1, 4, 32, 64, 128)] == [1.10, 1.10, 1.10, 1.15, 1.15]
    assert report_fused.GOAL_VS_ONE_KERNEL == 0.85


def test_fused_summary_ratios() -> None:
    four, big = report_fused.summary_rows(fake_fused_report())
    assert (four["world"], four["tokens"]) == (4, 4) and four["fused"].p50_us == 11.0
    assert four["ours_allreduce"].p50_us == 10.0 and four["ours_one_kernel"].p50_us == 13.0
    assert four["best_one_kernel"].algo == "one_shot+fi_addnorm" and four["ours_eager"].p50_us == 18.0
    assert four["fused_vs_allreduce"] == pytest.approx(1.1) and four["goal_vs_allreduce"] == 1.10
    assert four["fused_vs_ours_one_kernel"] == pytest.approx(11 / 13)
    assert four["fused_vs_best_one_kernel"] == pytest.approx(11 / 12.5)  # judged against the best one kernel
    assert four["forced"]["fused:oneshot"].p50_us == 11.5 and four["forced"]["fused:oneshot_ll"] is None
    assert big["best_one_kernel"].backend == "ours" and big["fused_vs_best_one_kernel"] == pytest.approx(40 / 42)
    assert big["goal_vs_allreduce"] == 1.15 and big["fused_vs_allreduce"] == pytest.approx(40 / 30)
    # what a fused call may spend above our plain all-reduce: 0.85 x the best pair - that all-reduce
    assert four["headroom_us"] == pytest.approx(0.85 * 12.5 - 10)
    assert big["headroom_us"] == pytest.approx(0.85 * 42 - 30)


def test_fused_goal_count_names_the_points_out_of_reach() -> None:
    def entry(ratio: float | None, headroom: float | None) -> dict:
        return {"fused_vs_best_one_kernel": ratio, "headroom_us": headroom}

    entries = [entry(0.80, 1.5), entry(0.85, 0.2), entry(0.97, -0.4), entry(0.90, 0.7), entry(None, None)]
    assert report_fused.goal_count(entries) == (
        "# fused/best1k <= 0.85 at 2 of 4 points; at 1 of them 0.85 x best 1-kernel is below our plain all-reduce "
        "alone (headroom < 0)")
    assert report_fused.headroom_us(None, None) is None


def test_fused_report_table_and_summary() -> None:
    text = report.format_report(fake_fused_report())
    assert text.startswith("# pcie_allreduce bench --fused | NVIDIA H200 x1")
    header = next(line for line in text.splitlines() if line.startswith("#") and "tokens" in line and "hidden" in line)
    assert header.lstrip("#").split() == ["tokens", "hidden", "size(B)", "backend", "algo", "p50(us)", "p99(us)",
                                          "wire(B)", "wire(GB/s)", "speedup", "status"]
    row = next(line.split() for line in text.splitlines() if "fused(oneshot)" in line)
    assert row[:5] == ["4", "7168", "57344", "ours", "fused(oneshot)"] and row[5] == "11.00" and row[9] == "1.14x"
    # the fused one-shot moves what the plain one-shot moves: the message to each of 3 peers
    assert row[7] == f"{3 * 57344}/{3 * 57344}" and float(row[8]) == pytest.approx(3 * 57344 / 11e3, abs=0.01)
    forced = next(line.split() for line in text.splitlines() if " fused:oneshot " in line)
    assert forced[4:6] == ["fused:oneshot", "11.50"] and forced[7] == f"{3 * 57344}/{3 * 57344}"
    skipped = next(line.split() for line in text.splitlines() if " fused:oneshot_ll " in line)
    assert skipped[5] == "-" and skipped[-1] == "skipped"
    other = next(line.split() for line in text.splitlines() if not line.startswith("#") and " torch_symm " in line)
    assert other[7] == "-"  # other backends' formats are theirs
    assert any("auto(twoshot)+norm" in line for line in text.splitlines())
    assert any("auto(oneshot)+addnorm" in line for line in text.splitlines())
    assert "best torch_symm row of the same tokens and op" in text
    summary = [line for line in text.splitlines() if line.split()[:2] in (["4", "4"], ["4", "128"])]
    header = next(line for line in text.splitlines() if line.startswith("# W ") and "best 1-kernel" in line)
    assert header.lstrip("#").split() == [
        "W", "tokens", "hidden", "fused", "(ran)", "fused:oneshot", "fused:oneshot_ll", "AR", "AR+addnorm", "best",
        "1-kernel", "(which)", "AR+norm", "fused/AR(<=1.10|1.15)", "fused/(AR+addnorm)", "fused/best1k(<=0.85)",
        "headroom"]
    four = summary[0].split()
    # W, tokens, hidden, fused, what it ran, forced..., AR, AR+addnorm, best 1-kernel, which, AR+norm, verdicts
    assert four[:12] == ["4", "4", "7168", "11.00", "oneshot", "11.50", "-", "10.00", "13.00", "12.50",
                         "torch_symm/one_shot+fi_addnorm", "18.00"]
    assert four[12:] == ["1.10", "ok", "0.85", "0.88", "MISS", f"{0.85 * 12.5 - 10:.2f}"]
    big = summary[1].split()
    assert big[2:12] == ["7168", "40.00", "twoshot", "60.00", "-", "30.00", "42.00", "42.00",
                         "ours/auto(twoshot)+addnorm", "45.00"]
    assert big[12:] == ["1.33", "MISS", "0.95", "0.95", "MISS", "5.70"]
    assert "# fused/best1k <= 0.85 at 0 of 2 points; at 0 of them" in text
    assert "fused/AR <= 1.10 for T <= 32, <= 1.15 above; fused/best1k <= 0.85" in text


def test_fused_csv_json_and_file_names(tmp_path) -> None:
    rep = fake_fused_report()
    rows = list(csv.DictReader(io.StringIO(report.to_csv(rep.results))))
    fused = next(r for r in rows if r["algo"] == "fused" and r["tokens"] == "4")
    assert fused["workload"] == FUSED and fused["hidden"] == "7168" and fused["resolved_algo"] == "oneshot"
    assert fused["pass_ms"] == ""
    data = json.loads(report.to_json(rep))
    assert data["config"]["workload"] == FUSED and data["results"][0]["tokens"] in (4, 128)
    paths = report.write_outputs(rep, str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["fused.csv", "fused.json", "fused.txt"]


def test_fused_command_end_to_end(monkeypatch, capsys, tmp_path) -> None:
    seen = {}

    def fake_sweep(cfg, gpus, env, echo, bar):
        seen["cfg"] = cfg
        return fake_fused_report()

    monkeypatch.setattr(command, "unavailable_reason", lambda cfg: None)
    monkeypatch.setattr(environment, "host_environment", lambda: {})
    monkeypatch.setattr(runner, "run_sweep", fake_sweep)
    assert bench_cli.main(["--fused", "--tokens", "4", "128", "--world", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert seen["cfg"].workload == FUSED and seen["cfg"].worlds == (4,)
    assert "fused/best1k(<=0.85)" in out.out and f"wrote {tmp_path}/fused.json" in out.err
    assert {"fused.csv", "fused.json", "fused.txt"} <= {p.name for p in tmp_path.iterdir()}


# ----------------------------------------------------------------------------- one-kernel baselines' checks


def _adapter(monkeypatch, kernels: dict, algos: tuple[str, ...]) -> norm_ops.NormAdapter:
    """A NormAdapter over a do-nothing backend (the one-kernel cross-check is not collective)."""
    monkeypatch.setattr(norm_ops, "load_kernel", lambda suffix: kernels[suffix])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ctx = type("Ctx", (), {"device": torch.device("cpu"), "rank": 0, "world_size": 1})()
    cases = tuple(plan.Case(i, 2 * 64 * 2, 2 * 64, a, tokens=2, hidden=64) for i, a in enumerate(algos))
    job = plan.RankJob(backend="nccl", dtype="bfloat16", cases=cases, max_bytes=256, progress_dir="/tmp")
    return norm_ops.NormAdapter(fakes.FakeBackend.__new__(fakes.FakeBackend), ctx, job)


def _norm_bufs() -> norm_ops.NormBuffers:
    """A [2, 64] bf16 case's buffers: the cross-check reads only the shape, dtype and weight."""
    def bf16(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.bfloat16)

    return norm_ops.NormBuffers(inp=bf16(128), out=bf16(128), inner=None, residual=bf16(2, 64),
                                weight=pattern.weight_values(64, torch.bfloat16), normed=bf16(2, 64),
                                new_residual=bf16(2, 64), tokens=2, hidden=64)


def test_one_kernel_cross_checks(monkeypatch) -> None:
    def rounded_twice(y, residual, weight, eps, normed, new_residual, *, compile_only=False):
        new_residual.copy_((residual.float() + y.float()).to(torch.float16).to(residual.dtype))  # not torch's add
        normed.copy_(torch_rmsnorm(new_residual, weight, eps))

    def in_place_off_by_a_little(x, residual, weight, eps):
        residual.copy_((residual.float() + x.float() * (1 + 2 ** -10)).to(residual.dtype))
        x.copy_(torch_rmsnorm(residual, weight, eps))

    def in_place_bad_norm(x, residual, weight, eps):
        residual.add_(x)
        x.copy_(torch_rmsnorm(residual, weight, eps) * 1.1)

    good = {"+addnorm": fakes.fake_add_rmsnorm, "+fi_addnorm": fakes.fake_fused_add_rmsnorm}
    adapter = _adapter(monkeypatch, good, ("auto+addnorm", "auto+fi_addnorm"))
    for algo in ("auto+addnorm", "auto+fi_addnorm"):
        assert adapter.cross_check(_norm_bufs(), algo) is None
    adapter = _adapter(monkeypatch, {"+addnorm": rounded_twice, "+fi_addnorm": in_place_off_by_a_little},
                       ("auto+addnorm", "auto+fi_addnorm"))
    problem = adapter.cross_check(_norm_bufs(), "auto+addnorm")
    assert problem.startswith("pcie_allreduce.fused.path.add_rmsnorm new_residual is not bitwise equal to "
                              "residual + y")
    assert adapter.cross_check(_norm_bufs(), "auto+fi_addnorm") is None  # within tolerance
    adapter = _adapter(monkeypatch, {"+sgl_addnorm": in_place_bad_norm}, ("auto+sgl_addnorm",))
    problem = adapter.cross_check(_norm_bufs(), "auto+sgl_addnorm")
    assert problem.startswith("sgl_kernel.fused_add_rmsnorm vs torch RMSNorm on random data: normed:")


@pytest.mark.parametrize("dependent", [True, False, None])
def test_our_norm_after_our_all_reduce_launches_as_the_unfused_pair_does(monkeypatch, dependent) -> None:
    """"ours+addnorm" is the library's unfused pair: its norm kernel is compiled and launched as the
    all-reduce's programmatic dependent where the communicator launches so (dependent_launch), and
    ordinarily after a backend without our communicator (None)."""
    seen: list[tuple[bool, bool]] = []

    def recording(y, residual, weight, eps, normed, new_residual, *, compile_only=False, after_all_reduce=False):
        seen.append((compile_only, after_all_reduce))

    class Inner:
        def buffers(self, count, dtype, algo):
            return Buffers(torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype))

        def call(self, bufs, algo):
            return bufs.out

    inner = Inner()
    if dependent is not None:
        inner.comm = types.SimpleNamespace(dependent_launch=dependent)
    monkeypatch.setattr(norm_ops, "load_kernel", lambda suffix: recording)
    ctx = type("Ctx", (), {"device": torch.device("cpu"), "rank": 0, "world_size": 1})()
    case = plan.Case(0, 2 * 64 * 2, 2 * 64, "auto+addnorm", tokens=2, hidden=64)
    job = plan.RankJob(backend="ours", dtype="bfloat16", cases=(case,), max_bytes=256, progress_dir="/tmp")
    adapter = norm_ops.NormAdapter(inner, ctx, job)
    bufs = adapter.buffers(case.count, torch.bfloat16, case.algo, hidden=64)
    adapter.call(bufs, case.algo)
    assert seen == [(True, bool(dependent)), (False, bool(dependent))]


def test_a_baseline_that_does_not_import_is_skipped(monkeypatch) -> None:
    def missing(suffix: str):
        raise ImportError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(norm_ops, "load_kernel", missing)
    ctx = type("Ctx", (), {"device": torch.device("cpu"), "rank": 0, "world_size": 1})()
    case = plan.Case(0, 256, 128, "default+fi_addnorm", tokens=2, hidden=64)
    job = plan.RankJob(backend="nccl", dtype="bfloat16", cases=(case,), max_bytes=256, progress_dir="/tmp")
    adapter = norm_ops.NormAdapter(fakes.FakeBackend.__new__(fakes.FakeBackend), ctx, job)
    assert adapter.skip_reason(case) == ("flashinfer.norm does not import here (ImportError: libcudart.so.13: cannot "
                                         "open shared object file)")
