"""Parent side of a sweep: one isolated ``run_ranks`` per (world, backend), retries, partial results.

A backend run that raises, hangs or dies loses nothing already measured (rank 0 logs every case
as it finishes, see :mod:`.progress`); the case it was in is recorded as failed with the reason,
and the run is restarted for the cases left, up to ``--retries`` times. Other backends and world
sizes are not affected.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Protocol, Sequence

from pcie_allreduce.tools.ranks import placement_label

from bench import backends, plan, progress, report, watchdog
from bench.options import BenchConfig
from bench.outcome import one_line
from bench.plan import TUNING_SETUPS, Case
from bench.results import ALLREDUCE, FAILED, NOT_RUN, OK, SKIPPED, VERIFY, Note, Report, Result, add_speedups

Echo = Callable[[str], None]
SPAWN_SLACK_S = 120.0  # run_ranks' own timeout is only a backstop behind the per-rank watchdogs
MAX_DETAIL_CHARS = 20_000


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a backend run stopped: a one-line reason for the table, the full text for the JSON, and
    for a hang the watchdog's phase ("setup", "tuning", "case", ...)."""

    reason: str
    detail: str = ""
    phase: str = ""


@dataclasses.dataclass
class BackendOutcome:
    results: list[Result]
    notes: list[Note]
    facts: dict[str, Any] | None  # rank 0's "setup" event of the first run that got that far


def make_result(cfg: BenchConfig, world: int, backend: str, case: Case, **fields: Any) -> Result:
    return Result(world=world, backend=backend, algo=case.algo, size_bytes=case.size_bytes, count=case.count,
                  dtype=cfg.dtype, calls_per_graph=case.calls or cfg.calls_per_graph, mode=cfg.mode,
                  workload=cfg.workload, tokens=case.tokens, hidden=case.hidden, model=case.model, **fields)


def cases_for(cfg: BenchConfig, backend: str) -> tuple[Case, ...]:
    """Every case ``backend`` runs under ``cfg`` (its workload decides what a case is)."""
    if cfg.workload == ALLREDUCE:
        return plan.make_cases(cfg.sizes, backends.algos_for(backend, cfg.algos), cfg.dtype)
    algos = backends.algos_for(backend, cfg.algos, cfg.workload, norm=cfg.norm, fused_algos=cfg.fused_algos)
    cases = []
    for shape in cfg.shapes:
        calls = 2 * shape.layers if cfg.workload == VERIFY else 0
        for algo in algos:
            cases.append(Case(len(cases), shape.nbytes(cfg.dtype), shape.tokens * shape.hidden, algo,
                              tokens=shape.tokens, hidden=shape.hidden, calls=calls, model=shape.model))
    return tuple(cases)


def make_job(cfg: BenchConfig, backend: str, cases: Sequence[Case], progress_dir: str) -> plan.RankJob:
    """The picklable job a backend run hands to its ranks."""
    return plan.RankJob(
        backend=backend, dtype=cfg.dtype, cases=tuple(cases), max_bytes=cfg.max_bytes, progress_dir=progress_dir,
        seed=cfg.seed, iters=cfg.iters, warmup=cfg.warmup, calls_per_graph=cfg.calls_per_graph, eager=cfg.eager,
        time_budget_s=cfg.time_budget_s, rounds=cfg.rounds, case_timeout_s=cfg.case_timeout_s,
        setup_timeout_s=cfg.setup_timeout_s, tune_baselines=cfg.tune_baselines,
        workload=cfg.workload, eps=cfg.eps, gemms=cfg.gemms,
    )


def rows_from_events(events: Sequence[dict[str, Any]], cases: Sequence[Case], cfg: BenchConfig, world: int,
                     backend: str) -> dict[int, Result]:
    """The finished cases of one run: case index -> Result (pure)."""
    by_index = {c.index: c for c in cases}
    rows = {}
    for ev in events:
        if ev.get("event") != "done" or ev.get("index") not in by_index:
            continue
        fields = {k: ev.get(k) for k in ("p50_us", "p99_us", "rank0_p50_us", "min_us")}
        rows[ev["index"]] = make_result(cfg, world, backend, by_index[ev["index"]], status=ev["status"],
                                        replays=int(ev.get("replays") or 0), resolved_algo=ev.get("resolved_algo") or "",
                                        error=ev.get("error") or "", **fields)
    return rows


def unfinished_case(events: Sequence[dict[str, Any]]) -> int | None:
    """Index of the case that was started but never finished (where a run died or hung), if any."""
    started = [ev["index"] for ev in events if ev.get("event") == "start"]
    done = {ev["index"] for ev in events if ev.get("event") == "done"}
    open_cases = [i for i in started if i not in done]
    return open_cases[-1] if open_cases else None


