"""Loads the compiled extension ``pcie_allreduce._C``, or records why it cannot be used.

Importing the package must always work (CPU-only machines, docs builds), so nothing here raises
at import time; callers ask :func:`load` or :func:`unavailable_reason`.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType


# Oldest Linux driver branch that supports each CUDA runtime this package can be built with
# (NVIDIA's CUDA Toolkit release notes, "CUDA Toolkit and Minimum Required Driver Version").
_MIN_DRIVER_FOR_RUNTIME: tuple[tuple[int, str], ...] = ((13000, "580"), (12090, "575"), (12080, "570"))

INSTALL_HINT = ("install on a Linux machine with an NVIDIA GPU and driver: `pip install -e .` from a checkout "
                "(builds the extension with nvcc from CUDA 12.8 or newer)")


@functools.lru_cache(maxsize=None)
def _import() -> tuple[ModuleType | None, str | None]:
    try:
        # By full name: this first runs while the package itself is still importing (constants.py
        # reads the exported values), where `from pcie_allreduce import _C` would report a missing
        # build as a circular import.
        _C = importlib.import_module("pcie_allreduce._C")
    except ImportError as exc:
        return None, (f"the CUDA extension pcie_allreduce._C is not built or does not load ({exc}); {INSTALL_HINT}")
    return _C, None


def load() -> ModuleType | None:
    """The extension module, or None when it is not built or does not load."""
    return _import()[0]


def require() -> ModuleType:
    """The extension module; raises UnavailableError with the reason when it cannot be used."""
    from pcie_allreduce.errors import UnavailableError

    module, reason = _import()
    if module is None:
        raise UnavailableError(reason)
    return module


def cuda_version_text(version: int) -> str | None:
    """CUDA's integer version (major * 1000 + minor * 10: 12080) as text ("12.8"); None for 0 (unknown)."""
    return f"{version // 1000}.{version % 1000 // 10}" if version > 0 else None


def _min_driver(runtime: int) -> str:
    return next((branch for floor, branch in _MIN_DRIVER_FOR_RUNTIME if runtime >= floor), "570")


NO_DRIVER = "no NVIDIA driver: libcuda.so.1 cannot be loaded in this process (no GPU here, or the driver is not installed)"


def _no_gpu_visible() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return f"no CUDA GPU is visible to this process{where}"


def _runtime_reason(module: ModuleType) -> str | None:
    """What the extension's CUDA runtime says is missing: driver, a new enough driver, a GPU."""
    runtime = module.runtime_version()
    needs = (f"this build uses the CUDA {cuda_version_text(runtime)} runtime, which needs NVIDIA driver "
             f"{_min_driver(runtime)} or newer")
    if module.driver_version() == 0:
        return f"{NO_DRIVER}; {needs}"
    status = module.runtime_status()
    if "InsufficientDriver" in status:
        return (f"the NVIDIA driver supports CUDA {cuda_version_text(module.driver_version())} only; {needs}: "
                "update the driver, or rebuild with an older nvcc (12.8 or newer)")
    if "NoDevice" in status or "no CUDA device" in status:
        return _no_gpu_visible()
    if status:
        return f"CUDA cannot start in this process: {status}"
    return None


def _driver_reason_without_extension() -> str | None:
    """The no-driver / no-GPU part of :func:`gpu_unavailable_reason` when the extension is not built."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return NO_DRIVER
    import torch

    if torch.version.cuda is not None and torch.cuda.device_count() == 0:
        return _no_gpu_visible()
    return None


def gpu_unavailable_reason() -> str | None:
    """Why no CUDA GPU can be used in this process (driver, visible devices, torch's build), or None.

    Needs no built extension (the harness's NCCL rows and the rank spawner use it too); with the
    extension it asks the extension's CUDA runtime, which also knows whether the driver is new enough.
    Creates no CUDA context.
    """
    module = load()
    reason = _runtime_reason(module) if module is not None else _driver_reason_without_extension()
    if reason is not None:
        return reason
    import torch

    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch "
                "(https://pytorch.org/get-started/locally/)")
    return None


def unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process, or None when they can.

    One sentence that names the missing piece and what to install; the same text everywhere
    (``pcie_allreduce.unavailable_reason()``, ``pcie-allreduce env``, the benchmark, test skips).
    """
    module, reason = _import()
    if module is None:
        return reason
    return gpu_unavailable_reason()
