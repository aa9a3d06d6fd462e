"""Multi-rank GPU tests of the CUDA all-reduce kernels' results (W ranks; on one GPU under MPS):
every algorithm, dtype and size against the fp64 reference, in and out of CUDA graphs, and the
two transports bitwise equal. The failure and lifecycle tests are test_allreduce_faults_gpu.py and
test_allreduce_lifecycle_gpu.py.

Skipped with a reason on a machine without a GPU or without the built extension.
Each test spawns W ranks once and runs a whole scenario inside them, because spawning is the
expensive part.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from pcie_allreduce.plan import algorithms
from pcie_allreduce.plan.algorithms import ALGO_IDS
from tests import _reference as ref
from tests._allreduce_gpu import ALGOS, DTYPES, MAX_BYTES, SKIP_REASON, TRANSPORTS, WORLDS, algos_of

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def _sizes(dtype: torch.dtype, seed: int) -> list[int]:
    es = torch.empty((), dtype=dtype).element_size()
    rng = random.Random(seed)
    fixed = [1, 7, 4096, 7168, 4 * 7168, 32 * 7168, (1 << 20) // es, MAX_BYTES // es]
    odd = [rng.randrange(1, 4096) | 1, rng.randrange(4096, MAX_BYTES // es) | 1]
    return fixed + odd


def _symmetric_results(comm: pcie_allreduce.Communicator, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x`` all-reduced from the symmetric input area (p2p): every in-place algorithm forced and
    auto, out of place and in place, with the area rewritten before each call (in place overwrites
    it); forcing one on an ordinary tensor is refused. Empty on the host transport."""
    if comm.transport != "p2p":
        with pytest.raises(ValueError, match="p2p transport"):
            comm.symmetric_input(x.shape, x.dtype)
        return {}
    results = {}
    area = comm.symmetric_input(x.shape, x.dtype)
    for algo in algorithms.SYMMETRIC_INPUT_ALGORITHMS + ("auto",):
        area.copy_(x)
        out = torch.full_like(x, float("nan"))
        comm.all_reduce(area, out=out, algo=algo)
        results[f"symmetric-{algo}"] = out
        area.copy_(x)
        comm.all_reduce(area, out=area, algo=algo)
        results[f"symmetric-{algo}-in-place"] = area.clone()
    for algo in algorithms.SYMMETRIC_INPUT_ALGORITHMS:
        with pytest.raises(ValueError, match="symmetric_input"):
            comm.all_reduce(x, algo=algo)
    return results


