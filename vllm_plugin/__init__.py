"""vLLM plugin: serve vLLM's tensor-parallel all-reduces with ``pcie_allreduce``.

Installed with this package; off until ``PCIE_AR_VLLM_ENABLE=1``. vLLM finds it through the entry
point ``pcie_allreduce`` of group ``vllm.general_plugins`` and calls
:func:`vllm_plugin.plugin.register` in every process; ``CudaCommunicator`` then builds
:class:`vllm_plugin.adapter.VllmAllReduceAdapter` as its ``ca_comm`` on PCIe groups of 2-16 GPUs.
:func:`fuse_allreduce_rmsnorm` is the optional compile pass (see ``vllm_plugin/README.md``).

vLLM resolves a pass named in ``inductor_passes`` from this package's own namespace (its
``__dict__``, not ``getattr``) and keys its compile cache on the pass's ``uuid()`` only when the
object is an ``InductorPass``; so where vLLM is installed, importing the package imports
:mod:`vllm_plugin.fusion` (torch and vLLM's pass base class) to put the pass instance here. Without
vLLM the package imports without torch and holds the settings only.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["Settings", "SettingsError", "VllmAllReduceAdapter", "from_env", "fuse_allreduce_rmsnorm", "register",
           "unregister"]


if importlib.util.find_spec("vllm") is not None:
    from vllm_plugin.fusion import fuse_allreduce_rmsnorm


def __getattr__(name: str) -> Any:  # lazy, see the module docstring
    if name in ("register", "unregister"):
        from vllm_plugin import plugin

        return getattr(plugin, name)
    if name in ("Settings", "SettingsError", "from_env"):
        from vllm_plugin import settings

        return getattr(settings, name)
    if name == "VllmAllReduceAdapter":
        from vllm_plugin.adapter import VllmAllReduceAdapter

        return VllmAllReduceAdapter
    if name == "fuse_allreduce_rmsnorm":
        raise AttributeError("vllm_plugin.fuse_allreduce_rmsnorm is defined only where vLLM is installed")
    raise AttributeError(f"module 'vllm_plugin' has no attribute {name!r}")
