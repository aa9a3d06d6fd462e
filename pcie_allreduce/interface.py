"""The one interface both communicators implement: :class:`pcie_allreduce.Communicator` (one
host) and :class:`pcie_allreduce.HierarchicalCommunicator` (across nodes).

Same methods, same signatures, same attributes, so a caller (the engine plugins, torch.compile's
registered ops through :attr:`AllReducer.handle`) holds either without asking which it has or
probing for what it offers. What one of them cannot do it refuses with a ValueError naming why
(a compressed wire across nodes, a forced fused kernel across nodes), never by a missing method.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class AllReducer(Protocol):
    """An all-reduce over a group of ranks (one process per rank), and the fused all-reduce +
    residual add + RMSNorm. Creation, calls and :meth:`close` are collective: every rank makes the
    same sequence of them."""

    #: This rank's CUDA device, its rank and the group's size.
    device: torch.device
    rank: int
    world_size: int
    #: Largest message, in bytes.
    max_bytes: int
    #: The compressed wires ``all_reduce(x, wire=...)`` takes (empty: exact only).
    wires: tuple[str, ...]
    #: This communicator's key in :data:`pcie_allreduce.ops.HANDLES`, for torch.ops.pcie_allreduce.*
    #: (a compiled graph refers to it by this integer).
    handle: int
    #: "p2p" or "host": where the (node's) workspaces live, and why that one.
    transport: str
    transport_reason: str
    #: Ranks per island where islands of consecutive ranks exist (island algorithms run), else 0.
    island_ranks: int

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto", *,
                   wire: str | None = None) -> torch.Tensor:
        """The sum of ``x`` over every rank, bitwise the same on every rank; ``out`` (new tensor if
        None; ``out=x`` is in place); ``algo``: "auto" (the table's choice) or a forced algorithm;
        ``wire``: None (exact) or one of :attr:`wires`."""
        ...

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                           out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                           algo: str = "auto", wire: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(residual + all_reduce(x)) * weight, residual + all_reduce(x))``."""
        ...

    def check(self) -> None:
        """Raise the error an earlier call recorded (a timeout, a mismatch, a failed send), if any."""
        ...

    def close(self, *, release_captured: bool = False) -> None:
        """Release everything (collective); calls after it raise. ``release_captured``: no CUDA
        graph captured with this communicator is replayed after this, so its workspaces go too."""
        ...

    def capacity_of(self, algo: str) -> int | None:
        """Largest message (bytes) a forced ``algo`` takes; None: up to :attr:`max_bytes`."""
        ...

    def select_algo(self, nbytes: int, dtype: torch.dtype) -> str:
        """What ``algo="auto"`` runs for a message of ``nbytes`` bytes of ``dtype``."""
        ...

    # The engine plugins make a graph-capture stream's workspace before the capture:

    def serves_stream(self, stream: int | None = None) -> bool:
        """Whether ``stream`` (default: the current one) has its workspace already (no collective)."""
        ...

    def prepare_stream(self, stream: int | None = None) -> None:
        """Make the workspace of ``stream`` (default: the current one) now, collectively on every rank."""
        ...