def _matrix(ctx: ranks.RankContext, transport: str) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    assert comm.transport == transport
    checks = 0
    for dtype in DTYPES:
        for seed, numel in enumerate(_sizes(dtype, 17)):
            inputs = ref.all_inputs(seed, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            results = {}
            algos = tuple(a for a in algos_of(comm)
                          if algorithms.fits_capacity(a, numel * x.element_size(), comm.ll_capacity))
            for algo in algos + ("auto",):
                out = torch.full_like(x, float("nan"))
                comm.all_reduce(x, out=out, algo=algo)
                results[algo] = out
            inplace = x.clone()
            comm.all_reduce(inplace, out=inplace, algo="auto")
            results["in-place"] = inplace
            # A view that is not 16-byte aligned takes the element-wise path; same bytes, same result.
            unaligned_buf = torch.empty(numel + 1, dtype=dtype, device=ctx.device)
            unaligned = unaligned_buf[1:]
            unaligned.copy_(x)
            for algo in algos:
                out = torch.full_like(x, float("nan"))
                comm.all_reduce(unaligned, out=out, algo=algo)
                results[f"unaligned-{algo}"] = out
            results.update(_symmetric_results(comm, x))
            for capped in algorithms.CAPPED_ALGORITHMS:
                if capped not in algos:
                    with pytest.raises(ValueError, match=capped):
                        comm.all_reduce(x, algo=capped)
            torch.cuda.synchronize()
            assert torch.equal(x.cpu(), inputs[ctx.rank]), "out-of-place call modified its input"
            for name, out in results.items():
                ref.check(out, inputs, f"W={ctx.world_size} rank {ctx.rank} {dtype} numel={numel} {name}")
                checks += 1
    comm.check()
    comm.close()
    return {"checks": checks}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
def test_matrix_every_algorithm_dtype_and_size(world: int, transport: str) -> None:
    results = ranks.run_ranks(_matrix, world, transport, timeout_s=600)
    assert all(r["checks"] == results[0]["checks"] > 0 for r in results)


def _graph(ctx: ranks.RankContext, captured: int, replays: int, transport: str) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    # dependent launch: on by default where the GPU has it, off under PCIE_AR_PDL=0
    assert comm.dependent_launch == (os.environ.get("PCIE_AR_PDL") != "0"
                                     and torch.cuda.get_device_capability(ctx.device)[0] >= 9)
    rng = random.Random(5)
    algos = algos_of(comm) + ("auto",)
    shapes = [(rng.choice([1, 7, 4 * 7168, 7168 * 3 + 5, 100_000]), rng.choice(DTYPES), algos[i % len(algos)])
              for i in range(8)]
    static_in = [torch.empty(n, dtype=d, device=ctx.device) for n, d, _ in shapes]
    outs = [torch.full((shapes[i % 8][0],), float("nan"), dtype=shapes[i % 8][1], device=ctx.device)
            for i in range(captured)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the capture stream's workspace is created inside the capture
        for i in range(captured):
            comm.all_reduce(static_in[i % 8], out=outs[i], algo=shapes[i % 8][2])
    # Every replay's every output is compared bitwise on the GPU with the rank-order sum (one op
    # per input shape, no synchronization; counts read at the end); every 20th is also checked
    # against fp64 on the CPU, with messages naming the call.
    bad = torch.zeros(replays, 8, dtype=torch.int64, device=ctx.device)
    for rep in range(replays):
        inputs = [ref.all_inputs(1000 + rep, ctx.world_size, n, d) for n, d, _ in shapes]
        wants = [ref.exact(per_rank).to(ctx.device) for per_rank in inputs]
        for buf, per_rank in zip(static_in, inputs):
            buf.copy_(per_rank[ctx.rank])
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        for k in range(8):
            got = torch.stack(outs[k::8])
            bad[rep, k] = ref.bitwise_mismatches(got, wants[k]).sum()
        if rep % 20 == 0 or rep == replays - 1:
            torch.cuda.synchronize()
            for i, out in enumerate(outs):
                ref.check(out, inputs[i % 8], f"graph replay {rep} call {i}")
    torch.cuda.synchronize()
    comm.check()
    bad = bad.cpu()
    failed = bad.nonzero().tolist()
    assert not failed, (f"W={ctx.world_size} rank {ctx.rank}: wrong elements in {len(failed)} (replay, shape) pairs; "
                        f"first: replay {failed[0][0]}, the calls on input {failed[0][1]} {shapes[failed[0][1]]}: "
                        f"{int(bad[failed[0][0], failed[0][1]])} elements differ from the rank-order fp32 sum")
    comm.close()
    return {"checked": replays * captured}


LARGE_BYTES = 16 << 20


def _large(ctx: ranks.RankContext, transport: str) -> dict:
    """Every uncapped algorithm of the transport at 5 MiB - 16 MiB (odd sizes among them), bitwise
    the plain two-shot's result and within the fp64 reference."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=LARGE_BYTES, timeout_s=30, transport=transport)
    checks = 0
    for dtype in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dtype).element_size()
        for seed, numel in enumerate((LARGE_BYTES // es, LARGE_BYTES // es - 3, (5 << 20) // es + 1)):
            inputs = ref.all_inputs(300 + seed, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            outs = {}
            for algo in ("twoshot",) + tuple(a for a in algos_of(comm) if a not in algorithms.CAPPED_ALGORITHMS):
                out = torch.full_like(x, float("nan"))
                comm.all_reduce(x, out=out, algo=algo)
                outs[algo] = out
            outs.update(_symmetric_results(comm, x))
            torch.cuda.synchronize()
            what = f"W={ctx.world_size} rank {ctx.rank} {transport} {dtype} numel={numel}"
            ref.check(outs["twoshot"], inputs, f"{what} twoshot")  # the others: bitwise this checked result
            bits = torch.int16 if es == 2 else torch.int32
            for algo, got in outs.items():
                assert torch.equal(got.view(bits), outs["twoshot"].view(bits)), f"{what} {algo}: not bitwise twoshot's"
                checks += 1
    comm.check()
    comm.close()
    return {"checks": checks}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 8)] or WORLDS[:1])
def test_large_messages_up_to_16_mib_through_every_uncapped_algorithm(world: int, transport: str) -> None:
    results = ranks.run_ranks(_large, world, transport, timeout_s=600)
    assert all(r["checks"] == results[0]["checks"] > 0 for r in results)



def _symmetric_graph(ctx: ranks.RankContext, replays: int) -> dict:
    """Calls from the symmetric input area captured on one stream (out of place, then in place),
    the area rewritten with fresh inputs before every replay; every output checked."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    stream = torch.cuda.Stream(ctx.device)
    numel, dtype = (3 << 20) // 4 + 5, torch.bfloat16  # past the one-shots' sizes: auto takes twoshot_symm
    area = comm.symmetric_input(numel, dtype, stream=stream)
    assert comm._choice(numel * 2, dtype, "auto", symmetric=True)[0] == ALGO_IDS["twoshot_symm"]
    outs = [torch.empty(numel, dtype=dtype, device=ctx.device) for _ in range(3)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        comm.all_reduce(area, out=outs[0], algo="twoshot_symm")
        comm.all_reduce(area, out=outs[1])  # auto
        comm.all_reduce(area, out=area)  # in place, last: it overwrites the input
        outs[2].copy_(area)
    for rep in range(replays):
        inputs = ref.all_inputs(2000 + rep, ctx.world_size, numel, dtype)
        area.copy_(inputs[ctx.rank])
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        for i, out in enumerate(outs):
            ref.check(out, inputs, f"W={ctx.world_size} symmetric graph replay {rep} call {i}")
    comm.check()
    comm.close()
    return {"checked": replays * len(outs)}


@pytest.mark.parametrize("world", WORLDS)
def test_symmetric_input_calls_in_a_cuda_graph(world: int) -> None:
    results = ranks.run_ranks(_symmetric_graph, world, 12, timeout_s=300)
    assert all(r["checked"] == 36 for r in results)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
def test_cuda_graph_128_calls_replayed_100_times(world: int, transport: str) -> None:
    results = ranks.run_ranks(_graph, world, 128, 100, transport, timeout_s=600)
    assert all(r["checked"] == 128 * 100 for r in results)


# The test above launches every call as the previous kernel's programmatic dependent (the default
# on Hopper and later: each kernel waits for the one before it before it reads anything); this one
# the ordinary way ($PCIE_AR_PDL=0), the same checks, every algorithm.
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 8)] or WORLDS[:1])
def test_calls_launched_the_ordinary_way(world: int, transport: str) -> None:
    results = ranks.run_ranks(_graph, world, 128, 30, transport, timeout_s=600, env={"PCIE_AR_PDL": "0"})
    assert all(r["checked"] == 128 * 30 for r in results)


