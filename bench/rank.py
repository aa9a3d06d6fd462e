"""Inside each rank: set up one backend, then check and time every case, logging as it goes.

What a case's inputs are and how its result is judged lives in :mod:`.checks`; with ``--fused``
and verify the backend is wrapped in :class:`~.norm_ops.NormAdapter`.

With ``rounds`` > 1 the case list runs that many times over (case 1, 2, ..., then again), each
time with 1/rounds of the replays and time budget, and a case's replays are pooled: rows then
sample the same stretch of time, so a drifting machine cannot favour one of them.

Every case ends with an all-gather over gloo of each rank's outcome, so all ranks agree on
whether to time it and whether to go on: a case that is wrong on one rank is wrong for all (and
not timed); a case that raised on any rank stops the run on every rank (the parent restarts a
fresh one for the cases left, since a failed collective can leave a backend unusable); a case
the backend cannot run here is "skipped" on all. A rank that hangs is killed by its
:class:`~.watchdog.Watchdog`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from pcie_allreduce.tools.ranks import RankContext

from bench import backends, checks, environment, outcome, timing
from bench.layer_gemms import GemmAdapter
from bench.norm_ops import NormAdapter
from bench.plan import TUNING_SETUPS, Case, RankJob
from bench.progress import ProgressLog
from bench.results import FAILED, FUSED, OK, SKIPPED, VERIFY, WRONG
from bench.watchdog import Watchdog


def _gather(ctx: RankContext, obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj, group=ctx.group)
    return gathered


def open_backend(ctx: RankContext, job: RankJob) -> Any:
    """The job's backend; for ``--fused`` / verify wrapped to offer the residual add + RMSNorm variants."""
    backend = backends.open_backend(ctx, job)
    if job.workload in (FUSED, VERIFY):
        backend = NormAdapter(backend, ctx, job)
    if job.workload == VERIFY and job.gemms:
        backend = GemmAdapter(backend, ctx, job)
    return backend


def _shape(case: Case, job: RankJob) -> dict[str, Any]:
    """Keyword arguments that tell a NormAdapter the case's hidden size (plain backends get none),
    and a GemmAdapter its model."""
    shape: dict[str, Any] = {"hidden": case.hidden} if case.hidden else {}
    if job.gemms and job.workload == VERIFY:
        shape["model"] = case.model
    return shape


def _check(backend: Any, bufs: backends.Buffers, algo: str, check: checks.PlainCheck) -> str | None:
    """Run one call eagerly and compare (plus the backend's own cross-check); the problem, or None."""
    check.load(bufs)
    result = backend.call(bufs, algo)
    torch.cuda.synchronize()
    backend.check()  # a recorded timeout explains a wrong result better than the values do
    problem = check.mismatch(bufs, result)
    cross = getattr(backend, "cross_check", None)
    extra = cross(bufs, algo) if cross is not None else None  # collective: every rank runs it
    return problem or extra


def _skip(ctx: RankContext, backend: Any, case: Case, calls: int) -> dict[str, Any] | None:
    """The merged "skipped" event when the backend cannot run ``case`` (ranks agree over gloo)."""
    skip = getattr(backend, "skip_reason", None)
    if skip is None:
        return None
    reason = skip(case)
    outcomes = _gather(ctx, outcome.rank_outcome(ctx.rank, SKIPPED if reason else OK, error=reason or ""))
    return outcome.merge(outcomes, calls) if outcome.worst_status(outcomes) != OK else None


