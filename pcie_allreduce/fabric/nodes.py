"""Which node (machine) each rank of a group runs on, for the all-reduce across nodes.

The ranks of a group find their nodes by gathering a host identity over the group: the host name
and the kernel's boot id (two containers or two boots of one name are not one node's shared
memory). ``$PCIE_AR_NODES=K`` emulates K nodes on one machine for tests: the group's ranks split
into K equal runs of consecutive ranks, whatever the machine is; every rank must set the same K.

Pure functions over the gathered identities (:func:`layout_of`) with one collective entry point
(:func:`gather_layout`), so the layout's rules run, and are tested, on a CPU; and what the
hierarchical all-reduce sends between nodes per call (:func:`off_node_bytes`, :func:`off_node_wire`).
"""

from __future__ import annotations

import collections
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch.distributed as dist

from pcie_allreduce import settings
from pcie_allreduce.plan.algorithms import WireBytes

#: Emulate this many nodes (equal runs of consecutive ranks) on one machine.
NODES_ENV = "PCIE_AR_NODES"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_identity(boot_id_path: str = _BOOT_ID) -> str:
    """This machine's identity: its host name and, where the kernel says it, its boot id."""
    try:
        with open(boot_id_path, encoding="ascii") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def emulated_nodes(environ: Mapping[str, str] | None = None) -> int | None:
    """``$PCIE_AR_NODES`` as a node count, None when unset or blank; SettingsError naming it when
    it is not a whole number of at least 1."""
    return settings.env_int(NODES_ENV, lo=1, environ=environ)