def describe_failure(exc: BaseException, hang: tuple[list[int], dict[str, Any], str] | None) -> Failure:
    """One line for a run that ended in an exception (RankFailed, usually), plus the full text."""
    detail = str(exc)
    if hang is not None:
        ranks, phase, stacks = hang
        what = phase.get("phase", "?")
        if what == "case":
            what = f"case {phase.get('size_bytes')} B / {phase.get('algo')}"
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        reason = (f"hung: {who} made no progress for {phase.get('seconds', '?')} s in {what} "
                  "(killed by the bench watchdog)")
        return Failure(reason, f"{detail}\n\nwatchdog stacks of rank {ranks[0]}:\n{stacks}"[-MAX_DETAIL_CHARS:],
                       str(phase.get("phase", "")))
    failures = getattr(exc, "failures", None) or {}
    headline = (str(exc).splitlines() or [type(exc).__name__])[0]
    if failures:
        text = next(iter(failures.values()))
        last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
        if last and last not in headline:
            headline = f"{headline}: {last}"
    else:
        headline = one_line(exc)
    return Failure(headline[:500], detail[-MAX_DETAIL_CHARS:])


class Progress(Protocol):
    """What the runner reports progress to (a progress bar, or nothing)."""

    def advance(self, cases: int) -> None: ...


class NoProgress:
    def advance(self, cases: int) -> None:
        pass


class _Follower(threading.Thread):
    """Watch the running backend's log: advance the progress bar for every finished case and, with
    --verbose, print its row."""

    def __init__(self, directory: str, cases: Sequence[Case], cfg: BenchConfig, world: int, backend: str,
                 echo: Echo, bar: Progress) -> None:
        super().__init__(daemon=True)
        self._args = (directory, cases, cfg, world, backend)
        self._echo = echo
        self._bar = bar
        self._done = threading.Event()
        self._shown: set[int] = set()

    def poll(self) -> None:
        directory, cases, cfg, world, backend = self._args
        rows = rows_from_events(progress.read_events(directory), cases, cfg, world, backend)
        new = sorted(set(rows) - self._shown)
        for index in new:
            self._shown.add(index)
            if cfg.verbose:
                self._echo(report.table_row(rows[index]))
        if new:
            self._bar.advance(len(new))

    def run(self) -> None:
        while not self._done.wait(0.5):
            self.poll()

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.poll()


def _launch(cfg: BenchConfig, backend: str, world: int, gpu_count: int, cases: Sequence[Case], directory: str,
            echo: Echo, bar: Progress) -> Failure | None:
    from pcie_allreduce.tools import ranks
    from bench.rank import bench_rank

    job = make_job(cfg, backend, cases, directory)
    backstop = cfg.setup_timeout_s * (2 + TUNING_SETUPS) + cfg.case_timeout_s * len(cases) + SPAWN_SLACK_S
    follower = _Follower(directory, cases, cfg, world, backend, echo, bar)
    follower.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ranks.MpsUnavailableWarning)
            ranks.run_ranks(bench_rank, world, job, timeout_s=backstop, gpu=True, mps="auto",
                              env={**backends.quiet_env(), **backends.rank_env(backend, world, gpu_count)})
        for w in caught:
            echo(f"[W={world} {backend}] warning: {' '.join(str(w.message).split())}")
        return None
    except Exception as exc:  # noqa: BLE001 - RankFailed above all; anything else is reported the same way
        failure = describe_failure(exc, watchdog.read_hang(directory, world))
        if not hasattr(exc, "failures"):
            failure = Failure(failure.reason, traceback.format_exc()[-MAX_DETAIL_CHARS:], failure.phase)
        return failure
    finally:
        follower.stop()


