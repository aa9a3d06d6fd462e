"""``pcie-allreduce tune``: its options, and the run over world sizes (measure in W ranks, then
report and write the table; the method: :mod:`pcie_allreduce.tools.tune`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pcie_allreduce import sizes, transport as transport_mod
from pcie_allreduce.constants import MAX_LAUNCH_BLOCKS, MAX_RANKS, MIN_RANKS
from pcie_allreduce.plan import cache
from pcie_allreduce.tools.cli import EXIT_FAILURES, non_negative_int, one_line, positive_float, positive_int, typed_arg
from pcie_allreduce.tools.tune import report
from pcie_allreduce.tools.tune.derive import (ALGORITHMS, DEFAULT_TOLERANCE, WRONG, FusedMeasurement, Measurement,
                                              derive_table, pick_shapes)
from pcie_allreduce.tools.tune.measure import FusedJob, TuneJob, measure_fused_rank, measure_rank

MIN_WORLD, MAX_WORLD = MIN_RANKS, MAX_RANKS
EMULATED_WORLDS: tuple[int, ...] = (2, 4, 8)  # on one GPU, under MPS
# Powers of two up to the launch cap.
DEFAULT_BLOCKS: tuple[int, ...] = tuple(1 << i for i in range(MAX_LAUNCH_BLOCKS.bit_length()) if 1 << i <= MAX_LAUNCH_BLOCKS)
DEFAULT_MIN_BYTES, DEFAULT_MAX_BYTES = "1K", "8M"  # 8M: the Communicator's default max_bytes


def default_worlds(gpu_count: int) -> tuple[int, ...]:
    """All local GPUs (capped at MAX_WORLD) when there are several, else 2, 4, 8 emulated on one GPU."""
    if gpu_count > 1:
        return (min(gpu_count, MAX_WORLD),)
    return EMULATED_WORLDS


world_arg = typed_arg(int, lambda v: MIN_WORLD <= v <= MAX_WORLD, f"an integer in [{MIN_WORLD}, {MAX_WORLD}]")
blocks_arg = typed_arg(int, lambda v: 1 <= v <= MAX_LAUNCH_BLOCKS, f"an integer in [1, {MAX_LAUNCH_BLOCKS}]")
tolerance_arg = typed_arg(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def add_world_argument(group: argparse._ArgumentGroup) -> None:
    """``--world W ...``, for ``pcie-allreduce tune`` and the benchmark (read back with
    :func:`default_worlds` when not given)."""
    group.add_argument("--world", type=world_arg, nargs="+", metavar="W",
                       help="ranks per run (default: the number of GPUs if > 1, else 2 4 8 emulated on one GPU "
                            "under MPS)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pcie-allreduce tune``."""
    what = parser.add_argument_group("what to measure")
    add_world_argument(what)
    what.add_argument("--dtype", choices=tuple(sizes.DTYPE_SIZES), default="bfloat16")
    sizes.add_size_arguments(what, default_min=DEFAULT_MIN_BYTES, default_max=DEFAULT_MAX_BYTES)
    what.add_argument("--algos", choices=ALGORITHMS, nargs="+", metavar="ALGO",
                      help=f"algorithms to consider ({' '.join(ALGORITHMS)}; default all)")
    what.add_argument("--transport", choices=transport_mod.CHOICES, default="auto",
                      help="the communicator's transport (default auto: P2P where it works, else host memory); "
                           "a host-transport table is cached apart from the P2P one")
    what.add_argument("--blocks", type=blocks_arg, nargs="+", metavar="N",
                      help=f"block counts to try (default {' '.join(map(str, DEFAULT_BLOCKS))}; counts above the "
                           "block cap of ranks sharing a GPU are skipped)")
    what.add_argument("--tolerance", type=tolerance_arg, default=DEFAULT_TOLERANCE, metavar="F",
                      help=f"a shape within this fraction of the fastest wins if it uses fewer blocks; a fused "
                           f"kernel must beat the unfused pair by more than it (default {DEFAULT_TOLERANCE:g})")
    what.add_argument("--fused-tokens", type=positive_int, nargs="+", metavar="T",
                      help="also measure all_reduce_rmsnorm at these token counts (with --hidden): every fused "
                           "kernel against the plain all-reduce + one add + RMSNorm kernel, and write fused "
                           "rules into the table (default: none; the built-in fused rules apply)")
    what.add_argument("--hidden", type=positive_int, metavar="H",
                      help="the model's hidden size, for --fused-tokens")
    how = parser.add_argument_group("how to time")
    how.add_argument("--iters", type=positive_int, default=30, metavar="N",
                     help="timed replays per shape, at most (fewer if --time-budget runs out; default 30)")
    how.add_argument("--warmup", type=non_negative_int, default=5, metavar="N",
                     help="untimed replays first (default 5)")
    how.add_argument("--calls-per-graph", type=positive_int, default=16, metavar="N",
                     help="launches captured in one CUDA graph; time per call = replay time / this (default 16)")
    how.add_argument("--time-budget", type=positive_float, default=0.2, metavar="S",
                     help="seconds of timed replays per shape before --iters is cut short (default 0.2)")
    how.add_argument("--timeout", type=positive_float, default=900.0, metavar="S",
                     help="a world size whose ranks take longer than this in all is stopped and reported (default 900)")
    where = parser.add_argument_group("where the table goes")
    where.add_argument("--cache-dir", metavar="DIR",
                       help=f"write tables here (default ${cache.CACHE_ENV}, else $XDG_CACHE_HOME/pcie_allreduce, "
                            "else ~/.cache/pcie_allreduce)")
    where.add_argument("--dry-run", action="store_true", help="measure and print, write no table")
    where.add_argument("--out", metavar="DIR", help="also write the report (tune.txt) and the measurements (tune.json) "
                                                    "into DIR")


