"""Formatting a :class:`~.results.Report`: nccl-tests style table, best-of summary, CSV, JSON.

Pure functions from data to text (plus one that writes files), so they are tested on CPU with
fake result sets. ``--fused`` and ``verify`` reports have their own tables and summaries
(:mod:`.report_fused`, :mod:`.report_verify`); this module dispatches on the config's workload.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from typing import Any, Iterable, Sequence

from bench.results import (
    ALLREDUCE, FUSED, NOT_RUN, OURS_HIER, SKIPPED, VERIFY, Note, Report, Result, backend_order, best_per_backend,
    sort_key,
)
from bench.table import WIRE_COLUMNS, Column, line, num, speedup

CSV_COLUMNS: tuple[str, ...] = (
    "world", "size_bytes", "count", "dtype", "backend", "algo", "resolved_algo", "mode", "calls_per_graph",
    "replays", "p50_us", "p99_us", "rank0_p50_us", "min_us", "algbw_gbps", "busbw_gbps", "wire_out_bytes",
    "wire_in_bytes", "wire_gbps", "speedup", "reference",
    "status", "error", "workload", "tokens", "hidden", "model", "pass_ms",
)
# The all-reduce table, right-aligned like nccl-tests.
TABLE_COLUMNS: tuple[Column, ...] = (
    Column("size(B)", 11, lambda r: str(r.size_bytes)),
    Column("count", 11, lambda r: str(r.count)),
    Column("dtype", 9, lambda r: r.dtype),
    Column("backend", 11, lambda r: r.backend),
    Column("algo", 16, lambda r: r.label),
    Column("p50(us)", 10, lambda r: num(r.p50_us)),
    Column("p99(us)", 10, lambda r: num(r.p99_us)),
    Column("algbw(GB/s)", 12, lambda r: num(r.algbw_gbps)),
    Column("busbw(GB/s)", 12, lambda r: num(r.busbw_gbps)),
    *WIRE_COLUMNS,
    Column("speedup", 8, lambda r: speedup(r.speedup)),
    Column("status", 8, lambda r: "" if r.ok else r.status),
)
FILE_STEMS = {ALLREDUCE: "bench", FUSED: "fused", VERIFY: "verify"}
FILE_STEM = FILE_STEMS[ALLREDUCE]


def columns_for(workload: str) -> tuple[Column, ...]:
    """The table columns of a workload's rows."""
    if workload == FUSED:
        from bench.report_fused import FUSED_COLUMNS

        return FUSED_COLUMNS
    if workload == VERIFY:
        from bench.report_verify import VERIFY_COLUMNS

        return VERIFY_COLUMNS
    return TABLE_COLUMNS


def table_header(workload: str = ALLREDUCE) -> str:
    columns = columns_for(workload)
    return "#" + line(columns, [c.header for c in columns])[1:]


def table_row(r: Result, compute_ms: float | None = None) -> str:
    """One table line for ``r`` (failed rows show '-' in the time columns and their status)."""
    columns = columns_for(r.workload)
    if r.workload == VERIFY and compute_ms is not None:
        from bench.report_verify import verify_columns

        columns = verify_columns(compute_ms)
    return line(columns, [c.cell(r) for c in columns]).rstrip()


def _worlds(results: Iterable[Result], notes: Iterable[Note]) -> list[int]:
    return sorted({r.world for r in results} | {n.world for n in notes})


def _timing_line(config: dict[str, Any]) -> str:
    if config.get("workload") == VERIFY:
        from bench.report_verify import timing_line

        return timing_line(config)
    calls = config.get("calls_per_graph", "?")
    how = (f"eager launches, {calls} calls per timed block" if config.get("eager")
           else f"CUDA-graph replay, {calls} calls per graph")
    rounds = config.get("rounds", 1)
    if rounds > 1:
        how += f", {rounds} interleaved rounds (replays pooled)"
    return (f"# {how}; time per call = p50 / p99 over timed replays of (slowest rank's replay time, "
            "CUDA events) / calls")


