"""Multi-rank GPU tests of the fused all-reduce + residual + RMSNorm (W ranks; one GPU under MPS)."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Sequence

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from tests import _reference as ref
from tests._allreduce_gpu import SKIP_REASON, TRANSPORTS, timed_out_peer

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

WORLDS = [int(w) for w in os.environ.get("PCIE_AR_TEST_WORLDS", "2,4,8").split(",")]
TOKENS = (1, 4, 8, 32, 128)
HIDDENS = (4096, 7168, 8192, 2050)  # 2050: rows not a multiple of 16 bytes (the unaligned variants)
MAX_BYTES = 128 * 8192 * 2
EPS = 1e-6


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _case(ctx: ranks.RankContext, tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    """(every rank's x, residual, weight, the rank-order sum of x, residual + that sum), on the CPU."""
    xs = [ref.rank_input(seed, r, tokens * hidden, dtype).view(tokens, hidden) for r in range(ctx.world_size)]
    residual = ref.rank_input(seed, 99, tokens * hidden, dtype).view(tokens, hidden)
    weight = (1 + 0.1 * ref.rank_input(seed, 98, hidden, torch.float32)).to(dtype)
    reduced = ref.exact([x.reshape(-1) for x in xs]).view(tokens, hidden)
    return xs, residual, weight, reduced, residual + reduced


def _check(normed, new_res, want_res, weight, what, comm=None):
    """The new residual bitwise ``residual + all_reduce(x)``; normed within ``ref.NORM_ULPS`` of
    the fp64 RMSNorm of that new residual (on the outputs' device). A call that gave up leaves
    NaN: with ``comm``, the error it recorded (timeout or mismatch, naming rank, peer and stage)
    is raised first, so a failure says why rather than only that the sums differ."""
    if comm is not None and bool(torch.isnan(new_res).any()):
        try:
            comm.check()
        except Exception as exc:  # the call that gave up, named: which shape and kernel
            raise AssertionError(f"{what} (block cap {comm.block_cap}) gave up: {exc}") from exc
    assert torch.equal(new_res, want_res.to(new_res.device)), \
        f"{what}: new residual is not bitwise residual + all_reduce(x)"
    ref.check_rmsnorm(normed, new_res, weight, EPS, what)


def _poisoned(*like: torch.Tensor) -> list[torch.Tensor]:
    return [torch.full_like(t, float("nan")) for t in like]


def _algos(comm: pcie_allreduce.Communicator, tokens: int, hidden: int, dtype: torch.dtype) -> list[str]:
    """Every fused kernel that can take this shape and W (every W up to MAX_RANKS), the unfused
    pair, and auto."""
    from pcie_allreduce.plan import algorithms
    from pcie_allreduce.plan import dispatch

    algos = [a for a in algorithms.FUSED_ALGORITHMS
             if algorithms.fused_problem(a, comm.world_size) is None
             and dispatch.fused_kernel_fits(a, tokens, hidden, dtype, comm.world_size, ll_capacity=comm.ll_capacity,
                                           block_cap=comm.block_cap)]
    return algos + ["auto"]


def _warm_up(comm: pcie_allreduce.Communicator, shapes: list[tuple[int, int]]) -> None:
    """Every kernel the test will run for ``shapes``, compiled ahead with the work shared out among
    the ranks (``warm_up_fused``), so the matrix compiles in about 1/W of the time; the calls
    then load them. A second warm-up of the same shapes must find nothing new."""
    for dtype in (torch.bfloat16, torch.float16):
        by_algo: dict[str, list[tuple[int, int]]] = {}
        for tokens, hidden in shapes:
            for algo in _algos(comm, tokens, hidden, dtype):
                by_algo.setdefault(algo, []).append((tokens, hidden))
        for algo, algo_shapes in by_algo.items():
            assert comm.warm_up_fused(algo_shapes, dtype, algo=algo) <= len(algo_shapes)
            assert comm.warm_up_fused(algo_shapes, dtype, algo=algo) == 0, f"{algo}: warmed shapes warmed again"


def _fused_matrix(ctx: ranks.RankContext, transport: str) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    _warm_up(comm, [(tokens, hidden) for tokens in TOKENS for hidden in HIDDENS])
    digests = {}
    seed = 0
    for dtype in (torch.bfloat16, torch.float16):
        for tokens in TOKENS:
            for hidden in HIDDENS:
                seed += 1
                xs, residual, weight, _, want_res = _case(ctx, tokens, hidden, dtype, seed)
                x, res, w = xs[ctx.rank].to(ctx.device), residual.to(ctx.device), weight.to(ctx.device)
                residuals, per_algo = [], {}
                for algo in _algos(comm, tokens, hidden, dtype):
                    # poisoned outputs of their own: a freed output of the previous algorithm, which the
                    # allocator hands out again, already holds the right answer
                    normed, new_res = _poisoned(x, res)
                    comm.all_reduce_rmsnorm(x, res, w, EPS, out=normed, residual_out=new_res, algo=algo)
                    _check(normed, new_res, want_res, w, f"{dtype} T={tokens} H={hidden} {algo}", comm)
                    residuals.append(_digest(new_res))
                    per_algo[algo] = _digest(normed, new_res)
                # The new residual is THE all-reduce formula in every kernel. The norm's statistics are
                # summed in a kernel-specific order, so normed may differ in the last bit between kernels,
                # never between ranks (the per-algorithm digests are compared across ranks below).
                assert len(set(residuals)) == 1, f"{dtype} T={tokens} H={hidden}: new residuals disagree bitwise"
                # the plain path: residual + all_reduce(x) must give the same bits
                plain = res + comm.all_reduce(x)
                assert torch.equal(plain.cpu(), want_res)
                for algo in per_algo:
                    if tokens == 4:
                        # tensors 2 bytes past a 4-byte boundary: the kernels' unaligned variants, same bits;
                        # then on even ranks only, beside aligned ranks' vector variants (same wire, same sums)
                        for misaligned_ranks in ("every", "even"):
                            tensors = (x, res, *_poisoned(x, res))
                            if misaligned_ranks == "every" or ctx.rank % 2 == 0:
                                tensors = tuple(ref.misaligned_copy(t) for t in tensors)
                            xm, resm, outm, res_outm = tensors
                            comm.all_reduce_rmsnorm(xm, resm, w, EPS, out=outm, residual_out=res_outm, algo=algo)
                            assert _digest(outm, res_outm) == per_algo[algo], \
                                f"{algo}: misaligned tensors on {misaligned_ranks} rank(s) differ"
                # in place: normed into x, new residual into residual
                x2, res2 = x.clone(), res.clone()
                comm.all_reduce_rmsnorm(x2, res2, w, EPS, out=x2, residual_out=res2)
                assert _digest(x2, res2) == per_algo["auto"], "in place differs from out of place"
                digests.update({f"{dtype}-{tokens}-{hidden}-{a}": d for a, d in per_algo.items()})
    comm.check()
    comm.close()
    return digests


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
def test_fused_matches_reference_and_is_bitwise_identical_across_ranks(world: int, transport: str) -> None:
    results = ranks.run_ranks(_fused_matrix, world, transport, timeout_s=900)
    assert all(r == results[0] for r in results), "ranks disagree bitwise"


def _fused_graph(ctx: ranks.RankContext, transport: str, replays: int, algo: str = "auto") -> dict:
    """8 layers x (fused, plain all-reduce) on 4 token counts in one graph, like a verify pass,
    replayed with fresh inputs copied into the graph's static tensors before each replay and
    every output (normed, new residual, plain) poisoned before and checked after it."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    # dependent launch: on by default where the GPU has it, off under PCIE_AR_PDL=0
    assert comm.dependent_launch == (os.environ.get("PCIE_AR_PDL") != "0"
                                     and torch.cuda.get_device_capability(ctx.device)[0] >= 9)
    hidden, dtype, token_counts = 7168, torch.bfloat16, (1, 4, 32, 128)
    static = [(torch.empty(t, hidden, dtype=dtype, device=ctx.device), torch.empty(t, hidden, dtype=dtype,
               device=ctx.device), torch.empty(hidden, dtype=dtype, device=ctx.device)) for t in token_counts]

    def load(seed: int) -> list:
        cases = [_case(ctx, t, hidden, dtype, seed + t) for t in token_counts]
        for (x, res, w), (xs, residual, weight, _, _) in zip(static, cases):
            x.copy_(xs[ctx.rank])
            res.copy_(residual)
            w.copy_(weight)
        return cases

    load(500)
    comm.warm_up_fused([(t, hidden) for t in token_counts], dtype, algo=algo)  # compiled, shared out
    for x, res, w in static:  # every shape's first call outside the capture
        comm.all_reduce_rmsnorm(x, res, w, EPS, algo=algo)
    torch.cuda.synchronize()
    fused, plain = [], []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):
            for x, res, w in static:
                fused.append(comm.all_reduce_rmsnorm(x, res, w, EPS, algo=algo))
                plain.append(comm.all_reduce(x))
    digests = []
    for rep in range(replays):
        cases = load(1000 * (rep + 1))
        for t in (*[t for pair in fused for t in pair], *plain):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        wants = [(reduced.to(ctx.device), want_res.to(ctx.device)) for _, _, _, reduced, want_res in cases]
        for i, ((normed, new_res), out) in enumerate(zip(fused, plain)):
            xs = cases[i % 4][0]
            reduced, want_res = wants[i % 4]
            _check(normed, new_res, want_res, static[i % 4][2], f"replay {rep} graph call {i}", comm)
            assert torch.equal(out, reduced), f"replay {rep} plain call {i}: not the rank-order fp32 sum"
            if i < 4:
                ref.check(out, [x.reshape(-1) for x in xs], f"replay {rep} plain call {i}")
        digests.append(_digest(*[normed for normed, _ in fused]))  # the other outputs are pinned bitwise above
    comm.check()
    comm.close()
    return {"digests": digests}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
def test_fused_inside_cuda_graph(world: int, transport: str) -> None:
    results = ranks.run_ranks(_fused_graph, world, transport, 5, timeout_s=900)
    assert len(results[0]["digests"]) == 5 and all(r == results[0] for r in results), "ranks disagree bitwise"


def _each_algo(ctx: ranks.RankContext, rank_fn: Callable[..., Any], algos: Sequence[str], *args: Any) -> dict:
    """``rank_fn(ctx, *args, algo)`` for each of ``algos`` in turn, in one set of ranks (each call
    makes and closes its own communicator): the per-algorithm checks of a test without a spawn
    of W processes for each."""
    return {algo: rank_fn(ctx, *args, algo) for algo in algos}


# The graph test above launches every kernel as its predecessor's programmatic dependent (the
# default on Hopper and later: the fused kernels, and the unfused pair's norm kernel dependent on
# the all-reduce); this one the ordinary way ($PCIE_AR_PDL=0), the same checks, for the fused
# call and the unfused pair.
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 8)] or WORLDS[:1])
def test_fused_and_unfused_with_the_ordinary_launch(world: int) -> None:
    algos = ("auto", "unfused")
    results = ranks.run_ranks(_each_algo, world, _fused_graph, algos, "p2p", 5, timeout_s=900,
                              env={"PCIE_AR_PDL": "0"})
    for algo in algos:
        assert len(results[0][algo]["digests"]) == 5, f"{algo}: not every replay was checked"
        assert all(r[algo] == results[0][algo] for r in results), f"{algo}: ranks disagree bitwise"


def _small_call(world: int) -> tuple[int, int]:
    """(tokens, hidden) of a call every fused kernel takes at ``world`` ranks on one GPU: above 8
    ranks the block cap (the GPU's SMs shared out) leaves a data-as-flag kernel too few programs
    for 4 x 7168."""
    return (4, 7168) if world <= 8 else (1, 4096)


CAPTURED_REPLAYS = 3  # replays of a stream's captured first fused call, each digest checked


def _first_fused_call_captured(ctx: ranks.RankContext, transport: str, algo: str) -> str:
    """A stream prepared before a graph capture (prepare_stream, as the plugins do) whose first
    fused call is inside it; each replay on fresh inputs copied into the captured tensors, both
    outputs poisoned first and checked after."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)

    def case(seed: int) -> tuple:
        xs, residual, weight, _, want_res = _case(ctx, *_small_call(ctx.world_size), torch.bfloat16, seed)
        return xs[ctx.rank].to(ctx.device), residual.to(ctx.device), weight.to(ctx.device), want_res

    x, res, w, _ = case(91)
    comm.all_reduce_rmsnorm(x, res, w, EPS, algo=algo)  # compiles the shape, on another stream's workspace
    side = torch.cuda.Stream(ctx.device)
    comm.prepare_stream(side.cuda_stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        normed, new_res = comm.all_reduce_rmsnorm(x, res, w, EPS, algo=algo)
    digests = []
    for replay in range(CAPTURED_REPLAYS):
        fresh_x, fresh_res, fresh_w, want_res = case(92 + replay)
        x.copy_(fresh_x)
        res.copy_(fresh_res)
        w.copy_(fresh_w)
        normed.fill_(float("nan"))
        new_res.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(normed, new_res, want_res, w, f"{algo}: replay {replay} of a stream's first fused call", comm)
        digests.append(_digest(normed, new_res))
    comm.check()
    comm.close()
    return "".join(digests)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 16)])