def sweep_sizes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, ...]:
    """--sizes, or the doubling sweep --min-bytes .. --max-bytes, checked against the dtype."""
    return sizes.requested_sizes(args.sizes, args.min_bytes, args.max_bytes, default_min=DEFAULT_MIN_BYTES,
                                 default_max=DEFAULT_MAX_BYTES, dtype=args.dtype, error=parser.error)


def job_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TuneJob:
    """The validated job; bad combinations call ``parser.error`` (exit 2)."""
    if bool(args.fused_tokens) != bool(args.hidden):
        parser.error("--fused-tokens and --hidden go together: the token counts to measure all_reduce_rmsnorm at, "
                     "and the model's hidden size")
    if args.fused_tokens and args.dtype not in ("bfloat16", "float16"):
        parser.error(f"--fused-tokens: all_reduce_rmsnorm takes bfloat16 or float16, not --dtype {args.dtype}")
    if args.hidden:
        from pcie_allreduce.validation import MAX_RMSNORM_HIDDEN  # torch: only when asked

        if args.hidden > MAX_RMSNORM_HIDDEN:
            parser.error(f"--hidden {args.hidden}: all_reduce_rmsnorm takes rows of at most {MAX_RMSNORM_HIDDEN}")
    return TuneJob(sizes=sweep_sizes(args, parser), algos=tuple(dict.fromkeys(args.algos or ALGORITHMS)),
                   blocks=tuple(sorted(set(args.blocks or DEFAULT_BLOCKS))), dtype=args.dtype, iters=args.iters,
                   warmup=args.warmup, calls_per_graph=args.calls_per_graph, time_budget_s=args.time_budget,
                   transport=args.transport)