def _reference_line(rows: Sequence[Result], workload: str) -> str:
    refs = sorted({r.reference for r in rows if r.reference})
    if not refs:
        return "# speedup: no reference backend (nccl or torch_symm) has results here"
    if workload == VERIFY:
        return (f"# speedup = projected verify time of the best {' / '.join(refs)} row of the same model, T and "
                "op / this row's (>1: faster)")
    same = "tokens and op" if workload == FUSED else "size"
    return f"# speedup = p50 of the best {' / '.join(refs)} row of the same {same} / p50 of this row (>1: faster)"


def format_world(report: Report, world: int) -> str:
    """The header and rows of one world size."""
    rows = sorted((r for r in report.results if r.world == world), key=sort_key)
    # A backend that never got past set-up would fill the table with "not run" rows; its note says why.
    ran = {r.backend for r in rows if r.status != NOT_RUN}
    rows = [r for r in rows if r.backend in ran]
    workload = str(report.config.get("workload", ALLREDUCE))
    dtypes = sorted({r.dtype for r in rows}) or [str(report.config.get("dtype", "?"))]
    lines = [f"# W={world} | {placements_label(report, world)} | {', '.join(dtypes)}",
             _timing_line(report.config), _reference_line(rows, workload), "#", table_header(workload)]
    compute_ms = report.config.get("compute_ms") if workload == VERIFY else None
    lines += [table_row(r, compute_ms) for r in rows]
    row_errors = {r.error for r in rows}
    lines += [f"# {n.kind}: {n.backend}: {n.reason}" for n in report.notes
              if n.world == world and n.reason not in row_errors and f"not run: {n.reason}" not in row_errors]
    return "\n".join(lines)


def format_summary(report: Report) -> str:
    """Best p50 per backend for every size, and our best over each other backend's best: the headline."""
    best = best_per_backend(report.results)
    backends = backend_order(report)
    others = [b for b in backends if b != "ours"]
    if not best:
        return "# summary: no successful measurements"
    keys = sorted({key for key, _ in best})
    cells = {key: ["-" if (r := best.get((key, b))) is None else f"{r.p50_us:.2f} ({r.resolved_algo or r.algo})"
                   for b in backends] for key in keys}
    # Each column as wide as its widest cell plus a gap, so a long algorithm name never runs into
    # the next column (or the W column into the first).
    widths = [max(20, len(b) + 2, *(len(cells[key][i]) + 2 for key in keys)) for i, b in enumerate(backends)]
    head = ("#" + "size(B)".rjust(10) + "  W" + "".join(b.rjust(w) for b, w in zip(backends, widths))
            + "".join(f"ours/{b}".rjust(len(b) + 7) for b in others))
    lines = ["# best p50 per backend (us, algo); ours/X = our best p50 / X's best p50 (<1: ours faster)", head]
    for key in keys:
        world, size = key[0], key[2]
        ours = best.get((key, "ours"))
        ratios = []
        for b in others:
            ref = best.get((key, b))
            ratio = "-" if ours is None or ref is None else f"{ours.p50_us / ref.p50_us:.2f}"
            ratios.append(ratio.rjust(len(b) + 7))
        lines.append(" " + str(size).rjust(10) + f"{world:>3}" + "".join(c.rjust(w) for c, w in zip(cells[key], widths))
                     + "".join(ratios))
    return "\n".join(lines)


def format_inter_node_bytes(results: Iterable[Result]) -> str:
    """For the hierarchy's rows: the most bytes a rank puts on the inter-node link per call, beside
    a flat ring's (NCCL's all-reduce on PCIe), which sends 2(W-1)/W of the message from each rank
    whose ring neighbour sits on the next node."""
    from pcie_allreduce.fabric.nodes import flat_ring_off_node_bytes

    rows = sorted({(r.world, r.nodes, r.size_bytes, r.wire) for r in results
                   if r.backend == OURS_HIER and r.wire is not None and r.algo == "auto"}, key=lambda t: (t[0], t[2], t[1]))
    if not rows:
        return ""
    lines = ["# inter-node bytes per rank and call: the hierarchy (most any rank sends / receives) against a flat "
             "ring (each node-boundary rank sends)",
             "#" + "size(B)".rjust(10) + "  W  nodes" + "hier out".rjust(12) + "hier in".rjust(12)
             + "flat ring".rjust(12)]
    for world, nodes, size, wire in rows:
        lines.append(" " + str(size).rjust(10) + f"{world:>3}{nodes:>7}" + str(wire.out).rjust(12)
                     + str(wire.into).rjust(12) + str(flat_ring_off_node_bytes(size, world)).rjust(12))
    return "\n".join(lines)


