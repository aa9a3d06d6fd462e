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
decline: the communicator's record of it is raised at the next eager call.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from pcie_allreduce import algo as algo_mod, validation
from vllm_plugin.settings import ALGO, WIRE, Settings

logger = logging.getLogger("vllm_plugin")

DTYPES: tuple[torch.dtype, ...] = validation.SUPPORTED_DTYPES
FUSED_DTYPES: tuple[torch.dtype, ...] = validation.RMSNORM_DTYPES
MAX_FUSED_HIDDEN: int = validation.MAX_RMSNORM_HIDDEN

CommunicatorFactory = Callable[..., Any]


def _default_factory() -> CommunicatorFactory:
    from pcie_allreduce.communicator import Communicator

    return Communicator


class VllmAllReduceAdapter:
    """vLLM's custom-all-reduce interface over :class:`pcie_allreduce.Communicator`.

    Construction is collective over ``group`` (the tp group's gloo ``cpu_group``, which vLLM
    passes): every rank must construct it at the same point. The communicator picks GPU
    peer-to-peer or pinned host memory (``PCIE_AR_TRANSPORT``).

    Args:
        group: the CPU process group of the tp group.
        device: this rank's CUDA device.
        settings: the plugin's settings.
        communicator_factory: builds the communicator (tests on CPU pass a stand-in for
            pcie_allreduce's, never for vLLM's classes).
    """

    # Read by vLLM's model code on any ca_comm: not NVLink, no MNNVL buffers, not cross-node only.
    fully_connected = False
    mnnvl_only = False
    mnnvl_multicast_ptr = 0
    mnnvl_lamport_ag_multicast_ptr = 0

    def __init__(self, group: dist.ProcessGroup, device: torch.device | int | str, settings: Settings, *,
                 communicator_factory: CommunicatorFactory | None = None) -> None:
        self._IS_CAPTURING = False
        self.disabled = True
        factory = communicator_factory or _default_factory()
        self.comm = factory(group, device, max_bytes=settings.max_bytes, timeout_s=settings.timeout_s)
        self.group = group
        self.device: torch.device = self.comm.device
        self.rank: int = self.comm.rank
        self.world_size: int = self.comm.world_size
        self.max_size: int = self.comm.max_bytes
        self.algo: str = settings.algo
        #: Largest message served: ``max_size``, less where a forced algorithm takes less, 0 where
        #: it cannot run on this communicator's transport (everything then stays on vLLM's path).
        self.largest_served: int = self._largest_served()
        self.fused_enabled: bool = settings.fused
        self.wire: str | None = None
        self.wire_min_bytes: int = settings.wire_min_bytes
        if settings.wire != "exact":
            if settings.wire in getattr(self.comm, "wires", ()):
                self.wire = settings.wire
            else:
                logger.warning("pcie_allreduce[vllm]: %s=%s: this group's communicator (%s) has no such wire; its "
                               "all-reduces stay exact", WIRE, settings.wire, type(self.comm).__name__)
        self.disabled = False

    # ---- the all-reduce ------------------------------------------------------------------

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Whether this call is ours: contiguous bf16/fp16/fp32 on this device, 1 byte to
        :attr:`largest_served` (any size, unlike vLLM's kernel, which wants multiples of 16)."""
        if self.disabled or inp.dtype not in DTYPES or not inp.is_contiguous():
            return False
        nbytes = inp.numel() * inp.element_size()
        return 0 < nbytes <= self.largest_served and inp.device == self.device

    def custom_all_reduce(self, input: torch.Tensor) -> torch.Tensor | None:  # noqa: A002 - vLLM's name
        """Sum over the group into a NEW tensor; None when :meth:`should_custom_ar` declines.

        Warm-up runs inside ``capture()`` (outside stream capture) do the real reduction, where
        vLLM's own kernel returns an empty tensor: every rank runs the same warm-ups.
        """
        if not self.should_custom_ar(input):
            return None
        self.comm.check()  # a failure a graph replay recorded surfaces at the next eager call
        wire = self._wire_for(input)
        if wire is not None:
            return self.comm.all_reduce(input, wire=wire)
        return self.comm.all_reduce(input, algo=self.algo)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """``GroupCoordinator.graph_capture``'s context: make the capture stream's workspace now.

        Entered with the capture stream current, before any capture starts; the communicator
        keeps one workspace per stream and would otherwise create this one collectively on first
        use, inside the captured region. The ranks first agree that the stream is new to all of
        them or to none (a stream handle reused on some ranks only would pair different workspaces).
        """
        if self.disabled:
            yield
            return
        self._agree_on_stream_workspace()
        self._IS_CAPTURING = True
        try:
            yield
        finally:
            self._IS_CAPTURING = False
        self.comm.check()

    def register_graph_buffers(self) -> None:
        """Nothing to register: the kernels read inputs staged into the workspace, not by IPC."""

    def close(self) -> None:
        """Free the workspaces (collective: every rank of the group must call it)."""
        if self.disabled:
            return
        self.disabled = True
        self.comm.close()

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

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`fused_allreduce_rmsnorm` serves these shapes (pure, like should_custom_ar)."""
        if self.disabled or not self.fused_enabled:
            return False
        if x.dim() != 2 or x.dtype not in FUSED_DTYPES or not 1 <= x.shape[1] <= MAX_FUSED_HIDDEN:
            return False
        if residual.shape != x.shape or residual.dtype != x.dtype:
            return False
        if tuple(weight.shape) != (x.shape[1],) or weight.dtype not in (x.dtype, torch.float32):
            return False
        if not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
            return False
        nbytes = x.numel() * x.element_size()
        return 0 < nbytes <= self.max_size and x.device == self.device

    def fused_allreduce_rmsnorm(self, input_: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rmsnorm(residual + all_reduce(input)) * weight, residual + all_reduce(input))``, both new
        tensors, the second bitwise the unfused pair's; None when :meth:`can_fuse` declines."""
        if not self.can_fuse(input_, residual, weight):
            return None
        self.comm.check()
        wire = self._wire_for(input_)
        if wire is not None:
            return self.comm.all_reduce_rmsnorm(input_, residual, weight, float(eps), wire=wire)
        return self.comm.all_reduce_rmsnorm(input_, residual, weight, float(eps))

    # ---- internals -----------------------------------------------------------------------

    def _wire_for(self, x: torch.Tensor) -> str | None:
        if self.wire is None or x.numel() * x.element_size() < self.wire_min_bytes:
            return None
        return self.wire

    def _largest_served(self) -> int:
        if self.algo == "auto":
            return self.max_size
        problem = algo_mod.availability_problem(self.algo, self.comm.transport, self.comm.island_ranks)
        if problem is not None:
            logger.warning("pcie_allreduce[vllm]: %s=%s: %s: every all-reduce stays on vLLM's own path", ALGO,
                           self.algo, problem)
            return 0
        limit = algo_mod.capacity_of(self.algo, self.comm.ll_capacity)
        return self.max_size if limit is None else max(0, min(self.max_size, limit))

    def _agree_on_stream_workspace(self) -> None:
        stream = 0 if self.device.type != "cuda" else torch.cuda.current_stream(self.device).cuda_stream
        known = bool(self.comm.has_workspace(stream))
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, known, group=self.group)
        if len(set(views)) != 1:
            raise RuntimeError(
                f"pcie_allreduce vllm plugin: ranks disagree on whether the graph-capture stream is new (per "
                f"rank: {views}); a CUDA stream handle was reused on some ranks only. Capture on a fresh "
                "torch.cuda.Stream() created in the same order on every rank.")
        if not known:
            self.comm.workspace(stream)  # collective on every rank, outside any capture

    def __repr__(self) -> str:
        return (f"VllmAllReduceAdapter(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_size={self.max_size}, algo={self.algo!r}, disabled={self.disabled})")
