"""CPU tests of ``python -m bench verify``: presets and options, the cases (2 x L calls per
graph), the rank loop on CPU ranks, and the pass / projected-verify report."""

from __future__ import annotations

import csv
import io

import pytest

from pcie_allreduce.tools.ranks import placement_label

from bench import __main__ as bench_cli
from bench import command, environment, options, report, report_verify, runner, verify_options
from bench.results import OK, SKIPPED, VERIFY, Report, Result, add_speedups

from tests import _bench_fakes as fakes


def _verify_config(argv: list[str], gpu_count: int = 1) -> options.BenchConfig:
    parser = bench_cli.build_parser()
    args = parser.parse_args(["verify", *argv])
    assert args.handler == "bench.command:run_verify"
    return verify_options.config_from_args(args, args.parser, gpu_count)


def test_verify_defaults() -> None:
    cfg = _verify_config([])
    assert cfg.workload == VERIFY and not cfg.norm and cfg.compute_ms == 5.0 and cfg.iters == 50
    assert [(s.model, s.layers, s.hidden, s.tokens) for s in cfg.shapes] == [
        ("kimi-k2.5", 61, 7168, 4), ("kimi-k2.5", 61, 7168, 32), ("llama-3-70b", 80, 8192, 4),
        ("llama-3-70b", 80, 8192, 32), ("qwen3-235b-a22b", 94, 4096, 4), ("qwen3-235b-a22b", 94, 4096, 32)]
    assert verify_options.DEFAULT_BATCH == (1, 8) and verify_options.DEFAULT_DRAFT_TOKENS == (4,)
    assert cfg.sizes == tuple(sorted(t * h * 2 for t in (4, 32) for h in (7168, 8192, 4096)))
    assert cfg.calls_per_graph == 188


def test_verify_options() -> None:
    cfg = _verify_config(["--model", "deepseek-v3", "kimi-k2.5", "--batch", "1", "8", "--draft-tokens", "4",
                          "--compute-ms", "7.5", "--fused", "--world", "4", "8", "--dtype", "float16"])
    assert [(s.model, s.tokens) for s in cfg.shapes] == [("deepseek-v3/kimi-k2.5", 4), ("deepseek-v3/kimi-k2.5", 32)]
    assert cfg.norm and cfg.compute_ms == 7.5 and cfg.worlds == (4, 8) and cfg.dtype == "float16"
    custom = _verify_config(["--layers", "2", "--hidden", "256", "--batch", "1"])
    assert [(s.model, s.layers, s.hidden) for s in custom.shapes] == [("custom-L2-H256", 2, 256)]
    both = _verify_config(["--layers", "2", "--hidden", "256", "--model", "llama-3-70b", "--batch", "1"])
    assert [s.model for s in both.shapes] == ["llama-3-70b", "custom-L2-H256"]