# Rounds of the back-to-back test between two checks: each size has a ring of this many outputs.
RING = 8


def _back_to_back(ctx: ranks.RankContext, calls: int) -> dict:
    """``calls`` all-reduces of alternating sizes, issued in groups of RING rounds with no
    synchronization, every call checked: each has fresh integer inputs whose exact sum the rank
    computes with one tensor op (``ref.AffinePools``); the outputs of RING rounds sit in a ring per
    size, poisoned (NaN) before each reuse and compared on the GPU with the sums after the group,
    the mismatch counts accumulating on the GPU and read once at the end."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30)
    if not ctx.mps and ctx.shared_gpu:
        calls = min(calls, 500)  # time-sliced contexts: milliseconds per call
    sizes = [1, 4 * 7168, 7168 * 3 + 5, 262_143, 1 << 19]
    dtype = torch.bfloat16
    rounds = -(-calls // len(sizes))
    groups = -(-rounds // RING)
    pools = [ref.AffinePools(7, ctx.world_size, n, dtype) for n in sizes]
    mine = [p.pools[ctx.rank].to(ctx.device) for p in pools]
    totals = [p.total.to(ctx.device) for p in pools]

    def ring(n: int) -> torch.Tensor:  # RING rows of n, each 16-byte aligned like a tensor of its own
        return torch.empty(RING, -(-n // 8) * 8, dtype=dtype, device=ctx.device)[:, :n]

    ins, outs = [ring(n) for n in sizes], [ring(n) for n in sizes]
    wants = [torch.empty(RING, n, dtype=dtype, device=ctx.device) for n in sizes]
    bad = torch.zeros(groups, len(sizes), dtype=torch.int64, device=ctx.device)
    rng = random.Random(11)  # the same draws on every rank
    made = 0
    for g in range(groups):
        count = min(RING, rounds - g * RING)
        for k, n in enumerate(sizes):
            outs[k].fill_(float("nan"))
            for j in range(count):
                params = pools[k].draw(rng)
                ref.AffinePools.apply(mine[k], n, params, out=ins[k][j])
                ref.AffinePools.apply(totals[k], n, params, ctx.world_size, out=wants[k][j])
        for j in range(count):
            for k in range(len(sizes)):
                comm.all_reduce(ins[k][j], out=outs[k][j])
        made += count * len(sizes)
        for k in range(len(sizes)):
            bad[g, k] = ref.value_mismatches(outs[k][:count], wants[k][:count])
    torch.cuda.synchronize()
    comm.check()
    bad = bad.cpu()
    failed = bad.nonzero().tolist()
    if failed:
        g, k = failed[0]
        raise AssertionError(f"W={ctx.world_size} rank {ctx.rank}: {len(failed)} of {groups * len(sizes)} checks "
                             f"(RING={RING} calls of one size each) found wrong elements ({int(bad.sum())} in all); "
                             f"first: size {sizes[k]}, rounds {g * RING}..{g * RING + RING - 1}: {int(bad[g, k])} "
                             f"elements differ from the exact sum")
    # After the run, one more round with random normal inputs: bitwise the rank-order fp32 sum.
    inputs = [ref.all_inputs(7, ctx.world_size, n, dtype) for n in sizes]
    finals = []
    for per_rank in inputs:
        x = per_rank[ctx.rank].to(ctx.device)
        finals.append(comm.all_reduce(x, out=torch.full_like(x, float("nan"))))
    torch.cuda.synchronize()
    for n, out, per_rank in zip(sizes, finals, inputs):
        ref.check(out, per_rank, f"after {made} back-to-back calls, size {n}")
    comm.check()
    comm.close()
    return {"calls": made}


@pytest.mark.parametrize("world", WORLDS)
def test_10000_back_to_back_calls_of_alternating_sizes(world: int) -> None:
    results = ranks.run_ranks(_back_to_back, world, 10_000, timeout_s=600)
    assert all(r["calls"] == results[0]["calls"] >= 500 for r in results)


def _compiled(ctx: ranks.RankContext) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pcie_allreduce.all_reduce(x * 2, comm.handle, "auto") + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    inputs = ref.all_inputs(9, ctx.world_size, 7168, torch.float32)
    got = compiled(inputs[ctx.rank].to(ctx.device))
    want = ref.exact([x * 2 for x in inputs]) + 1
    assert torch.equal(got.cpu(), want)
    y = inputs[ctx.rank].to(ctx.device)
    torch.ops.pcie_allreduce.all_reduce_(y, comm.handle, "twoshot")
    ref.check(y, inputs, "in-place custom op")
    # The fused all-reduce + residual + RMSNorm as one opaque op of a compiled graph.
    hidden = 7168
    fused_inputs = ref.all_inputs(10, ctx.world_size, 4 * hidden, torch.bfloat16)
    x = fused_inputs[ctx.rank].to(ctx.device).view(4, hidden)
    residual = ref.rank_input(11, 0, 4 * hidden, torch.bfloat16).to(ctx.device).view(4, hidden)
    weight = (1 + 0.1 * ref.rank_input(12, 0, hidden, torch.float32)).to(torch.bfloat16).to(ctx.device)

    def fused_step(x: torch.Tensor, residual: torch.Tensor,
                   weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.pcie_allreduce.all_reduce_rmsnorm(x, residual, weight, 1e-6, comm.handle)

    normed, got = torch.compile(fused_step, backend="aot_eager", fullgraph=True)(x, residual, weight)
    assert torch.equal(got.cpu(), residual.cpu() + ref.exact(fused_inputs).view(4, hidden))
    ref.check_rmsnorm(normed, got, weight, 1e-6, "fused custom op under torch.compile")
    comm.close()
    return {}


def test_torch_library_op_under_torch_compile() -> None:
    ranks.run_ranks(_compiled, 2, timeout_s=300)

def _transports_agree(ctx: ranks.RankContext) -> dict:
    """The same inputs through both transports, plain (every algorithm) and fused: bitwise equal
    outputs, and the host transport's segments gone from /dev/shm once created."""
    from pcie_allreduce import transport

    comms = {name: pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30,
                                               transport=name) for name in ("p2p", "host")}
    leftovers = [p for p in os.listdir(transport.SHM_DIR) if transport.creator_of(p) == transport.current_creator()]
    differ = []
    for dtype in DTYPES:
        for numel in (5, 7168 * 4 + 3, 300_001):
            inputs = ref.all_inputs(numel, ctx.world_size, numel, dtype)
            x = inputs[ctx.rank].to(ctx.device)
            for algo in ALGOS:  # host_oneshot has no P2P counterpart: compared with the others below
                if not algorithms.fits_capacity(algo, numel * x.element_size(), comms["p2p"].ll_capacity):
                    continue
                outs = {name: comm.all_reduce(x, algo=algo) for name, comm in comms.items()}
                if not torch.equal(outs["p2p"], outs["host"]):
                    differ.append(f"{dtype} numel={numel} {algo}")
                ref.check(outs["host"], inputs, f"host transport {dtype} numel={numel} {algo}")
            for host_algo in algorithms.HOST_ONLY_ALGORITHMS:
                if not torch.equal(comms["host"].all_reduce(x, algo=host_algo), outs["p2p"]):
                    differ.append(f"{dtype} numel={numel} {host_algo} vs p2p {algo}")
    hidden, tokens = 7168, 4
    for call, algo in enumerate(("oneshot", "twoshot", "oneshot_ll", "oneshot_full")):
        # Fresh inputs per call, a weight that is not all ones, outputs poisoned first; each
        # transport's new residual is bitwise residual + the rank-order sum, its normed output
        # within the fp64 RMSNorm's bound, and the two transports bitwise equal.
        inputs = ref.all_inputs(31 + call, ctx.world_size, tokens * hidden, torch.bfloat16)
        x = inputs[ctx.rank].to(ctx.device).view(tokens, hidden)
        residual = ref.rank_input(32 + call, 0, tokens * hidden, torch.bfloat16).view(tokens, hidden).to(ctx.device)
        weight = (1 + 0.1 * ref.rank_input(33 + call, 0, hidden, torch.float32)).to(torch.bfloat16).to(ctx.device)
        want_residual = residual + ref.exact([t.to(ctx.device) for t in inputs]).view(tokens, hidden)
        fused = {}
        for name, comm in comms.items():
            normed, new_residual = torch.full_like(x, float("nan")), torch.full_like(residual, float("nan"))
            comm.all_reduce_rmsnorm(x, residual, weight, 1e-6, out=normed, residual_out=new_residual, algo=algo)
            if not torch.equal(new_residual, want_residual):
                differ.append(f"fused {algo} on {name}: the new residual is not residual + the rank-order sum")
            ref.check_rmsnorm(normed, new_residual, weight, 1e-6, f"fused {algo} on {name}")
            fused[name] = (normed, new_residual)
        if not all(torch.equal(a, b) for a, b in zip(fused["p2p"], fused["host"])):
            differ.append(f"fused {algo}")
    torch.cuda.synchronize()
    for comm in comms.values():
        comm.check()
        comm.close()
    return {"differ": differ, "leftovers": leftovers}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_p2p_and_host_transports_give_bitwise_equal_results(world: int) -> None:
    for rank, r in enumerate(ranks.run_ranks(_transports_agree, world, timeout_s=600)):
        assert r["differ"] == [], f"rank {rank}: the transports disagree on {r['differ']}"
        assert r["leftovers"] == [], f"rank {rank}: segments left in /dev/shm after creation: {r['leftovers']}"


