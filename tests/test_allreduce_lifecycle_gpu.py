"""Multi-rank GPU tests of a communicator's life (W ranks; on one GPU under MPS): creation that
fails on one rank, a peer's workspace of another size, a transfer test that times out, and a graph
replayed after close.

Skipped with a reason on a machine without a GPU or without the built extension.
"""

from __future__ import annotations

import time

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from tests import _reference as ref
from tests._allreduce_gpu import MAX_BYTES, SKIP_REASON, TRANSPORTS, WORLDS

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def _creation_fails_on_one_rank(ctx: ranks.RankContext) -> dict:
    from pcie_allreduce import constants

    max_bytes = constants.MAX_MESSAGE_BYTES + 1 if ctx.rank == ctx.world_size - 1 else MAX_BYTES
    start = time.monotonic()
    try:
        pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=max_bytes, timeout_s=5.0)
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = (None, "")
    # A communicator made afterwards works: the failed one left nothing behind (and its
    # creation-time transfer test, a real P2P write from every rank to every other, passes).
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    inputs = ref.all_inputs(5, ctx.world_size, 7168, torch.bfloat16)
    ref.check(comm.all_reduce(inputs[ctx.rank].to(ctx.device)), inputs, "after a failed creation")
    comm.close()
    ext = pcie_allreduce._ext.require()
    bounds = []
    for args in ((constants.MAX_MESSAGE_BYTES + 1, 1.0), (MAX_BYTES, constants.MAX_TIMEOUT_S * 2.0)):
        try:
            ext.Workspace(ctx.device.index, ctx.rank, ctx.world_size, *args).close()
            bounds.append("accepted")
        except Exception as exc:  # noqa: BLE001
            bounds.append(str(exc))
    return {"outcome": outcome, "elapsed": time.monotonic() - start, "bounds": bounds}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_creation_failing_on_one_rank_raises_on_every_rank(world: int) -> None:
    results = ranks.run_ranks(_creation_fails_on_one_rank, world, timeout_s=300)
    last = world - 1
    for rank, r in enumerate(results):
        kind, message = r["outcome"]
        if rank == last:
            assert kind == "ValueError" and "max_bytes must be an int" in message, r
        else:
            assert kind == "UnavailableError" and f"rank {last}: ValueError" in message, r
        assert r["elapsed"] < 60, r
        assert "max_bytes must be in [1, " in r["bounds"][0] and "timeout must be" in r["bounds"][1], r


def _peer_of_another_size(ctx: ranks.RankContext) -> dict:
    """The last rank's workspace is larger (another max_bytes, as another build or setting would
    make it): no rank maps a peer's workspace of another size than its own layout's."""
    import torch.distributed as dist

    ext = pcie_allreduce._ext.require()
    last = ctx.world_size - 1
    max_bytes = MAX_BYTES + (4096 if ctx.rank == last else 0)
    workspace = ext.Workspace(ctx.device.index, ctx.rank, ctx.world_size, max_bytes, 5.0)
    exported = [None] * ctx.world_size
    dist.all_gather_object(exported, (workspace.ipc_handle(), workspace.total_bytes), group=ctx.group)
    try:
        workspace.open_peers([handle for handle, _ in exported])
        outcome = None
    except RuntimeError as exc:
        outcome = str(exc)
    dist.barrier(group=ctx.group)  # every rank is done mapping before any frees its memory
    workspace.close()
    return {"outcome": outcome, "sizes": [size for _, size in exported]}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_a_peer_workspace_of_another_size_is_refused(world: int) -> None:
    last = world - 1
    for rank, r in enumerate(ranks.run_ranks(_peer_of_another_size, world, timeout_s=300)):
        peer = 0 if rank == last else last
        assert r["outcome"] is not None, f"rank {rank} mapped a workspace of another size: {r}"
        assert (f"rank {rank} refuses the workspace of rank {peer}: it is {r['sizes'][peer]} bytes, this rank's "
                f"layout needs {r['sizes'][rank]}") in r["outcome"], r


def _mapped_workspace(ctx: ranks.RankContext, transport: str, timeout_s: float):
    """One ``_C.Workspace`` per rank with every peer mapped, as creation makes it before its probes."""
    import torch.distributed as dist
    from pcie_allreduce import constants, transport as transport_mod

    ext = pcie_allreduce._ext.require()
    name = transport_mod.new_segment_name() if transport == "host" else ""
    workspace = ext.Workspace(ctx.device.index, ctx.rank, ctx.world_size, MAX_BYTES, timeout_s,
                              constants.TRANSPORT_IDS[transport], name)
    handles = [None] * ctx.world_size
    dist.all_gather_object(handles, workspace.ipc_handle(), group=ctx.group)
    workspace.open_peers(handles)
    dist.barrier(group=ctx.group)
    workspace.release_name()
    return workspace


PROBE_TIMEOUT_S = 0.25
PROBE_STALL_S = 4.0


