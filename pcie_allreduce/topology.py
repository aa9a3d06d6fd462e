"""Peer-access facts about the GPUs of a communicator, from the ranks' PCI bus ids."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs, as exchanged at rendezvous."""

    rank: int
    host: str
    pci_bus_id: str


def local_placement(ext: ModuleType, rank: int, device_index: int) -> RankPlacement:
    """This rank's host name and its GPU's PCI bus id."""
    return RankPlacement(rank=rank, host=socket.gethostname(), pci_bus_id=ext.pci_bus_id(device_index).lower())


def peer_access_problem(ext: ModuleType, me: RankPlacement, device_index: int,
                        placements: list[RankPlacement]) -> str | None:
    """Why this rank cannot write into every peer's GPU memory, or None when it can.

    Ranks on the same GPU need no peer access (CUDA IPC on one device); ranks on different GPUs
    need the peer GPU visible in this process and ``cudaDeviceCanAccessPeer``.
    """
    for peer in placements:
        if peer.rank == me.rank:
            continue
        if peer.host != me.host:
            return (f"rank {peer.rank} runs on host {peer.host!r} but rank {me.rank} on {me.host!r}: "
                    "P2P all-reduce needs every rank on one host")
        if peer.pci_bus_id == me.pci_bus_id:
            continue
        peer_index = ext.device_by_pci_bus_id(peer.pci_bus_id)
        if peer_index < 0:
            return (f"rank {me.rank} cannot see rank {peer.rank}'s GPU {peer.pci_bus_id} (is CUDA_VISIBLE_DEVICES "
                    "restricted per process? every rank must see every GPU of the group)")
        if not ext.can_access_peer(device_index, peer_index):
            return (f"GPU {me.pci_bus_id} (rank {me.rank}) has no CUDA peer access to GPU {peer.pci_bus_id} "
                    f"(rank {peer.rank}); P2P is disabled by the driver, the IOMMU/ACS settings, or the platform")
    return None


def shares_gpu(placements: list[RankPlacement]) -> bool:
    """True when two or more ranks run on the same GPU (test emulation under MPS)."""
    return ranks_per_gpu(placements) > 1


def ranks_per_gpu(placements: list[RankPlacement]) -> int:
    """The most ranks that run on any one GPU (1 when every rank has its own)."""
    per_gpu: dict[str, int] = {}
    for p in placements:
        per_gpu[p.pci_bus_id] = per_gpu.get(p.pci_bus_id, 0) + 1
    return max(per_gpu.values(), default=1)
