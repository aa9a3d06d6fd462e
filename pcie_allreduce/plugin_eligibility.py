"""Whether an engine plugin serves a tensor-parallel group: one collective decision every rank shares.

Every rank gathers the same facts from every peer (host, whether the kernels can run, which
physical GPU, emulated nodes) and computes the decision from that one gathered list, so all ranks
take the same branch: a rank that served while its peers declined would hang the first
collective. The NVLink question is each engine's own (its custom all-reduce's answer, passed in
as ``nvlink_fn``): every rank asks it about its own node's GPUs, and the answers are gathered, so
a flaky query cannot split the ranks. Both plugins decide through :func:`decide`; a group across
nodes is served hierarchically where the engine's plugin offers that (``multinode_variable``).
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

logger = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class Engine:
    """What a decision names of the engine: its name in prose, and its plugin's variables."""

    name: str  # "SGLang", "vLLM"
    mode_variable: str
    #: The variable that turns serving groups across nodes off; None: the plugin leaves every
    #: such group to the engine.
    multinode_variable: str | None = None


FactsFn = Callable[[torch.device], RankFacts]
NvlinkFn = Callable[[Sequence[int]], bool]


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
    """The NVML index of ``device`` (CUDA_VISIBLE_DEVICES undone, an entry given by UUID looked up
    in NVML), the mapping both engines' own NVLink checks use; -1 where none can be given."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not visible:
        return index
    entries = [v.strip() for v in visible.split(",")]
    if index >= len(entries):
        return -1
    entry = entries[index]
    if entry.isascii() and entry.isdigit():
        return int(entry)
    try:  # a UUID (GPU-...): NVML knows its index; a MIG name has none
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(entry)))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no NVML, or no such device: unknown
        logger.debug("no physical GPU index for %s=%s (%s)", "CUDA_VISIBLE_DEVICES", entry, exc)
        return -1


def decide(group: dist.ProcessGroup, device: torch.device, settings: Any, engine: Engine, *,
           nvlink_fn: NvlinkFn, facts_fn: FactsFn = local_facts) -> Decision:
    """Collective over ``group`` (the tp group's CPU group): serve it or not, identically on every
    rank, and why. ``settings`` is the plugin's (``mode``, and ``multinode`` where the engine's
    plugin has it)."""
    world = dist.get_world_size(group)
    if not MIN_RANKS <= world <= MAX_RANKS:  # no collective needed: W is the same everywhere
        return Decision(False, f"the group has {world} ranks; pcie_allreduce serves {MIN_RANKS} to {MAX_RANKS}")
    facts: list[Any] = [None] * world
    dist.all_gather_object(facts, dataclasses.asdict(facts_fn(device)), group=group)
    if any(f.get("emulated_nodes") == -1 for f in facts):
        return Decision(False, f"${nodes.NODES_ENV} is not a positive number of nodes on some rank")
    try:
        layout = nodes.layout_of([f["host"] for f in facts], [f.get("emulated_nodes") for f in facts])
    except ValueError as exc:
        return Decision(False, str(exc))
    spread = multinode_problem(layout, settings, engine) if layout.count > 1 else None
    if spread is not None:
        return Decision(False, spread)
    hierarchy = layout if layout.count > 1 else None
    for rank, f in enumerate(facts):
        if f["unavailable"]:
            return Decision(False, f"rank {rank} cannot run the kernels: {f['unavailable']}")
    sms = "/".join(sorted({f["sm"] for f in facts}))
    how = "" if hierarchy is None else f"; {hierarchical_summary(hierarchy)}"
    if settings.mode == "always":
        return Decision(True, f"mode=always ({sms}){how}", hierarchy)
    node = layout.nodes[layout.node_of(dist.get_rank(group))]
    mine = bool(nvlink_fn([facts[r]["physical_gpu"] for r in node]))
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, mine, group=group)
    if all(answers):
        return Decision(False, f"the GPUs are fully NVLinked; mode=pcie leaves them to {engine.name}'s own custom "
                               f"all-reduce (set {engine.mode_variable}=always to serve them anyway)")
    return Decision(True, f"{world} GPUs without full NVLink ({sms}, mode=pcie){how}", hierarchy)


def multinode_problem(layout: nodes.NodeLayout, settings: Any, engine: Engine) -> str | None:
    """Why a group that spans ``layout``'s nodes is left to the engine, or None (served hierarchically)."""
    where = f"the group spans {layout.count} nodes ({layout.describe()})"
    if engine.multinode_variable is None:
        return f"{where}; {engine.name}'s own path (NCCL) serves groups across nodes"
    if not settings.multinode:
        return f"{where}; {engine.multinode_variable}=0 leaves such groups to {engine.name}"
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
