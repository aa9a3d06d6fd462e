"""Loads the compiled extension ``pcie_allreduce._C``, or records why it cannot be used.

Importing the package must always work (CPU-only machines, docs builds), so nothing here raises
at import time; callers ask :func:`load` or :func:`unavailable_reason`.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.lru_cache(maxsize=None)
def _import() -> tuple[ModuleType | None, str | None]:
    try:
        # By full name: this first runs while the package itself is still importing (constants.py
        # reads the exported values), where `from pcie_allreduce import _C` would report a missing
        # build as a circular import.
        _C = importlib.import_module("pcie_allreduce._C")
    except ImportError as exc:
        return None, (f"the CUDA extension pcie_allreduce._C is not built or does not load ({exc}); "
                      "build it with `pip install .` on a machine with nvcc (CUDA 12.8+)")
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


def unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process, or None when they can."""
    module, reason = _import()
    if module is None:
        return reason
    status = module.runtime_status()
    if status:
        return f"no usable CUDA GPU: {status}"
    return None
