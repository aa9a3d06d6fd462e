"""The replay timer shared by ``pcie-allreduce tune`` and the benchmark harness, and its percentile.

Inside W ranks (started by :func:`pcie_allreduce.tools.ranks.run_ranks`), a timed block (one
CUDA-graph replay, or a run of eager calls) is timed so that every rank measures the same thing:
before each block all ranks meet at a gloo barrier, then each queues a short GPU sleep (the block
is fully queued before the GPU reaches it, so the host's launch time is not measured) and a tiny
collective that lines the GPUs up (they start the block together, not skewed by when each host
left the barrier); CUDA events around the block give its time. How many blocks are timed is
agreed from a pilot: as many as the time budget allows, the same number on every rank. torch is
imported inside the functions, so :func:`percentile` and :func:`summarize` (a replay's time is
the slowest rank's) stay usable where torch is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

# ~100 us at 2 GHz. The sleep must outlast what the host does before the block reaches the GPU:
# the line-up call (an eager collective, ~10 us of host time), the start event and the graph
# launch, with W rank processes sharing the host's cores. Any part of that still running when the
# GPU finishes the line-up is idle time inside the timed block, spread over its calls. A sleep of
# ~10 us (20,000 cycles) is no longer than the line-up call's host time alone, so the host's work
# could reach into the timed block; the longer sleep is never timed and costs ~0.1 ms per block.
SLEEP_CYCLES = 200_000
MIN_REPLAYS = 10  # timed blocks at least (when iters allows), however long the pilot took


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


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call times in microseconds over ``replays`` timed replays."""

    p50_us: float
    p99_us: float
    min_us: float
    mean_us: float
    rank0_p50_us: float
    replays: int


def summarize(per_rank_block_us: Sequence[Sequence[float]], calls_per_block: int) -> Timing:
    """Per-call statistics from every rank's per-replay block times.

    A collective is done when its slowest rank is, so each replay counts as the maximum over
    ranks of that replay's time; dividing by ``calls_per_block`` gives the time per call.
    """
    if not per_rank_block_us or not per_rank_block_us[0]:
        raise ValueError("no timings")
    lengths = {len(t) for t in per_rank_block_us}
    if len(lengths) != 1:
        raise ValueError(f"ranks timed different numbers of replays: {sorted(lengths)}")
    if calls_per_block < 1:
        raise ValueError(f"calls_per_block must be >= 1, got {calls_per_block}")
    slowest = [max(replay) / calls_per_block for replay in zip(*per_rank_block_us)]
    rank0 = [t / calls_per_block for t in per_rank_block_us[0]]
    return Timing(p50_us=percentile(slowest, 50), p99_us=percentile(slowest, 99), min_us=min(slowest),
                  mean_us=sum(slowest) / len(slowest), rank0_p50_us=percentile(rank0, 50), replays=len(slowest))


def agreed_replays(pilot_us: float, iters: int, time_budget_s: float, group: Any) -> int:
    """How many blocks to time after a pilot of ``pilot_us``: what fits ``time_budget_s`` on the
    slowest rank, at most ``iters``, at least ``min(iters, MIN_REPLAYS)``; the same on every rank."""
    import torch
    import torch.distributed as dist

    slowest = torch.tensor([pilot_us], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    fits = int(time_budget_s * 1e6 / max(float(slowest[0]), 1e-3))
    return max(min(iters, MIN_REPLAYS), min(iters, fits))


def timed_replays(block: Callable[[], Any], line_up: Callable[[], Any], group: Any, *, iters: int,
                  time_budget_s: float, warmup: int = 0, stream: Any = None) -> list[float]:
    """This rank's times (us) of ``block``, one per timed run, after ``warmup`` untimed runs and one
    pilot; ``line_up`` enqueues the tiny collective that lines the GPUs up. Everything is enqueued
    on ``stream`` (default: the current stream)."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        block()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep = getattr(torch.cuda, "_sleep", None)  # private but long-standing; timing works without it

    def once() -> float:
        torch.cuda.synchronize()
        dist.barrier(group=group)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if sleep is not None:
                sleep(SLEEP_CYCLES)
            line_up()
            start.record()
            block()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3  # ms -> us

    count = agreed_replays(once(), iters, time_budget_s, group)
    return [once() for _ in range(count)]
