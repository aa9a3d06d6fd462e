"""Rank side of the ``ours`` backend: :class:`pcie_allreduce.Communicator`, out of place."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pcie_allreduce.plan.algorithms import SYMMETRIC_INPUT_ALGORITHMS, availability_problem, fits_capacity
from pcie_allreduce.tools.ranks import RankContext

from bench.backends import Backend, Buffers
from bench.options import OUR_ALGOS
from bench.plan import Case, RankJob

if TYPE_CHECKING:
    from pcie_allreduce.communicator import Communicator

SYNC_COUNT = 8  # elements of the tiny all-reduce that lines the GPUs up before a timed block


def kernel_timeout_s(job: RankJob) -> float:
    """How long our kernels wait for a peer in a bench run. They give up on a missing peer after it
    and the next call raises CollectiveTimeout: well inside the bench watchdog, so a stuck peer is
    reported by our own error (with rank/peer/stage) rather than as a killed process."""
    return max(1.0, min(10.0, job.case_timeout_s / 3))


class OursBackend(Backend):
    """One Communicator sized for the largest message of the run (transport: the default, "auto")."""

    algorithms = OUR_ALGOS  # --algos picks among them
    transport: ClassVar[str | None] = None

    @classmethod
    def runtime_problem(cls, world: int, gpu_count: int) -> str | None:
        import pcie_allreduce

        reason = pcie_allreduce.unavailable_reason()
        return None if reason is None else f"pcie_allreduce kernels unavailable: {reason}"

    def __init__(self, ctx: RankContext, job: RankJob) -> None:
        from pcie_allreduce.communicator import Communicator

        self._comm = Communicator(ctx.group, ctx.device, max_bytes=max(job.max_bytes, 4096),
                                  timeout_s=kernel_timeout_s(job), transport=self.transport)
        self._sync = torch.zeros(SYNC_COUNT, dtype=torch.float32, device=ctx.device)
        self._eager = job.eager
        self._capture: torch.cuda.Stream | None = None

    @property
    def comm(self) -> "Communicator":
        """The communicator (the fused kernel uses it directly)."""
        return self._comm

    def facts(self) -> dict[str, Any]:
        """Block cap, GPU model and topology fingerprint (the key of tuned tables) for the setup event."""
        from pcie_allreduce import _ext
        from pcie_allreduce.plan import cache

        facts: dict[str, Any] = {"block_cap": self._comm.block_cap,
                                 "gpu_name": torch.cuda.get_device_name(self._comm.device),
                                 "transport": self._comm.transport, "transport_reason": self._comm.transport_reason,
                                 "island_ranks": getattr(self._comm, "island_ranks", 0)}
        ext = _ext.load()
        placements = getattr(self._comm, "placements", None)
        if ext is not None and placements:
            facts["fingerprint"] = cache.fingerprint_of(ext, [p.pci_bus_id for p in placements],
                                                            getattr(self._comm, "islands", ()))
        return facts

    def buffers(self, count: int, dtype: torch.dtype, algo: str) -> Buffers:
        if algo in SYMMETRIC_INPUT_ALGORITHMS:
            # The input in the symmetric input area of the stream the timed calls run on (as torch
            # symmetric memory's rows have theirs in its buffer): the capture stream's under graphs.
            inp = self._comm.symmetric_input(count, dtype, stream=self._timed_stream())
        else:
            inp = torch.empty(count, dtype=dtype, device=self._comm.device)
        return Buffers(inp, torch.empty_like(inp))

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        timed = self._timed_stream()
        if algo not in SYMMETRIC_INPUT_ALGORITHMS or timed is None or torch.cuda.current_stream() == timed:
            return self._comm.all_reduce(bufs.inp, out=bufs.out, algo=algo)
        # An untimed check call of an in-place algorithm outside the capture: on the stream whose
        # area holds the input, ordered after the input's writes and before the output's readers.
        current = torch.cuda.current_stream()
        timed.wait_stream(current)
        with torch.cuda.stream(timed):
            result = self._comm.all_reduce(bufs.inp, out=bufs.out, algo=algo)
        current.wait_stream(timed)
        return result

    def _timed_stream(self) -> torch.cuda.Stream | None:
        """The stream the timed calls run on (None: the current one, eager timing)."""
        return None if self._eager else self._capture

    def mutates_input(self, algo: str) -> bool:
        return False

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return self._comm.select_algo(size_bytes, dtype) if algo == "auto" else algo

    def skip_reason(self, case: Case) -> str | None:
        return capacity_problem(self._comm, case.algo, case.size_bytes)

    def prepare_capture(self, stream: torch.cuda.Stream) -> None:
        # Creating the capture stream's workspace is collective (IPC handle exchange): do it once,
        # outside any capture and at the same point on every rank.
        self._capture = stream
        self._comm.prepare_stream(stream.cuda_stream)

    def device_sync(self) -> None:
        self._comm.all_reduce(self._sync, out=self._sync)  # zeros stay zeros

    def check(self) -> None:
        self._comm.check()  # CollectiveTimeout / CollectiveMismatch recorded by a kernel

    def close(self) -> None:
        self._comm.close()


class OursHostBackend(OursBackend):
    """Ours on the host transport: every byte through pinned host memory over each GPU's own PCIe
    link, as on a box without usable P2P (compare with ``nccl_shm``)."""

    transport = "host"


def capacity_problem(comm: "Communicator", algo: str, size_bytes: int) -> str | None:
    """Why ``algo`` cannot take a message of ``size_bytes`` here (the low-latency cap, or an
    algorithm of the host transport on a P2P communicator, an island algorithm without islands), or None."""
    problem = availability_problem(algo, comm.transport, comm.island_ranks)
    if problem is not None:
        return problem
    if not fits_capacity(algo, size_bytes, comm.ll_capacity):
        return f"{algo} takes messages up to {comm.ll_capacity} bytes"
    return None
