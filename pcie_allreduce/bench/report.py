"""Formatting a :class:`~.results.Report`: nccl-tests style table, best-of summary, CSV, JSON.

Pure functions from data to text (plus one that writes files), so they are tested on CPU with
fake result sets.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from typing import Any, Iterable, Sequence

from pcie_allreduce.bench.results import NOT_RUN, Note, Report, Result, best_per_backend, sort_key

CSV_COLUMNS: tuple[str, ...] = (
    "world", "size_bytes", "count", "dtype", "backend", "algo", "resolved_algo", "mode", "calls_per_graph",
    "replays", "p50_us", "p99_us", "rank0_p50_us", "algbw_gbps", "busbw_gbps", "speedup", "reference",
    "status", "error",
)
# (header, width) of the table; right-aligned like nccl-tests.
TABLE_COLUMNS: tuple[tuple[str, int], ...] = (
    ("size(B)", 11), ("count", 11), ("dtype", 9), ("backend", 11), ("algo", 16), ("p50(us)", 10),
    ("p99(us)", 10), ("algbw(GB/s)", 12), ("busbw(GB/s)", 12), ("speedup", 8), ("status", 8),
)
FILE_STEM = "bench"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _line(cells: Sequence[str]) -> str:
    return " ".join(cell.rjust(width) for cell, (_, width) in zip(cells, TABLE_COLUMNS))


def table_row(r: Result) -> str:
    """One table line for ``r`` (failed rows show '-' in the time columns and their status)."""
    status = "" if r.ok else r.status
    return _line([str(r.size_bytes), str(r.count), r.dtype, r.backend, r.label, _num(r.p50_us), _num(r.p99_us),
                  _num(r.algbw_gbps), _num(r.busbw_gbps), _speedup(r.speedup), status]).rstrip()


def _worlds(results: Iterable[Result], notes: Iterable[Note]) -> list[int]:
    return sorted({r.world for r in results} | {n.world for n in notes})


def _timing_line(config: dict[str, Any]) -> str:
    calls = config.get("calls_per_graph", "?")
    how = (f"eager launches, {calls} calls per timed block" if config.get("eager")
           else f"CUDA-graph replay, {calls} calls per graph")
    return (f"# {how}; time per call = p50 / p99 over timed replays of (slowest rank's replay time, "
            "CUDA events) / calls")


def _reference_line(rows: Sequence[Result]) -> str:
    refs = sorted({r.reference for r in rows if r.reference})
    if not refs:
        return "# speedup: no reference backend (nccl or torch_symm) has results here"
    return f"# speedup = p50 of the best {' / '.join(refs)} row of the same size / p50 of this row (>1: faster)"


def format_world(report: Report, world: int) -> str:
    """The header and rows of one world size."""
    rows = sorted((r for r in report.results if r.world == world), key=sort_key)
    # A backend that never got past set-up would fill the table with "not run" rows; its note says why.
    ran = {r.backend for r in rows if r.status != NOT_RUN}
    rows = [r for r in rows if r.backend in ran]
    dtypes = sorted({r.dtype for r in rows}) or [str(report.config.get("dtype", "?"))]
    lines = [f"# W={world} | {report.placements.get(world, f'{world} ranks')} | {', '.join(dtypes)}",
             _timing_line(report.config), _reference_line(rows), "#",
             "#" + _line([name for name, _ in TABLE_COLUMNS])[1:]]
    lines += [table_row(r) for r in rows]
    row_errors = {r.error for r in rows}
    lines += [f"# {n.kind}: {n.backend}: {n.reason}" for n in report.notes
              if n.world == world and n.reason not in row_errors and f"not run: {n.reason}" not in row_errors]
    return "\n".join(lines)


def format_summary(report: Report) -> str:
    """Best p50 per backend for every size, and our best over each other backend's best: the headline."""
    best = best_per_backend(report.results)
    backends = list(dict.fromkeys(r.backend for r in report.results))
    others = [b for b in backends if b != "ours"]
    if not best:
        return "# summary: no successful measurements"
    width = 20
    head = ("#" + "size(B)".rjust(10) + " W " + "".join(b.rjust(width) for b in backends)
            + "".join(f"ours/{b}".rjust(len(b) + 7) for b in others))
    lines = ["# best p50 per backend (us, algo); ours/X = our best p50 / X's best p50 (<1: ours faster)", head]
    for key in sorted({key for key, _ in best}):
        world, _, size, _ = key
        cells = []
        for b in backends:
            r = best.get((key, b))
            cells.append("-" if r is None else f"{r.p50_us:.2f} ({r.resolved_algo or r.algo})")
        ours = best.get((key, "ours"))
        ratios = []
        for b in others:
            ref = best.get((key, b))
            ratio = "-" if ours is None or ref is None else f"{ours.p50_us / ref.p50_us:.2f}"
            ratios.append(ratio.rjust(len(b) + 7))
        lines.append(" " + str(size).rjust(10) + f" {world}" + "".join(c.rjust(width) for c in cells) + "".join(ratios))
    return "\n".join(lines)


def format_errors(results: Iterable[Result]) -> str:
    """One line per distinct error (world, backend, error) with the cases it hit."""
    seen: dict[tuple[int, str, str], list[str]] = {}
    for r in results:
        if r.error and r.status != NOT_RUN:  # a not-run row only repeats the failure that stopped its run
            seen.setdefault((r.world, r.backend, r.error), []).append(f"{r.size_bytes}/{r.algo}")
    lines = []
    for (world, backend, error), cases in seen.items():
        where = ", ".join(cases[:4]) + (f" and {len(cases) - 4} more" if len(cases) > 4 else "")
        lines.append(f"# error: W={world} {backend} [{where}]: {error}")
    return "\n".join(lines)


def format_report(report: Report) -> str:
    """The whole printed report: environment line, one block per world, summary, errors."""
    env = report.environment
    gpus = env.get("gpus") or ["?"]
    parts = [f"# pcie_allreduce bench | {gpus[0]} x{len(gpus)} | driver {env.get('driver', '?')} | "
             f"torch {env.get('torch', '?')} (CUDA {env.get('cuda_runtime', '?')}) | {env.get('date', '?')}"]
    parts += [format_world(report, w) for w in _worlds(report.results, report.notes)]
    parts.append(format_summary(report))
    errors = format_errors(report.results)
    if errors:
        parts.append(errors)
    return "\n\n".join(parts) + "\n"


def to_csv(results: Iterable[Result]) -> str:
    """CSV with a header row of :data:`CSV_COLUMNS`; empty cells for missing values."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for r in sorted(results, key=sort_key):
        row = {k: ("" if v is None else v) for k, v in r.to_dict().items()}
        writer.writerow(row)
    return buf.getvalue()


def to_json_obj(report: Report) -> dict[str, Any]:
    return {
        "environment": report.environment,
        "config": report.config,
        "placements": {str(w): label for w, label in sorted(report.placements.items())},
        "results": [r.to_dict() for r in sorted(report.results, key=sort_key)],
        "notes": [dataclasses.asdict(n) for n in report.notes],
    }


def to_json(report: Report) -> str:
    """The report as JSON: environment, config, placements, results (with bandwidths), notes."""
    return json.dumps(to_json_obj(report), indent=2, sort_keys=False) + "\n"


def write_outputs(report: Report, out_dir: str) -> list[str]:
    """Write bench.csv, bench.json and bench.txt (the printed report) into ``out_dir``; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for ext, text in (("csv", to_csv(report.results)), ("json", to_json(report)), ("txt", format_report(report))):
        path = os.path.join(out_dir, f"{FILE_STEM}.{ext}")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        written.append(path)
    return written
