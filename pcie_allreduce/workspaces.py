"""Creating one stream's workspace, collectively: allocate and export, map and probe, the transfer test.

A communicator makes one workspace per CUDA stream it is called on, the first at creation
(:func:`pcie_allreduce.rendezvous.first_workspace`), the others at a stream's first call. Every
rank makes its own at the same point of its sequence of calls, and the three steps each end in a
gather of every rank's outcome (:meth:`pcie_allreduce.rendezvous.Collective.step`), so a failure
on one rank makes every rank raise at once and free what it made."""

from __future__ import annotations

from typing import Any

from pcie_allreduce import transport as transport_mod
from pcie_allreduce.constants import TRANSPORT_IDS
from pcie_allreduce.errors import CollectiveMismatch, UnavailableError
from pcie_allreduce.rendezvous import Agreed, Collective

# Seed of the creation-time transfer test; the workspace index is added, so a test pattern left
# by one stream's creation never passes for another's.
PROBE_SEED = 0x5EED0000


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
