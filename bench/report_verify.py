"""The ``python -m bench verify`` report: pass time, projected verify time and speed-up per backend (pure).

A verify pass is 2 x L collectives on [T, H] captured in one CUDA graph; a row's ``p50_us`` is per
collective, so pass = p50 x calls. Projected verify time = pass + the model's compute
(``--compute-ms``); the speed-up compares projected verify times with the reference backend's
(NCCL where it ran, else torch symmetric memory) for the same model, T and op.
"""

from __future__ import annotations

from typing import Any

from bench.results import (
    FUSED_ALGO, NORM_SUFFIX, ONE_KERNEL_NORM_SUFFIX, VERIFY, Report, Result, backend_order, is_fused_algo,
    is_one_kernel_norm, split_norm,
)
from bench.table import BEST_ONE_KERNEL_WHICH, Column, num, ratio, render, speedup

OURS = "ours"


def _verify_ms(r: Result, compute_ms: float) -> float | None:
    return None if r.pass_ms is None else r.pass_ms + compute_ms


def verify_columns(compute_ms: float) -> tuple[Column, ...]:
    return (
        Column("model", 22, lambda r: r.model),
        Column("L", 4, lambda r: str(r.layers)),
        Column("T", 5, lambda r: str(r.tokens)),
        Column("H", 6, lambda r: str(r.hidden)),
        Column("backend", 11, lambda r: r.backend),
        Column("algo", 22, lambda r: r.label),
        Column("pass(ms)", 9, lambda r: num(r.pass_ms, 3)),
        Column("p99(ms)", 8, lambda r: num(r.pass_p99_ms, 3)),
        Column("call(us)", 9, lambda r: num(r.p50_us)),
        Column("verify(ms)", 11, lambda r: num(_verify_ms(r, compute_ms), 3)),
        Column("speedup", 8, lambda r: speedup(r.speedup)),
        Column("status", 8, lambda r: "" if r.ok else r.status),
    )


VERIFY_COLUMNS = verify_columns(5.0)  # the compute time only changes the verify column; see timing_line


def timing_line(config: dict[str, Any]) -> str:
    how = "eager launches" if config.get("eager") else "one CUDA graph per pass"
    if config.get("rounds", 1) > 1:
        how += f", {config['rounds']} interleaved rounds (replays pooled)"
    what = ("2 x L collectives on [T, H], each after its layer's GEMMs (per-rank shapes, bench/layer_gemms.py)"
            if config.get("gemms") else "2 x L collectives on [T, H]")
    return (f"# {how}: {what}; pass = p50 / p99 over timed replays of the slowest rank's "
            f"pass time; verify = pass + {config.get('compute_ms', 5.0):g} ms compute")


def format_verify_summary(report: Report) -> str:
    """Per (W, model, T, op): each backend's best pass and projected verify time, and ours vs each."""
    compute = float(report.config.get("compute_ms", 5.0))
    rows = [r for r in report.results if r.workload == VERIFY and r.ok]
    if not rows:
        return "# verify summary: no successful measurements"
    backends = backend_order(report, [r for r in report.results if r.workload == VERIFY])
    groups = sorted({(r.world, r.model, r.tokens, r.op) for r in rows})
    entries = []
    for world, model, tokens, op in groups:
        best: dict[str, Result] = {}
        for r in rows:
            if (r.world, r.model, r.tokens, r.op) == (world, model, tokens, op):
                if r.backend not in best or r.p50_us < best[r.backend].p50_us:  # type: ignore[operator]
                    best[r.backend] = r
        entries.append({"world": world, "model": model, "tokens": tokens, "op": op, "best": best})

    def cell(e: dict[str, Any], b: str) -> str:
        r = e["best"].get(b)
        return "-" if r is None else f"{r.pass_ms:.3f}/{_verify_ms(r, compute):.3f} ({r.label})"

    def saving(e: dict[str, Any], b: str) -> str:
        ours, other = e["best"].get("ours"), e["best"].get(b)
        if ours is None or other is None:
            return "-"
        return f"{other.pass_ms - ours.pass_ms:+.3f} ms ({_verify_ms(other, compute) / _verify_ms(ours, compute):.3f}x)"

    others = [b for b in backends if b != "ours"]
    columns = [
        Column("W", 3, lambda e: str(e["world"])),
        Column("model", 22, lambda e: e["model"]),
        Column("T", 5, lambda e: str(e["tokens"])),
        Column("op", 15, lambda e: e["op"]),
        *[Column(b, 34, lambda e, b=b: cell(e, b)) for b in backends],
        *[Column(f"ours vs {b}", 24, lambda e, b=b: saving(e, b)) for b in others],
    ]
    parts = [f"# best per backend: pass ms / projected verify ms (pass + {compute:g} ms compute) (algo); "
             "ours vs X: the pass time ours saves per verify (verify speed-up)",
             *render(columns, entries)]
    if report.config.get("gemms"):
        from bench.layer_gemms import describe

        dtype_bytes = 4 if report.config.get("dtype") == "float32" else 2
        parts += ["", "# the GEMMs in each pass (per layer and rank; the attention's before the first collective, "
                      "the MLP's before the second):"]
        parts += [f"#   {describe(model, world, tokens, dtype_bytes)}"
                  for world, model, tokens in sorted({(e['world'], e['model'], e['tokens']) for e in entries})]
    fused = format_fused_pass_summary(report)
    return "\n".join(parts + (["", fused] if fused else []))


