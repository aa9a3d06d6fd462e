"""Whether the plugin serves an SGLang process group: the shared decision
(:mod:`pcie_allreduce.plugin_eligibility`) with SGLang's names, its own NVLink answer, and which of
its groups are served."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist

from pcie_allreduce import plugin_eligibility
from pcie_allreduce.plugin_eligibility import Decision, FactsFn, NvlinkFn, local_facts
from sglang_plugin.settings import MODE, MULTINODE, Settings

logger = logging.getLogger(__name__)

SERVED_GROUPS: tuple[str, ...] = ("tp",)
ENGINE = plugin_eligibility.Engine("SGLang", mode_variable=MODE, multinode_variable=MULTINODE)


def group_name(group: Any) -> str:
    """SGLang's name for the group behind a ``cpu_group`` ("tp" for ``tp:cpu``), or "".

    ``GroupCoordinator`` creates its gloo group with ``group_desc=f"{group_name}:cpu"``.
    """
    desc = getattr(group, "group_desc", "") or ""
    return desc.rsplit(":", 1)[0] if desc.endswith(":cpu") else ""


def sglang_full_nvlink(physical_gpus: Sequence[int]) -> bool:
    """SGLang's own answer (``custom_all_reduce_utils.is_full_nvlink``): all pairs NVLinked.

    Several ranks on one GPU (test emulation) or unknown indices count as not NVLinked.
    """
    distinct = sorted(set(physical_gpus))
    if len(distinct) < 2 or min(distinct) < 0:
        return False
    from sglang.srt.distributed.device_communicators.custom_all_reduce_utils import is_full_nvlink

    try:
        return bool(is_full_nvlink(distinct, len(distinct)))
    except Exception as exc:  # no NVML: treat as PCIe, which is what the plugin is for
        logger.debug("NVLink query failed (%s); treating the GPUs as PCIe-connected", exc)
        return False


def decide(group: dist.ProcessGroup, device: torch.device, settings: Settings, *,
           facts_fn: FactsFn = local_facts, nvlink_fn: NvlinkFn = sglang_full_nvlink) -> Decision:
    """Collective over ``group``: serve it or not, identically on every rank, and why."""
    return plugin_eligibility.decide(group, device, settings, ENGINE, nvlink_fn=nvlink_fn, facts_fn=facts_fn)
