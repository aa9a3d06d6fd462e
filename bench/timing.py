"""Inside a rank: time one case under CUDA-graph replay (or eager launches).

Each timed block is ``calls_per_graph`` all-reduces: one graph replay, or that many eager calls,
timed with the library's replay timer (:func:`pcie_allreduce.tools.timing.timed_replays`, shared
with ``pcie-allreduce tune``): a gloo barrier, a GPU sleep, then the backend's own tiny all-reduce
lines the GPUs up before each block.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from pcie_allreduce.tools.timing import timed_replays

from bench.backends import Buffers, RankBackend
from bench.plan import RankJob


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


def time_case(backend: RankBackend, bufs: Buffers, algo: str, job: RankJob, group: dist.ProcessGroup,
              capture_stream: torch.cuda.Stream, calls: int | None = None) -> tuple[list[float], torch.Tensor]:
    """This rank's block times (us, one per timed replay) and the result tensor of the last call."""
    block = make_block(backend, bufs, algo, job, capture_stream, calls)
    times = timed_replays(block, backend.device_sync, group, iters=job.iters, time_budget_s=job.time_budget_s,
                          warmup=job.warmup)
    result = block()  # one more, untimed, whose output the caller checks
    torch.cuda.synchronize()
    return times, result
