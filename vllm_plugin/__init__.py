"""vLLM plugin: serve vLLM's tensor-parallel all-reduces with ``pcie_allreduce``.

Installed with this package; off until ``PCIE_AR_VLLM_ENABLE=1``. vLLM finds it through the entry
point ``pcie_allreduce`` of group ``vllm.general_plugins`` and calls
:func:`vllm_plugin.plugin.register` in every process; ``CudaCommunicator`` then builds
:class:`vllm_plugin.adapter.VllmAllReduceAdapter` as its ``ca_comm`` on PCIe groups of 2-16 GPUs.
:func:`fuse_allreduce_rmsnorm` is the optional compile pass (see ``vllm_plugin/README.md``).

Importing this package is cheap (no torch, no vLLM): vLLM resolves the pass by this module's
attribute, so the pass is a plain function here that imports its body when it runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Settings", "SettingsError", "VllmAllReduceAdapter", "from_env", "fuse_allreduce_rmsnorm", "register",
           "unregister"]


def fuse_allreduce_rmsnorm(graph: Any) -> None:
    """vLLM post-grad pass (``"post_grad_custom_post_pass": "vllm_plugin.fuse_allreduce_rmsnorm"``):
    all-reduce followed by add + RMSNorm -> the fused op (:mod:`vllm_plugin.fusion`)."""
    from vllm_plugin.fusion import rewrite

    rewrite(graph)


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
    raise AttributeError(f"module 'vllm_plugin' has no attribute {name!r}")
