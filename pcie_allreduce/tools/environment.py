"""``pcie-allreduce env``: the build and runtime configuration, as one report.

What a bug report or a benchmark result needs to say about a machine: this package and how it was
built (compiled archs, CUDA runtime), the driver, torch and triton, every visible GPU with its PCI
bus id, NUMA node and CUDA peer access to the others, where each sits in the PCIe fabric (switch,
link) and the islands the library forms from that, MPS, the ``PCIE_AR_*`` settings in force, and
:func:`pcie_allreduce.unavailable_reason`. Works on a machine without GPU or without the
built extension (it says so); nothing here raises for a missing piece.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

SETTINGS_PREFIXES = ("PCIE_AR_", "CUDA_VISIBLE_DEVICES", "CUDA_MPS_", "TRITON_INTERPRET")


def distribution_version(distribution: str) -> str | None:
    """The installed version of a distribution (``"triton"``), None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def fabric_section(bus_ids: Sequence[str], root: str = "/",
                   environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Where each GPU sits in the PCIe fabric (sysfs under ``root``) and the islands of a group
    with one rank per GPU of ``bus_ids``, in that order: the detected ones, and those
    ``$PCIE_AR_ISLANDS`` sets instead (or why it is wrong). JSON-able; never raises."""
    from pcie_allreduce.fabric import sysfs, topology

    fabrics = [sysfs.read_gpu(b, root) for b in bus_ids]
    detected = topology.islands(fabrics)
    section: dict[str, Any] = {
        "gpus": [f.to_dict() for f in fabrics], "detected": [list(g) for g in detected],
        "basis": topology.islands_basis(fabrics), "override": None, "override_error": None,
        "islands": [list(g) for g in detected]}
    text = environ.get(topology.ISLANDS_ENV)
    if text is not None and text.strip() and bus_ids:
        section["override"] = text
        try:
            section["islands"] = [list(g) for g in topology.parse_islands(text, len(bus_ids))]
        except ValueError as exc:
            section["override_error"] = str(exc)
    return section


def fabric_lines(section: dict[str, Any]) -> list[str]:
    """:func:`fabric_section` as text: one line per GPU, then the islands."""
    from pcie_allreduce.fabric import sysfs, topology

    gpus = [sysfs.GpuFabric.from_dict(g) for g in section["gpus"]]
    if not gpus:
        return []
    lines = ["PCIe fabric (from sysfs)",
             f"  {'GPU':>3}  {'bus id':<13} {'NUMA':>4}  {'switch':<14} link"]
    for index, g in enumerate(gpus):
        numa = "?" if g.numa_node is None else str(g.numa_node)
        lines.append(f"  {index:>3}  {g.bus_id:<13} {numa:>4}  {g.switch_label():<14} {g.link_label()}")

    def text(groups: list[list[int]]) -> str:
        return topology.format_islands(tuple(tuple(g) for g in groups))

    detected = f"{text(section['detected'])} ({section['basis']})"
    lines.append("islands, for one rank per GPU in index order:")
    if section["override"] is None:
        lines.append(f"  {detected}")
    elif section["override_error"] is None:
        lines.append(f"  {text(section['islands'])} (set by ${topology.ISLANDS_ENV}; detected: {detected})")
    else:
        lines.append(f"  {detected}; ${topology.ISLANDS_ENV} is wrong, a Communicator would refuse it: "
                     f"{section['override_error']}")
    return lines


SMI_FIELDS = ("index", "uuid", "name", "pci.bus_id", "driver_version", "memory.total")


def nvidia_smi_gpus() -> list[dict[str, str]]:
    """Every GPU of the host as ``nvidia-smi`` lists it ({field of SMI_FIELDS: text}); [] when it
    does not run. A subprocess: the caller's process creates no CUDA context."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        proc = subprocess.run([binary, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    rows = []
    for line in proc.stdout.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == len(SMI_FIELDS):
            rows.append(dict(zip(SMI_FIELDS, cells)))
    return rows


def _gpus(ext: Any) -> list[dict[str, Any]]:
    """Every visible GPU: index, name, compute capability, memory, PCI bus id, NUMA node."""
    import torch

    count = ext.device_count()
    gpus = []
    for index in range(count):
        gpu: dict[str, Any] = {"index": index, "pci_bus_id": ext.pci_bus_id(index).lower()}
        if torch.version.cuda is not None:
            props = torch.cuda.get_device_properties(index)
            gpu.update(name=props.name, capability=f"{props.major}.{props.minor}",
                       memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
        gpus.append(gpu)
    return gpus


def _mps() -> dict[str, Any]:
    from pcie_allreduce.tools import mps

    external = mps._external_mps_env()
    return {"control_binary": shutil.which(mps.MPS_CONTROL_BINARY),
            "daemon_running": external is not None,
            "pipe_directory": (external or {}).get("CUDA_MPS_PIPE_DIRECTORY")}


def collect() -> dict[str, Any]:
    """The configuration as a JSON-able dict (keys: package, build, runtime, gpus, peer_access,
    fabric (:func:`fabric_section`, with GPUs only), mps, settings, unavailable_reason)."""
    import torch

    import pcie_allreduce
    from pcie_allreduce import _ext

    ext = _ext.load()
    report: dict[str, Any] = {
        "package": {"version": pcie_allreduce.__version__, "location": str(Path(pcie_allreduce.__file__).parent)},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda},
        "triton": distribution_version("triton"),
        "sglang": distribution_version("sglang"),
        "build": {"extension": ext.__file__ if ext is not None else None},
        "runtime": {"driver": next((row["driver_version"] for row in nvidia_smi_gpus()), None)},
        "gpus": [],
        "peer_access": [],
        "mps": _mps(),
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTINGS_PREFIXES)},
        "unavailable_reason": pcie_allreduce.unavailable_reason(),
    }
    if ext is None:
        return report
    report["build"].update(compiled_archs=[f"sm_{a // 10}" for a in ext.compiled_archs()],
                           cuda_runtime=_ext.cuda_version_text(ext.runtime_version()))
    report["runtime"]["driver_cuda"] = _ext.cuda_version_text(ext.driver_version())
    if ext.device_count() > 0 and not ext.runtime_status():
        gpus = report["gpus"] = _gpus(ext)
        report["peer_access"] = [[bool(ext.can_access_peer(a["index"], b["index"])) for b in gpus] for a in gpus]
        report["fabric"] = fabric_section([g["pci_bus_id"] for g in gpus])
        for gpu, place in zip(gpus, report["fabric"]["gpus"]):
            gpu["numa_node"] = place["numa_node"]
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as aligned text lines."""
    build, runtime = report["build"], report["runtime"]
    rows = [
        ("pcie_allreduce", f"{report['package']['version']} ({report['package']['location']})"),
        ("extension", build["extension"] or "not built"),
        ("compiled archs", " ".join(build.get("compiled_archs", [])) or "-"),
        ("CUDA runtime", build.get("cuda_runtime") or "-"),
        ("driver", " / ".join(filter(None, [runtime.get("driver"),
                                             runtime.get("driver_cuda") and f"CUDA {runtime['driver_cuda']}"]))
         or "none found"),
        ("torch", f"{report['torch']['version']} (CUDA {report['torch']['cuda'] or 'none: CPU build'})"),
        ("triton", report["triton"] or "not installed"),
        ("sglang", report["sglang"] or "not installed"),
        ("python", f"{report['python']} on {report['platform']}"),
        ("MPS", "daemon running at " + report["mps"]["pipe_directory"] if report["mps"]["daemon_running"]
         else "no daemon running" + ("" if report["mps"]["control_binary"] else " (nvidia-cuda-mps-control not found)")),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    gpus = report["gpus"]
    lines.append(f"{'GPUs':<{width}}  {len(gpus) or 'none visible'}")
    for gpu in gpus:
        numa = gpu["numa_node"]
        lines.append(f"  {gpu['index']}: {gpu.get('name', '?')} (sm_{gpu.get('capability', '?').replace('.', '')}, "
                     f"{gpu.get('memory_gib', '?')} GiB) at {gpu['pci_bus_id']}, NUMA node "
                     f"{'?' if numa is None or numa < 0 else numa}")
    if len(gpus) > 1:
        lines.append("peer access (row: from GPU, column: to GPU; Y = cudaDeviceCanAccessPeer)")
        lines.append("     " + " ".join(f"{g['index']:>2}" for g in gpus))
        for i, row in enumerate(report["peer_access"]):
            cells = (" -" if i == j else (" Y" if ok else " N") for j, ok in enumerate(row))
            lines.append(f"  {gpus[i]['index']:>2} " + " ".join(cells))
    if report.get("fabric"):
        lines += fabric_lines(report["fabric"])
    if report["settings"]:
        lines.append("settings: " + " ".join(f"{k}={v}" for k, v in report["settings"].items()))
    reason = report["unavailable_reason"]
    lines.append(f"{'status':<{width}}  " + ("ready: the kernels can run here" if reason is None
                                          else f"cannot run here: {reason}"))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pcie-allreduce env``."""
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the report; exit 0 whether or not the kernels can run here (the report says)."""
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
