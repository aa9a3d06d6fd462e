"""What ``pcie-allreduce tune`` runs inside each of its W ranks: every launch shape checked, then timed
(and with ``--fused-tokens``, every fused call, :func:`measure_fused_rank`).

One Communicator per rank; per size, every (algorithm, block count) of the job's grid and the
default table's own shape (:func:`shapes_of`) is the workspace's raw launch at that forced block
count, bypassing the algorithm table. A shape must first return the exact sum
of the ranks' small-integer inputs (exact in any reduction order), then is timed as CUDA-graph
replays of ``calls_per_graph`` launches with the shared replay timer
(:mod:`pcie_allreduce.tools.timing`); a replay's time is the slowest rank's. Shapes over the block
cap or the low-latency capacity are skipped identically on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from pcie_allreduce import sizes
from pcie_allreduce.plan import algorithms, cache
from pcie_allreduce.plan.algorithms import ALGO_IDS, fits_capacity
from pcie_allreduce.plan.tables import AlgoTable, default_table
from pcie_allreduce.tools.timing import summarize, timed_replays
from pcie_allreduce.tools.tune.derive import OK, SKIPPED, WRONG

SYNC_COUNT = 8  # elements of the tiny all-reduce that lines the GPUs up before a timed replay


@dataclasses.dataclass(frozen=True)
class TuneJob:
    """What every rank measures: each size x algorithm x block count."""

    sizes: tuple[int, ...]
    algos: tuple[str, ...]
    blocks: tuple[int, ...]
    dtype: str = "bfloat16"
    iters: int = 30
    warmup: int = 5
    calls_per_graph: int = 16
    time_budget_s: float = 0.2
    kernel_timeout_s: float = 10.0
    transport: str = "auto"  # the communicator's (its algorithms are measured, its table written)


def skip_reason(algo: str, blocks: int, size_bytes: int, block_cap: int, ll_capacity: int | None) -> str | None:
    """Why a shape cannot run on this communicator (the same on every rank: both limits are agreed)."""
    if blocks > block_cap:
        return f"{blocks} blocks > block cap {block_cap} (ranks share a GPU)"
    if not fits_capacity(algo, size_bytes, ll_capacity):
        return f"{algo} takes messages up to {ll_capacity} bytes"
    return None


def measure_rank(ctx: Any, job: TuneJob) -> dict[str, Any]:
    """``run_ranks`` runs this in every rank: every shape checked, then timed; rank 0's rows and facts."""
    import torch

    from pcie_allreduce import _ext
    from pcie_allreduce.communicator import Communicator

    dtype = getattr(torch, job.dtype)
    comm = Communicator(ctx.group, ctx.device, max_bytes=max(max(job.sizes), 4096), timeout_s=job.kernel_timeout_s,
                        transport=job.transport)
    try:
        stream = torch.cuda.Stream(ctx.device)
        comm.prepare_stream(stream.cuda_stream)  # collective (IPC handle exchange): once, before any capture
        rows = []
        default = default_table(comm.transport, islands=len(comm.islands))

        def runs_here(algo: str) -> bool:
            return algorithms.runs_on(algo, comm.transport, comm.island_ranks)

        for size in job.sizes:
            count = size // sizes.DTYPE_SIZES[job.dtype]
            inp = _rank_input(count, ctx.rank, dtype, ctx.device)
            expected = sum(_rank_input(count, r, torch.int64, ctx.device) for r in range(ctx.world_size)).to(dtype)
            out = torch.empty_like(inp)
            for algo, blocks in shapes_of(job, size, ctx.world_size, default, comm.block_cap, runs_here):
                rows.append(_measure_shape(ctx, job, comm, stream, inp, out, expected, algo, blocks))
        facts = {"gpu_name": torch.cuda.get_device_name(ctx.device), "block_cap": comm.block_cap, "mps": ctx.mps,
                 "transport": comm.transport, "islands": len(comm.islands)}
        ext = _ext.load()
        if ext is not None:
            facts["fingerprint"] = cache.fingerprint_of(ext, [p.pci_bus_id for p in comm.placements], comm.islands)
    finally:
        comm.close()
    return {"rows": rows, "facts": facts} if ctx.rank == 0 else {}


def shapes_of(job: TuneJob, size: int, world: int, default: AlgoTable, block_cap: int,
              runs_here: Callable[[str], bool]) -> list[tuple[str, int]]:
    """The (algorithm, block count) shapes measured at ``size``: the job's grid of the algorithms
    that run here, and the default table's own shape for the size where the grid lacks it (its
    block count need not be one of ``job.blocks``), so the report sets the tuned pick against the
    default as it launches, measured, and the derived table is never slower than it at a size."""
    grid = [(algo, blocks) for algo in job.algos if runs_here(algo) for blocks in job.blocks]
    choice = default.select(size, world, job.dtype)
    own = (choice.algo, min(choice.blocks, block_cap))
    if choice.algo in job.algos and runs_here(choice.algo) and own not in grid:
        grid.append(own)
    return grid