def format_errors(results: Iterable[Result]) -> str:
    """One line per distinct error (world, backend, error) with the cases it hit."""
    seen: dict[tuple[int, str, str], list[str]] = {}
    for r in results:
        # A not-run row only repeats the failure that stopped its run; a skipped one is by design.
        if r.error and r.status not in (NOT_RUN, SKIPPED):
            seen.setdefault((r.world, r.backend, r.error), []).append(f"{r.size_bytes}/{r.algo}")
    lines = []
    for (world, backend, error), cases in seen.items():
        where = ", ".join(cases[:4]) + (f" and {len(cases) - 4} more" if len(cases) > 4 else "")
        lines.append(f"# error: W={world} {backend} [{where}]: {error}")
    return "\n".join(lines)


TITLES = {ALLREDUCE: "bench", FUSED: "bench --fused", VERIFY: "bench verify"}


def format_report_header(report: Report) -> str:
    """The first line: what ran, on which GPUs and software, when."""
    env = report.environment
    gpus = env.get("gpus") or ["?"]
    workload = str(report.config.get("workload", ALLREDUCE))
    return (f"# pcie_allreduce {TITLES.get(workload, workload)} | {gpus[0]} x{len(gpus)} | "
            f"driver {env.get('driver', '?')} | torch {env.get('torch', '?')} (CUDA {env.get('cuda_runtime', '?')}) | "
            f"{env.get('date', '?')}")


def placements_label(report: Report, world: int) -> str:
    return report.placements.get(world, f"{world} ranks")


def format_report(report: Report) -> str:
    """The whole printed report: environment line, one block per world, summary, errors."""
    workload = str(report.config.get("workload", ALLREDUCE))
    parts = [format_report_header(report)]
    parts += [format_world(report, w) for w in _worlds(report.results, report.notes)]
    if workload == FUSED:
        from bench.report_fused import format_fused_summary

        parts.append(format_fused_summary(report))
    elif workload == VERIFY:
        from bench.report_verify import format_verify_summary

        parts.append(format_verify_summary(report))
    else:
        parts.append(format_summary(report))
        inter_node = format_inter_node_bytes(report.results)
        if inter_node:
            parts.append(inter_node)
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
        row["pass_ms"] = "" if r.pass_ms is None or r.workload != VERIFY else r.pass_ms
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


def from_json_obj(data: dict[str, Any]) -> Report:
    """A Report back from :func:`to_json_obj`'s output (to re-plot or re-print a saved run)."""
    return Report(environment=data.get("environment", {}), config=data.get("config", {}),
                  placements={int(w): label for w, label in data.get("placements", {}).items()},
                  results=[Result.from_dict(r) for r in data.get("results", [])],
                  notes=[Note(**n) for n in data.get("notes", [])])


def to_json(report: Report) -> str:
    """The report as JSON: environment, config, placements, results (with bandwidths), notes."""
    return json.dumps(to_json_obj(report), indent=2, sort_keys=False) + "\n"


def file_stem(report: Report) -> str:
    """"bench", "fused" or "verify": one out dir can hold every mode's files."""
    return FILE_STEMS.get(str(report.config.get("workload", ALLREDUCE)), FILE_STEM)


def write_outputs(report: Report, out_dir: str, text: str | None = None) -> list[str]:
    """Write <stem>.csv, <stem>.json and <stem>.txt (``text``, default the printed report) into
    ``out_dir``; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    stem = file_stem(report)
    body = format_report(report) if text is None else text
    for ext, content in (("csv", to_csv(report.results)), ("json", to_json(report)), ("txt", body)):
        path = os.path.join(out_dir, f"{stem}.{ext}")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(content)
        written.append(path)
    return written
