"""Creating a Communicator: the collective steps that decide what every rank of the group agrees on.

Creation is all or nothing: each step that can fail on one rank runs on every rank and ends in a
gather of every rank's outcome (:meth:`Collective.step`), so a failure anywhere makes every rank
raise at once instead of leaving peers in a later rendezvous. :func:`agree` runs the steps before
any memory is allocated (this rank's argument checks and GPU set-up, the arguments compared across
ranks, where each rank sits, the peer-access check and the transport, the tuned table, the block
cap); :func:`first_workspace` then makes the first workspace, falling back to host memory where
peer-to-peer fails at creation. What was agreed comes back as one frozen :class:`Agreed`, which
the communicator keeps."""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from pcie_allreduce import _ext, settings, transport as transport_mod, validation
from pcie_allreduce.constants import MAX_RANKS, MIN_RANKS
from pcie_allreduce.errors import UnavailableError
from pcie_allreduce.fabric import topology
from pcie_allreduce.layout import Layout
from pcie_allreduce.plan import cache, dispatch, tables

DEFAULT_TIMEOUT_S = 10.0
TIMEOUT_ENV = "PCIE_AR_TIMEOUT_S"
# Programmatic dependent launch where the GPU has it (Hopper and later), on unless this says "0":
# every all-reduce is launched as the previous kernel's dependent (it waits for that kernel before
# it reads anything: csrc/protocol.cuh's begin_call), and the unfused pair's norm kernel as the
# all-reduce's (it waits before it reads the sum), and the fused kernels as dependents too (waiting
# first thing). On by default because a verify pass with each layer's GEMMs between its collectives
# ran 0.97-1.00x its ordinary launch at W = 2, 4, 8 (bench/RESULTS.md). Each rank's own launch
# choice (results, protocol and peers are the same either way), so ranks need not agree.
PDL_ENV = "PCIE_AR_PDL"
# What ranks agree on for the islands (named so a disagreement says which setting differs).
ISLANDS_KEY = f"islands (${topology.ISLANDS_ENV})"
# The arguments every rank must give alike, compared after the first step.
# Whether the caller gave the table: a rank that did not reads the tuned cache in a collective step
# of its own, which the others must make too.
TABLE_GIVEN_KEY = f"whether a table was given (algo_table= or ${tables.TABLE_ENV})"
AGREED_ARGUMENTS = ("max_bytes", "timeout_s", "table", TABLE_GIVEN_KEY, "transport", "ranks_per_gpu", ISLANDS_KEY)

Made = TypeVar("Made")


def default_timeout() -> float:
    """How long a kernel waits for a peer when the caller gives no ``timeout_s``: ``$PCIE_AR_TIMEOUT_S``
    where set (checked, the error names the variable), else :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV)
    return DEFAULT_TIMEOUT_S if raw is None else settings.parse_seconds(TIMEOUT_ENV, raw)


def dependent_launch(device: torch.device) -> bool:
    """Whether this rank launches the unfused pair's norm kernel as the all-reduce's dependent."""
    return settings.env_bool(PDL_ENV, True) and torch.cuda.get_device_capability(device)[0] >= 9


def cuda_device(device: torch.device | int | str) -> torch.device:
    """``device`` as a CUDA device with an index (the current device where it names none); a
    device that is not CUDA is a ValueError."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass(frozen=True)
