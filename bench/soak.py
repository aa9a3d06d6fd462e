"""``python -m bench soak``: a long run of random collectives on W ranks, every result checked.

Every rank (:mod:`bench.soak_rank`) runs the same seeded schedule of plain all-reduces of every
size class, dtype and algorithm, fused all-reduce + residual add + RMSNorm, tensors at misaligned
offsets, in-place calls, stragglers on the host and on the stream, and CUDA graphs captured on a
side stream and replayed with new data, and checks every output against an exact sum. A rank
whose communicator failed (CollectiveTimeout / CollectiveMismatch) or that raised ends the run on
every rank at the next check-point, with a report; this module is the command and that report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any, Sequence

from pcie_allreduce.tools.cli import EXIT_FAILURES, non_negative_int, positive_float, positive_int
from pcie_allreduce.errors import UnavailableError
from pcie_allreduce.sizes import size_arg

from bench.soak_rank import (
    CHECK_EVERY, DEFAULT_CALLS, DEFAULT_MINUTES, DEFAULT_OUT, DEFAULT_SEED, GRAPH_EVERY, HUNG, MAX_LISTED, PROGRESS_S,
    SoakConfig, soak_rank,
)

DEFAULT_MAX_BYTES = "2M"
COMPILE_GOAL_S = 10.0   # a fused variant's first call should not stall a server longer than this
SETUP_S = 600.0         # spawn, communicator creation and teardown, on top of the run's own limit
JSON_NAME, TEXT_NAME = "soak.json", "soak.txt"


# ---- command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m bench soak``."""
    from pcie_allreduce import transport
    from pcie_allreduce.tools.tune.cli import world_arg

    parser.add_argument("--world", type=world_arg, metavar="W",
                        help="ranks (default: the number of GPUs if > 1, else 8 emulated on one GPU under MPS)")
    parser.add_argument("--calls", type=positive_int, default=DEFAULT_CALLS, metavar="N",
                        help=f"run at least this many collective calls (default {DEFAULT_CALLS})")
    parser.add_argument("--minutes", type=positive_float, default=DEFAULT_MINUTES, metavar="M",
                        help=f"and at least this many minutes (default {DEFAULT_MINUTES:g})")
    parser.add_argument("--seed", type=non_negative_int, default=DEFAULT_SEED, metavar="S",
                        help="seed of the schedule and of the input patterns (default 0)")
    parser.add_argument("--max-bytes", type=size_arg, default=size_arg(DEFAULT_MAX_BYTES), metavar="SIZE",
                        help=f"largest message, also the communicator's max_bytes (default {DEFAULT_MAX_BYTES})")
    parser.add_argument("--timeout-s", type=positive_float, metavar="S",
                        help="the communicator's kernel timeout (default: the library's default)")
    parser.add_argument("--transport", choices=transport.CHOICES, default="auto",
                        help="the communicator's transport (default auto: P2P where it works, else host memory)")
    parser.add_argument("--limit-minutes", type=positive_float, metavar="M",
                        help="stop here even if --calls is not reached, and fail (default 3 x --minutes + 10)")
    parser.add_argument("--check-every", type=positive_int, default=CHECK_EVERY, metavar="N",
                        help=f"calls between check-points (default {CHECK_EVERY})")
    parser.add_argument("--graph-every", type=non_negative_int, default=GRAPH_EVERY, metavar="N",
                        help=f"calls between CUDA graph episodes, about; 0: none (default {GRAPH_EVERY})")
    parser.add_argument("--progress", type=positive_float, default=PROGRESS_S, metavar="S",
                        help=f"seconds between progress lines (default {PROGRESS_S:g})")
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"write {JSON_NAME} and {TEXT_NAME} here (default bench/results/soak)")


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, gpu_count: int) -> SoakConfig:
    """The validated configuration; usage errors go through ``parser.error`` (exit 2)."""
    from pcie_allreduce.rendezvous import DEFAULT_TIMEOUT_S
    from pcie_allreduce.constants import MAX_MESSAGE_BYTES
    from pcie_allreduce.tools.tune.cli import default_worlds

    from bench.soak_schedule import FUSED_HIDDENS, LATE_S

    smallest = max(FUSED_HIDDENS) * 2  # one token of the widest fused call, in 2-byte dtypes
    if not smallest <= args.max_bytes <= MAX_MESSAGE_BYTES:
        parser.error(f"--max-bytes must be in [{smallest}, {MAX_MESSAGE_BYTES}], got {args.max_bytes}")
    world = args.world if args.world is not None else max(default_worlds(gpu_count))
    cfg = SoakConfig(world=world, calls=args.calls, minutes=args.minutes, seed=args.seed, max_bytes=args.max_bytes,
                     timeout_s=DEFAULT_TIMEOUT_S if args.timeout_s is None else args.timeout_s,
                     limit_minutes=args.limit_minutes or 0.0, check_every=args.check_every,
                     graph_every=args.graph_every, progress_s=args.progress, out=args.out,
                     transport=args.transport)
    if cfg.timeout_s < 2 * max(LATE_S):
        parser.error(f"--timeout-s must be at least {2 * max(LATE_S):g} s: the soak makes a rank "
                     f"{max(LATE_S):g} s late now and then")
    if cfg.limit_s < 60 * cfg.minutes:
        parser.error(f"--limit-minutes ({cfg.limit_s / 60:g}) is shorter than --minutes ({cfg.minutes:g})")
    return cfg


