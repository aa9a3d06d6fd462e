"""What the multi-rank GPU tests of the CUDA all-reduce kernels share: the worlds and transports
they run on (``PCIE_AR_TEST_WORLDS``, ``PCIE_AR_TEST_TRANSPORTS``), the reason they skip, and the
algorithms each transport takes, and what a rank saw of a call that gave up. The tests:
test_allreduce_gpu.py (results), test_allreduce_faults_gpu.py (a late, missing or mismatched
peer), test_allreduce_lifecycle_gpu.py (creation, peers and close). The fused, island, FP8 wire and
hierarchy GPU tests take their skip reason (and transports) from here, and the island and fused
ones its failure helpers."""

from __future__ import annotations

import os
import time

import torch

import pcie_allreduce
from pcie_allreduce.constants import SMALL_WORLD
from pcie_allreduce.errors import CollectiveTimeout
from pcie_allreduce.plan import algorithms
from pcie_allreduce.tools import ranks

SKIP_REASON = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason()

WORLDS = [int(w) for w in os.environ.get("PCIE_AR_TEST_WORLDS", "2,3,4,8").split(",")]
# Both transports run the same kernels over different memory (device memory through CUDA IPC, or
# pinned host memory in /dev/shm): the matrix and graph tests run on each.
TRANSPORTS = os.environ.get("PCIE_AR_TEST_TRANSPORTS", "p2p,host").split(",")
# Worlds above SMALL_WORLD run the kernels' 16-rank-capacity instances: the failure tests cover them too.
WIDE_WORLDS = [w for w in WORLDS if w > SMALL_WORLD]
MAX_BYTES = 2 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The algorithms of every transport and fabric; the host transport adds its own (HOST_ALGOS). The
# island algorithms need islands: tests/test_island_gpu.py.
# The in-place algorithms (SYMMETRIC_INPUT_ALGORITHMS) read the symmetric input area: their own
# checks (_symmetric_results), on p2p.
ALGOS = tuple(a for a in algorithms.ALGORITHMS
              if a not in algorithms.HOST_ONLY_ALGORITHMS + algorithms.ISLAND_ALGORITHMS
              + algorithms.SYMMETRIC_INPUT_ALGORITHMS)
HOST_ALGOS = ALGOS + algorithms.HOST_ONLY_ALGORITHMS


def algos_of(comm: pcie_allreduce.Communicator) -> tuple[str, ...]:
    """The algorithms this communicator's transport runs (the host transport adds its own)."""
    return HOST_ALGOS if comm.transport == "host" else ALGOS


def skip_one_call(ctx: ranks.RankContext, skipper: int, algo: str = "auto", numel: int = 4 * 7168) -> dict:
    """Six calls of ``algo``, rank ``skipper`` leaving out the fourth: what each rank raised, how long
    it took and whether its output is all NaN. The all-reduce and island failure tests share it."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=2.0)
    x = torch.randn(numel, device=ctx.device).to(torch.bfloat16)
    out = torch.full_like(x, 7.0)
    torch.distributed.barrier(group=ctx.group)
    start = time.monotonic()
    raised = None
    try:
        for i in range(6):
            if ctx.rank == skipper and i == 3:
                continue
            comm.all_reduce(x, out=out, algo=algo)
        torch.cuda.synchronize()
        comm.check()
    except CollectiveTimeout as exc:
        raised = {"type": "timeout", "rank": exc.rank, "peer": exc.peer, "stage": exc.stage, "message": str(exc)}
    elapsed = time.monotonic() - start
    torch.cuda.synchronize()
    all_nan = bool(torch.isnan(out).all())
    comm.close()
    return {"raised": raised, "elapsed": elapsed, "all_nan": all_nan}


def timed_out_peer(comm: pcie_allreduce.Communicator) -> int | None:
    """The peer ``comm.check()`` names in its CollectiveTimeout, or None where it raises nothing:
    what a rank saw of a call that gave up (the fused and plain give-up tests share it)."""
    try:
        comm.check()
    except CollectiveTimeout as exc:
        return exc.peer
    return None
