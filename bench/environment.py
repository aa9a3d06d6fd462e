"""Facts recorded with every result set: machine, software, command line, and where ranks ran.

The parent asks ``nvidia-smi`` (a subprocess, so the parent never creates a CUDA context before
a private MPS daemon starts); each backend run's rank 0 adds what only a CUDA process knows.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import socket
import sys
from typing import TYPE_CHECKING, Any, Sequence

from pcie_allreduce._ext import cuda_version_text
from pcie_allreduce.tools.environment import distribution_version, nvidia_smi_gpus

if TYPE_CHECKING:
    from pcie_allreduce.tools.ranks import RankContext

def visible_gpus(rows: list[dict[str, str]], cuda_visible_devices: str | None) -> list[dict[str, str]]:
    """The nvidia-smi rows of the GPUs CUDA_VISIBLE_DEVICES leaves to this run, in its order.

    nvidia-smi lists every GPU of the host; a run pinned with CUDA_VISIBLE_DEVICES=0 on a two-GPU
    host used one. Entries are indices or (prefixes of) UUIDs; CUDA stops at the first entry that
    names no GPU, and so does this."""
    if cuda_visible_devices is None:
        return rows
    picked: list[dict[str, str]] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit():
            match = [r for r in rows if r.get("index") == entry]
        elif entry:
            match = [r for r in rows if r.get("uuid", "").startswith(entry)]
        else:
            match = []
        if len(match) != 1 or match[0] in picked:
            break
        picked.append(match[0])
    return picked


def _driver_from_proc() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([\d.]+)", fh.read())
    except OSError:
        return None
    return match.group(1) if match else None


def _extension_versions() -> dict[str, Any]:
    """CUDA runtime our extension was built with (static cudart) and the driver's CUDA version.

    Neither call creates a CUDA context, so the parent may ask before any MPS daemon starts.
    """
    from pcie_allreduce import _ext

    ext = _ext.load()
    if ext is None:
        return {}
    try:
        return {"extension_cuda_runtime": cuda_version_text(int(ext.runtime_version())),
                "cuda_driver_api": cuda_version_text(int(ext.driver_version())),
                "extension_archs": list(ext.compiled_archs())}
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return {}


def command_line(argv: Sequence[str]) -> str:
    """The command as typed: ``python -m bench ...`` rather than the path of bench/__main__.py on
    the machine that ran it (result files must not carry a machine's paths)."""
    first = os.path.normpath(argv[0]) if argv else ""
    if first.endswith(os.path.join("bench", "__main__.py")):
        return shlex.join(["python", "-m", "bench", *argv[1:]])
    return shlex.join([os.path.basename(first), *argv[1:]])


def host_environment(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Machine and software facts, without creating a CUDA context in this process."""
    import torch

    import pcie_allreduce

    smi = visible_gpus(nvidia_smi_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(sys.argv if argv is None else argv),
        "host": socket.gethostname(),
        "gpus": [row["name"] for row in smi],
        "gpu_details": smi,
        "driver": smi[0]["driver_version"] if smi else _driver_from_proc(),
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "triton": distribution_version("triton"),
        "pcie_allreduce": pcie_allreduce.__version__,
        "python": platform.python_version(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        **_extension_versions(),
    }


def _cuda_driver_api_version() -> str | None:
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return cuda_version_text(version.value)


def rank_environment(ctx: "RankContext") -> dict[str, Any]:
    """What a rank (with CUDA up) knows: its placement, the devices it sees, the driver's CUDA version."""
    import torch

    count = torch.cuda.device_count()
    return {
        "world": ctx.world_size,
        "mps": ctx.mps,
        "shared_gpu": ctx.shared_gpu,
        "gpu_count": count,
        "device_names": [torch.cuda.get_device_name(i) for i in range(count)],
        "capability": ".".join(map(str, torch.cuda.get_device_capability(ctx.device))),
        "cuda_driver_api": _cuda_driver_api_version(),
        "torch_cuda": torch.version.cuda,
    }