def unavailable_reason() -> str | None:
    """Why the soak cannot run here: no GPU, or our kernels are not usable."""
    import pcie_allreduce
    from pcie_allreduce.tools import ranks

    return ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason()


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``python -m bench soak``: spawn the ranks, print and write the report, the exit status."""
    from pcie_allreduce.tools import ranks

    from bench.command import echo
    from bench.environment import host_environment

    gpu_count = ranks.gpu_count()
    cfg = config_from_args(args, parser, gpu_count)
    reason = unavailable_reason()
    if reason is not None:
        raise UnavailableError(reason)
    env = host_environment()
    echo(f"soak: W={cfg.world} ({ranks.placement_label(cfg.world, gpu_count, None)}), seed {cfg.seed}, "
        f"until >= {cfg.calls} calls and >= {cfg.minutes:g} min (limit {cfg.limit_s / 60:g} min)")
    failure = None
    try:
        results = ranks.run_ranks(soak_rank, cfg.world, cfg, timeout_s=cfg.limit_s + SETUP_S)
    except ranks.RankFailed as exc:  # a rank died or the run overran: still a report
        results, failure = [], str(exc)
    summary = summarize(cfg, results, failure)
    # As the other modes record it: rank 0's view (placement, devices) per W, and the placement label.
    rank0 = results[0] if results else {}
    env["ranks"] = {str(cfg.world): {**rank0.get("environment", {}), **rank0.get("communicator", {})}}
    env["placements"] = {str(cfg.world): ranks.placement_label(cfg.world, gpu_count, summary.get("mps"))}
    text = format_summary(summary)
    sys.stdout.write(text)
    sys.stdout.flush()
    for path in write_outputs(cfg.out, {"environment": env, "config": cfg.to_dict(), "summary": summary,
                                        "ranks": results}, text):
        echo(f"wrote {path}")
    return exit_status(summary)


# ---- the parent's report (pure) -----------------------------------------------------------------


def summarize(cfg: SoakConfig, results: Sequence[dict[str, Any]], failure: str | None = None) -> dict[str, Any]:
    """One summary from the ranks' results (every rank counts the same calls; wrong elements and
    failures add up over ranks). ``failure``: why there are no results (a rank died)."""
    errors = [f"rank {r['rank']}: {r['error']}" for r in results if r.get("error")]
    if failure:
        errors.append(failure)
    first = results[0] if results else {}
    calls = [r.get("calls", 0) for r in results]
    if len(set(calls)) > 1 and not errors:  # a rank that failed stops early: that is its error
        errors.append(f"ranks disagree on the number of calls done: {calls}")
    counts: Counter[str] = Counter()
    for key, value in first.get("counts", {}).items():
        counts[key] += value
    summary = {
        "world": cfg.world,
        "calls": first.get("calls", 0),
        "plain": first.get("plain", 0),
        "fused": first.get("fused", 0),
        "in_graphs": first.get("in_graphs", 0),
        "graphs": first.get("graphs", 0),
        "stragglers": first.get("stragglers", 0),
        "warmup": {**first.get("warmup", {}), "compile_s": _slowest_compiles(results)},
        "elapsed_s": first.get("elapsed_s", 0.0),
        "wrong": sum(r.get("wrong", 0) for r in results),
        "hung": sum(1 for r in results if r.get("failure") == HUNG),
        "errors": errors,
        "wrong_calls": [w for r in results for w in r.get("wrong_calls", [])][:MAX_LISTED],
        "counts": dict(sorted(counts.items())),
        "mps": first.get("environment", {}).get("mps"),
        "communicator": first.get("communicator", {}),
    }
    summary["calls_per_s"] = summary["calls"] / summary["elapsed_s"] if summary["elapsed_s"] else 0.0
    summary["targets_met"] = summary["calls"] >= cfg.calls and summary["elapsed_s"] >= 60 * cfg.minutes
    return summary


def exit_status(summary: dict[str, Any]) -> int:
    """0 when nothing was wrong, nothing hung or failed and both targets were met; else 1."""
    ok = summary["wrong"] == 0 and summary["hung"] == 0 and not summary["errors"] and summary["targets_met"]
    return 0 if ok else EXIT_FAILURES


def _slowest_compiles(results: list[dict[str, Any]]) -> dict[str, float]:
    """Each fused variant's compile time on the slowest rank (the one every rank waited for)."""
    slowest: dict[str, float] = {}
    for r in results:
        for variant, seconds in (r.get("warmup") or {}).get("compile_s", {}).items():
            slowest[variant] = max(seconds, slowest.get(variant, 0.0))
    return dict(sorted(slowest.items()))