def _wire_edge_values(ctx: ranks.RankContext) -> dict:
    """-0.0, NaN, +-Inf and the poison pattern as data (``ref.edge_inputs``: the bf16/fp16 lane
    0x8000 is -0.0; the fp32 word 0x80008000 a negative subnormal), on every rank at once and
    mixed, through every algorithm and ``auto`` on each transport, at a small and a medium odd
    size. Each call must deliver every element (data taken for the poison would be waited for
    until the timeout) and give, bitwise, what README documents: the rank-order fp32 sum, and for
    the full-payload algorithms the sum of what they send (-0.0 as +0.0 in bf16/fp16, the fp32
    poison word as -0.0); NaN where the sum is NaN. Outputs are poisoned first with a finite value
    no sum here takes, so an element left unwritten shows, NaN positions included."""
    mismatches = []
    for transport in TRANSPORTS:
        comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=10,
                                           transport=transport)
        for dtype in DTYPES:
            es = torch.empty((), dtype=dtype).element_size()
            for numel in (283, 40_001):
                inputs = ref.edge_inputs(numel, ctx.world_size, numel, dtype)
                x = inputs[ctx.rank].to(ctx.device)
                algos = [a for a in algos_of(comm) if algorithms.fits_capacity(a, numel * es, comm.ll_capacity)]
                results = {}
                for algo in (*algos, "auto"):
                    results[algo] = comm.all_reduce(x, out=torch.full_like(x, 30000.0), algo=algo)
                torch.cuda.synchronize()
                for algo, out in results.items():
                    runs = comm.select_algo(numel * es, dtype) if algo == "auto" else algo
                    want = ref.expected_sum(inputs, runs)
                    got = out.cpu()
                    bad = ref.bitwise_mismatches(got, want).nonzero().view(-1)
                    if len(bad):
                        i, mask = int(bad[0]), (1 << 8 * es) - 1
                        mismatches.append(f"{transport} {dtype} numel={numel} {algo} ({runs}): {len(bad)} elements "
                                          f"differ, first at {i}: got {got[i].item()!r} "
                                          f"(bits {ref.bits(got)[i].item() & mask:#x}), want {want[i].item()!r} "
                                          f"(bits {ref.bits(want)[i].item() & mask:#x})")
        comm.check()
        comm.close()
    return {"mismatches": mismatches}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_every_algorithm_carries_zeros_nan_inf_and_the_poison_word(world: int) -> None:
    for rank, r in enumerate(ranks.run_ranks(_wire_edge_values, world, timeout_s=300)):
        assert r["mismatches"] == [], f"rank {rank}: {r['mismatches']}"