def _stalled_transfer_test(ctx: ranks.RankContext, transport: str) -> dict:
    """Rank 0's creation-time transfer test is held past its timeout (the test hook delays its
    kernel, as peer writes stalled in the platform would): write_probes raises within about the
    timeout, and close() returns at once instead of waiting for that kernel, leaving the memory
    allocated; a kernel that ended before close() is freed as usual."""
    import torch.distributed as dist

    result = {}
    for case, delay in (("running at close", PROBE_STALL_S), ("ended before close", 1.0)):
        workspace = _mapped_workspace(ctx, transport, PROBE_TIMEOUT_S)
        if ctx.rank == 0:
            workspace.debug_delay_probes(delay)
            start = time.monotonic()
            try:
                workspace.write_probes(1)
                raised = None
            except RuntimeError as exc:
                raised = str(exc)
            gave_up_s = time.monotonic() - start
            if case == "ended before close":
                torch.cuda.synchronize(ctx.device)  # the hook's delay is bounded: the kernel ends by itself
            start = time.monotonic()
            workspace.close()
            result[case] = {"raised": raised, "gave_up_s": gave_up_s, "close_s": time.monotonic() - start,
                            "abandoned": workspace.abandoned}
            torch.cuda.synchronize(ctx.device)  # the delayed kernel ends within its delay
        else:
            workspace.write_probes(1)
        dist.barrier(group=ctx.group)  # rank 0's kernel has written into the peers: only now may they free
        if ctx.rank != 0:
            workspace.close()
    return result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_transfer_test_that_times_out_never_blocks_close(transport: str) -> None:
    rank0 = ranks.run_ranks(_stalled_transfer_test, 2, transport, timeout_s=300)[0]
    stalled, ended = rank0["running at close"], rank0["ended before close"]
    for r in (stalled, ended):
        assert r["raised"] is not None and "did not complete within 0.25" in r["raised"], r
        assert "until the process exits" in r["raised"], r
        assert PROBE_TIMEOUT_S <= r["gave_up_s"] < PROBE_TIMEOUT_S + 1.5, r
    # Releasing its memory would have waited the rest of PROBE_STALL_S for the kernel.
    assert stalled["close_s"] < 1.0 and stalled["abandoned"], stalled
    assert not ended["abandoned"], ended


def _replay_after_close(ctx: ranks.RankContext) -> dict:
    """A graph of plain and fused calls, replayed once while the communicator is open and once
    after close(): the second replay must touch no freed memory (the workspace is retired, not
    freed) and leave NaN in every output."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=5.0)
    hidden = 7168
    inputs = ref.all_inputs(21, ctx.world_size, 4 * hidden, torch.bfloat16)
    x = inputs[ctx.rank].to(ctx.device)
    residual = ref.rank_input(22, 0, 4 * hidden, torch.bfloat16).view(4, hidden).to(ctx.device)
    weight = (1 + 0.1 * ref.rank_input(23, 0, hidden, torch.float32)).to(torch.bfloat16).to(ctx.device)
    plain_algos = ("oneshot", "twoshot", "oneshot_ll", "staged", "oneshot_full", "twoshot_full")
    outs = [torch.full_like(x, 7.0) for _ in plain_algos]
    normed, new_residual = torch.full_like(residual, 7.0), torch.full_like(residual, 7.0)
    stream = torch.cuda.Stream(ctx.device)
    with torch.cuda.stream(stream):
        comm.all_reduce(x, out=outs[0])  # the capture stream's workspace, made eagerly
        comm.all_reduce_rmsnorm(x.view(4, hidden), residual, weight, 1e-6, out=normed, residual_out=new_residual)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for out, algo in zip(outs, plain_algos):
                comm.all_reduce(x, out=out, algo=algo)
            comm.all_reduce_rmsnorm(x.view(4, hidden), residual, weight, 1e-6, out=normed, residual_out=new_residual)
    eager = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=5.0)
    ref.check(eager.all_reduce(x), inputs, "eager communicator")
    torch.cuda.synchronize()  # the eager calls on `stream` wrote outs[0], normed and new_residual
    for t in (*outs, normed, new_residual):
        t.fill_(float("nan"))  # so only the replay can have written them
    graph.replay()
    torch.cuda.synchronize()
    for out, algo in zip(outs, plain_algos):
        ref.check(out, inputs, f"{algo} in the graph")
    assert torch.equal(new_residual.cpu(), residual.cpu() + ref.exact(inputs).view(4, hidden))
    ref.check_rmsnorm(normed, new_residual, weight, 1e-6, "fused call in the graph")
    comm.close()
    eager.close()
    for t in (*outs, normed, new_residual):
        t.fill_(7.0)
    graph.replay()  # after close(): aborted calls, NaN outputs, no peer memory touched
    torch.cuda.synchronize()
    result = {"retained": comm.retained_bytes, "eager_retained": eager.retained_bytes,
              "all_nan": [bool(torch.isnan(t).all()) for t in (*outs, normed, new_residual)]}
    del graph
    return result


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_a_graph_replayed_after_close_leaves_nan_and_touches_no_freed_memory(world: int) -> None:
    for rank, r in enumerate(ranks.run_ranks(_replay_after_close, world, timeout_s=300)):
        assert r["retained"] > 0, f"rank {rank}: close() freed a workspace a graph captured"
        assert r["eager_retained"] == 0, f"rank {rank}: close() kept a workspace no graph captured"
        assert all(r["all_nan"]), f"rank {rank}: a replay after close() left data in an output: {r}"
