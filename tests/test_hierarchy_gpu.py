"""The all-reduce across nodes on GPUs: nodes emulated on one machine (``equal_nodes``, as
``$PCIE_AR_NODES`` sets them), the library's kernels inside each node, gloo between nodes
(staged through host memory). Two and four nodes of 1, 2 and 4 ranks: plain and fused results
bitwise equal on every rank to a single-node Communicator's on the same inputs, and to the fp32
rank-order sum. Skipped with a reason on a machine without a GPU or without the built extension.
"""

from __future__ import annotations

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from pcie_allreduce.hierarchy import HierarchicalCommunicator
from pcie_allreduce.fabric.nodes import equal_nodes
from tests import _reference as ref
from tests._allreduce_gpu import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
MAX_BYTES = 2 << 20
CASES = [(1, torch.bfloat16), (7, torch.float16), (4099, torch.bfloat16), (4 * 7168, torch.bfloat16),
         (32 * 7168 + 3, torch.float16), (1000, torch.float32)]


def _hierarchy_matches_one_node(ctx: ranks.RankContext, node_counts: list[int]) -> dict:
    single = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    checked = 0
    for count in node_counts:
        layout = equal_nodes(ctx.world_size, count)
        comm = HierarchicalCommunicator(ctx.group, ctx.device, layout=layout, inter_node_timeout_s=60,
                                        max_bytes=2 * MAX_BYTES, timeout_s=30)
        for seed, (numel, dtype) in enumerate(CASES):
            inputs = ref.all_inputs(seed + 10 * count, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            out = torch.full_like(x, float("nan"))
            comm.all_reduce(x, out=out)
            flat = single.all_reduce(x)
            what = f"{count} nodes, {numel} x {dtype}"
            assert torch.equal(ref.bits(out).cpu(), ref.bits(flat).cpu()), f"{what}: not the single-node bits"
            assert torch.equal(ref.bits(out).cpu(), ref.bits(ref.exact(inputs))), f"{what}: not the rank-order sum"
            checked += 1
        for tokens in (1, 4, 32):
            xs = ref.all_inputs(7 + tokens, ctx.world_size, tokens * 7168, torch.bfloat16)
            x = xs[ctx.rank].view(tokens, 7168).to(ctx.device)
            residual = ref.rank_input(99, 0, tokens * 7168, torch.bfloat16).view(tokens, 7168).to(ctx.device)
            weight = (1 + ref.rank_input(98, 0, 7168, torch.float32) / 8).to(torch.bfloat16).to(ctx.device)
            poisoned = [torch.full_like(x, float("nan")) for _ in range(2)]
            normed, new_residual = comm.all_reduce_rmsnorm(x, residual, weight, 1e-6, out=poisoned[0],
                                                           residual_out=poisoned[1])
            want_normed, want_residual = single.all_reduce_rmsnorm(x, residual, weight, 1e-6, algo="unfused")
            assert torch.equal(ref.bits(new_residual), ref.bits(want_residual)), f"{count} nodes, T={tokens}: residual"
            assert torch.equal(ref.bits(normed), ref.bits(want_normed)), f"{count} nodes, T={tokens}: normed"
            reduced = ref.exact(xs).view(tokens, 7168)
            assert torch.equal(ref.bits(new_residual.cpu()), ref.bits(residual.cpu() + reduced)), "residual + sum"
            ref.check_rmsnorm(normed.cpu(), new_residual.cpu(), weight.cpu(), 1e-6, f"{count} nodes, T={tokens}")
            checked += 1
        torch.cuda.synchronize()
        comm.close()
    single.check()
    single.close()
    return {"checked": checked}


# (W, node counts): 2 x 2 and 4 x 1, 2 x 4 and 4 x 2, 4 x 4 ranks
@pytest.mark.parametrize("world, node_counts", [(4, [2, 4]), (8, [2, 4]), (16, [4])])
def test_hierarchy_is_bitwise_the_single_node_result(world: int, node_counts: list[int]) -> None:
    results = ranks.run_ranks(_hierarchy_matches_one_node, world, node_counts, timeout_s=400)
    assert all(r["checked"] == (len(CASES) + 3) * len(node_counts) for r in results), results


def _silent_last_node_rank(ctx: ranks.RankContext) -> dict:
    import time

    from pcie_allreduce.errors import InterNodeError

    comm = HierarchicalCommunicator(ctx.group, ctx.device, layout=equal_nodes(4, 2), inter_node_timeout_s=3,
                                    max_bytes=MAX_BYTES, timeout_s=5)
    if ctx.rank == 2:  # the last node's first rank never sends node 0's first rank its shard of the result
        comm._link.send = lambda tensor, peer, step: None  # type: ignore[method-assign]
    x = ref.rank_input(5, ctx.rank, 4 * 7168, torch.bfloat16).to(ctx.device)
    started = time.monotonic()
    raised = None
    try:
        comm.all_reduce(x)
        torch.cuda.synchronize()
        comm.check()
    except InterNodeError as exc:
        raised = {"peer": exc.peer, "stage": exc.stage, "rank": exc.rank}
    except RuntimeError as exc:  # the node's own all-reduce: its peer gone, the kernel's bounded wait
        raised = {"node": " ".join(str(exc).split())[:300]}
    return {"raised": raised, "elapsed": time.monotonic() - started}


def test_a_silent_inter_node_peer_raises_on_gpus_never_hangs() -> None:
    """Two nodes of two GPU ranks: the last node's first rank never sends rank 0 its shard of the
    result. Rank 0 raises InterNodeError naming the step and the peer; its node peer's kernel
    gives up within the node's timeout and raises; nothing hangs."""
    results = ranks.run_ranks(_silent_last_node_rank, 4, timeout_s=180)
    assert results[0]["raised"] == {"peer": 2, "stage": "the result from node 1", "rank": 0}, results
    assert results[1]["raised"] is not None, results
    assert all(r["elapsed"] < 60 for r in results), results


def _graph_across_nodes(ctx: ranks.RankContext, replays: int) -> dict:
    from pcie_allreduce import hierarchy

    comm = HierarchicalCommunicator(ctx.group, ctx.device, layout=equal_nodes(ctx.world_size, 2),
                                    inter_node_backend="nccl", inter_node_timeout_s=30, max_bytes=MAX_BYTES,
                                    timeout_s=30)
    between = comm._link.group
    shapes = [(4 * 7168, torch.bfloat16), (7, torch.float16), (1000, torch.float32)]
    static_in = [torch.zeros(n, dtype=d, device=ctx.device) for n, d in shapes]
    outs = [torch.full_like(x, float("nan")) for x in static_in]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, out in zip(static_in, outs):
            comm.all_reduce(x, out=out)
    checked = 0
    for rep in range(replays):
        inputs = [ref.all_inputs(500 + rep, ctx.world_size, n, d) for n, d in shapes]
        for buf, per_rank in zip(static_in, inputs):
            buf.copy_(per_rank[ctx.rank])
        graph.replay()
        torch.cuda.synchronize()
        for out, per_rank, (n, d) in zip(outs, inputs, shapes):
            assert torch.equal(ref.bits(out.cpu()), ref.bits(ref.exact(per_rank))), f"replay {rep}: {n} x {d}"
            checked += 1
    comm.check()
    captured = comm._link.captured
    comm.close()
    kept = any(g is between for g in hierarchy._NEVER_SHUT_DOWN)  # a graph may still replay its sends
    return {"checked": checked, "captured": captured, "kept": kept}


def _graph_skip_reason() -> str | None:
    if SKIP_REASON is not None:
        return SKIP_REASON
    count = ranks.gpu_count()
    return None if count >= 2 else (f"the graph path sends between nodes over NCCL, which takes one GPU per rank "
                                    f"and two ranks at least: {count} GPU here")


@pytest.mark.skipif(_graph_skip_reason() is not None, reason=_graph_skip_reason() or "")
def test_the_hierarchy_in_a_cuda_graph_over_nccl() -> None:
    """The plugin's decode path: the hierarchy captured in a CUDA graph, NCCL between two nodes
    (of one rank each on two GPUs, of two on four), every replay bitwise the flat rank-order sum
    on every rank; close() keeps the NCCL group a graph captured sends on."""
    world = 4 if ranks.gpu_count() >= 4 else 2
    results = ranks.run_ranks(_graph_across_nodes, world, 5, timeout_s=300)
    assert all(r == {"checked": 15, "captured": True, "kept": True} for r in results), results