def _run_case(ctx: RankContext, job: RankJob, backend: Any, case: Case, check: checks.PlainCheck,
              capture_stream: torch.cuda.Stream, earlier: list[float], last_round: bool) -> dict[str, Any] | None:
    """The case's merged event; None after a good round that is not the last (its replay times
    are added to ``earlier``, this rank's times of the case in the rounds before)."""
    dtype = getattr(torch, job.dtype)
    calls = job.calls(case)
    skipped = _skip(ctx, backend, case, calls)
    if skipped is not None:
        return skipped
    resolved = ""
    try:
        resolved = backend.resolved_algo(case.size_bytes, dtype, case.algo, **_shape(case, job))
        bufs = backend.buffers(case.count, dtype, case.algo, **_shape(case, job))
        problem = _check(backend, bufs, case.algo, check)
        mine = outcome.rank_outcome(ctx.rank, WRONG if problem else OK, error=problem or "", resolved=resolved)
    except outcome.CaseSkipped as exc:
        mine = outcome.rank_outcome(ctx.rank, SKIPPED, error=str(exc), resolved=resolved)
    except Exception as exc:  # noqa: BLE001 - recorded per case; the parent decides what next
        mine = outcome.rank_outcome(ctx.rank, FAILED, error=outcome.one_line(exc), resolved=resolved)
    checked = _gather(ctx, mine)
    if outcome.worst_status(checked) != OK:
        return outcome.merge(checked, calls)
    try:
        zeroed = backend.mutates_input(case.algo)
        if zeroed:
            # Timed calls would keep summing sums (overflow to inf/NaN); zeros stay zeros. The inputs
            # are loaded again first: an in-place norm kernel's check call has added y into the residual.
            check.load(bufs)
            bufs.inp.zero_()
        times, result = timing.time_case(backend, bufs, case.algo, job, ctx.group, capture_stream, calls=calls)
        backend.check()
        checkable = getattr(backend, "checks_after_timing", None)
        problem = check.mismatch(bufs, result, zeroed=zeroed) if checkable is None or checkable(bufs, case.algo) \
            else None
        mine = outcome.rank_outcome(ctx.rank, WRONG if problem else OK, times=earlier + times, resolved=resolved,
                                    error=f"after timing: {problem}" if problem else "")
    except Exception as exc:  # noqa: BLE001
        mine = outcome.rank_outcome(ctx.rank, FAILED, error=outcome.one_line(exc), resolved=resolved)
    timed = _gather(ctx, mine)
    if outcome.worst_status(timed) == OK and not last_round:
        earlier.extend(times)
        return None
    return outcome.merge(timed, calls)


def _round_job(job: RankJob) -> RankJob:
    """The timing knobs of one of ``job.rounds`` rounds: a share of the replays and the budget."""
    if job.rounds == 1:
        return job
    return dataclasses.replace(job, iters=math.ceil(job.iters / job.rounds),
                               time_budget_s=job.time_budget_s / job.rounds)


def _run_cases(ctx: RankContext, job: RankJob, backend: Any, dog: Watchdog, log: ProgressLog | None,
               capture_stream: torch.cuda.Stream) -> None:
    round_job = _round_job(job)
    earlier: dict[int, list[float]] = {}  # case index -> this rank's replay times of the rounds so far
    finished: set[int] = set()            # cases with their final event (wrong, skipped: not timed again)
    for round_index in range(job.rounds):
        last_round = round_index == job.rounds - 1
        check: checks.PlainCheck | None = None
        for case in job.cases:
            if case.index in finished:
                continue
            dog.arm(job.case_timeout_s, "case", index=case.index, size_bytes=case.size_bytes, algo=case.algo)
            if log:
                log.write("start", index=case.index)
            if check is None or check.key != checks.check_key(case):
                check = None  # free the previous shape's tensors first
                check = checks.make_check(ctx, job, case)
            event = _run_case(ctx, round_job, backend, case, check, capture_stream,
                              earlier.setdefault(case.index, []), last_round)
            if event is None:
                continue
            finished.add(case.index)
            if log:
                log.write("done", index=case.index, **event)
            if event["status"] == FAILED:
                return


def bench_rank(ctx: RankContext, job: RankJob) -> dict[str, Any]:
    """The function ``run_ranks`` runs in every rank; results go to the progress log (rank 0)."""
    log = ProgressLog(job.progress_dir) if ctx.rank == 0 else None
    with Watchdog(job.progress_dir, ctx.rank) as dog:
        dog.arm(job.setup_timeout_s, "setup")
        backend = open_backend(ctx, job)
        tune = getattr(backend, "tune", None)
        if tune is not None and job.tune_baselines:
            # a library's own per-machine tuning, as its users run it: a search, given three set-ups' time
            dog.arm(job.setup_timeout_s * TUNING_SETUPS, "tuning")
            tune()
            dog.arm(job.setup_timeout_s, "setup")  # the rest of the set-up keeps its own bound
        capture_stream = torch.cuda.Stream(ctx.device)
        backend.prepare_capture(capture_stream)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        facts = getattr(backend, "facts", None)
        if log:
            log.write("setup", **environment.rank_environment(ctx), **(facts() if facts is not None else {}))
        _run_cases(ctx, job, backend, dog, log, capture_stream)
        dog.arm(job.setup_timeout_s, "teardown")
        backend.close()
    if log:
        log.close()
    return {"rank": ctx.rank}
