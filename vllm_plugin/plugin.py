"""Registration with vLLM: the ``vllm.general_plugins`` entry point, and what it puts in place.

vLLM runs :func:`register` through ``vllm.plugins.load_general_plugins()`` in every process it
starts (the front end, the engine core, each worker), for every entry point of the group (or only
those named in ``VLLM_PLUGINS``). When ``PCIE_AR_VLLM_ENABLE=1`` it replaces the class vLLM's
``CudaCommunicator.__init__`` imports (lazily, at each construction) as ``CustomAllreduce`` from
vllm/distributed/device_communicators/custom_all_reduce.py with a subclass whose constructor
decides collectively and returns :class:`~vllm_plugin.adapter.VllmAllReduceAdapter` (served) or
vLLM's own ``CustomAllreduce`` (declined); static helpers other vLLM code calls on the class stay
inherited. It also registers the fused op (:mod:`vllm_plugin.ops`). A malformed setting is logged
as an error naming the variable, and vLLM runs without the plugin (vLLM would otherwise stop).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import torch

from pcie_allreduce import plugin_adapter, plugin_logline
from pcie_allreduce.plugin_eligibility import Decision
from vllm_plugin import eligibility, lifecycle, settings as settings_mod
from vllm_plugin.adapter import VllmAllReduceAdapter
from vllm_plugin.settings import FUSED, MAX_BYTES, Settings, SettingsError
from vllm_plugin.surface import SUPPORTED_VLLM_VERSIONS

logger = logging.getLogger("vllm_plugin")

PLUGIN_NAME = "pcie_allreduce"
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT = "vllm_plugin.plugin:register"
TAG = "pcie_allreduce[vllm]"
CA_MODULE = "vllm.distributed.device_communicators.custom_all_reduce"


@dataclasses.dataclass(kw_only=True)
class PluginState(plugin_adapter.PluginState):
    """What :func:`install` set up in this process: the shared state, and vLLM's ``CustomAllreduce``
    class (``original``), which :func:`unregister` puts back."""

    original: Any


STATE: PluginState | None = None
"""The installed state (None: not installed). Read by the class vLLM constructs as ``ca_comm``."""


def register() -> None:
    """Entry point of group ``vllm.general_plugins``: put the adapter in place when enabled, and
    log one line saying what the plugin serves (or why it does nothing)."""
    try:
        settings = settings_mod.from_env(os.environ)
    except SettingsError as exc:
        logger.error("%s: not loaded, vLLM's own all-reduce serves: %s", TAG, exc)
        return
    if not settings.enabled:
        logger.debug("%s: installed but off (%s=1 turns it on)", TAG, settings_mod.ENABLE)
        return
    install(settings)


def install(settings: Settings, *, communicator_factory: Callable[..., Any] | None = None,
            facts_fn: Callable[..., Any] | None = None) -> PluginState:
    """Replace vLLM's ``CustomAllreduce`` once per process; returns the (possibly existing) state."""
    global STATE
    if STATE is not None:
        return STATE
    import importlib

    car = importlib.import_module(CA_MODULE)
    original = car.CustomAllreduce
    STATE = PluginState(settings=settings, original=original, communicator_factory=communicator_factory,
                        facts_fn=facts_fn)
    car.CustomAllreduce = _dispatching_class(original)
    if settings.fused:
        from vllm_plugin import ops

        ops.register()
    logger.info("%s: on (%s): vLLM's tp custom all-reduce (CudaCommunicator.ca_comm) -> pcie_allreduce on groups "
                "of 2-16 GPUs of one node%s, P2P or host memory; fused all-reduce+residual+RMSNorm %s; every rank "
                "logs its group's decision and why%s", TAG, settings_mod.describe(settings),
                " without full NVLink" if settings.mode == "pcie" else "",
                "op pcie_allreduce_vllm::all_reduce_rmsnorm (compile pass: vllm_plugin.fuse_allreduce_rmsnorm)"
                if settings.fused else "off", _version_note())
    return STATE


def unregister() -> bool:
    """Put vLLM's ``CustomAllreduce`` back, and the methods :mod:`vllm_plugin.lifecycle` wrapped;
    False if nothing was installed. Adapters already serving stay (closing them is collective:
    ``adapter.close()`` on every rank); communicators built afterwards get vLLM's own."""
    global STATE
    state, STATE = STATE, None
    if state is None:
        return False
    import importlib

    importlib.import_module(CA_MODULE).CustomAllreduce = state.original
    lifecycle.detach()
    return True


def build_ca_comm(original: Any, group: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
    """What ``CustomAllreduce(group=cpu_group, device=..., ...)`` returns in ``CudaCommunicator``:
    our adapter where the collective decision serves the group, else vLLM's own class."""
    state = STATE
    if state is None:
        return original(group, device, *args, **kwargs)
    device = torch.device(device) if not isinstance(device, torch.device) else device
    decision = eligibility.decide(group, device, state.settings, facts_fn=state.facts_fn or eligibility.local_facts)
    where = plugin_logline.where("vllm", group, device)
    if not decision.serve:
        logger.info("%s", plugin_logline.declined(where, "vLLM", decision.reason))
        return original(group, device, *args, **kwargs)
    try:
        adapter = VllmAllReduceAdapter(group, device, state.settings,
                                       communicator_factory=state.communicator_factory)
    except Exception as exc:
        # Raised on every rank alike (creation is collective); vLLM's own class then serves.
        logger.error("%s: could not create the communicator (%s: %s); vLLM's own backends serve this group", where,
                     type(exc).__name__, exc)
        return original(group, device, *args, **kwargs)
    state.adapters.add(adapter)
    lifecycle.attach(state.adapters)  # the per-step failure check and the teardown's close
    logger.info("%s", serving_line(where, adapter, decision))
    return adapter


def serving_line(start: str, adapter: VllmAllReduceAdapter, decision: Decision) -> str:
    """The INFO line of a rank whose group the plugin serves (:func:`pcie_allreduce.plugin_logline.serving`)."""
    fused = ("fused all-reduce+residual+RMSNorm: op pcie_allreduce_vllm::all_reduce_rmsnorm (compile pass "
             "vllm_plugin.fuse_allreduce_rmsnorm)" if adapter.fused_enabled else f"fused path off ({FUSED}=0)")
    return plugin_logline.serving(start, adapter, decision.reason, engine_name="vLLM", max_bytes_variable=MAX_BYTES,
                                  fused=fused, others="; all-gather and reduce-scatter -> vLLM's (NCCL)")


def _dispatching_class(original: type) -> type:
    """A subclass of vLLM's ``CustomAllreduce`` whose construction returns :func:`build_ca_comm`'s
    choice (not an instance of the subclass, so no second ``__init__`` runs)."""

    class PcieAllReduceDispatch(original):  # type: ignore[misc, valid-type]
        """vLLM's ``CustomAllreduce`` as seen by ``CudaCommunicator``: built through
        :func:`vllm_plugin.plugin.build_ca_comm`."""

        def __new__(cls, group: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
            return build_ca_comm(original, group, device, *args, **kwargs)

    PcieAllReduceDispatch.__qualname__ = PcieAllReduceDispatch.__name__ = "CustomAllreduce"
    return PcieAllReduceDispatch


def _version_note() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("vllm")
    except PackageNotFoundError:
        return ""
    if found in SUPPORTED_VLLM_VERSIONS:
        return ""
    return f" (vLLM {found} is not a tested version: {', '.join(SUPPORTED_VLLM_VERSIONS)})"
