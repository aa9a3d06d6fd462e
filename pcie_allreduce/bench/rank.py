"""Inside each rank: set up one backend, then check and time every case, logging as it goes.

Every case ends with an all-gather over gloo of each rank's outcome, so all ranks agree on
whether to time it and whether to go on: a case that is wrong on one rank is wrong for all (and
not timed); a case that raised on any rank stops the run on every rank (the parent restarts a
fresh one for the cases left, since a failed collective can leave a backend unusable). A rank
that hangs is killed by its :class:`~.watchdog.Watchdog`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pcie_allreduce.bench import backends, environment, outcome, pattern, timing
from pcie_allreduce.bench.plan import Case, RankJob
from pcie_allreduce.bench.progress import ProgressLog
from pcie_allreduce.bench.results import FAILED, OK, WRONG
from pcie_allreduce.bench.watchdog import Watchdog
from pcie_allreduce.testing import RankContext


class _Inputs:
    """One size's source pattern and expected sum, built once and reused by every algo of the size."""

    def __init__(self, ctx: RankContext, job: RankJob, count: int) -> None:
        dtype = getattr(torch, job.dtype)
        self.count = count
        self.src = pattern.rank_input(count, ctx.rank, job.seed, dtype, ctx.device)
        self.expected = pattern.expected_sum(count, ctx.world_size, job.seed, dtype, ctx.device)


def _gather(ctx: RankContext, obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj, group=ctx.group)
    return gathered


def _check(backend: Any, bufs: backends.Buffers, algo: str, inputs: _Inputs) -> str | None:
    """Run one call eagerly and compare; the problem, or None."""
    bufs.inp.copy_(inputs.src)
    result = backend.call(bufs, algo)
    torch.cuda.synchronize()
    backend.check()  # a recorded timeout explains a wrong result better than the values do
    return pattern.mismatch(result, inputs.expected)


def _run_case(ctx: RankContext, job: RankJob, backend: Any, case: Case, inputs: _Inputs,
              capture_stream: torch.cuda.Stream) -> dict[str, Any]:
    dtype = getattr(torch, job.dtype)
    resolved = ""
    try:
        resolved = backend.resolved_algo(case.size_bytes, dtype, case.algo)
        bufs = backend.buffers(case.count, dtype, case.algo)
        problem = _check(backend, bufs, case.algo, inputs)
        mine = outcome.rank_outcome(ctx.rank, WRONG if problem else OK, error=problem or "", resolved=resolved)
    except Exception as exc:  # noqa: BLE001 - recorded per case; the parent decides what next
        mine = outcome.rank_outcome(ctx.rank, FAILED, error=outcome.one_line(exc), resolved=resolved)
    checked = _gather(ctx, mine)
    if outcome.worst_status(checked) != OK:
        return outcome.merge(checked, job.calls_per_graph)
    try:
        expected_after = inputs.expected
        if backend.mutates_input(case.algo):
            # Timed calls would keep summing sums (overflow to inf/NaN); zeros stay zeros.
            bufs.inp.zero_()
            expected_after = torch.zeros_like(inputs.expected)
        times, result = timing.time_case(backend, bufs, case.algo, job, ctx.group, capture_stream)
        backend.check()
        problem = pattern.mismatch(result, expected_after)
        mine = outcome.rank_outcome(ctx.rank, WRONG if problem else OK, times=times, resolved=resolved,
                                    error=f"after timing: {problem}" if problem else "")
    except Exception as exc:  # noqa: BLE001
        mine = outcome.rank_outcome(ctx.rank, FAILED, error=outcome.one_line(exc), resolved=resolved)
    return outcome.merge(_gather(ctx, mine), job.calls_per_graph)


def _run_cases(ctx: RankContext, job: RankJob, backend: Any, dog: Watchdog, log: ProgressLog | None,
               capture_stream: torch.cuda.Stream) -> None:
    inputs: _Inputs | None = None
    for case in job.cases:
        dog.arm(job.case_timeout_s, "case", index=case.index, size_bytes=case.size_bytes, algo=case.algo)
        if log:
            log.write("start", index=case.index)
        if inputs is None or inputs.count != case.count:
            inputs = None  # free the previous size's tensors first
            inputs = _Inputs(ctx, job, case.count)
        event = _run_case(ctx, job, backend, case, inputs, capture_stream)
        if log:
            log.write("done", index=case.index, **event)
        if event["status"] == FAILED:
            return


def bench_rank(ctx: RankContext, job: RankJob) -> dict[str, Any]:
    """The function ``run_ranks`` runs in every rank; results go to the progress log (rank 0)."""
    log = ProgressLog(job.progress_dir) if ctx.rank == 0 else None
    with Watchdog(job.progress_dir, ctx.rank) as dog:
        dog.arm(job.setup_timeout_s, "setup")
        backend = backends.open_backend(ctx, job)
        capture_stream = torch.cuda.Stream(ctx.device)
        backend.prepare_capture(capture_stream)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        if log:
            log.write("setup", **environment.rank_environment(ctx))
        _run_cases(ctx, job, backend, dog, log, capture_stream)
        dog.arm(job.setup_timeout_s, "teardown")
        backend.close()
    if log:
        log.close()
    return {"rank": ctx.rank}
