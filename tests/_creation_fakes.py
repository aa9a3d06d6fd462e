"""A fake ``pcie_allreduce._C`` for creating a Communicator on CPU ranks (used by
tests/test_creation_all_or_nothing_cpu.py, tests/test_lifetime_and_shm_cpu.py and the other CPU
tests that create one): a workspace whose ``fault`` scripts one failure (an allocation or mapping
that fails, probes that do not arrive, another layout), the few torch.cuda calls creation makes,
and ``_create``, one rank's creation with its outcome as a dict the test compares across ranks.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

import pcie_allreduce
from pcie_allreduce.plan.tables import default_table
from pcie_allreduce import communicator, constants
from pcie_allreduce.tools import ranks


WORLD = 2
FAULTS = ("none", "bad_max_bytes", "no_gpu", "alloc", "open", "probe", "layout", "timeout_differs")


class FakeWorkspace:
    """The binding's Workspace as the creation protocol uses it; ``fault`` scripts one failure."""

    instances: list["FakeWorkspace"] = []

    def __init__(self, device: int, rank: int, world: int, max_bytes: int, timeout_s: float, transport: int = 0,
                 segment_name: str = "", *, fault: str) -> None:
        if fault == "alloc":
            raise RuntimeError("CUDA error: out of memory (cudaMalloc)")
        # "open" and "probe" model a platform without usable P2P: the host transport is unaffected.
        if transport != constants.TRANSPORT_IDS["p2p"] and fault in ("open", "probe"):
            fault = "none"
        self.rank, self.world, self.max_bytes, self.fault, self.transport = rank, world, max_bytes, fault, transport
        self.name_released = False
        self.segment_name = segment_name
        self.total_bytes = 4096 + max_bytes * world * 2 + (256 if fault == "layout" else 0)
        self.closed = self.retired = self.captured = False
        FakeWorkspace.instances.append(self)

    def ipc_handle(self) -> bytes:
        return bytes(64)

    def open_peers(self, handles: list[bytes]) -> None:
        if self.fault == "open":
            raise RuntimeError("rank 1 could not map the workspace of rank 0 (cudaIpcOpenMemHandle: invalid handle)")

    def write_probes(self, seed: int) -> None:
        pass

    def probe_failures(self, seed: int) -> list[int]:
        return [0] if self.fault == "probe" else []

    def failed(self) -> int:
        return 0

    def release_name(self) -> None:
        self.name_released = True

    def close(self) -> None:
        self.closed = True

    def retire(self) -> None:
        self.retired = True


class FakeExtension:
    """What Communicator creation asks of pcie_allreduce._C."""

    def __init__(self, fault: str, rank: int = 0, distinct_gpus: bool = False) -> None:
        self.fault, self.rank, self.distinct_gpus = fault, rank, distinct_gpus

    def runtime_status(self) -> str:
        return "no CUDA device is visible" if self.fault == "no_gpu" else ""

    def pci_bus_id(self, device: int) -> str:
        return f"0000:00:{6 + self.rank:02x}.0" if self.distinct_gpus else "0000:00:06.0"

    def device_by_pci_bus_id(self, bus_id: str) -> int:
        return 0 if not self.distinct_gpus or bus_id == self.pci_bus_id(0) else 1

    def can_access_peer(self, device: int, peer: int) -> bool:
        return self.fault != "no_peer_access"

    def Workspace(self, *args: Any) -> FakeWorkspace:  # noqa: N802 - the binding's class name
        return FakeWorkspace(*args, fault=self.fault)


class _Properties:
    """An H100's: its SM count, and the compute capability dependent launch is decided by."""

    multi_processor_count = 132
    major, minor = 9, 0


def _fake_cuda(fault: str, rank: int = 0, distinct_gpus: bool = False) -> None:
    """Inside a CPU rank: the extension and the few torch.cuda calls creation makes (every rank on
    one GPU, or each on its own with ``distinct_gpus``)."""
    from pcie_allreduce import _ext

    _ext.require = lambda: FakeExtension(fault, rank, distinct_gpus)
    torch.cuda.get_device_properties = lambda device: _Properties()
    torch.cuda.device = lambda device: contextlib.nullcontext()
    communicator.current_stream_handle = lambda device: 7


def _create(ctx: ranks.RankContext, fault: str, faulty_rank: int, transport: str = "p2p") -> dict[str, Any]:
    _fake_cuda(fault if ctx.rank == faulty_rank else "none", ctx.rank, distinct_gpus=fault == "no_peer_access")
    max_bytes = constants.MAX_MESSAGE_BYTES + 1 if fault == "bad_max_bytes" and ctx.rank == faulty_rank else 1 << 20
    timeout_s = 3.0 if fault == "timeout_differs" and ctx.rank == faulty_rank else 5.0
    if fault == "transport_differs" and ctx.rank == faulty_rank:
        transport = "host"
    # ranks of other groups on the same GPU: 16 on every rank, or a rank that says 15, or nonsense
    sharing = {"sharing_16": 16, "sharing_differs": 15 if ctx.rank == faulty_rank else 16,
               "sharing_bad": 0 if ctx.rank == faulty_rank else None}.get(fault)
    failure = None
    gc.disable()  # a failed creation must leave nothing behind that only a cyclic collection frees
    try:
        # one rank leaving the table to the tuned cache while the others give the built-in one
        table = None if fault == "table_given_differs" and ctx.rank == faulty_rank else default_table()
        comm = pcie_allreduce.Communicator(ctx.group, "cuda:0", max_bytes=max_bytes, timeout_s=timeout_s,
                                           algo_table=table, transport=transport, ranks_per_gpu=sharing)
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        failure = {"error": type(exc).__name__, "message": str(exc),
                   "all_closed": all(w.closed for w in FakeWorkspace.instances), "made": len(FakeWorkspace.instances)}
    if failure is not None:
        failure["left_alive"] = sum(isinstance(o, pcie_allreduce.Communicator) for o in gc.get_objects())
    gc.enable()
    if failure is not None:
        return failure
    made = list(comm._workspaces.values())
    comm._closed = True  # no CUDA here: skip close()'s synchronize
    return {"error": None, "made": len(made), "open": not any(w.closed for w in made),
            "transport": comm.transport, "reason": comm.transport_reason, "repr": repr(comm),
            "workspace_transports": [w.transport for w in made], "names_released": all(w.name_released for w in made),
            "segment_names": [w.segment_name for w in made], "block_cap": comm.block_cap,
            "discarded": [(w.transport, w.closed) for w in FakeWorkspace.instances if w not in made]}
