"""One stream's workspace, made collectively (allocate and export, map and probe, the transfer test),
its recorded error as a typed exception, and its release at close.

A communicator makes one workspace per CUDA stream it is called on, the first at creation
(:func:`pcie_allreduce.rendezvous.first_workspace`), the others at a stream's first call. Every
rank makes its own at the same point of its sequence of calls, and the three steps each end in a
gather of every rank's outcome (:meth:`pcie_allreduce.rendezvous.Collective.step`), so a failure
on one rank makes every rank raise at once and free what it made."""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch.distributed as dist

from pcie_allreduce import outcomes, transport as transport_mod
from pcie_allreduce.constants import ERROR_MISMATCH, STAGE_NAMES, TRANSPORT_IDS
from pcie_allreduce.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, UnavailableError
from pcie_allreduce.rendezvous import Agreed, Collective

# Seed of the creation-time transfer test; the workspace index is added, so a test pattern left
# by one stream's creation never passes for another's.
PROBE_SEED = 0x5EED0000
# How long close() waits for every rank to reach it before it gives up on freeing: an engine's
# ranks tear a group down together, so only a rank that is gone (or stuck) is missed.
CLOSE_WAIT_S = 60.0
CLOSE_STAGE = "close"
#: Workspaces that must never be freed here: a forked child's copies, those of a communicator
#: dropped without close(), and those close() had to keep (captured, or a rank missing).
NEVER_FREED: list[Any] = []


def create(collective: Collective, agreed: Agreed, index: int) -> Any:
    """The ``_C.Workspace`` of this rank's ``index``-th stream, mapped to every peer's and tested.

    Three collective steps, each ending in a gather of every rank's outcome: allocate and
    export (with the layout, checked to be the same everywhere); map the peers' memory and
    write a probe into each; read the probes the peers wrote here. A pair whose probe did not
    arrive means the driver reports peer access the platform does not deliver: a clean
    UnavailableError now instead of timeouts on the first calls. What failed is freed here."""
    rank, transport = collective.rank, agreed.transport
    created: list[Any] = []
    if transport == "host":
        transport_mod.remove_stale_segments()

    def allocate() -> dict[str, Any]:
        # The host transport's segment is named here: its name records who created it, which
        # the stale-segment sweep reads (transport.py).
        name = transport_mod.new_segment_name() if transport == "host" else ""
        workspace = agreed.ext.Workspace(agreed.device.index, rank, collective.world, agreed.max_bytes,
                                         agreed.timeout_s, TRANSPORT_IDS[transport], name)
        created.append(workspace)
        workspace.island_ranks = agreed.island_ranks
        workspace.dependent_launch = agreed.dependent_launch
        return {"index": index, "handle": workspace.ipc_handle(),
                "layout": (workspace.total_bytes, workspace.max_bytes, workspace.world, workspace.rank)}

    try:
        exchanged = collective.step("workspace allocation", allocate)
        workspace = created[0]
        indices = [e["index"] for e in exchanged]
        if len(set(indices)) != 1:
            raise CollectiveMismatch(
                f"ranks disagree on which stream this is (workspace indices {indices}): every rank must use "
                "its streams in the same order", rank=rank)
        layouts = [e["layout"] for e in exchanged]
        if any(lay[:3] != layouts[0][:3] or lay[3] != r for r, lay in enumerate(layouts)):
            raise UnavailableError(f"the ranks' workspaces differ (total bytes, max_bytes, world, rank per rank: "
                                   f"{layouts}): every rank must run the same pcie_allreduce build")
        seed = PROBE_SEED + index

        def map_and_probe() -> None:
            workspace.open_peers([e["handle"] for e in exchanged])
            workspace.write_probes(seed)

        collective.step("mapping the peers' workspaces", map_and_probe)
        workspace.release_name()  # every rank has mapped it: a later crash leaves nothing in /dev/shm
        missing = [(sender, receiver) for receiver, senders in
                   enumerate(collective.step("the transfer test", lambda: workspace.probe_failures(seed)))
                   for sender in senders]
        if missing:
            pairs = ", ".join(f"{s} -> {r}" for s, r in missing)
            if transport == "host":
                raise UnavailableError(
                    f"writes into the shared pinned host memory do not arrive (rank -> rank: {pairs}): the GPUs "
                    "cannot reach each other's registered /dev/shm segments. Use NCCL for this group.")
            raise UnavailableError(
                f"P2P writes between the ranks' GPUs do not arrive (rank -> rank: {pairs}) although the driver "
                "reports peer access: the platform drops or misroutes peer-to-peer writes (IOMMU / ACS settings, "
                "a cross-socket path). Use transport='host' (what 'auto' falls back to), NCCL, or fix the "
                "platform's P2P.")
    except BaseException:
        for made in created:
            made.close()
        raise
    return workspace


