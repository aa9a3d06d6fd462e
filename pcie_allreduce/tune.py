"""``pcie-allreduce tune``: measure our algorithms at every block count, at the sizes and W you serve,
and cache the algorithm table every Communicator on this machine then adopts.

Measurement (:func:`measure_rank`, in W ranks started by :func:`pcie_allreduce.ranks.run_ranks`,
under MPS when they share a GPU): one Communicator; per size, every (algorithm, block count) is
the workspace's raw launch at that forced block count, bypassing the algorithm table. Each shape
must first return the exact sum of the ranks' small-integer inputs (exact in any reduction
order), then is timed as CUDA-graph replays of ``calls_per_graph`` launches; a replay's time is
the slowest rank's. Shapes over the block cap (ranks sharing a GPU: every rank's blocks must be
co-resident) or the low-latency capacity are skipped identically on every rank.

Derivation (pure, :func:`pick_shapes` and :func:`derive_table`): for every (W, size) the winner
is the fastest shape, except that a shape within ``tolerance`` of the fastest wins if it uses
fewer blocks (fewer SMs taken from the model's compute, and the difference is noise). Then per
W, in size order, one rule per measured size::

    Rule(algo, max_bytes=size, world=(W,), bytes_per_block=size // blocks, max_blocks=blocks)

which launches exactly ``blocks`` at the measured size and proportionally fewer below it; the
last rule of a W has no size bound, and a rule the next one already reproduces is dropped. The
default table follows, for the other world sizes. Sizes between two measured ones get the larger
one's rule: measure the sizes you serve.

The table is written to the tune cache (:mod:`pcie_allreduce.tune_cache`), keyed by GPU model, W
and topology fingerprint, where every Communicator created on the same placement finds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from typing import Any, Iterable, Sequence

from pcie_allreduce import sizes, transport as transport_mod, tune_cache
from pcie_allreduce.cli import EXIT_FAILURES, non_negative_int, one_line, positive_float, positive_int, typed_arg
from pcie_allreduce.constants import MAX_LAUNCH_BLOCKS, MAX_RANKS, MIN_RANKS
from pcie_allreduce.plan import algorithms
from pcie_allreduce.plan.algorithms import ALGO_IDS, SYMMETRIC_INPUT_ALGORITHMS, fits_capacity
from pcie_allreduce.plan.algorithms import ALGORITHMS as ALL_ALGORITHMS
from pcie_allreduce.plan.rules import Rule
from pcie_allreduce.plan.tables import AlgoTable, default_table

# What tune times: the algorithms that take any tensor (the in-place ones keep their built-in rules).
ALGORITHMS: tuple[str, ...] = tuple(a for a in ALL_ALGORITHMS if a not in SYMMETRIC_INPUT_ALGORITHMS)

MIN_WORLD, MAX_WORLD = MIN_RANKS, MAX_RANKS
EMULATED_WORLDS: tuple[int, ...] = (2, 4, 8)  # on one GPU, under MPS
# Powers of two up to the launch cap.
DEFAULT_BLOCKS: tuple[int, ...] = tuple(1 << i for i in range(MAX_LAUNCH_BLOCKS.bit_length()) if 1 << i <= MAX_LAUNCH_BLOCKS)
DEFAULT_MIN_BYTES, DEFAULT_MAX_BYTES = "1K", "8M"  # 8M: the Communicator's default max_bytes
DEFAULT_TOLERANCE = 0.03
MIN_REPLAYS = 10
SLEEP_CYCLES = 20_000  # ~10 us at 2 GHz: the timed block is fully queued before the GPU reaches it
SYNC_COUNT = 8         # elements of the tiny all-reduce that lines the GPUs up before a timed block
OK, SKIPPED, WRONG = "ok", "skipped", "wrong"


def default_worlds(gpu_count: int) -> tuple[int, ...]:
    """All local GPUs (capped at MAX_WORLD) when there are several, else 2, 4, 8 emulated on one GPU."""
    if gpu_count > 1:
        return (min(gpu_count, MAX_WORLD),)
    return EMULATED_WORLDS


# ---- what is measured (picklable, pure) --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TuneJob:
    """What every rank measures: each size x algorithm x block count."""

    sizes: tuple[int, ...]
    algos: tuple[str, ...]
    blocks: tuple[int, ...]
    dtype: str = "bfloat16"
    iters: int = 30
    warmup: int = 5
    calls_per_graph: int = 16
    time_budget_s: float = 0.2
    kernel_timeout_s: float = 10.0
    transport: str = "auto"  # the communicator's (its algorithms are measured, its table written)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One launch shape at one (W, size): p50 / p99 per call in us over the timed replays, if ok."""

    world: int
    size_bytes: int
    algo: str
    blocks: int
    status: str = OK
    p50_us: float | None = None
    p99_us: float | None = None
    replays: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK and self.p50_us is not None