def _rank_input(count: int, rank: int, dtype: Any, device: Any) -> Any:
    """Rank ``rank``'s input: integers in [-7, 7], so sums of up to 8 ranks are exact in any order."""
    import torch

    generator = torch.Generator(device=device).manual_seed(rank + 1)
    return torch.randint(-7, 8, (count,), generator=generator, device=device).to(dtype)


def _agree(ctx: Any, mine: Any) -> list[Any]:
    import torch.distributed as dist

    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine, group=ctx.group)
    return everyone


def _measure_shape(ctx: Any, job: TuneJob, comm: Any, stream: Any, inp: Any, out: Any, expected: Any, algo: str,
                   blocks: int) -> dict[str, Any]:
    from pcie_allreduce.plan.dispatch import DTYPE_IDS

    size = inp.numel() * inp.element_size()
    row: dict[str, Any] = {"size_bytes": size, "algo": algo, "blocks": blocks}
    reason = skip_reason(algo, blocks, size, comm.block_cap, comm.ll_capacity)
    if reason is not None:
        return {**row, "status": SKIPPED, "error": reason}
    from pcie_allreduce.workspaces import error_of  # torch: only inside the ranks

    workspace = comm._workspace(stream.cuda_stream)  # its raw launch: the measurement, without the call's checks
    args = (ALGO_IDS[algo], inp.data_ptr(), out.data_ptr(), size, DTYPE_IDS[inp.dtype], blocks, stream.cuda_stream)

    def launch() -> None:
        if workspace.all_reduce(*args):
            raise error_of(workspace)

    def wrong() -> str:
        stream.synchronize()
        comm.check()  # a recorded timeout explains a wrong sum better than the values do
        bad = int((out != expected).sum())
        return f"rank {ctx.rank}: {bad} of {out.numel()} elements wrong" if bad else ""

    out.fill_(float("nan"))
    return {**row, **_check_then_time(ctx, job, comm, stream, launch, wrong)}


def _check_then_time(ctx: Any, job: TuneJob, comm: Any, stream: Any, launch: Callable[[], None],
                     wrong: Callable[[], str]) -> dict[str, Any]:
    """One launch on ``stream`` checked on every rank (``wrong``: this rank's problem, "" if none),
    then ``job.calls_per_graph`` launches captured in a CUDA graph, timed as replays and checked
    again: the status and, if ok, the per-call timing. The caller has written the inputs and
    poisoned the outputs on the default stream."""
    import torch

    # The inputs, the expected result and the poison were written on the default stream; the launch
    # runs on the tune's stream, which must not start before them (a race that reads as a wrong result).
    stream.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(stream):
        launch()
    problems = [p for p in _agree(ctx, wrong()) if p]
    if problems:
        return {"status": WRONG, "error": problems[0]}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(job.calls_per_graph):
            launch()
    sync = torch.zeros(SYNC_COUNT, dtype=torch.float32, device=ctx.device)
    times = timed_replays(graph.replay, lambda: comm.all_reduce(sync, out=sync),  # zeros stay zeros
                          ctx.group, iters=job.iters, time_budget_s=job.time_budget_s, warmup=job.warmup, stream=stream)
    gathered = _agree(ctx, (times, wrong()))
    problems = [p for _, p in gathered if p]
    if problems:
        return {"status": WRONG, "error": f"after timing: {problems[0]}"}
    timing = summarize([t for t, _ in gathered], job.calls_per_graph)
    return {"status": OK, "p50_us": timing.p50_us, "p99_us": timing.p99_us, "replays": timing.replays}


# ---- the fused call ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FusedJob:
    """What every rank measures for the fused rules: at each token count of ``hidden`` columns, the
    unfused pair and every fused kernel that takes the shape, with the plain table the run derived
    (the pair's all-reduce, and the table the "kernel" rules follow); dtype, timing and transport
    are the run's (``plain``)."""

    tokens: tuple[int, ...]
    hidden: int
    table: AlgoTable
    plain: TuneJob
    eps: float = 1e-6


