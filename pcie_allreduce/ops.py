"""torch.library registration, so torch.compile graphs can contain our all-reduce and the fused
all-reduce + residual add + RMSNorm as opaque ops (traced through their fake implementations;
the Triton launch and the extension call stay out of the graph).

A compiled graph cannot hold a Python object, so it refers to a communicator by an integer
handle. The handle table is the one piece of process-wide state in the package: it holds weak
references only, so a communicator's lifetime is still its owner's. The communicator imports
this module, never the reverse: the table holds any
:class:`pcie_allreduce.interface.AllReducer`.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from pcie_allreduce.interface import AllReducer


class _Handles:
    """int handle <-> communicator, weakly held."""

    def __init__(self) -> None:
        self._by_id: "weakref.WeakValueDictionary[int, AllReducer]" = weakref.WeakValueDictionary()
        self._next = itertools.count(1)

    def register(self, comm: AllReducer) -> int:
        handle = next(self._next)
        self._by_id[handle] = comm
        return handle

    def get(self, handle: int) -> AllReducer:
        comm = self._by_id.get(handle)
        if comm is None:
            raise RuntimeError(f"pcie_allreduce: communicator handle {handle} is closed or was never registered")
        return comm


HANDLES = _Handles()


@torch.library.custom_op("pcie_allreduce::all_reduce", mutates_args=())
def all_reduce_op(x: torch.Tensor, handle: int, algo: str = "auto", wire: Optional[str] = None) -> torch.Tensor:
    """Out-of-place all-reduce through the communicator registered under ``handle``."""
    return HANDLES.get(handle).all_reduce(x, algo=algo, wire=wire)


@all_reduce_op.register_fake
def _all_reduce_fake(x: torch.Tensor, handle: int, algo: str = "auto", wire: Optional[str] = None) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pcie_allreduce::all_reduce_", mutates_args=("x",))
def all_reduce_inplace_op(x: torch.Tensor, handle: int, algo: str = "auto", wire: Optional[str] = None) -> None:
    """In-place all-reduce through the communicator registered under ``handle``."""
    HANDLES.get(handle).all_reduce(x, out=x, algo=algo, wire=wire)


@all_reduce_inplace_op.register_fake
def _all_reduce_inplace_fake(x: torch.Tensor, handle: int, algo: str = "auto", wire: Optional[str] = None) -> None:
    return None


@torch.library.custom_op("pcie_allreduce::all_reduce_rmsnorm", mutates_args=())
def all_reduce_rmsnorm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, handle: int,
                          algo: str = "auto", wire: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(residual + all_reduce(x)) * weight, residual + all_reduce(x))``, new tensors,
    through the communicator registered under ``handle`` (``Communicator.all_reduce_rmsnorm``)."""
    return HANDLES.get(handle).all_reduce_rmsnorm(x, residual, weight, eps, algo=algo, wire=wire)


@all_reduce_rmsnorm_op.register_fake
def _all_reduce_rmsnorm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, handle: int,
                             algo: str = "auto", wire: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(residual)