def run_backend(cfg: BenchConfig, backend: str, world: int, gpu_count: int, echo: Echo,
                bar: Progress | None = None) -> BackendOutcome:
    """All cases of one backend at one world size, restarting after a failed case up to cfg.retries times.

    A library's own tuning that hangs (the watchdog's "tuning" phase) spends a restart on the
    library untuned, with the launch configurations it ships: the best its users would run on a
    machine where its tuner hangs, and the run keeps a baseline instead of none."""
    cases = cases_for(cfg, backend)
    counted = _Counted(bar or NoProgress())
    rows: dict[int, Result] = {}
    notes: list[Note] = []
    facts: dict[str, Any] | None = None
    pending = list(cases)
    last: Failure | None = None
    run_cfg = cfg
    for attempt in range(cfg.retries + 1):
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="pcie_ar_bench_") as directory:
            failure = _launch(run_cfg, backend, world, gpu_count, pending, directory, echo, counted)
            events = progress.read_events(directory)
        setup = next((ev for ev in events if ev.get("event") == "setup"), None)
        if setup is not None and facts is None and setup.get("baseline_tuning"):
            notes.append(Note(world, backend, "tuning", str(setup["baseline_tuning"])))
        facts = facts or setup
        rows.update(rows_from_events(events, pending, cfg, world, backend))
        open_index = unfinished_case(events)
        if open_index is not None and failure is not None:
            case = next(c for c in pending if c.index == open_index)
            rows[open_index] = make_result(cfg, world, backend, case, status=FAILED, error=failure.reason)
        pending = [c for c in pending if c.index not in rows]
        n_bad = sum(1 for r in rows.values() if r.status not in (OK, SKIPPED))
        echo(f"[W={world} {backend}] attempt {attempt + 1}: {len(rows)}/{len(cases)} cases done, {n_bad} not ok, "
             f"{time.monotonic() - started:.0f} s" + (f"; {failure.reason}" if failure else ""))
        if failure is not None:
            last = failure
            notes.append(Note(world, backend, "failed", failure.reason, failure.detail))
            if setup is None:
                if failure.phase == "tuning" and run_cfg.tune_baselines:
                    run_cfg = dataclasses.replace(run_cfg, tune_baselines=False)  # its own tuner hung
                    continue
                break  # set-up itself failed: a restart would fail the same way
        if not pending:
            break
        if failure is None:
            # The ranks stopped on their own after a case that raised; its row says why.
            failed = [rows[i] for i in sorted(rows) if rows[i].status == FAILED]
            last = Failure(failed[-1].error if failed else "the ranks stopped before the last case")
    why = f"not run: {last.reason}" if last else "not run: an earlier case of this run failed"
    for case in pending:
        rows[case.index] = make_result(cfg, world, backend, case, status=NOT_RUN, error=why)
    counted.advance(max(0, len(cases) - counted.total))  # cases that never finished still leave the bar
    island_ranks = int((facts or {}).get("island_ranks") or 0)
    nodes = int((facts or {}).get("nodes") or 0)
    results = [rows[c.index] for c in cases]
    if island_ranks:  # what the island algorithms' wire bytes depend on
        results = [dataclasses.replace(r, island_ranks=island_ranks) for r in results]
    if nodes:  # what the hierarchy's inter-node bytes depend on
        results = [dataclasses.replace(r, nodes=nodes) for r in results]
    return BackendOutcome(results, notes, facts)


class _Counted:
    """Forwards progress and counts it, so a backend run advances the bar by exactly its cases."""

    def __init__(self, bar: Progress) -> None:
        self._bar = bar
        self.total = 0

    def advance(self, cases: int) -> None:
        self.total += cases
        self._bar.advance(cases)


def total_cases(cfg: BenchConfig) -> int:
    """Cases of the whole sweep (every world and backend), for the progress bar."""
    return len(cfg.worlds) * sum(len(cases_for(cfg, b)) for b in cfg.backends)


def run_sweep(cfg: BenchConfig, gpu_count: int, environment: dict[str, Any], echo: Echo,
              bar: Progress | None = None) -> Report:
    """Every (world, backend) of ``cfg``: unavailable backends are noted and skipped.

    Ctrl-C stops the sweep but keeps the backend runs already finished (``environment`` then has
    ``"interrupted": true``); the run in progress is lost.
    """
    bar = bar or NoProgress()
    results: list[Result] = []
    notes: list[Note] = []
    placements: dict[int, str] = {}
    rank_facts: dict[str, Any] = {}
    interrupted = False
    for world in cfg.worlds:
        mps: bool | None = None
        for backend in cfg.backends:
            reason = backends.skip_reason(backend, world, gpu_count)
            if reason is not None:
                echo(f"[W={world} {backend}] skipped: {reason}")
                notes.append(Note(world, backend, "skipped", reason))
                bar.advance(len(cases_for(cfg, backend)))
                continue
            echo(f"[W={world} {backend}] running {len(cases_for(cfg, backend))} cases ...")
            try:
                out = run_backend(cfg, backend, world, gpu_count, echo, bar)
            except KeyboardInterrupt:
                interrupted = True
                break
            results += out.results
            notes += out.notes
            if out.facts:
                mps = bool(out.facts.get("mps")) if mps is None else mps
                rank_facts.setdefault(str(world), {k: v for k, v in out.facts.items() if k != "event"})
        placements[world] = placement_label(world, gpu_count, mps)
        if interrupted:
            echo("interrupted: reporting the backend runs that finished")
            break
    environment = {**environment, "ranks": rank_facts, "interrupted": interrupted,
                   "placements": {str(w): label for w, label in placements.items()}}
    compute_ms = cfg.compute_ms if cfg.workload == VERIFY else None
    return Report(environment, cfg.to_dict(), placements, add_speedups(results, compute_ms), notes)
