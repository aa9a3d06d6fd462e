"""Where a GPU sits in the PCIe fabric, read from Linux sysfs (pure Python, no CUDA).

``/sys/bus/pci/devices/<bdf>`` links into ``/sys/devices/pci<domain>:<bus>/<root port>/.../<bdf>``:
the path names the host bridge, then every bridge from the root port down to the GPU. A PCIe
switch shows up in that chain as an upstream port (a bridge whose parent is a bridge) with a
downstream port below it; it is named by its upstream port's bdf. Next to that, the GPU's
``numa_node`` and its link speed and width.

Every reader takes the root of the file system (default ``/``) so the tests can point it at a
recorded tree. Nothing here raises: a missing, unreadable or odd file (containers, non-Linux)
leaves that fact unknown (None).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

BRIDGE_CLASS_PREFIX = "0x0604"  # PCI-to-PCI bridge (root ports and switch ports)
# What lies between the host bridge and the GPU when the GPU hangs off a root port directly.
ROOT_PORT = "root port"
HOST_BRIDGE = "host bridge"
UNKNOWN = "unknown"

_HOST_BRIDGE_RE = re.compile(r"^pci([0-9a-f]{4,}):([0-9a-f]{2})$")
_BDF_RE = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclasses.dataclass(frozen=True)
class GpuFabric:
    """One GPU's place in the PCIe fabric; None (or ``known=False``) where sysfs does not say.

    ``bridges`` run from the root port down to the GPU's parent; ``switches`` are the upstream
    ports of the PCIe switches among them, the top one first (``()``: none, the GPU sits on a root
    port or on the host bridge; None: unknown).
    """

    bus_id: str
    known: bool = False                     # the sysfs entry resolved to a device path
    numa_node: int | None = None            # None: unknown, or -1 in sysfs (no affinity reported)
    domain: str | None = None               # PCI domain (segment), e.g. "0000"
    host_bridge: str | None = None          # e.g. "pci0000:40"
    root_port: str | None = None            # bdf; None if the GPU sits on the host bridge, or unknown
    bridges: tuple[str, ...] | None = None
    switches: tuple[str, ...] | None = None
    link_speed: str | None = None           # current, e.g. "32.0 GT/s PCIe" (GPUs slow idle links down)
    link_width: int | None = None
    max_link_speed: str | None = None
    max_link_width: int | None = None

    @property
    def switch(self) -> str | None:
        """The top PCIe switch above this GPU (its upstream port's bdf), None if none or unknown."""
        return self.switches[0] if self.switches else None

    def switch_label(self) -> str:
        """The switch's bdf, ``"root port"``, ``"host bridge"`` or ``"unknown"``, for display."""
        if self.switches is None:
            return UNKNOWN
        if self.switches:
            return " > ".join(self.switches)
        return ROOT_PORT if self.root_port else HOST_BRIDGE

    def link_label(self) -> str:
        """``"<speed> x<width> (max <speed> x<width>)"``, with "?" for what is unknown."""
        now = f"{_speed(self.link_speed)} x{self.link_width or '?'}"
        if self.max_link_speed is None and self.max_link_width is None:
            return now if self.link_speed or self.link_width else UNKNOWN
        return f"{now} (max {_speed(self.max_link_speed)} x{self.max_link_width or '?'})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the fields (tuples as lists) plus ``switch``."""
        data = dataclasses.asdict(self)
        for key in ("bridges", "switches"):
            if data[key] is not None:
                data[key] = list(data[key])
        data["switch"] = self.switch
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GpuFabric":
        """The inverse of :meth:`to_dict` (keys it does not know are ignored)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
        return cls(**values)


def _speed(text: str | None) -> str:
    return "?" if not text else text.removesuffix(" PCIe")


def sysfs_bus_id(bus_id: str) -> str:
    """CUDA's ``"00000000:41:00.0"`` / ``"0000:41:00.0"`` -> sysfs's ``"0000:41:00.0"`` (lower case,
    the domain with at least four digits, as Linux names it: ``"10000:e1:00.0"`` stays)."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or not rest.count(":"):
        return text
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return text


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except (OSError, ValueError):
        return None
    return text or None


def _read_int(path: str) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text, 0)
    except ValueError:
        return None