def test_a_prepared_streams_first_fused_call_may_be_captured(world: int, transport: str) -> None:
    algos = ("oneshot", "oneshot_ll")
    results = ranks.run_ranks(_each_algo, world, _first_fused_call_captured, algos, transport, timeout_s=600)
    for algo in algos:
        assert len(results[0][algo]) == CAPTURED_REPLAYS * len(_digest()), f"{algo}: not every replay was checked"
        assert all(r[algo] == results[0][algo] for r in results), f"{algo}: ranks disagree bitwise"


def _fused_call_gives_up(ctx: ranks.RankContext, algo: str) -> dict:
    """The last rank never issues one fused call: every other rank's call gives up after timeout_s,
    raises through check(), and leaves NaN in both outputs (normed and new residual)."""
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=2.0)
    xs, residual, weight, _, want_res = _case(ctx, *_small_call(ctx.world_size), torch.bfloat16, 77)
    x, res, w = xs[ctx.rank].to(ctx.device), residual.to(ctx.device), weight.to(ctx.device)
    normed, new_res = comm.all_reduce_rmsnorm(x, res, w, EPS, algo=algo)  # also compiles the kernel
    torch.cuda.synchronize()
    _check(normed, new_res, want_res, w, f"{algo} before the failure", comm)
    normed.fill_(7.0)
    new_res.fill_(7.0)
    torch.distributed.barrier(group=ctx.group)
    late = ctx.rank == ctx.world_size - 1
    if not late:
        comm.all_reduce_rmsnorm(x, res, w, EPS, out=normed, residual_out=new_res, algo=algo)
    torch.cuda.synchronize()
    raised = timed_out_peer(comm)
    result = {"late": late, "raised": raised,
              "all_nan": [bool(torch.isnan(normed).all()), bool(torch.isnan(new_res).all())]}
    comm.close()
    return result


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4, 16)])
def test_a_fused_call_that_gives_up_leaves_nan_in_both_outputs(world: int) -> None:
    algos = ("oneshot", "twoshot", "oneshot_ll", "oneshot_full", "unfused")
    results = ranks.run_ranks(_each_algo, world, _fused_call_gives_up, algos, timeout_s=300 + 60 * len(algos))
    for rank, per_algo in enumerate(results):
        for algo in algos:
            r = per_algo[algo]
            if r["late"]:
                continue
            assert r["raised"] == world - 1, f"{algo}, rank {rank}: check() did not name the late rank: {r}"
            assert r["all_nan"] == [True, True], f"{algo}, rank {rank}: the fused call that gave up left data: {r}"


