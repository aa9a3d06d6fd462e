"""Rank side of ``pcie-allreduce tune``: our kernels at a forced (algorithm, block count).

Case algos are launch shapes, "oneshot/b8" (:func:`~.plan.shape_algo`). Calls go straight to the
workspace's raw launch, bypassing the algorithm table, so one communicator serves every shape.
Shapes with more blocks than the communicator's block cap (ranks sharing a GPU: every rank's
blocks must be co-resident) are skipped, identically on every rank since the cap is agreed.
"""

from __future__ import annotations

import torch

from bench.backend_ours import OursBackend, capacity_problem
from bench.backends import Buffers
from bench.plan import Case, parse_shape_algo


class OursShapesBackend(OursBackend):
    """One Communicator; every call is ``Workspace.all_reduce(algo_id, ..., blocks, stream)``."""

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        from pcie_allreduce.algo import ALGO_IDS
        from pcie_allreduce.communicator import DTYPE_IDS

        name, blocks = parse_shape_algo(algo)
        comm = self.comm
        stream = torch.cuda.current_stream(comm.device).cuda_stream
        workspace = comm.workspace(stream)
        nbytes = bufs.inp.numel() * bufs.inp.element_size()
        failed = workspace.all_reduce(ALGO_IDS[name], bufs.inp.data_ptr(), bufs.out.data_ptr(), nbytes,
                                      DTYPE_IDS[bufs.inp.dtype], blocks, stream)
        if failed:
            comm.raise_if_failed(workspace)
        return bufs.out

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return algo

    def skip_reason(self, case: Case) -> str | None:
        name, blocks = parse_shape_algo(case.algo)
        if blocks > self.comm.block_cap:
            return f"{blocks} blocks > block cap {self.comm.block_cap} (ranks share a GPU)"
        return capacity_problem(self.comm, name, case.size_bytes)
