"""Whether the plugin serves a process group: one collective decision that every rank shares.

Every rank gathers the same facts from every peer (host, whether the kernels can run, which
physical GPU) and computes the decision from that one gathered list, so all ranks take the same
branch. A rank that served while its peers declined would hang the first collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from pcie_allreduce.fabric import nodes
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
    #: The group's nodes where it spans several (served by the hierarchical all-reduce); None: one node.
    layout: nodes.NodeLayout | None = None


@dataclasses.dataclass(frozen=True)
class RankFacts:
    """What one rank reports about itself."""

    host: str  # pcie_allreduce.fabric.nodes.host_identity(): host name and boot id
    unavailable: str | None  # pcie_allreduce.unavailable_reason() on that rank
    physical_gpu: int  # index as NVML counts (CUDA_VISIBLE_DEVICES undone), -1 if unknown
    sm: str  # e.g. "SM120"
    emulated_nodes: int | None = None  # $PCIE_AR_NODES on that rank (tests emulate nodes with it)


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
    try:
        emulated = nodes.emulated_nodes()
    except ValueError:
        emulated = -1  # malformed: decide() declines, naming the variable
    return RankFacts(host=nodes.host_identity(), unavailable=reason, physical_gpu=physical, sm=sm,
                     emulated_nodes=emulated)


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
    if any(f.get("emulated_nodes") == -1 for f in facts):
        return Decision(False, f"${nodes.NODES_ENV} is not a positive number of nodes on some rank")
    try:
        layout = nodes.layout_of([f["host"] for f in facts], [f.get("emulated_nodes") for f in facts])
    except ValueError as exc:
        return Decision(False, str(exc))
    spread = multinode_problem(layout, settings) if layout.count > 1 else None
    if spread is not None:
        return Decision(False, spread)
    hierarchy = layout if layout.count > 1 else None
    for rank, f in enumerate(facts):
        if f["unavailable"]:
            return Decision(False, f"rank {rank} cannot run the kernels: {f['unavailable']}")
    sms = sorted({f["sm"] for f in facts})
    how = "" if hierarchy is None else f"; {hierarchical_summary(hierarchy)}"
    if settings.mode == "always":
        return Decision(True, f"mode=always ({'/'.join(sms)}){how}", hierarchy)
    # Every rank asks NVML about its own node's GPUs, then the answers are combined, so a flaky
    # query cannot split ranks.
    node = layout.nodes[layout.node_of(dist.get_rank(group))]
    mine = bool(nvlink_fn([facts[r]["physical_gpu"] for r in node]))
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, mine, group=group)
    if all(answers):
        return Decision(False, "the GPUs are fully NVLinked; mode=pcie leaves them to SGLang's own custom "
                               "all-reduce (set PCIE_AR_SGLANG_MODE=always to serve them anyway)")
    return Decision(True, f"{world} GPUs without full NVLink ({'/'.join(sms)}, mode=pcie){how}", hierarchy)


def multinode_problem(layout: nodes.NodeLayout, settings: Settings) -> str | None:
    """Why a group that spans ``layout``'s nodes is left to SGLang, or None (served hierarchically)."""
    where = f"the group spans {layout.count} nodes ({layout.describe()})"
    if not settings.multinode:
        return f"{where}; PCIE_AR_SGLANG_MULTINODE=0 leaves such groups to SGLang"
    problem = layout.hierarchy_problem()
    if problem is not None:
        return f"{where}: {problem}"
    if len(layout.nodes[0]) == 1:
        return f"{where}, one GPU each: every step would be between nodes, where NCCL serves it"
    return None


def hierarchical_summary(layout: nodes.NodeLayout) -> str:
    """How a group across nodes is served, for the log line."""
    return (f"hierarchical across {layout.count} nodes of {len(layout.nodes[0])} GPUs ({layout.describe()}): "
            "the kernels inside each node, NCCL between nodes")