def format_summary(summary: dict[str, Any]) -> str:
    """The report: the summary line, the counts per kind/dtype/algorithm, what went wrong."""
    s = summary
    lines = [f"soak: W={s['world']} calls={s['calls']} (plain {s['plain']}, fused {s['fused']}, in graphs "
             f"{s['in_graphs']}) calls/s={s['calls_per_s']:.0f} wrong={s['wrong']} hung={s['hung']} "
             f"elapsed={s['elapsed_s']:.0f} s"]
    if not s["targets_met"]:
        lines.append("soak: the targets (--calls and --minutes) were not met")
    warmup = s.get("warmup") or {}
    if warmup:
        lines.append(f"# before the clock: {warmup.get('calls', 0)} fused calls, one per kernel variant (Triton "
                     f"compiles), {warmup.get('seconds', 0.0):.0f} s, checked like the rest")
        compiles = warmup.get("compile_s") or {}
        if compiles:
            slowest = max(compiles.values())
            lines.append(f"# compile time per fused variant, slowest rank: {len(compiles)} variants, longest "
                         f"{slowest:.1f} s{' (over ' + str(COMPILE_GOAL_S) + ' s)' if slowest > COMPILE_GOAL_S else ''}")
            lines += [f"  compile {variant:<52} {seconds:>7.2f} s" for variant, seconds in compiles.items()]
    lines.append(f"# {s['graphs']} CUDA graphs captured; {s['stragglers']} stragglers injected")
    lines.append("# calls per kind, dtype and algorithm (auto: what it picked)")
    lines += [f"  {key:<40} {value:>10}" for key, value in s["counts"].items()]
    for wrong in s["wrong_calls"]:
        lines.append(f"# wrong: {wrong}")
    for error in s["errors"]:
        lines.append(f"# error: {error}")
    return "\n".join(lines) + "\n"


def write_outputs(out: str, document: dict[str, Any], text: str) -> list[str]:
    """soak.json (the document) and soak.txt (the printed report) into ``out``; the paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, JSON_NAME), os.path.join(out, TEXT_NAME)]
    with open(paths[0], "w", encoding="utf-8") as fh:
        json.dump(document, fh, indent=2, default=str)
        fh.write("\n")
    with open(paths[1], "w", encoding="utf-8") as fh:
        fh.write(text)
    return paths
