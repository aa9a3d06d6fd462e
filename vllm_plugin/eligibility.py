"""Whether the plugin serves vLLM's tensor-parallel group: one collective decision all ranks share.

Every rank gathers the same facts from every peer (host, whether the kernels can run, which physical
GPU) and computes the decision from that one list, so all ranks take the same branch: a rank that
served while its peers declined would hang the first collective. The NVLink question is answered
the way vLLM's own ``CustomAllreduce`` answers it (``current_platform.is_fully_connected`` on the
physical GPU ids), each rank asking, the answers then gathered.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from pcie_allreduce.fabric import nodes
from pcie_allreduce.constants import MAX_RANKS, MIN_RANKS
from vllm_plugin.settings import MODE, Settings

logger = logging.getLogger("vllm_plugin")


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome for one group: ``serve`` and a reason a person can act on."""

    serve: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class RankFacts:
    """What one rank reports about itself."""

    host: str  # pcie_allreduce.fabric.nodes.host_identity(): host name and boot id
    unavailable: str | None  # pcie_allreduce.unavailable_reason() on that rank
    physical_gpu: int  # physical index (vLLM's mapping of CUDA_VISIBLE_DEVICES), -1 if unknown
    sm: str  # e.g. "SM120"


FactsFn = Callable[[torch.device], RankFacts]
NvlinkFn = Callable[[Sequence[int]], bool]


def local_facts(device: torch.device) -> RankFacts:
    """This rank's facts (queries CUDA and vLLM's platform; no collective)."""
    import pcie_allreduce

    reason = pcie_allreduce.unavailable_reason()
    sm, physical = "SM?", -1
    if reason is None:
        major, minor = torch.cuda.get_device_capability(device)
        sm = f"SM{major}{minor}"
        try:
            from vllm.platforms import current_platform

            index = device.index if device.index is not None else torch.cuda.current_device()
            physical = int(current_platform.visible_device_id_to_physical_device_id(index))
        except Exception as exc:  # UUIDs, MIG names: no index to give
            logger.debug("no physical GPU index for %s (%s)", device, exc)
    return RankFacts(host=nodes.host_identity(), unavailable=reason, physical_gpu=physical, sm=sm)


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
    world = dist.get_world_size(group)
    if not MIN_RANKS <= world <= MAX_RANKS:  # no collective needed: W is the same everywhere
        return Decision(False, f"the group has {world} ranks; pcie_allreduce serves {MIN_RANKS} to {MAX_RANKS}")
    facts: list[Any] = [None] * world
    dist.all_gather_object(facts, dataclasses.asdict(facts_fn(device)), group=group)
    hosts = sorted({f["host"] for f in facts})
    if len(hosts) > 1:
        return Decision(False, f"the group spans {len(hosts)} nodes; vLLM's own path (NCCL) serves groups "
                               "across nodes")
    for rank, f in enumerate(facts):
        if f["unavailable"]:
            return Decision(False, f"rank {rank} cannot run the kernels: {f['unavailable']}")
    sms = "/".join(sorted({f["sm"] for f in facts}))
    if settings.mode == "always":
        return Decision(True, f"mode=always ({sms})")
    mine = bool(nvlink_fn([f["physical_gpu"] for f in facts]))
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, mine, group=group)  # a flaky query cannot split the ranks
    if all(answers):
        return Decision(False, f"the GPUs are fully NVLinked; mode=pcie leaves them to vLLM's own custom "
                               f"all-reduce (set {MODE}=always to serve them anyway)")
    return Decision(True, f"{world} GPUs without full NVLink ({sms}, mode=pcie)")
