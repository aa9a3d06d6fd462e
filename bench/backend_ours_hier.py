"""Rank side of the ``ours_hier`` backend: :class:`pcie_allreduce.HierarchicalCommunicator`, the
all-reduce across nodes (the library's kernels inside each node, torch.distributed between).

The nodes are the hosts the ranks run on, or ``$PCIE_AR_NODES`` emulated nodes; on one host the
runner sets ``PCIE_AR_NODES=2``. Between nodes the sends go over NCCL where every rank has its own
GPU (capturable in a CUDA graph), else over the ranks' gloo group through host memory, which a
graph cannot capture: time that with ``--eager``. Its wire columns are the bytes a rank puts on
the inter-node link (``fabric.nodes.off_node_wire``); the report sets flat NCCL's beside them.
"""

from __future__ import annotations

from typing import Any

import torch

from pcie_allreduce.fabric.nodes import NODES_ENV, emulated_nodes
from pcie_allreduce.tools.ranks import RankContext

from bench.backend_ours import SYNC_COUNT, OursBackend, kernel_timeout_s
from bench.plan import Case, RankJob

EMULATED_NODES = 2  # on one host, where no $PCIE_AR_NODES says otherwise


class OursHierBackend(OursBackend):
    """The hierarchical communicator, its nodes' tables choosing their algorithms. It serves the
    rank side as ``ours`` does (buffers, calls, capture, sync, check, close), on
    ``HierarchicalCommunicator``'s matching methods."""

    algorithms = ("auto",)

    @classmethod
    def runtime_problem(cls, world: int, gpu_count: int) -> str | None:
        problem = super().runtime_problem(world, gpu_count)
        if problem is not None:
            return problem
        nodes = emulated_nodes() or EMULATED_NODES  # SettingsError naming $PCIE_AR_NODES where malformed
        if nodes < 2 or world % nodes or world // nodes < 2:
            return (f"the hierarchy needs {world} ranks split into 2 or more nodes of 2 or more ranks; "
                    f"${NODES_ENV}={nodes} does not")
        return None

    @classmethod
    def rank_env(cls, world: int, gpu_count: int) -> dict[str, str]:
        return {NODES_ENV: str(emulated_nodes() or EMULATED_NODES)}

    def __init__(self, ctx: RankContext, job: RankJob) -> None:  # its own communicator: not ours
        from pcie_allreduce.hierarchy import HierarchicalCommunicator

        # NCCL refuses two ranks on one GPU: between emulated nodes of one GPU the sends take gloo.
        self._graphable = torch.cuda.device_count() >= ctx.world_size
        timeout_s = kernel_timeout_s(job)
        self._comm = HierarchicalCommunicator(ctx.group, ctx.device,
                                              inter_node_backend="nccl" if self._graphable else None,
                                              inter_node_timeout_s=timeout_s, max_bytes=max(job.max_bytes, 4096),
                                              timeout_s=timeout_s)
        self._sync = torch.zeros(SYNC_COUNT, dtype=torch.float32, device=ctx.device)
        self._eager = job.eager

    def facts(self) -> dict[str, Any]:
        return {"nodes": self._comm.layout.count, "node_layout": self._comm.layout.describe(),
                "inter_node_backend": self._comm.backend, "transport": self._comm.transport}

    def skip_reason(self, case: Case) -> str | None:
        if not self._graphable and not self._eager:
            return (f"the inter-node step runs on {self._comm.backend} here (ranks share a GPU, NCCL refuses them), "
                    "which a CUDA graph cannot capture: time it with --eager")
        return None

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return f"hier({self._comm.select_algo(size_bytes, dtype)})"