@dataclasses.dataclass(frozen=True)
class Pick:
    """The winning launch shape of one (world, size), and the fastest one's p50 for reference."""

    world: int
    size_bytes: int
    algo: str
    blocks: int
    p50_us: float
    fastest_us: float


# ---- from measurements to a table (pure) --------------------------------------------------


def measured(rows: Iterable[Measurement]) -> dict[tuple[int, int, str, int], float]:
    """(world, size, algo, blocks) -> p50 us of every ok measurement."""
    return {(r.world, r.size_bytes, r.algo, r.blocks): float(r.p50_us) for r in rows if r.ok}  # type: ignore[arg-type]


def pick_shapes(rows: Iterable[Measurement], tolerance: float = DEFAULT_TOLERANCE) -> list[Pick]:
    """The winner of every measured (world, size), sorted by world then size."""
    groups: dict[tuple[int, int], list[tuple[str, int, float]]] = {}
    for (world, size, algo, blocks), p50 in measured(rows).items():
        groups.setdefault((world, size), []).append((algo, blocks, p50))
    picks = []
    for (world, size), shapes in sorted(groups.items()):
        fastest = min(p50 for _, _, p50 in shapes)
        near = [s for s in shapes if s[2] <= fastest * (1 + tolerance)]
        algo, blocks, p50 = min(near, key=lambda s: (s[1], s[2], ALGORITHMS.index(s[0])))
        picks.append(Pick(world, size, algo, blocks, p50, fastest))
    return picks


def rules_for_world(world: int, picks: Sequence[Pick]) -> list[Rule]:
    """The rules reproducing ``picks`` (one world, any order) at their sizes; the last is unbounded."""
    ordered = sorted((p for p in picks if p.world == world), key=lambda p: p.size_bytes)
    rules: list[Rule] = []
    chosen: list[Pick] = []
    for p in ordered:
        rule = Rule(p.algo, max_bytes=p.size_bytes, world=(world,), bytes_per_block=max(1, p.size_bytes // p.blocks),
                    max_blocks=p.blocks)
        # Drop earlier rules that this one already reproduces (same algo and block count there).
        while rules and rules[-1].algo == rule.algo and all(
                rule.blocks_for(q.size_bytes) == q.blocks for q in chosen[-1:]):
            rules.pop()
            chosen.pop()
        rules.append(rule)
        chosen.append(p)
    if rules:
        rules[-1] = dataclasses.replace(rules[-1], max_bytes=None)
    return rules


def derive_table(picks: Sequence[Pick], worlds: Sequence[int] | None = None,
                 fallback: AlgoTable | None = None) -> AlgoTable:
    """Tuned rules for ``worlds`` (default: every world in ``picks``), then the fallback table's."""
    worlds = sorted({p.world for p in picks}) if worlds is None else list(worlds)
    tuned = [rule for w in worlds for rule in rules_for_world(w, picks)]
    base = fallback or default_table()
    return AlgoTable(tuple(tuned) + base.rules, base.fused)


def check_table(table: AlgoTable, picks: Sequence[Pick], dtype: str) -> list[str]:
    """Sizes where ``table`` does not launch what was picked (should be empty)."""
    problems = []
    for p in picks:
        choice = table.select(p.size_bytes, p.world, dtype)
        if (choice.algo, choice.blocks) != (p.algo, p.blocks):
            problems.append(f"W={p.world} {p.size_bytes} B: table picks {choice.algo}/b{choice.blocks}, "
                            f"measured best {p.algo}/b{p.blocks}")
    return problems


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ---- inside each rank ---------------------------------------------------------------------


def skip_reason(algo: str, blocks: int, size_bytes: int, block_cap: int, ll_capacity: int | None) -> str | None:
    """Why a shape cannot run on this communicator (the same on every rank: both limits are agreed)."""
    if blocks > block_cap:
        return f"{blocks} blocks > block cap {block_cap} (ranks share a GPU)"
    if not fits_capacity(algo, size_bytes, ll_capacity):
        return f"{algo} takes messages up to {ll_capacity} bytes"
    return None


def measure_rank(ctx: Any, job: TuneJob) -> dict[str, Any]:
    """``run_ranks`` runs this in every rank: every shape checked, then timed; rank 0's rows and facts."""
    import torch

    from pcie_allreduce import _ext
    from pcie_allreduce.communicator import Communicator

    dtype = getattr(torch, job.dtype)
    comm = Communicator(ctx.group, ctx.device, max_bytes=max(max(job.sizes), 4096), timeout_s=job.kernel_timeout_s,
                        transport=job.transport)
    try:
        stream = torch.cuda.Stream(ctx.device)
        comm.workspace(stream.cuda_stream)  # collective (IPC handle exchange): once, before any capture
        rows = []
        for size in job.sizes:
            count = size // sizes.DTYPE_SIZES[job.dtype]
            inp = _rank_input(count, ctx.rank, dtype, ctx.device)
            expected = sum(_rank_input(count, r, torch.int64, ctx.device) for r in range(ctx.world_size)).to(dtype)
            out = torch.empty_like(inp)
            for algo in (a for a in job.algos if algorithms.runs_on(a, comm.transport, comm.island_ranks)):
                for blocks in job.blocks:
                    rows.append(_measure_shape(ctx, job, comm, stream, inp, out, expected, algo, blocks))
        facts = {"gpu_name": torch.cuda.get_device_name(ctx.device), "block_cap": comm.block_cap, "mps": ctx.mps,
                 "transport": comm.transport, "islands": len(comm.islands)}
        ext = _ext.load()
        if ext is not None:
            facts["fingerprint"] = tune_cache.fingerprint_of(ext, [p.pci_bus_id for p in comm.placements], comm.islands)
    finally:
        comm.close()
    return {"rows": rows, "facts": facts} if ctx.rank == 0 else {}


def _rank_input(count: int, rank: int, dtype: Any, device: Any) -> Any:
    """Rank ``rank``'s input: integers in [-7, 7], so sums of up to 8 ranks are exact in any order."""
    import torch

    generator = torch.Generator(device=device).manual_seed(rank + 1)
    return torch.randint(-7, 8, (count,), generator=generator, device=device).to(dtype)


def _agree(ctx: Any, mine: Any) -> list[Any]:
    import torch.distributed as dist

    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine, group=ctx.group)
    return everyone


