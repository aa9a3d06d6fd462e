"""Facts about the GPUs of a communicator: peer access from the ranks' PCI bus ids, and the
islands their place in the PCIe fabric (:mod:`pcie_allreduce.fabric.sysfs`) forms.

This module describes; which algorithm a fabric calls for is decided elsewhere.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from types import ModuleType
from typing import Mapping, Sequence

from pcie_allreduce.fabric import sysfs as fabric_mod
from pcie_allreduce.fabric.sysfs import GpuFabric

ISLANDS_ENV = "PCIE_AR_ISLANDS"
Islands = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs, as exchanged at rendezvous."""

    rank: int
    host: str
    pci_bus_id: str
    #: Where the GPU sits in the PCIe fabric, as this rank's sysfs says (None: not read).
    fabric: GpuFabric | None = None


def local_placement(ext: ModuleType, rank: int, device_index: int, sysfs_root: str = "/") -> RankPlacement:
    """This rank's host name, its GPU's PCI bus id and its place in the fabric (read under ``sysfs_root``)."""
    bus_id = ext.pci_bus_id(device_index).lower()
    return RankPlacement(rank=rank, host=socket.gethostname(), pci_bus_id=bus_id,
                         fabric=fabric_mod.read_gpu(bus_id, sysfs_root))


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


# ---- islands: groups of ranks to reduce together first ------------------------------------


def fabric_of(placements: Sequence[RankPlacement], root: str = "/") -> list[GpuFabric]:
    """Each rank's place in the fabric: what its placement carries (read by that rank, which may
    see another /sys than this process in a container), else read here under ``root``."""
    return [p.fabric if p.fabric is not None else fabric_mod.read_gpu(p.pci_bus_id, root) for p in placements]


def islands(fabrics: Sequence[GpuFabric | None]) -> Islands:
    """The ranks (indices into ``fabrics``) grouped into islands, as sorted tuples that partition them.

    Ranks are first split by NUMA node (by PCI domain where a NUMA node is unknown, by nothing
    where that is unknown too); within each part, the GPUs under one PCIe switch form an island,
    and those under no switch that another GPU of the group shares form one island together. The
    top switch shared by two or more distinct GPUs counts (a switch on one card, above that GPU
    alone, does not). Where anything a level needs is unknown for any rank, that level splits
    nothing: an unknown fabric gives one island (flat).
    """
    return _detect(fabrics)[0]


def islands_basis(fabrics: Sequence[GpuFabric | None]) -> str:
    """What :func:`islands` grouped by, in words: "by NUMA node", "by PCIe switch", "flat: ..."."""
    return _detect(fabrics)[1]


def _detect(fabrics: Sequence[GpuFabric | None]) -> tuple[Islands, str]:
    count = len(fabrics)
    if count == 0:
        return (), "no ranks"
    numa = [f.numa_node if f is not None else None for f in fabrics]
    domains = [f.domain if f is not None else None for f in fabrics]
    level: str | None
    if all(n is not None for n in numa):
        part, level = list(numa), "NUMA node"
    elif all(d is not None for d in domains):
        part, level = list(domains), "PCI domain"
    else:
        part, level = [None] * count, None
    switches = _shared_switches(fabrics)
    keys = [(str(part[r]), switches[r] if switches is not None else "") for r in range(count)]
    members: dict[tuple[str, str], list[int]] = {}
    for rank, key in enumerate(keys):
        members.setdefault(key, []).append(rank)
    found = tuple(sorted(tuple(sorted(m)) for m in members.values()))
    parts = len(set(part))
    if len(found) > 1:
        by = ([level] if parts > 1 and level else []) + (["PCIe switch"] if len(found) > parts else [])
        return found, "by " + " and ".join(by)
    if not any(f is not None and f.known for f in fabrics):
        return found, "flat: the PCIe fabric is unknown"
    facts = [f"one {level}" if level else "NUMA node unknown"]
    if switches is None:
        facts.append("PCIe switches unknown")
    elif switches[0]:
        facts.append("one PCIe switch")
    else:
        facts.append("no shared PCIe switch")
    return found, "flat: " + ", ".join(facts)


