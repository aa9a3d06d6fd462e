"""Rank side of the ``nccl`` backend: ``torch.distributed.all_reduce`` on a separate NCCL group.

Only used when every rank has its own GPU (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import os
from types import MappingProxyType

import torch
import torch.distributed as dist

from pcie_allreduce.tools.ranks import RankContext

from bench.backends import Backend, Buffers
from bench.plan import RankJob


class NcclBackend(Backend):
    """NCCL all-reduce, in place (NCCL's out-of-place path costs the same)."""

    algorithms = ("default",)  # NCCL picks ring/tree and protocol itself

    @classmethod
    def runtime_problem(cls, world: int, gpu_count: int) -> str | None:
        if world > gpu_count:
            return (f"NCCL refuses two ranks on one GPU ({world} ranks on {gpu_count} GPU"
                    f"{'s' if gpu_count != 1 else ''}); it runs only when every rank has its own GPU")
        if not dist.is_nccl_available():
            return "this torch has no NCCL backend"
        return None

    def __init__(self, ctx: RankContext, job: RankJob) -> None:
        self._device = ctx.device
        self._group = dist.new_group(ranks=list(range(ctx.world_size)), backend="nccl")
        self._sync = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        # NCCL creates its communicator on the first collective; that must not happen inside a capture.
        dist.all_reduce(self._sync, group=self._group)
        torch.cuda.synchronize(ctx.device)

    def buffers(self, count: int, dtype: torch.dtype, algo: str) -> Buffers:
        buf = torch.empty(count, dtype=dtype, device=self._device)
        return Buffers(buf, buf)

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        dist.all_reduce(bufs.inp, group=self._group)
        return bufs.inp

    def mutates_input(self, algo: str) -> bool:
        return True

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        forced = [f"{k[5:].lower()}={os.environ[k]}" for k in ("NCCL_ALGO", "NCCL_PROTO") if os.environ.get(k)]
        return ",".join(forced) or algo

    def prepare_capture(self, stream: torch.cuda.Stream) -> None:
        pass

    def device_sync(self) -> None:
        dist.all_reduce(self._sync, group=self._group)

    def check(self) -> None:
        pass  # NCCL errors surface from the calls themselves

    def close(self) -> None:
        torch.cuda.synchronize(self._device)
        dist.destroy_process_group(self._group)


class NcclLowLatencyBackend(NcclBackend):
    """NCCL with its low-latency protocol for every size: the tuned-NCCL row."""

    env = MappingProxyType({"NCCL_PROTO": "LL"})


class NcclSharedMemoryBackend(NcclBackend):
    """NCCL with peer-to-peer disabled: the path it takes on boxes without usable P2P (through
    host shared memory), the row the host transport is judged against."""

    env = MappingProxyType({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "0"})

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return ",".join(["p2p off", *filter(None, [super().resolved_algo(size_bytes, dtype, "")])])