def _measure_shape(ctx: Any, job: TuneJob, comm: Any, stream: Any, inp: Any, out: Any, expected: Any, algo: str,
                   blocks: int) -> dict[str, Any]:
    import torch

    from pcie_allreduce.plan.dispatch import DTYPE_IDS

    size = inp.numel() * inp.element_size()
    row: dict[str, Any] = {"size_bytes": size, "algo": algo, "blocks": blocks}
    reason = skip_reason(algo, blocks, size, comm.block_cap, comm.ll_capacity)
    if reason is not None:
        return {**row, "status": SKIPPED, "error": reason}
    workspace = comm.workspace(stream.cuda_stream)
    args = (ALGO_IDS[algo], inp.data_ptr(), out.data_ptr(), size, DTYPE_IDS[inp.dtype], blocks, stream.cuda_stream)

    def launch() -> None:
        if workspace.all_reduce(*args):
            comm.raise_if_failed(workspace)

    def wrong() -> str:
        stream.synchronize()
        comm.check()  # a recorded timeout explains a wrong sum better than the values do
        bad = int((out != expected).sum())
        return f"rank {ctx.rank}: {bad} of {out.numel()} elements wrong" if bad else ""

    out.fill_(float("nan"))
    launch()
    problems = [p for p in _agree(ctx, wrong()) if p]
    if problems:
        return {**row, "status": WRONG, "error": problems[0]}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(job.calls_per_graph):
            launch()
    for _ in range(job.warmup):
        graph.replay()
    times = _timed_replays(ctx, job, comm, stream, graph)
    gathered = _agree(ctx, (times, wrong()))
    problems = [p for _, p in gathered if p]
    if problems:
        return {**row, "status": WRONG, "error": f"after timing: {problems[0]}"}
    slowest = [max(replay) / job.calls_per_graph for replay in zip(*(t for t, _ in gathered))]
    return {**row, "status": OK, "p50_us": percentile(slowest, 50), "p99_us": percentile(slowest, 99),
            "replays": len(slowest)}


