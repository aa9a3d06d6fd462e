"""``python -m bench topo``: which GPUs can write into which (CUDA peer access), their PCI bus ids,
NUMA nodes and place in the PCIe fabric (switch, link; the islands the library forms from them:
:func:`pcie_allreduce.tools.environment.fabric_section`), then measured between W ranks (:mod:`.topo_probe`): flag round-trip latency and
one-way write bandwidth per pair, one-to-one vs all-to-all write bandwidth. Printed as matrices
and optionally saved (JSON, the printed text, CSV and PNG: :mod:`.topo_files`).

The static probe takes the extension as a parameter and reads NUMA nodes under a sysfs root, and
the measurement formatting is pure, so the CPU tests run both against fakes. A measurement that
fails (per W) is reported in one line and does not stop the others.
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

from pcie_allreduce.errors import UnavailableError, one_line
from pcie_allreduce.fabric import sysfs
from pcie_allreduce.tools import environment

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
    fabric: dict[str, Any] | None = None  # environment.fabric_section of the GPUs, in index order

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": [dataclasses.asdict(g) for g in self.gpus],
                "peer_access": [list(row) for row in self.peer_access],
                "nvidia_smi_topo": self.nvidia_smi_topo, "fabric": self.fabric}


#: CUDA's "00000000:19:00.0" or "0000:19:00.0" -> sysfs's "0000:19:00.0".
sysfs_bus_id = sysfs.sysfs_bus_id


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


def probe(ext: PeerQueries, names: list[str], sysfs_root: str = SYSFS_PCI, smi_topo: str = "",
          fabric_root: str = "/") -> Topology:
    """Peer access between every pair of the ``len(names)`` visible GPUs, and their place in the
    PCIe fabric as sysfs under ``fabric_root`` describes it."""
    count = len(names)
    gpus = []
    for i, name in enumerate(names):
        bus = sysfs_bus_id(ext.pci_bus_id(i))
        gpus.append(Gpu(i, name, bus, numa_node(bus, sysfs_root)))
    access = tuple(tuple(i == j or bool(ext.can_access_peer(i, j)) for j in range(count)) for i in range(count))
    return Topology(tuple(gpus), access, smi_topo, environment.fabric_section([g.pci_bus_id for g in gpus], fabric_root))


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
    if topo.fabric:
        lines += [""] + [line if line.startswith(" ") else "# " + line for line in environment.fabric_lines(topo.fabric)]
    if topo.nvidia_smi_topo:
        lines += ["", "# nvidia-smi topo -m", topo.nvidia_smi_topo]
    return "\n".join(lines) + "\n"


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _matrix(title: str, rows: list[list[float | None]], digits: int) -> list[str]:
    n = len(rows)
    lines = [title, ("        " + "".join(f"{'r' + str(j):>9}" for j in range(n))).rstrip()]
    for i, row in enumerate(rows):
        cells = ["X" if i == j else _cell(v, digits) for j, v in enumerate(row)]
        lines.append((f"r{i:<7}" + "".join(f"{c:>9}" for c in cells)).rstrip())
    return lines


def format_probe(world: int, placement: str, data: dict[str, Any]) -> str:
    """One world size's measured matrices and the one-to-one vs all-to-all figures."""
    mib = data.get("nbytes", 0) / (1 << 20)
    lines = [f"# measured between W={world} ranks ({placement}); rN = rank N"]
    lines += _matrix(f"# flag round-trip latency (us), {data.get('pingpong_iters', '?')} round trips per pair",
                     data["rtt_us"], 2)
    lines += _matrix(f"# one-way write bandwidth (GB/s), row rank writes {mib:g} MiB into column rank, alone",
                     data["write_gbps"], 1)
    if data.get("read_gbps"):
        lines += _matrix(f"# one-way read bandwidth (GB/s), row rank reads {mib:g} MiB from column rank, alone "
                         "(uncached loads, as the pull forms read)", data["read_gbps"], 1)
    one, many = data["one_to_one"], data["all_to_all"]
    lines.append(f"# bandwidth per rank, all ranks at once, {mib:g} MiB each (GB/s):")
    lines.append(f"  one-to-one writes (rank r -> r+1):     mean {_cell(one['mean'], 1)}  min {_cell(one['min'], 1)}")
    lines.append(f"  all-to-all writes (1/(W-1) to each):   mean {_cell(many['mean'], 1)}  min {_cell(many['min'], 1)}")
    many_read = data.get("all_to_all_read")
    if many_read:
        lines.append(f"  all-to-all reads (1/(W-1) from each):  mean {_cell(many_read['mean'], 1)}  "
                     f"min {_cell(many_read['min'], 1)}")
    for key, what in (("cross_write", "writes"), ("cross_read", "reads")):
        cross = data.get(key)
        if cross:
            lines.append(f"  cross-island {what} (partner in the next island): mean {_cell(cross['mean'], 1)}  "
                         f"min {_cell(cross['min'], 1)}")
    ratio = data.get("all_to_all_over_one_to_one")
    if ratio is not None:
        lines.append(f"  all-to-all / one-to-one writes: {ratio:.2f} (well below 1: the fabric collapses under "
                     "many-to-many writes, which staging avoids)")
    if many_read and many_read.get("mean") and many.get("mean"):
        lines.append(f"  all-to-all reads / writes: {many_read['mean'] / many['mean']:.2f} (above 1: the pull forms "
                     "may pay here; `pcie-allreduce tune` times them)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m bench topo``."""
    from pcie_allreduce import sizes
    from pcie_allreduce.tools.cli import positive_float, positive_int
    from pcie_allreduce.tools.tune.cli import add_world_argument

    parser.add_argument("--out", metavar="DIR", help="also write topo.json, topo.txt, topo.csv and topo.png into DIR")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the matrices")
    probe = parser.add_argument_group("measurements between ranks")
    probe.add_argument("--no-probe", action="store_true", help="only the static facts; measure nothing")
    add_world_argument(probe)
    probe.add_argument("--bytes", type=sizes.size_arg, default=sizes.parse_size("16M"), metavar="SIZE",
                       help="bytes each rank writes per bandwidth measurement (default 16M)")
    probe.add_argument("--iters", type=positive_int, default=2000, metavar="N",
                       help="round trips per pair for the latency (default 2000)")
    probe.add_argument("--reps", type=positive_int, default=10, metavar="N",
                       help="timed writes per bandwidth measurement (default 10)")
    probe.add_argument("--blocks", type=positive_int, default=32, metavar="N",
                       help="CTAs per writing rank (default 32)")
    probe.add_argument("--timeout", type=positive_float, default=60.0, metavar="S",
                       help="a rank stuck this long in one step is killed and that W reported failed (default 60)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of the ``topo`` subcommand."""
    import torch

    from pcie_allreduce import _ext
    from pcie_allreduce.tools import ranks

    reason = ranks.skip_reason_no_gpu()
    if reason is not None:
        raise UnavailableError(reason)
    ext = _ext.load()
    if ext is None:
        raise UnavailableError(_ext.unavailable_reason() or "the extension pcie_allreduce._C does not load")
    count = ranks.gpu_count()
    names = [torch.cuda.get_device_properties(i).name for i in range(count)]
    topo = probe(ext, names, smi_topo=_nvidia_smi_topo())
    data = topo.to_dict()
    if not args.json:
        sys.stdout.write(format_topology(topo))
        sys.stdout.flush()
    if not args.no_probe:
        fabric_islands = (data.get("fabric") or {}).get("islands")
        data["measured"], data["measure_errors"] = _measure(args, count, not args.json, fabric_islands)
    text = json.dumps(data, indent=2) + "\n"
    if args.json:
        sys.stdout.write(text)
    if args.out:
        _write_files(args.out, data, text, format_document(topo, data))
    return 1 if data.get("measure_errors") else 0


def format_document(topo: Topology, data: dict[str, Any]) -> str:
    """Everything ``topo`` prints: the static facts, then each W's matrices."""
    parts = [format_topology(topo)]
    for world, measured in sorted((data.get("measured") or {}).items(), key=lambda item: int(item[0])):
        parts.append("\n" + format_probe(int(world), measured.get("placement", ""), measured) + "\n")
    for world, error in sorted((data.get("measure_errors") or {}).items()):
        parts.append(f"\n# W={world}: measurement failed: {error}\n")
    return "".join(parts)


def _write_files(out: str, data: dict[str, Any], json_text: str, table: str) -> None:
    """topo.json, topo.txt, topo.csv and (with matplotlib) topo.png into ``out``."""
    from bench import plot, topo_files

    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, os.path.splitext(JSON_NAME)[0])
    for suffix, content in ((".json", json_text), (".txt", table), (".csv", topo_files.csv_text(data))):
        with open(stem + suffix, "w", encoding="utf-8") as fh:
            fh.write(content)
        print(f"wrote {stem + suffix}", file=sys.stderr)
    problem = plot.write_topo_png(data, stem + ".png")
    print(f"no {stem}.png: {problem}" if problem else f"wrote {stem}.png", file=sys.stderr)


def _probe_islands(world: int, gpu_count: int, fabric_islands: list[list[int]] | None) -> tuple[tuple[int, ...], ...]:
    """The islands of ``world`` ranks for the cross-island rates: ``$PCIE_AR_ISLANDS`` where set
    (an unusable setting measures none), else, with one rank per GPU, the detected ones."""
    from pcie_allreduce.fabric import topology

    try:
        override = topology.islands_override(world)
    except ValueError:
        return ()
    if override is not None:
        return tuple(tuple(g) for g in override)
    if world == gpu_count and fabric_islands:
        return tuple(tuple(g) for g in fabric_islands)
    return ()


def _measure(args: argparse.Namespace, gpu_count: int, show: bool,
             fabric_islands: list[list[int]] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Run the probe per world size; (world -> matrices, world -> one-line error)."""
    from bench import topo_probe
    from pcie_allreduce.tools.ranks import placement_label
    from bench.options import default_worlds, unique

    measured: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for world in unique(args.world) if args.world else default_worlds(gpu_count):
        print(f"[topo W={world}] measuring ({placement_label(world, gpu_count, None)}) ...", file=sys.stderr,
              flush=True)
        job = topo_probe.ProbeJob(nbytes=max(16 * world, args.bytes // 16 * 16), pingpong_iters=max(2, args.iters),
                                  reps=args.reps, programs=args.blocks, step_timeout_s=args.timeout,
                                  timeout_s=min(10.0, args.timeout / 3),
                                  islands=_probe_islands(world, gpu_count, fabric_islands))
        try:
            data = topo_probe.run_probe(world, job)
        except Exception as exc:  # noqa: BLE001 - reported per W; the other worlds go on
            errors[str(world)] = one_line(exc)
            if show:
                print(f"\n# W={world}: measurement failed: {errors[str(world)]}", flush=True)
            continue
        placement = placement_label(world, gpu_count, data.get("mps"))
        data["placement"] = placement
        measured[str(world)] = data
        if show:
            print("\n" + format_probe(world, placement, data), flush=True)
    return measured, errors
