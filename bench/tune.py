"""``pcie-allreduce tune``: measure every (algorithm, block count) at the sizes and W you serve, and
write the resulting algorithm table to the cache (see :mod:`.tune_cache`).

The measurement is a bench run of the internal ``ours_shapes`` backend (our raw launch at a forced
block count), so it gets the bench's isolation, watchdog, retries, exact-sum check and timing.
The table is derived by :mod:`.tune_table`. Use it with ``PCIE_AR_ALGO_TABLE=<path>`` (every rank
must load the same table; the communicator checks that they agree).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Any, Sequence

from pcie_allreduce import tune_cache
from pcie_allreduce.cli import typed_arg
from pcie_allreduce.algo import ALGORITHMS
from bench import options, report, tune_table
from bench.backends import OURS_SHAPES
from bench.options import BenchConfig
from bench.plan import parse_shape_algo
from bench.results import TUNE, Report, Result
from bench.table import Column, render

DEFAULT_BLOCKS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_MAX = "8M"  # the Communicator's default max_bytes
MAX_LAUNCH_BLOCKS = 64

blocks_arg = typed_arg(int, lambda v: 1 <= v <= MAX_LAUNCH_BLOCKS, f"an integer in [1, {MAX_LAUNCH_BLOCKS}]")
tolerance_arg = typed_arg(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pcie-allreduce tune``."""
    what = options.add_run_arguments(parser, backends=False)
    what.add_argument("--sizes", type=options.size_arg, nargs="+", metavar="SIZE",
                      help="the message sizes you serve (K/M/G suffixes); default a doubling sweep")
    what.add_argument("--min-bytes", type=options.size_arg, metavar="SIZE",
                      help=f"smallest size of the doubling sweep (default {options.DEFAULT_MIN_BYTES})")
    what.add_argument("--max-bytes", type=options.size_arg, metavar="SIZE",
                      help=f"largest size of the doubling sweep (default {DEFAULT_MAX})")
    what.add_argument("--algos", choices=ALGORITHMS, nargs="+", metavar="ALGO",
                      help=f"algorithms to consider ({' '.join(ALGORITHMS)}; default all)")
    what.add_argument("--blocks", type=blocks_arg, nargs="+", metavar="N",
                      help=f"block counts to try (default {' '.join(map(str, DEFAULT_BLOCKS))}; counts above the "
                           "block cap of ranks sharing a GPU are skipped)")
    what.add_argument("--tolerance", type=tolerance_arg, default=tune_table.DEFAULT_TOLERANCE, metavar="F",
                      help="a shape within this fraction of the fastest wins if it uses fewer blocks "
                           f"(default {tune_table.DEFAULT_TOLERANCE:g})")
    where = parser.add_argument_group("where the table goes")
    where.add_argument("--cache-dir", metavar="DIR",
                       help=f"write tables here (default ${tune_cache.CACHE_ENV}, else $XDG_CACHE_HOME/pcie_allreduce, "
                            "else ~/.cache/pcie_allreduce)")
    where.add_argument("--dry-run", action="store_true", help="measure and print, write no table")
    options.add_timing_arguments(parser, iters=30, warmup=5, time_budget=0.2)
    options.add_output_arguments(parser, "tune.csv, tune.json and tune.txt (the measurements)")


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, gpu_count: int) -> BenchConfig:
    if args.max_bytes is None and not args.sizes:
        args.max_bytes = options.sizes.parse_size(DEFAULT_MAX)
    return BenchConfig(
        sizes=options.sweep_sizes(args, parser),
        algos=options.unique(args.algos) if args.algos else ALGORITHMS,
        backends=(OURS_SHAPES,),
        backends_explicit=True,
        calls_per_graph=args.calls_per_graph,
        workload=TUNE,
        blocks=tuple(sorted(options.unique(args.blocks or DEFAULT_BLOCKS))),
        **options.common_fields(args, gpu_count),
    )


# ---- formatting (pure) --------------------------------------------------------------------


def format_matrix(results: Sequence[Result], world: int, blocks: Sequence[int]) -> str:
    """p50 us per (size, algo) row and block-count column; '-' not measured, 'skip' over the block cap."""
    cells: dict[tuple[int, str], dict[int, str]] = {}
    for r in results:
        if r.world != world or r.workload != TUNE:
            continue
        algo, b = parse_shape_algo(r.algo)
        text = f"{r.p50_us:.2f}" if r.ok else ("skip" if r.status == "skipped" else r.status)
        cells.setdefault((r.size_bytes, algo), {})[b] = text
    columns = [Column("size(B)", 10, lambda k: str(k[0])), Column("algo", 8, lambda k: k[1]),
               *[Column(f"b={b}", 8, lambda k, b=b: cells[k].get(b, "-")) for b in blocks]]
    order = sorted(cells, key=lambda k: (k[0], ALGORITHMS.index(k[1]) if k[1] in ALGORITHMS else 9))
    return "\n".join(render(columns, order))