def error_of(workspace: Any) -> CollectiveError:
    """The typed error a kernel recorded in ``workspace`` (call only when ``workspace.failed()``):
    a CollectiveMismatch where a peer issued a different call, else a CollectiveTimeout, each
    naming rank, peer, stage, call number and block."""
    err = workspace.error()
    stage = STAGE_NAMES.get(err.stage, f"stage {err.stage}")
    where = dict(rank=err.rank, peer=err.peer, stage=stage, epoch=err.epoch, block=err.block)
    if err.kind == ERROR_MISMATCH:
        return CollectiveMismatch(
            f"rank {err.rank} got a different collective from rank {err.peer} as call #{err.epoch} "
            f"({stage}, block {err.block}; signature {err.observed_signature:#010x} vs ours "
            f"{err.expected_signature:#010x}): every rank must issue the same sequence of calls with the same "
            "size, dtype and algorithm. This communicator is now unusable.", **where)
    return CollectiveTimeout(
        f"rank {err.rank} waited more than {workspace.timeout:g} s for rank {err.peer} in {stage} of call "
        f"#{err.epoch} (block {err.block}): that rank is stuck, dead, or skipped a collective. "
        "This communicator is now unusable.", **where)


def release(made: Iterable[Any], group: dist.ProcessGroup, meeting_id: str, rank: int, *,
            release_captured: bool) -> int:
    """Free a closing communicator's workspaces ``made`` once every rank has reached close(); returns
    the bytes kept allocated.

    Every rank's arrival is met in the group's store within CLOSE_WAIT_S (never a collective on
    the group, which a gone peer would hold for the group's timeout, 30 minutes by default). A
    workspace that served a CUDA graph capture is kept unless ``release_captured`` (a captured
    graph may still be replayed), and every workspace is kept where a rank did not arrive (a peer
    still running may write into it): kept ones are retired (abort word raised, peers unmapped) and
    stay in NEVER_FREED until the process exits."""
    everyone = _every_rank_closing(group, meeting_id, rank)
    retained = 0
    for workspace in made:
        if everyone and (release_captured or not workspace.captured):
            workspace.close()
        else:
            workspace.retire()
            NEVER_FREED.append(workspace)
            retained += workspace.total_bytes
    return retained


def _every_rank_closing(group: dist.ProcessGroup, meeting_id: str, rank: int) -> bool:
    """Whether every rank reached close() within CLOSE_WAIT_S. Where no process group is left to
    ask, nobody can be waited for: True, as before any group."""
    if not dist.is_initialized():
        return True
    try:
        outcomes.meet(group, f"pcie_allreduce/{meeting_id}/close", 0, "close()", CLOSE_STAGE, wait_s=CLOSE_WAIT_S,
                      stage=CLOSE_STAGE)
    except Exception as exc:  # noqa: BLE001 - a missing rank, or the store gone with rank 0's process
        warnings.warn(f"pcie_allreduce: rank {rank}: close() keeps this communicator's workspaces allocated "
                      f"({' '.join(str(exc).split())}): a peer that did not close may still write into them",
                      ResourceWarning, stacklevel=4)
        return False
    return True


def abandon(made: Iterable[Any], rank: int) -> None:
    """Keep the workspaces ``made`` of a communicator dropped without close() allocated until the
    process exits, and warn: only close() (collective) frees, since peers may still write into this
    memory and a CUDA graph captured with it may still be replayed."""
    kept = list(made)
    NEVER_FREED.extend(kept)
    mib = sum(getattr(w, "total_bytes", 0) for w in kept) / 2**20
    warnings.warn(f"pcie_allreduce: a Communicator (rank {rank}) was dropped without close(); its {mib:.0f} MiB of "
                  "workspaces stay allocated until the process exits, since peers may still write into them. Call "
                  "close() on every rank to free them.", ResourceWarning, stacklevel=3)