@pytest.mark.parametrize("argv, fragment", [
    (["--layers", "3"], "needs both --layers and --hidden"),
    (["--model", "gpt-5"], "invalid choice"),
    (["--compute-ms", "-1"], "--compute-ms"),
    (["--dtype", "float32"], "invalid choice"),
    (["--batch", "0"], "--batch"),
])
def test_verify_bad_options(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _verify_config(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err


def test_verify_cases() -> None:
    cfg = _verify_config(["--model", "qwen3-235b-a22b", "--fused"])
    ours = runner.cases_for(cfg, "ours")
    norms = ("+norm", "+addnorm", "+fi_addnorm", "+sgl_addnorm")
    assert [c.algo for c in ours if c.tokens == 4] == ["auto", "fused", *(f"auto{n}" for n in norms)]
    assert {(c.calls, c.hidden, c.model) for c in ours} == {(188, 4096, "qwen3-235b-a22b")}
    assert [c.algo for c in runner.cases_for(cfg, "torch_symm") if c.tokens == 4] == [
        "one_shot", "two_shot", *(f"one_shot{n}" for n in norms), *(f"two_shot{n}" for n in norms)]
    plain = _verify_config(["--model", "qwen3-235b-a22b"])
    assert [(c.algo, c.tokens) for c in runner.cases_for(plain, "nccl")] == [("default", 4), ("default", 32)]
    job = runner.make_job(cfg, "ours", ours, "/tmp")
    assert job.calls(ours[0]) == 188 and job.workload == VERIFY


def test_verify_rank_loop_on_cpu(monkeypatch) -> None:
    fakes.use_cpu_ranks(monkeypatch)
    cfg = options.BenchConfig(worlds=(2,), sizes=(256,), backends=("ours",), workload=VERIFY, norm=True,
                              shapes=(options.Shape(2, 64, layers=3, model="tiny"),), eager=True, iters=3, warmup=1,
                              setup_timeout_s=60.0, retries=0, compute_ms=1.0)
    rep = runner.run_sweep(cfg, 1, {"gpus": []}, lambda _: None)
    rows = {r.algo: r for r in rep.results}
    assert set(rows) == {"auto", "fused", "auto+norm", "auto+addnorm", "auto+fi_addnorm", "auto+sgl_addnorm"}
    assert rows["auto"].status == OK and rows["auto+norm"].status == OK and rows["auto+addnorm"].status == OK
    assert rows["auto+fi_addnorm"].status == OK and rows["auto+sgl_addnorm"].status == SKIPPED
    assert rows["fused"].status != OK  # the fake's fused path at T=2 corrupts rank 1's residual
    assert rows["auto"].calls_per_graph == 6 and rows["auto"].model == "tiny" and rows["auto"].layers == 3
    assert rows["auto"].pass_ms == pytest.approx(rows["auto"].p50_us * 6 / 1e3)


def _row(backend: str, algo: str, p50: float, model: str = "kimi-k2.5", layers: int = 61, tokens: int = 4,
         hidden: int = 7168, **kw) -> Result:
    return Result(world=8, backend=backend, algo=algo, size_bytes=tokens * hidden * 2, count=tokens * hidden,
                  dtype="bfloat16", p50_us=p50, p99_us=p50 * 1.1, replays=50, calls_per_graph=2 * layers,
                  workload=VERIFY, tokens=tokens, hidden=hidden, model=model, **kw)


def fake_verify_report(compute_ms: float = 5.0) -> Report:
    rows = [_row("ours", "auto", 10.0, resolved_algo="oneshot"), _row("torch_symm", "one_shot", 12.5),
            _row("torch_symm", "two_shot", 14.0), _row("ours", "fused", 12.0, resolved_algo="oneshot"),
            _row("ours", "auto+norm", 20.0, resolved_algo="oneshot+norm"), _row("torch_symm", "one_shot+norm", 22.0),
            _row("ours", "auto+addnorm", 15.0, resolved_algo="oneshot+addnorm"),
            _row("ours", "auto+fi_addnorm", 14.0, resolved_algo="oneshot+fi_addnorm"),
            _row("torch_symm", "one_shot+addnorm", 17.0)]
    config = options.BenchConfig(worlds=(8,), sizes=(57344,), workload=VERIFY, compute_ms=compute_ms, norm=True,
                                 shapes=(options.Shape(4, 7168, 61, "kimi-k2.5"),)).to_dict()
    return Report({"gpus": ["NVIDIA H200"]}, config, {8: placement_label(8, 1, True)},
                  add_speedups(rows, compute_ms))


def test_verify_pass_and_projected_speedup() -> None:
    by = {r.algo: r for r in fake_verify_report().results}
    assert by["auto"].pass_ms == pytest.approx(1.22)  # 10 us x 122 calls
    # projected verify: (1.525 + 5) / (1.22 + 5)
    assert by["auto"].reference == "torch_symm" and by["auto"].speedup == pytest.approx(6.525 / 6.22)
    assert by["fused"].speedup == pytest.approx((2.074 + 5) / (1.464 + 5))  # vs torch_symm one_shot+addnorm


def test_verify_report_text() -> None:
    text = report.format_report(fake_verify_report())
    assert text.startswith("# pcie_allreduce bench verify | NVIDIA H200")
    assert "one CUDA graph per pass: 2 x L collectives on [T, H]" in text and "verify = pass + 5 ms compute" in text
    header = next(line for line in text.splitlines() if "pass(ms)" in line and "verify(ms)" in line)
    assert header.lstrip("#").split() == ["model", "L", "T", "H", "backend", "algo", "pass(ms)", "p99(ms)",
                                          "call(us)", "verify(ms)", "speedup", "status"]
    row = next(line.split() for line in text.splitlines() if "auto(oneshot)" in line and "norm" not in line
               and not line.startswith("#") and line.split()[0] == "kimi-k2.5")
    assert row[:6] == ["kimi-k2.5", "61", "4", "7168", "ours", "auto(oneshot)"]
    assert row[6:11] == ["1.220", "1.342", "10.00", "6.220", "1.05x"]
    summary = [line for line in text.splitlines() if line.startswith("  8") and "fi_addnorm" not in line]
    assert len(summary) == 2  # (allreduce, allreduce+norm) for the one model and T
    assert "1.220/6.220 (auto(oneshot))" in summary[0] and "+0.305 ms (1.049x)" in summary[0]
    assert "1.464/6.464 (fused(oneshot))" in summary[1]
    fused_header = next(line for line in text.splitlines() if line.startswith("# W ") and "fused/plain" in line)
    assert fused_header.lstrip("#").split() == [
        "W", "model", "T", "fused", "plain", "plain+addnorm", "best", "1-kernel", "(which)", "plain+norm",
        "fused/plain", "fused/(plain+addnorm)", "fused/best1k"]
    fused_row = next(line.split() for line in text.splitlines() if line.split()[:3] == ["8", "kimi-k2.5", "4"]
                     and "fi_addnorm" in line)
    assert fused_row[3:] == ["1.464", "1.220", "1.830", "1.708", "ours/auto(oneshot)+fi_addnorm", "2.440",
                             "1.20", "0.80", "0.86"]


def test_verify_fused_pass_ratios() -> None:
    (entry,) = report_verify.fused_pass_rows(fake_verify_report())
    assert (entry["world"], entry["model"], entry["tokens"]) == (8, "kimi-k2.5", 4)
    assert entry["fused"].pass_ms == pytest.approx(1.464) and entry["plain"].pass_ms == pytest.approx(1.22)
    assert entry["ours_one_kernel"].algo == "auto+addnorm" and entry["best_one_kernel"].algo == "auto+fi_addnorm"
    assert entry["ours_eager"].algo == "auto+norm"
    assert entry["fused_vs_plain"] == pytest.approx(12 / 10)
    assert entry["fused_vs_ours_one_kernel"] == pytest.approx(12 / 15)
    assert entry["fused_vs_best_one_kernel"] == pytest.approx(12 / 14)
    plain_only = fake_verify_report()
    plain_only.results = [r for r in plain_only.results if r.algo != "fused"]
    assert report_verify.format_fused_pass_summary(plain_only) == ""


def test_verify_compute_time_changes_the_verify_column() -> None:
    text = report.format_report(fake_verify_report(compute_ms=10.0))
    row = next(line.split() for line in text.splitlines() if line.split()[:1] == ["kimi-k2.5"]
               and "auto(oneshot)" in line and "norm" not in line)
    assert row[9] == "11.220"


def test_verify_csv_has_pass_ms(tmp_path) -> None:
    rep = fake_verify_report()
    rows = list(csv.DictReader(io.StringIO(report.to_csv(rep.results))))
    assert float(next(r for r in rows if r["algo"] == "auto")["pass_ms"]) == pytest.approx(1.22)
    assert sorted(p.rsplit("/", 1)[1] for p in report.write_outputs(rep, str(tmp_path))) == [
        "verify.csv", "verify.json", "verify.txt"]


def test_verify_command_end_to_end(monkeypatch, capsys) -> None:
    seen = {}

    def fake_sweep(cfg, gpus, env, echo, bar):
        seen["cfg"] = cfg
        return fake_verify_report()

    monkeypatch.setattr(command, "unavailable_reason", lambda cfg: None)
    monkeypatch.setattr(environment, "host_environment", lambda: {})
    monkeypatch.setattr(runner, "run_sweep", fake_sweep)
    assert bench_cli.main(["verify", "--model", "kimi-k2.5", "--fused", "--world", "8"]) == 0
    assert seen["cfg"].norm and seen["cfg"].worlds == (8,)
    assert "verify(ms)" in capsys.readouterr().out


def test_a_pass_with_gemms_says_so_and_lists_them() -> None:
    rep = fake_verify_report(compute_ms=0.0)
    rep.config["gemms"] = True
    text = report.format_report(rep)
    assert "each after its layer's GEMMs (per-rank shapes, bench/layer_gemms.py)" in text
    assert "verify = pass + 0 ms compute" in text
    listed = [line for line in text.splitlines() if line.startswith("#   kimi-k2.5 at TP 8, T = 4:")]
    assert len(listed) == 1 and "gate_up_proj 9x[7168, 512]" in listed[0] and "o_proj [2048, 7168]" in listed[0]
    assert "GEMMs" not in report.format_report(fake_verify_report())