def _timed_replays(ctx: Any, job: TuneJob, comm: Any, stream: Any, graph: Any) -> list[float]:
    """This rank's replay times (us): as many as the time budget allows, the same number on every rank.

    Before each replay the ranks meet at a gloo barrier, then each queues a short GPU sleep (the
    replay is queued before the GPU reaches it) and a tiny all-reduce (the GPUs start together).
    """
    import torch
    import torch.distributed as dist

    sync = torch.zeros(SYNC_COUNT, dtype=torch.float32, device=ctx.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep = getattr(torch.cuda, "_sleep", None)  # private but long-standing; timing works without it

    def replay() -> float:
        torch.cuda.synchronize(ctx.device)
        dist.barrier(group=ctx.group)
        with torch.cuda.stream(stream):
            if sleep is not None:
                sleep(SLEEP_CYCLES)
            comm.all_reduce(sync, out=sync)  # zeros stay zeros
            start.record(stream)
            graph.replay()
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    pilot = torch.tensor([replay()], dtype=torch.float64)
    dist.all_reduce(pilot, op=dist.ReduceOp.MAX, group=ctx.group)
    fits = int(job.time_budget_s * 1e6 / max(float(pilot[0]), 1e-3))
    count = max(min(job.iters, MIN_REPLAYS), min(job.iters, fits))
    return [replay() for _ in range(count)]


# ---- the parent ---------------------------------------------------------------------------


def measure_world(world: int, job: TuneJob, timeout_s: float) -> tuple[list[Measurement], dict[str, Any]]:
    """Every shape of ``job`` at ``world`` ranks (raises RankFailed when a rank fails or hangs)."""
    import warnings

    from pcie_allreduce import ranks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ranks.MpsUnavailableWarning)  # the placement line says so
        result = ranks.run_ranks(measure_rank, world, job, timeout_s=timeout_s, gpu=True, mps="auto")[0]
    return [Measurement(world=world, **row) for row in result["rows"]], result["facts"]


# ---- text -----------------------------------------------------------------------------------


def _render(header: Sequence[tuple[str, int]], rows: Iterable[Sequence[str]]) -> list[str]:
    """Right-aligned columns; the header line starts with '#'."""
    def line(cells: Sequence[str]) -> str:
        return " ".join(cell.rjust(width) for cell, (_, width) in zip(cells, header)).rstrip()

    head = line([name for name, _ in header])
    return ["#" + head[1:]] + [line(cells) for cells in rows]


def format_matrix(rows: Sequence[Measurement], world: int, blocks: Sequence[int]) -> str:
    """p50 us per (size, algo) row and block-count column; '-' not measured, 'skip' not runnable here."""
    cells: dict[tuple[int, str], dict[int, str]] = {}
    for r in rows:
        if r.world == world:
            text = f"{r.p50_us:.2f}" if r.ok else ("skip" if r.status == SKIPPED else r.status)
            cells.setdefault((r.size_bytes, r.algo), {})[r.blocks] = text
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


def format_rules(table_json: str) -> str:
    return "\n".join("  " + json.dumps(rule, sort_keys=True) for rule in json.loads(table_json)["rules"])


# ---- the command ----------------------------------------------------------------------------

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
                      help=f"a shape within this fraction of the fastest wins if it uses fewer blocks "
                           f"(default {DEFAULT_TOLERANCE:g})")
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
                       help=f"write tables here (default ${tune_cache.CACHE_ENV}, else $XDG_CACHE_HOME/pcie_allreduce, "
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
    return TuneJob(sizes=sweep_sizes(args, parser), algos=tuple(dict.fromkeys(args.algos or ALGORITHMS)),
                   blocks=tuple(sorted(set(args.blocks or DEFAULT_BLOCKS))), dtype=args.dtype, iters=args.iters,
                   warmup=args.warmup, calls_per_graph=args.calls_per_graph, time_budget_s=args.time_budget,
                   transport=args.transport)