# The late-rank test's kernel timeout; its late rank arrives three times this late.
LATE_TIMEOUT_S = 2.0


def _first_calls_of_a_late_rank(ctx: ranks.RankContext) -> dict:
    """The last rank reaches the first fused call of each shape 6 s after the others (eagerly,
    then inside a graph capture), three times the kernels' timeout: the others wait for it while
    compiling, never inside a kernel, so every call completes with the right result."""
    import time

    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=LATE_TIMEOUT_S)
    late = ctx.rank == ctx.world_size - 1
    outcomes = []
    for capture, tokens, algo in ((False, 4, "auto"), (False, 3, "oneshot"), (True, 5, "auto"), (True, 6, "twoshot")):
        xs, residual, weight, _, want_res = _case(ctx, tokens, 7168, torch.bfloat16, 900 + tokens)
        x, res, w = xs[ctx.rank].to(ctx.device), residual.to(ctx.device), weight.to(ctx.device)
        torch.distributed.barrier(group=ctx.group)
        if late:
            time.sleep(3 * LATE_TIMEOUT_S)
        if capture:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                normed, new_res = comm.all_reduce_rmsnorm(x, res, w, EPS, algo=algo)
            graph.replay()
        else:
            normed, new_res = comm.all_reduce_rmsnorm(x, res, w, EPS, algo=algo)
        torch.cuda.synchronize()
        comm.check()
        _check(normed, new_res, want_res, w, f"first call of T={tokens} {algo} (capture={capture})", comm)
        outcomes.append(_digest(normed, new_res))
    comm.close()
    return {"digests": outcomes}


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_a_rank_late_to_the_first_call_of_a_shape_does_not_trip_the_timeout(world: int) -> None:
    results = ranks.run_ranks(_first_calls_of_a_late_rank, world, timeout_s=300)
    assert all(r == results[0] for r in results), "ranks disagree bitwise"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_rmsnorm_kernel_compiled(dtype: torch.dtype) -> None:
    """The one add + RMSNorm kernel of the unfused path, compiled (one GPU, one process): against
    the fp64 norm, new residual bitwise ``residual + y``, outputs poisoned first, fresh inputs per
    shape, and the vector and scalar variants (aligned, misaligned views) give the same bits."""
    from pcie_allreduce.fused import path as fused_path

    device = torch.device("cuda", 0)
    gen = torch.Generator(device=device).manual_seed(5)
    for tokens, hidden in ((1, 7168), (4, 7168), (32, 7168), (128, 7168), (3, 2050), (5, 4096), (7, 8191)):
        y = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
        residual = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
        normed = torch.full_like(y, float("nan"))
        new_residual = torch.full_like(y, float("nan"))
        fused_path.add_rmsnorm(y, residual, weight, EPS, normed, new_residual)
        _check(normed, new_residual, residual + y, weight, f"add_rmsnorm [{tokens}, {hidden}] {dtype}")
        ym, rm = ref.misaligned_copy(y), ref.misaligned_copy(residual)
        fused_path.add_rmsnorm(ym, rm, weight, EPS, ym, rm)  # in place, misaligned
        assert _digest(ym, rm) == _digest(normed, new_residual), f"[{tokens}, {hidden}]: misaligned variant differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_statistic_compiled_is_its_specification_bit_for_bit(dtype: torch.dtype) -> None:
    """The row statistic every fused kernel and the add + RMSNorm kernel share, compiled for this
    GPU, gives the bits its specification gives (tests/_statistic.py: every branch, sums on an
    fp32 rounding tie, inf and NaN), forwards and reversed: the compiled code, not only the
    interpreter, keeps the contract that makes the norm independent of order and layout."""
    from tests import _statistic as stat

    wrong = stat.contract_violations(dtype, "cuda")
    assert not wrong, "\n".join(wrong)