def measure_world(world: int, job: TuneJob, timeout_s: float) -> tuple[list[Measurement], dict[str, Any]]:
    """Every shape of ``job`` at ``world`` ranks (raises RankFailed when a rank fails or hangs)."""
    import warnings

    from pcie_allreduce.tools import ranks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ranks.MpsUnavailableWarning)  # the placement line says so
        result = ranks.run_ranks(measure_rank, world, job, timeout_s=timeout_s, gpu=True, mps="auto")[0]
    return [Measurement(world=world, **row) for row in result["rows"]], result["facts"]


def fused_job(args: argparse.Namespace, job: TuneJob, rows: list[Measurement],
              facts: dict[str, Any]) -> FusedJob:
    """The fused measurement of one world, with the plain table its measured ``rows`` derive (the
    one the report writes for it)."""
    table = derive_table(pick_shapes(rows, args.tolerance), fallback=report.default_of(facts))
    return FusedJob(tokens=tuple(sorted(set(args.fused_tokens))), hidden=args.hidden, table=table, plain=job)


def measure_fused_world(world: int, job: FusedJob, timeout_s: float) -> list[FusedMeasurement]:
    """The fused calls of ``job`` at ``world`` ranks (raises RankFailed when a rank fails or hangs)."""
    import warnings

    from pcie_allreduce.tools import ranks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ranks.MpsUnavailableWarning)
        result = ranks.run_ranks(measure_fused_rank, world, job, timeout_s=timeout_s, gpu=True, mps="auto")[0]
    return [FusedMeasurement(world=world, **row) for row in result["rows"]]


def _gpu_count() -> int:
    """Visible GPUs; raises UnavailableError when none, or when our kernels cannot run here."""
    import torch

    import pcie_allreduce
    from pcie_allreduce.errors import UnavailableError
    from pcie_allreduce.tools import ranks

    reason = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason()
    if reason is not None:
        raise UnavailableError(reason)
    return ranks.gpu_count() if torch.version.cuda is not None else 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``pcie-allreduce tune``: 0, or 1 when a world size failed or a shape summed wrong."""
    from pcie_allreduce.tools import ranks

    job = job_from_args(args, parser)
    gpu_count = _gpu_count()
    worlds = tuple(dict.fromkeys(args.world)) if args.world else default_worlds(gpu_count)
    rows: list[Measurement] = []
    fused_rows: list[FusedMeasurement] = []
    fused_errors: dict[int, str] = {}
    facts: dict[int, dict[str, Any]] = {}
    placements: dict[int, str] = {}
    errors: dict[int, str] = {}
    for world in worlds:
        shapes = len(job.sizes) * len(job.algos) * len(job.blocks)
        print(f"[W={world}] measuring {shapes} launch shapes ...", file=sys.stderr, flush=True)
        try:
            measured_rows, facts[world] = measure_world(world, job, args.timeout)
        except Exception as exc:  # noqa: BLE001 - RankFailed above all: reported per W, the others go on
            errors[world] = one_line(exc)
            continue
        rows += measured_rows
        placements[world] = ranks.placement_label(world, gpu_count, facts[world].get("mps"))
        if args.fused_tokens:
            print(f"[W={world}] measuring all_reduce_rmsnorm at {len(args.fused_tokens)} token counts ...",
                  file=sys.stderr, flush=True)
            try:
                fused_rows += measure_fused_world(world, fused_job(args, job, measured_rows, facts[world]), args.timeout)
            except Exception as exc:  # noqa: BLE001 - as above; this W's table keeps the built-in fused rules
                fused_errors[world] = one_line(exc)
    fused = report.Fused(fused_rows, fused_errors, args.hidden)
    text, paths = report.report(rows, facts, placements, errors, job, args, fused)
    sys.stdout.write(text)
    sys.stdout.flush()
    out = report.write_out(args.out, text, rows, facts, errors, job, fused) if args.out else []
    for path in paths + out:
        print(f"wrote {path}", file=sys.stderr)
    failed = errors or fused_errors or any(r.status == WRONG for r in [*rows, *fused_rows])
    return EXIT_FAILURES if failed else 0
