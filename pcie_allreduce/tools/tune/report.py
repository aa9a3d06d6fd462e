"""What ``pcie-allreduce tune`` prints and writes: the measured matrix per W, the tuned picks against
the default table, with ``--fused-tokens`` the fused calls against the unfused pair, the derived
rules; the table written into the tune cache, and with ``--out`` the report and the measurements
as files."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
from typing import Any, Iterable, Sequence

from pcie_allreduce.plan import cache
from pcie_allreduce.plan.tables import AlgoTable, default_table
from pcie_allreduce.tools.tune.cache import write_table
from pcie_allreduce.plan.algorithms import FUSED_KERNELS, UNFUSED
from pcie_allreduce.tools.tune.derive import (ALGORITHMS, SKIPPED, WRONG, FusedMeasurement, FusedPick, Measurement,
                                              Pick, check_table, derive_table, measured, pick_fused, pick_shapes,
                                              with_fused_rules)
from pcie_allreduce.tools.tune.measure import TuneJob


@dataclasses.dataclass(frozen=True)
class Fused:
    """The fused measurements of a run (``--fused-tokens``): the rows, the worlds whose fused
    measurement failed (one line each), and the hidden size (None: not measured)."""

    rows: Sequence[FusedMeasurement] = ()
    errors: dict[int, str] = dataclasses.field(default_factory=dict)
    hidden: int | None = None


def default_of(facts: dict[str, Any]) -> AlgoTable:
    """The built-in table a world's measured communicator had (its transport and islands): what
    its tuned rules go ahead of."""
    return default_table(facts.get("transport", "p2p"), islands=facts.get("islands", 1))


def _render(header: Sequence[tuple[str, int]], rows: Iterable[Sequence[str]]) -> list[str]:
    """Right-aligned columns; the header line starts with '#'."""
    def line(cells: Sequence[str]) -> str:
        return " ".join(cell.rjust(width) for cell, (_, width) in zip(cells, header)).rstrip()

    head = line([name for name, _ in header])
    return ["#" + head[1:]] + [line(cells) for cells in rows]


def _cell(r: Measurement | FusedMeasurement) -> str:
    """A measurement's matrix cell: its p50 us, 'skip' where it cannot run here, else its status."""
    return f"{r.p50_us:.2f}" if r.ok else ("skip" if r.status == SKIPPED else r.status)


def format_matrix(rows: Sequence[Measurement], world: int, blocks: Sequence[int]) -> str:
    """p50 us per (size, algo) row and block-count column (``blocks``, and any other count measured:
    the default table's own shape); '-' not measured, 'skip' not runnable here."""
    blocks = sorted({*blocks, *(r.blocks for r in rows if r.world == world)})
    cells: dict[tuple[int, str], dict[int, str]] = {}
    for r in rows:
        if r.world == world:
            cells.setdefault((r.size_bytes, r.algo), {})[r.blocks] = _cell(r)
    order = sorted(cells, key=lambda k: (k[0], ALGORITHMS.index(k[1]) if k[1] in ALGORITHMS else len(ALGORITHMS)))
    header = [("size(B)", 10), ("algo", 10), *[(f"b={b}", 8) for b in blocks]]
    return "\n".join(_render(header, ([str(k[0]), k[1], *[cells[k].get(b, "-") for b in blocks]] for k in order)))


def format_picks(picks: Sequence[Pick], rows: Sequence[Measurement], world: int, dtype: str,
                 block_cap: int | None, default: AlgoTable | None = None) -> str:
    """Per size: the tuned pick vs what the default table (``default``: the flat P2P one when
    None) launches, and its measured p50 if measured."""
    times = measured(rows)
    lines = []
    for p in picks:
        if p.world != world:
            continue
        choice = (default or default_table()).select(p.size_bytes, world, dtype)
        blocks = min(choice.blocks, block_cap) if block_cap else choice.blocks
        default_us = times.get((world, p.size_bytes, choice.algo, blocks))
        lines.append([str(p.size_bytes), f"{p.algo}/b{p.blocks}", f"{p.p50_us:.2f}", f"{choice.algo}/b{blocks}",
                      "-" if default_us is None else f"{default_us:.2f}",
                      "-" if default_us is None else f"{(1 - p.p50_us / default_us) * 100:+.0f}%"])
    header = [("size(B)", 10), ("tuned", 14), ("p50(us)", 9), ("default", 14), ("p50(us)", 9), ("gain", 7)]
    return "\n".join(_render(header, lines))


def format_fused(rows: Sequence[FusedMeasurement], picks: Sequence[FusedPick], world: int) -> str:
    """p50 us per token count (row) and algorithm (column: the pair, then each fused kernel; 'skip'
    where it cannot take the shape), the choice and its time over the pair's."""
    cells: dict[int, dict[str, str]] = {}
    for r in rows:
        if r.world == world:
            cells.setdefault(r.tokens, {})[r.algo] = _cell(r)
    chosen = {p.tokens: p for p in picks if p.world == world}
    lines = []
    for tokens in sorted(cells):
        pick = chosen.get(tokens)
        ratio = "-" if pick is None or pick.algo not in cells[tokens] else \
            f"{float(cells[tokens][pick.algo]) / pick.pair_us:.2f}"
        lines.append([str(tokens), *[cells[tokens].get(a, "-") for a in (UNFUSED, *FUSED_KERNELS)],
                      "-" if pick is None else pick.algo, ratio])
    header = [("tokens", 7), *[(a, 13) for a in (UNFUSED, *FUSED_KERNELS)], ("runs", 13), ("/pair", 6)]
    return "\n".join(_render(header, lines))


