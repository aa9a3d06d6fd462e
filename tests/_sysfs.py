"""Recorded sysfs trees for the fabric tests, laid out as Linux lays them out.

``/sys/devices/pci<domain>:<bus>/<root port>/.../<bdf>/`` directories holding ``class``,
``numa_node`` and the link files, and ``/sys/bus/pci/devices/<bdf>`` relative symlinks into them
(``../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0``).
"""

from __future__ import annotations

import os
from pathlib import Path

GPU_CLASS = "0x030000"      # VGA controller (GeForce / RTX PRO workstation cards)
GPU_3D_CLASS = "0x030200"   # 3D controller (data-centre cards)
BRIDGE_CLASS = "0x060400"


class Sysfs:
    """A sysfs tree under ``root`` (pass ``str(root)`` to the readers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "sys" / "devices").mkdir(parents=True, exist_ok=True)
        (root / "sys" / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)

    def device(self, path: str, cls: str | None = GPU_3D_CLASS, numa: str | None = "0",
               speed: str | None = "32.0 GT/s PCIe", width: str | None = "16",
               max_speed: str | None = "32.0 GT/s PCIe", max_width: str | None = "16",
               bridge_numa: str | None = None) -> str:
        """Add the device at ``path`` ("pci0000:00/0000:00:01.0/0000:01:00.0"), its bridges too
        (class 0x060400, made once); a None file is left out. Returns its bdf."""
        parts = path.split("/")
        for depth in range(1, len(parts)):
            here = self.root / "sys" / "devices" / Path(*parts[:depth + 1])
            last = depth == len(parts) - 1
            if not last and here.is_dir():
                continue
            here.mkdir(parents=True, exist_ok=True)
            files = {"class": cls, "numa_node": numa, "current_link_speed": speed, "current_link_width": width,
                     "max_link_speed": max_speed, "max_link_width": max_width} if last else {
                "class": BRIDGE_CLASS, "numa_node": bridge_numa if bridge_numa is not None else numa}
            for name, text in files.items():
                if text is not None:
                    (here / name).write_text(text + "\n")
            link = self.root / "sys" / "bus" / "pci" / "devices" / parts[depth]
            if not link.is_symlink():
                os.symlink(os.path.join("..", "..", "..", "devices", *parts[:depth + 1]), link)
        return parts[-1]


def two_sockets_no_switch(root: Path) -> list[str]:
    """8 GPUs, each on its own root port; 0-3 on NUMA node 0 (two host bridges), 4-7 on node 1."""
    sysfs = Sysfs(root)
    gpus = []
    for i in range(8):
        host = f"{(i // 2) * 0x20 + (0x40 if i >= 4 else 0):02x}"
        bus = f"{int(host, 16) + 1 + i % 2:02x}"
        gpus.append(sysfs.device(f"pci0000:{host}/0000:{host}:0{1 + 2 * (i % 2)}.1/0000:{bus}:00.0",
                                 cls="0x030000", numa=str(i // 4)))
    return gpus


def switch_path(root_bus: int, root_port: str, switch_bus: int, port: int) -> str:
    """The path of a GPU behind downstream port ``port`` of a switch whose upstream port is on
    bus ``switch_bus`` below ``root_port`` (e.g. "0000:00:01.0")."""
    usp = f"0000:{switch_bus:02x}:00.0"
    dsp = f"0000:{switch_bus + 1:02x}:{port:02x}.0"
    gpu = f"0000:{switch_bus + 2 + port:02x}:00.0"
    return f"pci0000:{root_bus:02x}/{root_port}/{usp}/{dsp}/{gpu}"


def two_switches_one_socket(root: Path) -> list[str]:
    """8 GPUs under two PCIe switches (4 each), both on NUMA node 0."""
    sysfs = Sysfs(root)
    gpus = []
    for s, (root_port, bus) in enumerate((("0000:00:01.0", 0x10), ("0000:00:03.0", 0x30))):
        for port in range(4):
            gpus.append(sysfs.device(switch_path(0, root_port, bus, port)))
    return gpus


def one_switch_sixteen(root: Path) -> list[str]:
    """16 GPUs under one PCIe switch (one upstream port, 16 downstream ports), NUMA node 0."""
    sysfs = Sysfs(root)
    return [sysfs.device(switch_path(0, "0000:00:01.0", 0x10, port)) for port in range(16)]


def geforce_one_socket(root: Path) -> list[str]:
    """4 GeForce cards on root ports of one host bridge, NUMA -1, no link files, GPU 3 without a
    class file."""
    sysfs = Sysfs(root)
    gpus = []
    for i in range(4):
        gpus.append(sysfs.device(f"pci0000:00/0000:00:{1 + i:02x}.0/0000:{1 + i:02x}:00.0",
                                 cls=None if i == 3 else GPU_CLASS, numa="-1", speed=None, width=None,
                                 max_speed=None, max_width=None))
    return gpus
