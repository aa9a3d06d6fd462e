"""Whether the plugin serves vLLM's tensor-parallel group: the shared decision
(:mod:`pcie_allreduce.plugin_eligibility`) with vLLM's names and its own NVLink answer (the one
vLLM's ``CustomAllreduce`` gives: ``current_platform.is_fully_connected`` on the physical GPU
ids). Groups across nodes stay vLLM's (NCCL)."""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist

from pcie_allreduce import plugin_eligibility
from pcie_allreduce.plugin_eligibility import Decision, FactsFn, NvlinkFn, local_facts
from vllm_plugin.settings import MODE, Settings

logger = logging.getLogger("vllm_plugin")

ENGINE = plugin_eligibility.Engine("vLLM", mode_variable=MODE)


def vllm_full_nvlink(physical_gpus: Sequence[int]) -> bool:
    """vLLM's own answer: every pair of these GPUs is NVLinked. Ranks sharing a GPU (test
    emulation), unknown indices or a failed query count as not NVLinked (PCIe)."""
    distinct = sorted(set(physical_gpus))
    if len(distinct) < 2 or min(distinct) < 0:
        return False
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_fully_connected(distinct))
    except Exception as exc:  # no NVML: treat as PCIe, which is what the plugin is for
        logger.debug("NVLink query failed (%s); treating the GPUs as PCIe-connected", exc)
        return False


def decide(group: dist.ProcessGroup, device: torch.device, settings: Settings, *,
           facts_fn: FactsFn = local_facts, nvlink_fn: NvlinkFn = vllm_full_nvlink) -> Decision:
    """Collective over ``group`` (vLLM's CPU group of the tp group): serve it or not, identically on
    every rank, and why."""
    return plugin_eligibility.decide(group, device, settings, ENGINE, nvlink_fn=nvlink_fn, facts_fn=facts_fn)
