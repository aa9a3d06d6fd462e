"""SGLang plugin: serve SGLang's tensor-parallel all-reduces with ``pcie_allreduce``.

Installed with this package; off until ``PCIE_AR_SGLANG_ENABLE=1``. SGLang (0.5.23+) finds it
through the entry point ``pcie_allreduce`` of group ``sglang.srt.plugins`` and calls
:func:`sglang_plugin.plugin.register` in every process; for the ``tp`` group it then replaces
``ca_comm`` with :class:`sglang_plugin.adapter.PcieAllReduceAdapter` and routes the fused
all-reduce + residual + RMSNorm to ``Communicator.all_reduce_rmsnorm`` where SGLang's own
fusion is unavailable. See ``sglang_plugin/README.md``.

Importing this package is cheap (no torch, no sglang): the ``.pth`` import hook imports it in
every interpreter when enabled.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PcieAllReduceAdapter", "Settings", "SettingsError", "from_env", "register", "unregister"]


def __getattr__(name: str) -> Any:  # lazy, see the module docstring
    if name in ("register", "unregister"):
        from sglang_plugin import plugin

        return getattr(plugin, name)
    if name in ("Settings", "SettingsError", "from_env"):
        from sglang_plugin import settings

        return getattr(settings, name)
    if name == "PcieAllReduceAdapter":
        from sglang_plugin.adapter import PcieAllReduceAdapter

        return PcieAllReduceAdapter
    raise AttributeError(f"module 'sglang_plugin' has no attribute {name!r}")
