"""Inside a rank: time one case under CUDA-graph replay (or eager launches).

Each timed block is ``calls_per_graph`` all-reduces: one graph replay, or that many eager calls.
Before every block all ranks meet at a gloo barrier, then each queues a short GPU sleep (so the
block is fully queued before the GPU reaches it and the host's launch time is not measured in
graph mode) and a tiny all-reduce of the backend itself (so the GPUs start the block together,
not skewed by when each host left the barrier). The block is timed with CUDA events around it.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from bench.backends import Buffers, RankBackend
from bench.plan import RankJob

# ~100 us at 2 GHz. The sleep must outlast what the host does before the block reaches the GPU:
# the sync call (an eager collective, ~10 us of host time), the start event and the graph launch,
# with W rank processes sharing the host's cores. Any part of that still running when the GPU
# finishes the sync call is idle time inside the timed block, spread over its calls.
SLEEP_CYCLES = 200_000
MIN_REPLAYS = 10


def _sleep() -> None:
    sleep = getattr(torch.cuda, "_sleep", None)  # private but long-standing; timing works without it
    if sleep is not None:
        sleep(SLEEP_CYCLES)


def make_block(backend: RankBackend, bufs: Buffers, algo: str, job: RankJob,
               capture_stream: torch.cuda.Stream, calls: int | None = None) -> Callable[[], torch.Tensor]:
    """The timed block (it holds the CUDA graph, if any).

    Calling the block enqueues ``calls`` (default ``job.calls_per_graph``) all-reduces and returns
    the result tensor of the last one (for the post-timing correctness check).
    """
    calls = calls or job.calls_per_graph
    if job.eager:
        def eager_block() -> torch.Tensor:
            result = bufs.out
            for _ in range(calls):
                result = backend.call(bufs, algo)
            return result

        return eager_block
    graph = torch.cuda.CUDAGraph()
    result = bufs.out
    # Some backends must see the capture begin and end (vLLM's custom all-reduce registers the
    # captured buffers with its peers when the capture ends).
    capture_context = getattr(backend, "capture_context", None)
    # thread_local: a backend's background threads (NCCL's watchdog) may call CUDA during capture.
    with capture_context() if capture_context is not None else contextlib.nullcontext():
        with torch.cuda.graph(graph, stream=capture_stream, capture_error_mode="thread_local"):
            for _ in range(calls):
                result = backend.call(bufs, algo)

    def replay() -> torch.Tensor:
        graph.replay()
        return result

    return replay


def _agreed_replays(pilot_us: float, job: RankJob, group: dist.ProcessGroup) -> int:
    """How many timed replays fit the time budget; every rank must use the same number."""
    slowest = torch.tensor([pilot_us], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    fits = int(job.time_budget_s * 1e6 / max(float(slowest[0]), 1e-3))
    return max(min(job.iters, MIN_REPLAYS), min(job.iters, fits))


def _timed(block: Callable[[], torch.Tensor], backend: RankBackend, group: dist.ProcessGroup,
           start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    torch.cuda.synchronize()
    dist.barrier(group=group)
    _sleep()
    backend.device_sync()
    start.record()
    block()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3  # ms -> us


def time_case(backend: RankBackend, bufs: Buffers, algo: str, job: RankJob, group: dist.ProcessGroup,
              capture_stream: torch.cuda.Stream, calls: int | None = None) -> tuple[list[float], torch.Tensor]:
    """This rank's block times (us, one per timed replay) and the result tensor of the last call."""
    block = make_block(backend, bufs, algo, job, capture_stream, calls)
    for _ in range(job.warmup):
        block()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pilot = _timed(block, backend, group, start, end)
    replays = _agreed_replays(pilot, job, group)
    times = []
    for _ in range(replays):
        times.append(_timed(block, backend, group, start, end))
    result = block()  # one more, untimed, whose output the caller checks
    torch.cuda.synchronize()
    return times, result
