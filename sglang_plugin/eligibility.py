"""Whether the plugin serves a process group: one collective decision that every rank shares.

Every rank gathers the same facts from every peer (host, whether the kernels can run, which
physical GPU) and computes the decision from that one gathered list, so all ranks take the same
branch. A rank that served while its peers declined would hang the first collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from pcie_allreduce.constants import MAX_RANKS, MIN_RANKS
from sglang_plugin.settings import Settings

logger = logging.getLogger(__name__)

SERVED_GROUPS: tuple[str, ...] = ("tp",)
MIN_WORLD, MAX_WORLD = MIN_RANKS, MAX_RANKS


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome for one group: ``serve`` and a reason a person can act on."""

    serve: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class RankFacts:
    """What one rank reports about itself."""

    host: str
    unavailable: str | None  # pcie_allreduce.unavailable_reason() on that rank
    physical_gpu: int  # index as NVML counts (CUDA_VISIBLE_DEVICES undone), -1 if unknown
    sm: str  # e.g. "SM120"


FactsFn = Callable[[torch.device], RankFacts]
NvlinkFn = Callable[[Sequence[int]], bool]


def group_name(group: Any) -> str:
    """SGLang's name for the group behind a ``cpu_group`` ("tp" for ``tp:cpu``), or "".

    ``GroupCoordinator`` creates its gloo group with ``group_desc=f"{group_name}:cpu"``.
    """
    desc = getattr(group, "group_desc", "") or ""
    return desc.rsplit(":", 1)[0] if desc.endswith(":cpu") else ""


def local_facts(device: torch.device) -> RankFacts:
    """This rank's facts (queries CUDA; no collective)."""
    import pcie_allreduce

    reason = pcie_allreduce.unavailable_reason()
    sm = "SM?"
    physical = -1
    if reason is None:
        major, minor = torch.cuda.get_device_capability(device)
        sm = f"SM{major}{minor}"
        physical = physical_gpu_index(device)
    return RankFacts(host=socket.gethostname(), unavailable=reason, physical_gpu=physical, sm=sm)


def physical_gpu_index(device: torch.device) -> int:
    """The NVML index of ``device``: the same mapping SGLang's own NVLink check uses."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if visible:
        try:
            return [int(v) for v in visible.split(",")][index]
        except (ValueError, IndexError):  # UUIDs or MIG names: no index to give
            return -1
    return index


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
    world = dist.get_world_size(group)
    if not MIN_WORLD <= world <= MAX_WORLD:  # no collective needed: W is the same everywhere
        return Decision(False, f"the group has {world} ranks; pcie_allreduce serves {MIN_WORLD} to {MAX_WORLD}")
    facts: list[Any] = [None] * world
    dist.all_gather_object(facts, dataclasses.asdict(facts_fn(device)), group=group)
    hosts = sorted({f["host"] for f in facts})
    if len(hosts) > 1:
        return Decision(False, f"the group spans hosts {hosts}; P2P all-reduce needs one host")
    for rank, f in enumerate(facts):
        if f["unavailable"]:
            return Decision(False, f"rank {rank} cannot run the kernels: {f['unavailable']}")
    sms = sorted({f["sm"] for f in facts})
    if settings.mode == "always":
        return Decision(True, f"mode=always ({'/'.join(sms)})")
    # Every rank asks NVML, then the answers are combined, so a flaky query cannot split ranks.
    mine = bool(nvlink_fn([f["physical_gpu"] for f in facts]))
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, mine, group=group)
    if all(answers):
        return Decision(False, "the GPUs are fully NVLinked; mode=pcie leaves them to SGLang's own custom "
                               "all-reduce (set PCIE_AR_SGLANG_MODE=always to serve them anyway)")
    return Decision(True, f"{world} GPUs without full NVLink ({'/'.join(sms)}, mode=pcie)")
