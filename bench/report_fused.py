"""The ``python -m bench --fused`` report: the per-case table and the summary the fused kernel is judged by.

The goals, per W and token count: our fused all-reduce + residual add + RMSNorm should cost
at most 1.15x our plain all-reduce alone, and at most 0.75x our all-reduce and then
the separate torch add + RMSNorm. Pure.
"""

from __future__ import annotations

from typing import Any

from bench.results import FUSED, FUSED_ALGO, NORM_SUFFIX, Report, Result, backend_order
from bench.table import WIRE_COLUMNS, Column, num, ratio, render, speedup

GOAL_VS_ALLREDUCE = 1.15  # fused / our plain all-reduce alone
GOAL_VS_UNFUSED = 0.75    # fused / (our all-reduce + torch add + RMSNorm)

FUSED_COLUMNS: tuple[Column, ...] = (
    Column("tokens", 8, lambda r: str(r.tokens)),
    Column("hidden", 7, lambda r: str(r.hidden)),
    Column("size(B)", 10, lambda r: str(r.size_bytes)),
    Column("backend", 11, lambda r: r.backend),
    Column("algo", 22, lambda r: r.label),
    Column("p50(us)", 10, lambda r: num(r.p50_us)),
    Column("p99(us)", 10, lambda r: num(r.p99_us)),
    *WIRE_COLUMNS,
    Column("speedup", 8, lambda r: speedup(r.speedup)),
    Column("status", 8, lambda r: "" if r.ok else r.status),
)


def _best(rows: list[Result], backend: str, norm: bool) -> Result | None:
    """The fastest ok row of ``backend``: its "+norm" variants (norm) or its plain ones."""
    picked = [r for r in rows if r.backend == backend and r.ok and r.algo != FUSED_ALGO
              and r.algo.endswith(NORM_SUFFIX) == norm]
    return min(picked, key=lambda r: r.p50_us, default=None)  # type: ignore[arg-type,return-value]


def summary_rows(report: Report) -> list[dict[str, Any]]:
    """Per (world, tokens): the p50 of every contender and the two ratios the goals are about."""
    rows = [r for r in report.results if r.workload == FUSED]
    others = [b for b in backend_order(report, rows) if b != "ours"]
    out = []
    for world, tokens, hidden in sorted({(r.world, r.tokens, r.hidden) for r in rows}):
        group = [r for r in rows if (r.world, r.tokens, r.hidden) == (world, tokens, hidden)]
        fused = next((r for r in group if r.backend == "ours" and r.algo == FUSED_ALGO and r.ok), None)
        plain = _best(group, "ours", norm=False)
        unfused = _best(group, "ours", norm=True)
        entry: dict[str, Any] = {"world": world, "tokens": tokens, "hidden": hidden,
                                 "fused": fused, "ours_allreduce": plain, "ours_unfused": unfused,
                                 "others": {b: _best(group, b, norm=True) for b in others}}
        entry["fused_vs_allreduce"] = _ratio(fused, plain)
        entry["fused_vs_unfused"] = _ratio(fused, unfused)
        best_other = min((r for r in entry["others"].values() if r is not None), key=lambda r: r.p50_us,
                         default=None)
        entry["fused_vs_best_other"] = _ratio(fused, best_other)
        out.append(entry)
    return out


def _ratio(a: Result | None, b: Result | None) -> float | None:
    if a is None or b is None or not b.p50_us:
        return None
    return a.p50_us / b.p50_us  # type: ignore[operator]


def _verdict(value: float | None, goal: float) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} {'ok' if value <= goal else 'MISS'}"


def format_fused_summary(report: Report) -> str:
    """The headline: fused vs our plain all-reduce, vs our unfused path, vs the best other backend."""
    entries = summary_rows(report)
    if not entries:
        return "# fused summary: no results"
    others = list(entries[0]["others"])

    def p50(r: Result | None) -> str:
        return "-" if r is None else f"{r.p50_us:.2f}"

    columns = [
        Column("W", 3, lambda e: str(e["world"])),
        Column("tokens", 7, lambda e: str(e["tokens"])),
        Column("fused", 9, lambda e: p50(e["fused"])),
        Column("ours AR", 9, lambda e: p50(e["ours_allreduce"])),
        Column("ours AR+norm", 13, lambda e: p50(e["ours_unfused"])),
        *[Column(f"{b}+norm", max(12, len(b) + 6), lambda e, b=b: p50(e["others"][b])) for b in others],
        Column(f"fused/AR(<={GOAL_VS_ALLREDUCE})", 19, lambda e: _verdict(e["fused_vs_allreduce"], GOAL_VS_ALLREDUCE)),
        Column(f"fused/(AR+norm)(<={GOAL_VS_UNFUSED})", 24,
               lambda e: _verdict(e["fused_vs_unfused"], GOAL_VS_UNFUSED)),
        Column("fused/best other", 17, lambda e: ratio(e["fused_vs_best_other"])),
    ]
    lines = ["# fused all-reduce + residual add + RMSNorm vs the same work unfused: best p50 per call (us)",
             "# AR = our plain all-reduce (auto) alone; AR+norm = our all-reduce, then torch add + RMSNorm; "
             "X+norm = backend X's best all-reduce, then the same torch ops",
             *render(columns, entries)]
    return "\n".join(lines)