class Collective:
    """The group a communicator is created over and this rank's place in it: what each creation
    step gathers over. Gathers run on the group itself (a CPU group, gloo), once per step."""

    group: dist.ProcessGroup
    rank: int
    world: int

    def gather(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``obj``, in rank order."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def step(self, step: str, local: Callable[[], Any]) -> list[Any]:
        """Run ``local`` on this rank and gather every rank's result.

        A rank whose ``local`` raises still joins the gather, with its error; then every rank
        raises: that rank its own exception, the others UnavailableError naming it and why. So no
        rank is left waiting in a later rendezvous for one that gave up (gloo would hold it for the
        process group's timeout, 30 minutes by default)."""
        try:
            result = local()
        except Exception as exc:
            # Raised from inside the handler, never kept in a local: a frame holding its own
            # exception is a reference cycle that keeps the communicator alive.
            self.gather({"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
            raise
        gathered = self.gather({"ok": result})
        failed = {r: g["error"] for r, g in enumerate(gathered) if "error" in g}
        if failed:
            reasons = "; ".join(f"rank {r}: {why}" for r, why in failed.items())
            raise UnavailableError(f"rank {self.rank}: creating the communicator failed on another rank in {step} "
                                   f"({reasons})")
        return [g["ok"] for g in gathered]


def check_agreement(agreed: list[dict[str, Any]], key: str) -> None:
    """ValueError naming ``key``, rank 0's value and the ranks that differ, where the ranks'
    ``agreed[rank][key]`` are not all the same."""
    values = [a[key] for a in agreed]
    if any(v != values[0] for v in values):
        differing = [r for r, v in enumerate(values) if v != values[0]]
        raise ValueError(f"ranks disagree on {key}: rank 0 has {values[0]!r}, ranks {differing} differ "
                         f"({[values[r] for r in differing]!r})")


@dataclass(frozen=True)
class Agreed:
    """What creation decided, the same on every rank but for this rank's own extension, device and
    launch choice: the communicator keeps it and reads its fields as its own attributes."""

    ext: ModuleType  #: the compiled extension, pcie_allreduce._C
    device: torch.device
    max_bytes: int
    ll_capacity: int  #: largest message ``oneshot_ll`` takes (its line slots cost twice the payload)
    timeout_s: float
    dependent_launch: bool  #: this rank's choice ($PCIE_AR_PDL); ranks need not agree
    table: tables.AlgoTable
    table_source: str
    table_given: bool  #: by the caller or $PCIE_AR_ALGO_TABLE: never replaced by a tuned one
    transport_asked: str  #: "p2p", "host" or "auto"
    transport: str  #: "p2p" or "host"
    transport_reason: str
    placements: list[topology.RankPlacement]
    islands: tuple[tuple[int, ...], ...]
    islands_source: str
    island_ranks: int
    shares_gpu: bool
    block_cap: int
    meeting_id: str  #: names the communicator's keys in the group's store


@dataclass(frozen=True)
class _LocalSetUp:
    """This rank's part of the first step: what it keeps, and what every rank must agree on."""

    ext: ModuleType
    device: torch.device
    max_bytes: int
    ll_capacity: int
    timeout_s: float
    table: tables.AlgoTable
    dependent_launch: bool
    shared: dict[str, Any]


def set_up_locally(rank: int, world: int, device: torch.device | int | str, max_bytes: object, timeout_s: object,
                   algo_table: tables.AlgoTable | str | os.PathLike[str] | None, transport: str | None,
                   ranks_per_gpu: object) -> _LocalSetUp:
    """This rank's part of creation before any memory is allocated: arguments, extension, GPU.
    Returns what it keeps, and (``shared``) what every rank must agree on and its placement."""
    table_given = algo_table is not None or bool(os.environ.get(tables.TABLE_ENV))
    if ranks_per_gpu is not None and (isinstance(ranks_per_gpu, bool) or not isinstance(ranks_per_gpu, int)
                                      or ranks_per_gpu < 1):
        raise ValueError(f"ranks_per_gpu must be a positive int or None, got {ranks_per_gpu!r}")
    ext = _ext.require()
    dev = cuda_device(device)
    checked_bytes = validation.validate_max_bytes(max_bytes)
    timeout = default_timeout() if timeout_s is None else validation.validate_timeout(timeout_s)
    table = tables.load_table(algo_table)
    requested = transport_mod.requested(transport)
    status = ext.runtime_status()
    if status:
        raise UnavailableError(f"rank {rank}: no usable CUDA GPU ({status})")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return _LocalSetUp(
        ext=ext, device=dev, max_bytes=checked_bytes, ll_capacity=Layout.make(checked_bytes, world).ll_capacity,
        timeout_s=timeout, table=table, dependent_launch=dependent_launch(dev),
        shared={"max_bytes": checked_bytes, "timeout_s": timeout, "table": table.to_json(), TABLE_GIVEN_KEY: table_given,
                "transport": requested,
                "meeting_id": secrets.token_hex(8), "ranks_per_gpu": ranks_per_gpu, "sms": sms,
                "mps_share": dispatch.runs_in_mps_share(), ISLANDS_KEY: topology.islands_override(world),
                "placement": topology.local_placement(ext, rank, dev.index)})


def tuned_table(collective: Collective, ext: ModuleType, device: torch.device,
                placements: list[topology.RankPlacement], islands: tuple[tuple[int, ...], ...], island_ranks: int,
                transport: str) -> tuple[tables.AlgoTable, str]:
    """The table `pcie-allreduce tune` cached for this GPU model, W, topology and transport, if
    any, else the transport's built-in one (:func:`pcie_allreduce.plan.cache.resolve_table`), and
    where it came from.

    Rank 0 reads it and every rank adopts rank 0's copy, so the table is agreed once, here."""
    found = None
    if collective.rank == 0:
        found = cache.find_tuned(ext, [p.pci_bus_id for p in placements], islands,
                                 torch.cuda.get_device_name(device), collective.world, transport)
    found = collective.gather({"tuned": found})[0]["tuned"]
    return cache.resolve_table(found, transport, islands, island_ranks)


def agree(collective: Collective, device: torch.device | int | str, max_bytes: object, timeout_s: object,
          algo_table: tables.AlgoTable | str | os.PathLike[str] | None, transport: str | None,
          ranks_per_gpu: object) -> Agreed:
    """Every creation step before the first workspace, collectively (module docstring): the
    arguments checked here and compared across ranks, the placements and islands, one host, the
    peer-access check and the transport (p2p, until the first workspace says otherwise), the
    table (the caller's, or the tuned or built-in one), the block cap."""
    if not MIN_RANKS <= collective.world <= MAX_RANKS:
        raise ValueError(f"pcie_allreduce supports {MIN_RANKS} to {MAX_RANKS} ranks, "
                         f"the group has {collective.world}")
    rank = collective.rank
    mine: list[_LocalSetUp] = []

    def set_up() -> dict[str, Any]:
        mine.append(set_up_locally(rank, collective.world, device, max_bytes, timeout_s, algo_table, transport,
                                   ranks_per_gpu))
        return mine[0].shared

    agreed = collective.step("argument checks and GPU set-up", set_up)
    local = mine[0]
    for key in AGREED_ARGUMENTS:
        check_agreement(agreed, key)
    table_given = local.shared[TABLE_GIVEN_KEY]
    table_source = ("algo_table argument" if algo_table is not None
                    else f"${tables.TABLE_ENV}" if table_given else "built-in default")
    placements = [a["placement"] for a in agreed]
    fabrics = [p.fabric for p in placements]  # each read by its own rank
    override = agreed[0][ISLANDS_KEY]
    islands = override if override is not None else topology.islands(fabrics)
    islands_source = f"${topology.ISLANDS_ENV}" if override is not None else topology.islands_basis(fabrics)
    island_ranks = topology.island_ranks(islands)
    requested = agreed[0]["transport"]
    hosts = sorted({p.host for p in placements})
    if len(hosts) > 1:  # neither transport reaches another host
        raise UnavailableError(f"pcie_allreduce needs every rank on one host; this group spans {hosts}")
    problems = [p for p in collective.step(
        "the peer-access check",
        lambda: topology.peer_access_problem(local.ext, placements[rank], local.device.index, placements)) if p]
    no_peer_access = problems[0] if len(problems) == 1 else "; ".join(dict.fromkeys(problems))
    if problems and requested == "p2p":
        raise UnavailableError(no_peer_access)
    chosen = "host" if requested == "host" or problems else "p2p"
    table = local.table
    if not table_given:
        table, table_source = tuned_table(collective, local.ext, local.device, placements, islands, island_ranks,
                                          chosen)
    sharing = max(topology.ranks_per_gpu(placements), agreed[0]["ranks_per_gpu"] or 1)
    return Agreed(
        ext=local.ext, device=local.device, max_bytes=local.max_bytes, ll_capacity=local.ll_capacity,
        timeout_s=local.timeout_s, dependent_launch=local.dependent_launch, table=table, table_source=table_source,
        table_given=table_given, transport_asked=requested, transport=chosen,
        transport_reason="asked for" if requested == chosen else f"no peer-to-peer: {no_peer_access}",
        placements=placements, islands=islands, islands_source=islands_source, island_ranks=island_ranks,
        shares_gpu=topology.shares_gpu(placements),
        # The fewest SMs any rank sees, and whether every rank runs capped to an MPS share of its GPU.
        block_cap=dispatch.block_cap(sharing, min(a["sms"] for a in agreed), all(a["mps_share"] for a in agreed)),
        meeting_id=agreed[0]["meeting_id"])


def first_workspace(collective: Collective, agreed: Agreed, create: Callable[[Agreed], Made]) -> tuple[Agreed, Made]:
    """The first workspace, ``create(agreed)`` (collective), on ``agreed.device``; and what was
    agreed once it exists.

    Where the transport was left to choose ("auto") and p2p was chosen, but mapping or the
    transfer test failed on some pair, the driver reports peer access the platform does not
    deliver: every rank saw the same failure, and all move to host memory together (with the
    host's tuned or built-in table, unless the caller gave one) and make it there."""
    with torch.cuda.device(agreed.device):
        try:
            workspace = create(agreed)
        except Exception as exc:  # noqa: BLE001 - every rank raised here together (collective steps)
            if agreed.transport_asked != "auto" or agreed.transport != "p2p":
                raise
            table, table_source = agreed.table, agreed.table_source
            if not agreed.table_given:
                table, table_source = tuned_table(collective, agreed.ext, agreed.device, agreed.placements,
                                                  agreed.islands, agreed.island_ranks, "host")
            agreed = dataclasses.replace(
                agreed, transport="host", table=table, table_source=table_source,
                transport_reason=f"peer-to-peer failed at creation: {' '.join(str(exc).split())}")
            workspace = create(agreed)
    if agreed.transport_asked == "auto" and agreed.transport == "p2p":
        agreed = dataclasses.replace(
            agreed, transport_reason="every pair has peer access and the creation transfer test passed")
    return agreed, workspace
