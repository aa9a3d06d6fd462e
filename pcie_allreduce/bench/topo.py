"""``pcie-allreduce topo``: which GPUs can write into which (CUDA peer access), their PCI bus ids
and NUMA nodes, printed as a matrix and optionally saved as JSON.

Issue 5 extends it with NVML link types, flag round-trip latency and write bandwidth per pair.
The probe takes the extension as a parameter and reads NUMA nodes under a sysfs root, so the
CPU tests run it against fakes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Protocol

from pcie_allreduce.bench.errors import Unavailable

SYSFS_PCI = "/sys/bus/pci/devices"
JSON_NAME = "topo.json"


class PeerQueries(Protocol):
    """The part of ``pcie_allreduce._C`` the probe needs."""

    def pci_bus_id(self, device: int) -> str: ...

    def can_access_peer(self, device: int, peer_device: int) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    pci_bus_id: str
    numa_node: int | None  # None: unknown (no sysfs entry, or -1 = no NUMA affinity reported)


@dataclasses.dataclass(frozen=True)
class Topology:
    gpus: tuple[Gpu, ...]
    peer_access: tuple[tuple[bool, ...], ...]  # [i][j]: GPU i can access GPU j's memory (diagonal True)
    nvidia_smi_topo: str = ""  # `nvidia-smi topo -m` as printed, when available

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": [dataclasses.asdict(g) for g in self.gpus],
                "peer_access": [list(row) for row in self.peer_access],
                "nvidia_smi_topo": self.nvidia_smi_topo}


def sysfs_bus_id(bus_id: str) -> str:
    """CUDA's "00000000:19:00.0" or "0000:19:00.0" -> sysfs's "0000:19:00.0" (4-digit domain, lower case)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return f"{domain[-4:].rjust(4, '0')}:{rest}" if rest else bus_id.strip().lower()


def numa_node(bus_id: str, sysfs_root: str = SYSFS_PCI) -> int | None:
    """The NUMA node sysfs reports for a PCI device, or None (missing file, or -1)."""
    try:
        with open(os.path.join(sysfs_root, sysfs_bus_id(bus_id), "numa_node"), encoding="ascii") as fh:
            node = int(fh.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _nvidia_smi_topo() -> str:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return ""
    try:
        proc = subprocess.run([binary, "topo", "-m"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.rstrip() if proc.returncode == 0 else ""


def probe(ext: PeerQueries, names: list[str], sysfs_root: str = SYSFS_PCI, smi_topo: str = "") -> Topology:
    """Peer access between every pair of the ``len(names)`` visible GPUs."""
    count = len(names)
    gpus = []
    for i, name in enumerate(names):
        bus = sysfs_bus_id(ext.pci_bus_id(i))
        gpus.append(Gpu(i, name, bus, numa_node(bus, sysfs_root)))
    access = tuple(tuple(i == j or bool(ext.can_access_peer(i, j)) for j in range(count)) for i in range(count))
    return Topology(tuple(gpus), access, smi_topo)


def format_topology(topo: Topology) -> str:
    """The GPU list and the peer-access matrix (row i, column j: can GPU i write into GPU j)."""
    lines = ["# GPU  PCI bus id      NUMA  name"]
    for g in topo.gpus:
        numa = "-" if g.numa_node is None else str(g.numa_node)
        lines.append(f"  {g.index:>3}  {g.pci_bus_id:<14} {numa:>4}  {g.name}")
    lines += ["", "# peer access (row GPU can write into column GPU): Y yes, N no, X itself"]
    lines.append(("      " + "".join(f"GPU{g.index:<3}" for g in topo.gpus)).rstrip())
    for g, row in zip(topo.gpus, topo.peer_access):
        cells = ["X" if j == g.index else ("Y" if ok else "N") for j, ok in enumerate(row)]
        lines.append((f"GPU{g.index:<3}" + "".join(f"{c:<6}" for c in cells)).rstrip())
    missing = [(i, j) for i, row in enumerate(topo.peer_access) for j, ok in enumerate(row) if not ok]
    if missing:
        lines.append(f"# {len(missing)} pairs without peer access: P2P all-reduce cannot span them")
    if topo.nvidia_smi_topo:
        lines += ["", "# nvidia-smi topo -m", topo.nvidia_smi_topo]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pcie-allreduce topo``."""
    parser.add_argument("--out", metavar="DIR", help=f"also write {JSON_NAME} into DIR")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the matrices")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of the ``topo`` subcommand."""
    import torch

    from pcie_allreduce import _ext, testing

    reason = testing.skip_reason_no_gpu()
    if reason is not None:
        raise Unavailable(reason)
    ext = _ext.load()
    if ext is None:
        raise Unavailable(_ext.unavailable_reason() or "the extension pcie_allreduce._C does not load")
    names = [torch.cuda.get_device_properties(i).name for i in range(testing.gpu_count())]
    topo = probe(ext, names, smi_topo=_nvidia_smi_topo())
    text = json.dumps(topo.to_dict(), indent=2) + "\n"
    sys.stdout.write(text if args.json else format_topology(topo))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, JSON_NAME)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0