def measure_fused_rank(ctx: Any, job: FusedJob) -> dict[str, Any]:
    """``run_ranks`` runs this in every rank: per token count the pair, then each fused kernel that
    takes the shape, each checked on fresh outputs (:class:`_FusedCall`), then timed; rank 0's rows."""
    import torch

    from pcie_allreduce.communicator import Communicator

    run = job.plain
    dtype = getattr(torch, run.dtype)
    max_bytes = max(job.tokens) * job.hidden * sizes.DTYPE_SIZES[run.dtype]
    comm = Communicator(ctx.group, ctx.device, max_bytes=max(max_bytes, 4096), timeout_s=run.kernel_timeout_s,
                        algo_table=job.table, transport=run.transport)
    try:
        stream = torch.cuda.Stream(ctx.device)
        comm.prepare_stream(stream.cuda_stream)
        rows = []
        for tokens in job.tokens:
            call = _FusedCall(ctx, comm, stream, tokens, job, dtype)
            for algo in (algorithms.UNFUSED, *algorithms.FUSED_KERNELS):
                reason = None if algo == algorithms.UNFUSED else _fused_skip_reason(comm, algo, tokens, job.hidden,
                                                                                    dtype)
                if reason is not None:
                    rows.append({"tokens": tokens, "hidden": job.hidden, "algo": algo, "status": SKIPPED,
                                 "error": reason})
                    continue
                rows.append({"tokens": tokens, "hidden": job.hidden, "algo": algo, **call.measure(algo)})
    finally:
        comm.close()
    return {"rows": rows} if ctx.rank == 0 else {}


def _fused_skip_reason(comm: Any, algo: str, tokens: int, hidden: int, dtype: Any) -> str | None:
    """Why a forced fused kernel cannot take ``[tokens, hidden]`` here (the same on every rank: the
    plan is a function of agreed values)."""
    from pcie_allreduce.plan import dispatch  # torch: only inside the ranks

    try:
        dispatch.fused_plan(tokens, hidden, dtype, comm.world_size, comm.table, ll_capacity=comm.ll_capacity,
                            block_cap=comm.block_cap, algo=algo, transport=comm.transport,
                            island_ranks=comm.island_ranks)
    except ValueError as exc:
        return str(exc)
    return None


class _FusedCall:
    """One token count's inputs (random per rank; the residual and weight the same on every rank),
    the expected outputs, and the check-then-time of one forced algorithm. The new residual must
    equal ``residual + all_reduce(x)`` bitwise (what every algorithm promises); the normed rows an
    fp32 RMSNorm of it to within a bf16 unit (their last bit may depend on the kernel)."""

    def __init__(self, ctx: Any, comm: Any, stream: Any, tokens: int, job: FusedJob, dtype: Any) -> None:
        import torch

        self.ctx, self.comm, self.stream, self.job = ctx, comm, stream, job
        gen = torch.Generator(device=ctx.device).manual_seed(1000 * tokens + ctx.rank)
        shared = torch.Generator(device=ctx.device).manual_seed(tokens)
        shape = (tokens, job.hidden)
        self.x = torch.randn(shape, generator=gen, device=ctx.device).to(dtype)
        self.residual = torch.randn(shape, generator=shared, device=ctx.device).to(dtype)
        self.weight = (1 + 0.1 * torch.randn(job.hidden, generator=shared, device=ctx.device)).to(dtype)
        self.normed, self.new_residual = torch.empty_like(self.x), torch.empty_like(self.x)
        self.want_residual = self.residual + comm.all_reduce(self.x)  # collective: every rank, in this order
        rows = self.want_residual.float()
        self.want_normed = rows * torch.rsqrt(rows.pow(2).mean(dim=-1, keepdim=True) + job.eps) * self.weight.float()

    def _launch(self, algo: str) -> None:
        self.comm.all_reduce_rmsnorm(self.x, self.residual, self.weight, self.job.eps, out=self.normed,
                                     residual_out=self.new_residual, algo=algo)

    def _wrong(self) -> str:
        import torch

        self.stream.synchronize()
        self.comm.check()  # a recorded timeout explains a wrong result better than the values do
        if not torch.equal(self.new_residual, self.want_residual):
            return f"rank {self.ctx.rank}: the new residual is not residual + all_reduce(x)"
        if not torch.allclose(self.normed.float(), self.want_normed, rtol=2 ** -7, atol=2 ** -7):
            return f"rank {self.ctx.rank}: the normed rows are not the RMSNorm of the new residual"
        return ""

    def measure(self, algo: str) -> dict[str, Any]:
        """Check ``algo`` once on poisoned outputs, then time it (:func:`_check_then_time`)."""
        self.normed.fill_(float("nan"))
        self.new_residual.fill_(float("nan"))
        return _check_then_time(self.ctx, self.job.plain, self.comm, self.stream, lambda: self._launch(algo),
                                self._wrong)