def format_picks(picks: Sequence[tune_table.Pick], results: Sequence[Result], world: int, dtype: str,
                 block_cap: int | None) -> str:
    """Per size: the tuned pick vs what the default table launches (and its measured p50, if measured)."""
    from pcie_allreduce.algo import default_table

    times = tune_table.measured(results)
    rows = []
    for p in picks:
        if p.world != world:
            continue
        choice = default_table().select(p.size_bytes, world, dtype)
        blocks = min(choice.blocks, block_cap) if block_cap else choice.blocks
        default_us = times.get((world, p.size_bytes, choice.algo, blocks))
        rows.append((p, f"{choice.algo}/b{blocks}", default_us))
    columns = [
        Column("size(B)", 10, lambda t: str(t[0].size_bytes)),
        Column("tuned", 12, lambda t: f"{t[0].algo}/b{t[0].blocks}"),
        Column("p50(us)", 9, lambda t: f"{t[0].p50_us:.2f}"),
        Column("default", 12, lambda t: t[1]),
        Column("p50(us)", 9, lambda t: "-" if t[2] is None else f"{t[2]:.2f}"),
        Column("gain", 7, lambda t: "-" if t[2] is None else f"{(1 - t[0].p50_us / t[2]) * 100:+.0f}%"),
    ]
    return "\n".join(render(columns, rows))


def format_rules(table_json: str) -> str:
    import json

    return "\n".join("  " + json.dumps(rule, sort_keys=True) for rule in json.loads(table_json)["rules"])


# ---- the command --------------------------------------------------------------------------


def _facts(rep: Report, world: int) -> dict[str, Any]:
    return dict(rep.environment.get("ranks", {}).get(str(world)) or {})


def write_tables(rep: Report, cfg: BenchConfig, picks: Sequence[tune_table.Pick], cache_dir: str | None,
                 dry_run: bool) -> tuple[list[str], list[str]]:
    """(text sections, paths written): one table per world that has picks and a fingerprint."""
    sections, paths = [], []
    for world in cfg.worlds:
        mine = [p for p in picks if p.world == world]
        facts = _facts(rep, world)
        if not mine:
            sections.append(f"# W={world}: nothing measured, no table")
            continue
        table = tune_table.derive_table(mine)
        problems = tune_table.check_table(table, mine, cfg.dtype)
        text = [f"# W={world}: tuned vs default table ({report.placements_label(rep, world)})",
                format_picks(mine, rep.results, world, cfg.dtype, facts.get("block_cap")),
                "# rules (first match wins; the default table's follow for other world sizes):",
                format_rules(table.to_json())]
        text += [f"# warning: {p}" for p in problems]
        gpu, fp = facts.get("gpu_name"), facts.get("fingerprint")
        if gpu is None or fp is None:
            text.append("# no table written: the run did not report the GPU model and topology fingerprint")
        elif dry_run:
            text.append(f"# --dry-run: would write {tune_cache.table_path(gpu, world, fp, cache_dir)}")
        else:
            path = tune_cache.table_path(gpu, world, fp, cache_dir)
            meta = {"gpu": gpu, "world": world, "fingerprint": fp, "dtype": cfg.dtype,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "placement": rep.placements.get(world, ""), "sizes": list(cfg.sizes),
                    "picks": [[p.size_bytes, p.algo, p.blocks, round(p.p50_us, 3)] for p in mine]}
            tune_cache.write_table(path, table.to_json(), meta)
            paths.append(path)
            text += [f"# wrote {path}", f"# use it: export PCIE_AR_ALGO_TABLE={path}   (on every rank)"]
        sections.append("\n".join(text))
    return sections, paths


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``pcie-allreduce tune``."""
    from bench import command

    gpu_count = command._gpu_count()
    cfg = config_from_args(args, parser, gpu_count)
    rep = command.sweep(cfg, gpu_count, "tune")
    picks = tune_table.pick_shapes(rep.results, args.tolerance)
    head = report.format_report_header(rep)
    matrices = [f"# W={w} | {report.placements_label(rep, w)} | {cfg.dtype} | p50 per call (us), "
                f"{'eager' if cfg.eager else 'CUDA-graph replay'}, {cfg.calls_per_graph} calls per block\n"
                + format_matrix(rep.results, w, cfg.blocks) for w in cfg.worlds]
    sections, paths = write_tables(rep, cfg, picks, args.cache_dir, args.dry_run)
    errors = report.format_errors(rep.results)
    text = "\n\n".join([head, *matrices, *sections, *([errors] if errors else [])]) + "\n"
    status = command.finish(rep, cfg, text)
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    return status