def format_rules(table_json: str, key: str = "rules") -> str:
    return "\n".join("  " + json.dumps(rule, sort_keys=True) for rule in json.loads(table_json).get(key, []))


def write_tables(rows: Sequence[Measurement], facts: dict[int, dict[str, Any]], placements: dict[int, str],
                 job: TuneJob, picks: Sequence[Pick], cache_dir: str | None, dry_run: bool,
                 fused: Fused = Fused(), fused_picks: Sequence[FusedPick] = ()) -> tuple[list[str], list[str]]:
    """(text sections, paths written): one table per world that has picks and a fingerprint, with
    the fused rules its ``fused_picks`` derive ahead of the built-in ones."""
    sections, paths = [], []
    for world in sorted(facts):
        mine = [p for p in picks if p.world == world]
        if not mine:
            sections.append(f"# W={world}: nothing measured, no table")
            continue
        transport = facts[world].get("transport", "p2p")
        default = default_of(facts[world])
        my_fused = [p for p in fused_picks if p.world == world]
        table = with_fused_rules(derive_table(mine, fallback=default), my_fused)
        text = [f"# W={world}: tuned vs default table ({placements.get(world, '')})",
                format_picks(mine, rows, world, job.dtype, facts[world].get("block_cap"), default),
                "# rules (first match wins; the default table's follow for other world sizes):",
                format_rules(table.to_json())]
        text += [f"# warning: {p}" for p in check_table(table, mine, job.dtype)]
        if world in fused.errors:
            text.append(f"# all_reduce_rmsnorm: measurement failed: {fused.errors[world]}")
        if any(r.world == world for r in fused.rows):
            text += [f"# W={world}: all_reduce_rmsnorm, hidden {fused.hidden}, p50 per call (us) of each forced "
                     "algorithm (unfused: the plain all-reduce, then the one add + RMSNorm kernel)",
                     format_fused(fused.rows, my_fused, world),
                     "# fused rules (first match wins; the built-in ones follow):",
                     format_rules(table.to_json(), "fused")]
        gpu, fp = facts[world].get("gpu_name"), facts[world].get("fingerprint")
        if gpu is None or fp is None:
            text.append("# no table written: the ranks did not report the GPU model and topology fingerprint")
        elif dry_run:
            text.append(f"# --dry-run: would write {cache.table_path(gpu, world, fp, cache_dir, transport)}")
        else:
            path = cache.table_path(gpu, world, fp, cache_dir, transport)
            meta = {"gpu": gpu, "world": world, "fingerprint": fp, "dtype": job.dtype,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "placement": placements.get(world, ""), "sizes": list(job.sizes),
                    "picks": [[p.size_bytes, p.algo, p.blocks, round(p.p50_us, 3)] for p in mine]}
            if my_fused:
                meta["fused_picks"] = {"hidden": fused.hidden, "picks": [
                    [p.tokens, p.algo, round(p.pair_us, 3), p.fastest_algo,
                     None if p.fastest_us is None else round(p.fastest_us, 3)] for p in my_fused]}
            write_table(path, table.to_json(), meta)
            paths.append(path)
            text += [f"# wrote {path}", "# every Communicator created on this placement now adopts it"]
        sections.append("\n".join(text))
    return sections, paths


def report(rows: Sequence[Measurement], facts: dict[int, dict[str, Any]], placements: dict[int, str],
           errors: dict[int, str], job: TuneJob, args: argparse.Namespace,
           fused: Fused = Fused()) -> tuple[str, list[str]]:
    """The printed report and the tables written (paths)."""
    picks = pick_shapes(rows, args.tolerance)
    fused_picks = pick_fused(fused.rows, args.tolerance)
    parts = [f"# pcie_allreduce tune | {job.dtype} | p50 per call (us), CUDA-graph replay of {job.calls_per_graph} "
             "raw launches at a forced block count; a replay's time is the slowest rank's"]
    for world in sorted(set(facts) | set(errors)):
        if world in errors:
            parts.append(f"# W={world}: measurement failed: {errors[world]}")
        else:
            parts.append(f"# W={world} | {placements[world]}\n" + format_matrix(rows, world, job.blocks))
    sections, paths = write_tables(rows, facts, placements, job, picks, args.cache_dir, args.dry_run, fused,
                                   fused_picks)
    wrong = [f"# wrong sum: W={r.world} {r.size_bytes} B {r.algo}/b{r.blocks}: {r.error}" for r in rows
             if r.status == WRONG]
    wrong += [f"# wrong result: W={r.world} {r.tokens} x {r.hidden} {r.algo}: {r.error}" for r in fused.rows
              if r.status == WRONG]
    return "\n\n".join(parts + sections + (["\n".join(wrong)] if wrong else [])) + "\n", paths


def write_out(out_dir: str, text: str, rows: Sequence[Measurement], facts: dict[int, dict[str, Any]],
              errors: dict[int, str], job: TuneJob, fused: Fused = Fused()) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    document = {"job": dataclasses.asdict(job), "facts": {str(w): f for w, f in facts.items()},
                "errors": {str(w): e for w, e in errors.items()},
                "measurements": [dataclasses.asdict(r) for r in rows],
                "fused": {"hidden": fused.hidden, "errors": {str(w): e for w, e in fused.errors.items()},
                          "measurements": [dataclasses.asdict(r) for r in fused.rows]}}
    written = []
    for name, content in (("tune.txt", text), ("tune.json", json.dumps(document, indent=1) + "\n")):
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(content)
        written.append(path)
    return written