def _shared_switches(fabrics: Sequence[GpuFabric | None]) -> list[str] | None:
    """Per rank, the top switch above its GPU that another distinct GPU of the group sits under
    too ("" where none); None when any rank's switches are unknown."""
    if any(f is None or f.switches is None for f in fabrics):
        return None
    gpus_under: dict[str, set[str]] = {}
    for f in fabrics:
        assert f is not None and f.switches is not None
        for switch in f.switches:
            gpus_under.setdefault(switch, set()).add(f.bus_id)
    shared = []
    for f in fabrics:
        assert f is not None and f.switches is not None
        shared.append(next((s for s in f.switches if len(gpus_under[s]) > 1), ""))
    return shared


def parse_islands(text: str, world: int, source: str = ISLANDS_ENV) -> Islands:
    """Islands written as text, checked to partition the ranks ``0 .. world-1``.

    Syntax: ``;`` separates islands, ``,`` separates the ranks of one, ``N-M`` is a range:
    ``"0-3;4-7"``, ``"0,1,2,3;4,5,6,7"``, ``"0-1,4-5;2-3,6-7"``. Without a ``;``, a list made
    only of ranges, ``"0-3,4-7"``, means one island per range. Spaces are ignored.

    Raises ValueError naming ``source`` and the problem: an empty island, a word that is not a
    rank or range, a rank out of range, a rank in two islands, ranks in none.
    """
    where = f"{source}={text!r}"
    body = "".join(text.split())
    if not body:
        raise ValueError(f"{where}: no islands given (write e.g. '0-3;4-7')")
    if ";" in body:
        groups = body.split(";")
    else:
        items = body.split(",")
        groups = items if len(items) > 1 and all("-" in i for i in items) else [body]
    seen: dict[int, int] = {}
    result = []
    for number, group in enumerate(groups, 1):
        if not group.strip(","):
            raise ValueError(f"{where}: island {number} is empty")
        ranks: list[int] = []
        for item in group.split(","):
            ranks.extend(_parse_item(item, where, world))
        for rank in ranks:
            if rank in seen:
                again = "twice in island" if seen[rank] == number else f"in islands {seen[rank]} and"
                raise ValueError(f"{where}: rank {rank} is {again} {number}: every rank must be in exactly one island")
            seen[rank] = number
        result.append(tuple(sorted(ranks)))
    missing = [r for r in range(world) if r not in seen]
    if missing:
        which = f"rank {missing[0]} is" if len(missing) == 1 else f"ranks {_ranges(missing)} are"
        raise ValueError(f"{where}: {which} in no island: each of the ranks 0-{world - 1} must be in exactly one")
    return tuple(sorted(result))


def _parse_item(item: str, where: str, world: int) -> list[int]:
    low_text, dash, high_text = item.partition("-")
    if not re.fullmatch(r"[0-9]+", low_text) or (dash and not re.fullmatch(r"[0-9]+", high_text)):  # ASCII only
        raise ValueError(f"{where}: {item!r} is not a rank or a range of ranks (N or N-M)"
                         if item else f"{where}: an empty entry (two commas in a row, or one at an end)")
    low = int(low_text)
    high = int(high_text) if dash else low
    if high < low:
        raise ValueError(f"{where}: the range {item!r} runs backwards")
    if high >= world:
        raise ValueError(f"{where}: rank {high} is out of range: the group has {world} ranks (0-{world - 1})")
    return list(range(low, high + 1))


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (sorted input)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def islands_override(world: int, environ: Mapping[str, str] = os.environ) -> Islands | None:
    """The islands ``$PCIE_AR_ISLANDS`` sets for ``world`` ranks, None when unset or empty.

    Raises ValueError (:func:`parse_islands`) when it is set but wrong.
    """
    text = environ.get(ISLANDS_ENV)
    if text is None or not text.strip():
        return None
    return parse_islands(text, world)


def island_ranks(groups: Islands) -> int:
    """Ranks per island where ``groups`` are two or more islands of one size >= 2, each a run of
    consecutive ranks in order (0..S-1, S..2S-1, ...: the layout ``island_twoshot``'s chain of
    partial sums follows), else 0 (no island algorithm serves such a group)."""
    if len(groups) < 2:
        return 0
    size = len(groups[0])
    expected = tuple(tuple(range(g * size, (g + 1) * size)) for g in range(len(groups)))
    return size if size >= 2 and tuple(sorted(groups)) == expected else 0


def format_islands(groups: Islands) -> str:
    """Islands as :func:`parse_islands` reads them: ``"0-3;4-7"``."""
    return ";".join(_ranges(list(g)) for g in groups)