def write_tables(rows: Sequence[Measurement], facts: dict[int, dict[str, Any]], placements: dict[int, str],
                 job: TuneJob, picks: Sequence[Pick], cache_dir: str | None,
                 dry_run: bool) -> tuple[list[str], list[str]]:
    """(text sections, paths written): one table per world that has picks and a fingerprint."""
    sections, paths = [], []
    for world in sorted(facts):
        mine = [p for p in picks if p.world == world]
        if not mine:
            sections.append(f"# W={world}: nothing measured, no table")
            continue
        transport = facts[world].get("transport", "p2p")
        default = default_table(transport, islands=facts[world].get("islands", 1))
        table = derive_table(mine, fallback=default)
        text = [f"# W={world}: tuned vs default table ({placements.get(world, '')})",
                format_picks(mine, rows, world, job.dtype, facts[world].get("block_cap"), default),
                "# rules (first match wins; the default table's follow for other world sizes):",
                format_rules(table.to_json())]
        text += [f"# warning: {p}" for p in check_table(table, mine, job.dtype)]
        gpu, fp = facts[world].get("gpu_name"), facts[world].get("fingerprint")
        if gpu is None or fp is None:
            text.append("# no table written: the ranks did not report the GPU model and topology fingerprint")
        elif dry_run:
            text.append(f"# --dry-run: would write {tune_cache.table_path(gpu, world, fp, cache_dir, transport)}")
        else:
            path = tune_cache.table_path(gpu, world, fp, cache_dir, transport)
            meta = {"gpu": gpu, "world": world, "fingerprint": fp, "dtype": job.dtype,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "placement": placements.get(world, ""), "sizes": list(job.sizes),
                    "picks": [[p.size_bytes, p.algo, p.blocks, round(p.p50_us, 3)] for p in mine]}
            tune_cache.write_table(path, table.to_json(), meta)
            paths.append(path)
            text += [f"# wrote {path}", "# every Communicator created on this placement now adopts it"]
        sections.append("\n".join(text))
    return sections, paths


def report(rows: Sequence[Measurement], facts: dict[int, dict[str, Any]], placements: dict[int, str],
           errors: dict[int, str], job: TuneJob, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The printed report and the tables written (paths)."""
    picks = pick_shapes(rows, args.tolerance)
    parts = [f"# pcie_allreduce tune | {job.dtype} | p50 per call (us), CUDA-graph replay of {job.calls_per_graph} "
             "raw launches at a forced block count; a replay's time is the slowest rank's"]
    for world in sorted(set(facts) | set(errors)):
        if world in errors:
            parts.append(f"# W={world}: measurement failed: {errors[world]}")
        else:
            parts.append(f"# W={world} | {placements[world]}\n" + format_matrix(rows, world, job.blocks))
    sections, paths = write_tables(rows, facts, placements, job, picks, args.cache_dir, args.dry_run)
    wrong = [f"# wrong sum: W={r.world} {r.size_bytes} B {r.algo}/b{r.blocks}: {r.error}" for r in rows
             if r.status == WRONG]
    return "\n\n".join(parts + sections + (["\n".join(wrong)] if wrong else [])) + "\n", paths


def _write_out(out_dir: str, text: str, rows: Sequence[Measurement], facts: dict[int, dict[str, Any]],
               errors: dict[int, str], job: TuneJob) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    document = {"job": dataclasses.asdict(job), "facts": {str(w): f for w, f in facts.items()},
                "errors": {str(w): e for w, e in errors.items()},
                "measurements": [dataclasses.asdict(r) for r in rows]}
    written = []
    for name, content in (("tune.txt", text), ("tune.json", json.dumps(document, indent=1) + "\n")):
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(content)
        written.append(path)
    return written


def _gpu_count() -> int:
    """Visible GPUs; raises UnavailableError when none, or when our kernels cannot run here."""
    import torch

    import pcie_allreduce
    from pcie_allreduce import ranks
    from pcie_allreduce.errors import UnavailableError

    reason = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason()
    if reason is not None:
        raise UnavailableError(reason)
    return ranks.gpu_count() if torch.version.cuda is not None else 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``pcie-allreduce tune``: 0, or 1 when a world size failed or a shape summed wrong."""
    from pcie_allreduce import ranks

    job = job_from_args(args, parser)
    gpu_count = _gpu_count()
    worlds = tuple(dict.fromkeys(args.world)) if args.world else default_worlds(gpu_count)
    rows: list[Measurement] = []
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
    text, paths = report(rows, facts, placements, errors, job, args)
    sys.stdout.write(text)
    sys.stdout.flush()
    for path in paths + (_write_out(args.out, text, rows, facts, errors, job) if args.out else []):
        print(f"wrote {path}", file=sys.stderr)
    return EXIT_FAILURES if errors or any(r.status == WRONG for r in rows) else 0
