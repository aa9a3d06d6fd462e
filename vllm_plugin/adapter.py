"""``VllmAllReduceAdapter``: a ``pcie_allreduce.Communicator`` behind vLLM's ``ca_comm`` interface.

vLLM's ``CudaCommunicator`` (vllm/distributed/device_communicators/cuda_communicator.py) uses its
``ca_comm`` through ``disabled``, ``should_custom_ar(x)`` then ``custom_all_reduce(x)`` (out of
place; it asserts a tensor comes back whenever ``should_custom_ar`` said yes), ``capture()``
around CUDA-graph capture (``GroupCoordinator.graph_capture``, entered with the capture stream
current), ``custom_all_gather`` / ``custom_reduce_scatter`` (sequence parallelism asks, and takes
None as "use NCCL"), and model code reads ``fully_connected`` and the MNNVL pointers. This class
answers all of them; it serves all-reduce only and says no to the rest.

CUDA-graph safety: every rank must capture the same sequence of collectives, so whether a call is
served is a pure function of dtype, size, contiguity and W, which all ranks share. Nothing a call
can be given makes it raise: what the communicator cannot take is declined up front and vLLM's next
backend serves it. A collective that failed (a peer stopped past the timeout) is a failure, not a
decline: the communicator's record of it is raised before the next step (vllm_plugin/lifecycle.py),
or at the next eager call. vLLM's teardown (``CudaCommunicator.destroy``) closes it.
"""

from __future__ import annotations

import torch

from pcie_allreduce.plugin_adapter import CaCommAdapter
from vllm_plugin.settings import ALGO, WIRE


class VllmAllReduceAdapter(CaCommAdapter):
    """vLLM's custom-all-reduce interface over :class:`pcie_allreduce.Communicator`.

    Construction is collective over ``group`` (the tp group's gloo ``cpu_group``, which vLLM
    passes): every rank must construct it at the same point. The communicator picks GPU
    peer-to-peer or pinned host memory (``PCIE_AR_TRANSPORT``);
    :class:`~pcie_allreduce.plugin_adapter.CaCommAdapter` holds what does not depend on vLLM.
    """

    ENGINE, ENGINE_NAME, ALGO_VARIABLE, WIRE_VARIABLE = "vllm", "vLLM", ALGO, WIRE

    # Read by vLLM's model code on any ca_comm: not NVLink, no MNNVL buffers, not cross-node only.
    fully_connected = False
    mnnvl_only = False
    mnnvl_multicast_ptr = 0
    mnnvl_lamport_ag_multicast_ptr = 0

    # ---- the all-reduce ------------------------------------------------------------------

    def custom_all_reduce(self, input: torch.Tensor) -> torch.Tensor | None:  # noqa: A002 - vLLM's name
        """Sum over the group into a NEW tensor; None when :meth:`should_custom_ar` declines.

        Warm-up runs inside ``capture()`` (outside stream capture) do the real reduction, where
        vLLM's own kernel returns an empty tensor: every rank runs the same warm-ups.
        """
        return self._all_reduce(input)

    def register_graph_buffers(self) -> None:
        """Nothing to register: the kernels read inputs staged into the workspace, not by IPC."""

    # ---- what it does not serve: vLLM's other collectives keep NCCL ----------------------

    def should_custom_all_gather(self, inp: torch.Tensor) -> bool:
        """No: all-gather is not implemented; vLLM's NCCL path serves it."""
        return False

    def custom_all_gather(self, inp: torch.Tensor) -> torch.Tensor | None:
        """None (vLLM then all-gathers with NCCL)."""
        return None

    def should_custom_reduce_scatter(self, inp: torch.Tensor) -> bool:
        """No: reduce-scatter is not implemented; vLLM's NCCL path serves it."""
        return False

    def should_mnnvl_multimem_reduce_scatter(self, inp: torch.Tensor) -> bool:
        """No (no MNNVL on PCIe)."""
        return False

    def custom_reduce_scatter(self, inp: torch.Tensor) -> torch.Tensor | None:
        """None (vLLM then reduce-scatters with NCCL)."""
        return None

    # ---- fused all-reduce + residual add + RMSNorm -----------------------------------------

    def fused_allreduce_rmsnorm(self, input_: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rmsnorm(residual + all_reduce(input)) * weight, residual + all_reduce(input))``, both new
        tensors, the second bitwise the unfused pair's; None when :meth:`can_fuse` declines."""
        if not self.can_fuse(input_, residual, weight, eps):
            return None
        return self._all_reduce_rmsnorm(input_, residual, weight, eps)