@dataclass(frozen=True)
class NodeLayout:
    """The group's ranks by node: ``nodes[g]`` lists node g's ranks in rank order, nodes in the
    order of their lowest rank."""

    nodes: tuple[tuple[int, ...], ...]
    #: How the nodes were found: "host identity" or "$PCIE_AR_NODES".
    source: str = "host identity"

    @property
    def world(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def count(self) -> int:
        return len(self.nodes)

    def node_of(self, rank: int) -> int:
        return next(g for g, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def hierarchy_problem(self) -> str | None:
        """Why the hierarchical all-reduce cannot serve this layout, or None. Its result is the
        single-node sum bit for bit because the nodes are runs of consecutive ranks of one size:
        the rank-order sum then splits at node boundaries into one chain of partials."""
        if self.count < 2:
            return "the group runs on one node"
        sizes = sorted({len(n) for n in self.nodes})
        if len(sizes) > 1:
            return f"its nodes hold different numbers of ranks ({self.describe()})"
        size = sizes[0]
        for g, ranks in enumerate(self.nodes):
            if ranks != tuple(range(g * size, (g + 1) * size)):
                return (f"node {g} holds ranks {list(ranks)}, not a run of consecutive ranks ({self.describe()}); "
                        "start the ranks node by node")
        return None

    def describe(self) -> str:
        """``0-3;4-7``: each node's ranks (a run as first-last)."""
        def run(ranks: tuple[int, ...]) -> str:
            if ranks == tuple(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
                return f"{ranks[0]}-{ranks[-1]}"
            return ",".join(map(str, ranks))
        return ";".join(run(n) for n in self.nodes)


def equal_nodes(world: int, count: int, source: str = f"${NODES_ENV}") -> NodeLayout:
    """``world`` ranks as ``count`` nodes of equal runs of consecutive ranks (``count`` divides ``world``)."""
    size = world // count
    return NodeLayout(tuple(tuple(range(g * size, (g + 1) * size)) for g in range(count)), source)


def layout_of(identities: Sequence[str], emulate: Sequence[int | None] = ()) -> NodeLayout:
    """The layout from each rank's host identity (index = rank) and each rank's
    ``$PCIE_AR_NODES`` (None: unset); ValueError when the ranks disagree on it or it does not
    divide the group."""
    world = len(identities)
    counts = set(emulate) if emulate else {None}
    if len(counts) > 1:
        raise ValueError(f"the ranks set ${NODES_ENV} differently ({sorted(counts, key=str)}); set one value on all")
    count = counts.pop()
    if count is not None:
        if world % count:
            raise ValueError(f"${NODES_ENV}={count} does not divide the group's {world} ranks into equal nodes")
        return equal_nodes(world, count)
    order: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        order.setdefault(identity, []).append(rank)
    return NodeLayout(tuple(tuple(ranks) for ranks in order.values()))


def gather_layout(group: dist.ProcessGroup, environ: Mapping[str, str] | None = None) -> NodeLayout:
    """Collective over ``group``: every rank's identity and ``$PCIE_AR_NODES``, gathered; the
    same layout on every rank (or the same ValueError)."""
    try:
        mine: tuple[str, int | None, str] = (host_identity(), emulated_nodes(environ), "")
    except ValueError as exc:
        mine = (host_identity(), None, str(exc))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    problems = [(rank, p) for rank, (_, _, p) in enumerate(gathered) if p]
    if problems:
        rank, problem = problems[0]
        raise ValueError(f"rank {rank}: {problem}")
    return layout_of([g[0] for g in gathered], [g[1] for g in gathered])


def agree_on_layout(group: dist.ProcessGroup, layout: NodeLayout | None) -> NodeLayout:
    """Collective over ``group``: the one layout every rank uses. Each rank's ``layout`` (None:
    :func:`gather_layout`, which then runs on every rank) is gathered and compared, so ranks given
    different layouts raise ValueError together instead of waiting in process groups that the
    others never make."""
    given: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(given, None if layout is None else layout.nodes, group=group)
    gathered = gather_layout(group) if any(g is None for g in given) else None
    resolved = [g if g is not None else gathered.nodes for g in given]  # type: ignore[union-attr]
    if len(set(resolved)) > 1:
        views = "; ".join(f"rank {r}: {NodeLayout(n).describe()}" for r, n in enumerate(resolved))
        raise ValueError(f"the ranks were given different node layouts ({views}); every rank must pass the same "
                         "layout= (or None on every rank)")
    return layout if layout is not None else gathered  # type: ignore[return-value]


def ranks_per_gpu(group: dist.ProcessGroup, device: Any) -> int:
    """Collective over ``group``: the most of its ranks on one GPU (host identity and PCI bus id,
    gathered). Where nodes are emulated on one machine every node's calls run on the same GPUs at
    once, and each node's communicator must leave SMs for the others' blocks (dispatch.block_cap)."""
    from pcie_allreduce import _ext

    mine = (host_identity(), _ext.require().pci_bus_id(device.index).lower())
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return max(collections.Counter(gathered).values())


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` near-equal shards of ``numel`` elements, in order."""
    return [(i * numel // parts, (i + 1) * numel // parts) for i in range(parts)]


def off_node_bytes(numel: int, elem_size: int, layout: NodeLayout, rank: int) -> int:
    """Bytes ``rank`` sends off its node for one call of ``numel`` elements of ``elem_size`` bytes:
    its shard of the node's fp32 partial (every node but the last), or its shard of the result to
    each other node (the last node): 1/L of the message, L ranks a node."""
    start, end = shard_bounds(numel, len(layout.nodes[0]))[layout.local_rank(rank)]
    if layout.node_of(rank) == layout.count - 1:
        return (layout.count - 1) * (end - start) * elem_size
    return 4 * (end - start)


def off_node_wire(numel: int, elem_size: int, layout: NodeLayout) -> WireBytes:
    """The most bytes any rank sends off its node (``out``) and receives from other nodes
    (``into``) in one call: a non-first node's first rank receives the whole fp32 partial."""
    shards = shard_bounds(numel, len(layout.nodes[0]))
    last = layout.count - 1

    def received(rank: int) -> int:
        node, local = layout.node_of(rank), layout.local_rank(rank)
        start, end = shards[local]
        return (4 * numel if node > 0 and local == 0 else 0) + ((end - start) * elem_size if node < last else 0)

    ranks = range(layout.world)
    return WireBytes(max(off_node_bytes(numel, elem_size, layout, r) for r in ranks), max(received(r) for r in ranks))


def flat_ring_off_node_bytes(nbytes: int, world: int) -> int:
    """What a flat ring all-reduce (NCCL's on PCIe) sends per call from each rank whose ring
    neighbour is on the next node: 2(W-1)/W of the message, as every rank of the ring sends."""
    return 2 * (world - 1) * nbytes // world
