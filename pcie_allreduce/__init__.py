"""pcie_allreduce: low-latency all-reduce for multi-GPU servers whose GPUs talk over PCIe.

    comm = pcie_allreduce.Communicator(gloo_group, device=torch.device("cuda", local_rank))
    y = comm.all_reduce(x)            # sum over ranks, bitwise identical everywhere

Importing never needs a GPU; :func:`is_available` says whether the kernels can run here.
"""

from __future__ import annotations

from pcie_allreduce.errors import (CollectiveError, CollectiveMismatch, CollectiveTimeout, InterNodeError,
                                   UnavailableError)

__version__ = "0.1.0"

# The public surface: the communicators, their errors, whether the kernels can run here, and the
# FP8 wire's error helpers. Algorithm tables (``algo_table=``) are pcie_allreduce.plan.tables'.
__all__ = [
    "CollectiveError", "CollectiveMismatch", "CollectiveTimeout", "InterNodeError", "UnavailableError",
    "AllReducer", "Communicator", "HierarchicalCommunicator", "is_available", "unavailable_reason",
    "fp8_error_bound", "fp8_all_reduce", "__version__",
]


def unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot run in this process (no extension, no GPU), or None."""
    from pcie_allreduce import _ext

    return _ext.unavailable_reason()


def is_available() -> bool:
    """True when the extension is built and a CUDA GPU is usable."""
    return unavailable_reason() is None


def __getattr__(name: str):  # lazy: keep `import pcie_allreduce` free of torch.distributed setup cost
    if name == "AllReducer":
        from pcie_allreduce.interface import AllReducer

        return AllReducer
    if name == "Communicator":
        from pcie_allreduce.communicator import Communicator

        return Communicator
    if name in ("fp8_error_bound", "fp8_all_reduce"):
        from pcie_allreduce import fp8_wire

        return fp8_wire.error_bound if name == "fp8_error_bound" else fp8_wire.all_reduce
    if name == "HierarchicalCommunicator":
        from pcie_allreduce.hierarchy import HierarchicalCommunicator

        return HierarchicalCommunicator
    raise AttributeError(f"module 'pcie_allreduce' has no attribute {name!r}")