def _fastest(rows: list[Result]) -> Result | None:
    return min(rows, key=lambda r: r.p50_us, default=None)  # type: ignore[arg-type,return-value]


def fused_pass_rows(report: Report) -> list[dict[str, Any]]:
    """Per (W, model, T) where our fused pass ran: the fused pass, our plain pass, our plain pass +
    our one-kernel add + RMSNorm, the best plain + one-kernel pass of any backend, our plain + eager
    torch ops, and the fused pass over each (ms per pass)."""
    rows = [r for r in report.results if r.workload == VERIFY and r.ok]
    out = []
    for world, model, tokens in sorted({(r.world, r.model, r.tokens) for r in rows if r.algo == FUSED_ALGO}):
        group = [r for r in rows if (r.world, r.model, r.tokens) == (world, model, tokens)]
        ours = [r for r in group if r.backend == OURS and not is_fused_algo(r.algo)]
        entry: dict[str, Any] = {
            "world": world, "model": model, "tokens": tokens,
            "fused": _fastest([r for r in group if r.backend == OURS and r.algo == FUSED_ALGO]),
            "plain": _fastest([r for r in ours if not split_norm(r.algo)[1]]),
            "ours_one_kernel": _fastest([r for r in ours if split_norm(r.algo)[1] == ONE_KERNEL_NORM_SUFFIX]),
            "best_one_kernel": _fastest([r for r in group if is_one_kernel_norm(r.algo)]),
            "ours_eager": _fastest([r for r in ours if split_norm(r.algo)[1] == NORM_SUFFIX]),
        }
        for key in ("plain", "ours_one_kernel", "best_one_kernel"):
            other = entry[key]
            entry[f"fused_vs_{key}"] = None if other is None else entry["fused"].pass_ms / other.pass_ms
        out.append(entry)
    return out


def format_fused_pass_summary(report: Report) -> str:
    """The fused pass against the plain pass and the plain + one-kernel-norm pass; "" without fused rows."""
    entries = fused_pass_rows(report)
    if not entries:
        return ""

    def ms(r: Result | None) -> str:
        return "-" if r is None else f"{r.pass_ms:.3f}"

    columns = [
        Column("W", 3, lambda e: str(e["world"])),
        Column("model", 22, lambda e: e["model"]),
        Column("T", 5, lambda e: str(e["tokens"])),
        Column("fused", 8, lambda e: ms(e["fused"])),
        Column("plain", 8, lambda e: ms(e["plain"])),
        Column("plain+addnorm", 14, lambda e: ms(e["ours_one_kernel"])),
        Column("best 1-kernel", 14, lambda e: ms(e["best_one_kernel"])),
        BEST_ONE_KERNEL_WHICH,
        Column("plain+norm", 11, lambda e: ms(e["ours_eager"])),
        Column("fused/plain", 12, lambda e: ratio(e["fused_vs_plain"])),
        Column("fused/(plain+addnorm)", 22, lambda e: ratio(e["fused_vs_ours_one_kernel"])),
        Column("fused/best1k", 13, lambda e: ratio(e["fused_vs_best_one_kernel"])),
    ]
    return "\n".join([
        "# fused vs unfused verify passes (ms per pass, ours unless named): fused = every collective our fused "
        "all-reduce + add + RMSNorm; plain = our all-reduce alone; plain+addnorm = our all-reduce, then our one "
        "add_rmsnorm kernel; best 1-kernel = the fastest all-reduce + ONE add + RMSNorm kernel of any backend "
        "(which: backend/algo); plain+norm = our all-reduce, then eager torch ops",
        *render(columns, entries)])