def _link_speed(path: str) -> str | None:
    text = _read(path)
    return None if text is None or text.lower().startswith("unknown") else text


def _link_width(path: str) -> int | None:
    width = _read_int(path)
    return width if width is not None and width > 0 else None


def _chain(root: str, bdf: str) -> tuple[str, str, str, list[str]] | None:
    """(domain, host bridge, its directory, [bdfs from the root port down to the GPU itself]) or None.

    Components between ``sys/devices`` and the host bridge (``platform/...`` on some arm64
    machines) are allowed."""
    link = os.path.join(root, "sys", "bus", "pci", "devices", bdf)
    devices = os.path.realpath(os.path.join(root, "sys", "devices"))
    try:
        real = os.path.realpath(link)
    except (OSError, ValueError):
        return None
    if not real.startswith(devices + os.sep) or not os.path.isdir(real):
        return None
    parts = os.path.relpath(real, devices).split(os.sep)
    host = next((i for i in range(len(parts) - 1, -1, -1) if _HOST_BRIDGE_RE.match(parts[i])), None)
    if host is None:
        return None
    below = parts[host + 1:]
    if not below or below[-1] != bdf or not all(_BDF_RE.match(p) for p in below):
        return None
    match = _HOST_BRIDGE_RE.match(parts[host])
    assert match is not None
    return f"{int(match.group(1), 16):04x}", parts[host], os.path.join(devices, *parts[:host + 1]), below


def _switches(host_dir: str, bridges: list[str]) -> tuple[str, ...] | None:
    """The upstream ports among ``bridges`` (root port first): every bridge at an odd depth that has
    a downstream port below it. None when a device of the chain reads as something else than a
    bridge (the path is not the plain PCIe tree this reads)."""
    for depth in range(len(bridges)):
        cls = _read(os.path.join(host_dir, *bridges[:depth + 1], "class"))
        if cls is not None and not cls.lower().startswith(BRIDGE_CLASS_PREFIX):
            return None
    return tuple(bridges[i] for i in range(1, len(bridges) - 1, 2))


def read_gpu(bus_id: str, root: str = "/") -> GpuFabric:
    """What sysfs under ``root`` says about the PCI device ``bus_id``; never raises."""
    bdf = sysfs_bus_id(bus_id)
    try:
        return _read_gpu(bdf, root)
    except Exception:  # noqa: BLE001 - a description of the fabric must never break its user
        return GpuFabric(bus_id=bdf)


def _read_gpu(bdf: str, root: str) -> GpuFabric:
    entry = os.path.join(root, "sys", "bus", "pci", "devices", bdf)
    numa = _read_int(os.path.join(entry, "numa_node"))
    links = dict(link_speed=_link_speed(os.path.join(entry, "current_link_speed")),
                 link_width=_link_width(os.path.join(entry, "current_link_width")),
                 max_link_speed=_link_speed(os.path.join(entry, "max_link_speed")),
                 max_link_width=_link_width(os.path.join(entry, "max_link_width")))
    numa_node = numa if numa is not None and numa >= 0 else None
    chain = _chain(root, bdf)
    if chain is None:
        return GpuFabric(bus_id=bdf, known=os.path.isdir(entry), numa_node=numa_node, **links)
    domain, host_bridge, host_dir, path = chain
    bridges = path[:-1]
    return GpuFabric(bus_id=bdf, known=True, numa_node=numa_node, domain=domain, host_bridge=host_bridge,
                     root_port=bridges[0] if bridges else None, bridges=tuple(bridges),
                     switches=_switches(host_dir, bridges), **links)

