"""``python -m bench.graph_loop``: our all-reduce timed the way a bare kernel is timed.

The harness (``python -m bench``) times each replay of a graph between barriers and reports the
slowest rank's p50. A stand-alone kernel (a minimal push one-shot without flags or timeouts, run
as a yardstick) is usually timed more simply: K calls captured in one CUDA graph, the graph
replayed R times back to back, the elapsed time divided by K x R. To compare our kernels with
such a yardstick in one run, this times them the same way: K = 20, R = 20, the best of three
repetitions on each rank, then the slowest rank. It runs whatever ``pcie_allreduce`` is
imported, so two builds side by side (``cd`` into each checkout) give an A/B in one run.

    python -m bench.graph_loop --world 2 4 8 --sizes 1K 14K 56K 448K --algos oneshot_ll oneshot_full

``--transport host`` puts the workspaces in pinned host memory (the push algorithms and the
host transport's own), so the data crosses each GPU's PCIe link to host memory.

``--fused`` times the all-reduce + residual add + RMSNorm on ``[T, --hidden]`` bf16 instead, for
each ``--tokens`` T: the plain all-reduce alone (``allreduce``), then each of ``--fused-algos``
(``unfused`` is the plain all-reduce followed by the library's one add + RMSNorm kernel, and
with it ``unfused+fi_addnorm`` / ``unfused+sgl_addnorm`` the same all-reduce followed by
FlashInfer's / sgl-kernel's ``fused_add_rmsnorm`` where it imports: the pairs a fused kernel must
beat; a kernel that cannot take the shape is left out), every case on fresh inputs, in one run:

    python -m bench.graph_loop --fused --world 2 8 --tokens 1 4 32 --fused-algos auto unfused oneshot_full oneshot

``--chunks C ...`` adds, for each data-as-flag kernel among ``--fused-algos``, rows with C column
chunks per row forced (``oneshot_full/cC``, C as the shape rounds it) in place of the shape's own
choice, where that many programs fit the block cap: how the split of a row over programs trades
the row statistics' exchange against one program's bandwidth. ``--quads`` adds, for
``oneshot_full``, rows with each of its two kernels forced (``oneshot_full/quads``: 16-byte quads,
``oneshot_full/words``: 4-byte words) where the shape allows, whatever the call would choose
(``fused_shapes.takes_quads``): the two kernels side by side in one run; with ``--chunks`` too,
each kernel at each forced chunk count (``oneshot_full/cC/quads``, ``oneshot_full/cC/words``).

``--against CHECKOUT`` times each ``--fused-algos`` row with this checkout's Triton kernels
(``label A1``) and with CHECKOUT's (``label B1``, :mod:`bench.kernel_variant`: kernel bodies only),
``--rounds`` times in turn on the same ranks: an A/B of two kernels without the spread between
runs. ``--warm-replays N`` replays each graph N times untimed first.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from bench import kernel_variant
from pcie_allreduce.plan.algorithms import DATA_AS_FLAG_ONESHOTS

CALLS_PER_GRAPH = 20
REPLAYS = 20
REPETITIONS = 3


def _time_algo(comm, x, out, algo: str, group, warm: int) -> float:
    return _time_call(comm, lambda: comm.all_reduce(x, out, algo=algo), group, warm)


def _time_call(comm, call, group, warm: int, reset: Callable[[], object] = lambda: None) -> float:
    """Per-call time of ``call`` (:func:`time_in_graph`, ``warm`` untimed replays first), ``reset``
    run and the ranks lined up before each repetition."""
    import torch.distributed as dist

    def before_each() -> None:
        reset()
        dist.barrier(group=group)

    best = time_in_graph(call, before_each, warm)
    comm.check()
    return best


def time_in_graph(call: Callable[[], object], before_each: Callable[[], object] = lambda: None,
                  warm_replays: int = 0) -> float:
    """Microseconds per call of ``call`` captured CALLS_PER_GRAPH times in one CUDA graph and
    replayed REPLAYS times back to back: the best of REPETITIONS, ``before_each`` run ahead of
    each (a barrier between ranks; restoring the inputs of an in-place kernel), outside the
    timing. The one bare-kernel timing of this module and :mod:`bench.norm_loop`.

    ``warm_replays``: untimed replays before the first repetition (none by default, as a bare
    yardstick is timed). A GPU that sat idle through a point's set-up (capture, compilation,
    barriers) runs below its clock until load raises it, and a repetition is a few milliseconds,
    so an A/B of two kernels over several runs may want the GPU busy first. A count, not a
    duration: every rank must replay the same collective calls."""
    import torch

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        for _ in range(CALLS_PER_GRAPH):
            call()
    for _ in range(1 + warm_replays):
        graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(REPETITIONS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before_each()
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (CALLS_PER_GRAPH * REPLAYS))
    return best


def _rank(ctx, sizes: list[int], algos: list[str], transport: str, warm: int) -> list[tuple[str, int, float]]:
    import torch

    from pcie_allreduce import Communicator

    rows = []
    with Communicator(ctx.group, ctx.device, transport=transport) as comm:
        for algo in algos:
            for nbytes in sizes:
                x = torch.randn(nbytes // 2, device=ctx.device, dtype=torch.bfloat16)
                out = torch.empty_like(x)
                label = algo if algo != "auto" else "auto:" + comm.select_algo(nbytes, torch.bfloat16)
                rows.append((label, nbytes, _time_algo(comm, x, out, algo, ctx.group, warm)))
    return rows


def _fused_rank(ctx, tokens: list[int], hidden: int, algos: list[str], transport: str,
                chunks: list[int], quads: bool = False, warm: int = 0, against: str | None = None,
                rounds: int = 1) -> list[tuple[str, int, float]]:
    import torch

    from pcie_allreduce import Communicator
    from pcie_allreduce.plan import dispatch

    variant = None if against is None else kernel_variant.load(against)
    rows = []
    eps = 1e-6
    with Communicator(ctx.group, ctx.device, max_bytes=max(tokens) * hidden * 2, transport=transport) as comm:
        for t in tokens:
            gen = torch.Generator(device=ctx.device).manual_seed(1000 * t + ctx.rank)
            x = torch.randn(t, hidden, generator=gen, device=ctx.device).to(torch.bfloat16)
            residual = torch.randn(t, hidden, generator=torch.Generator(device=ctx.device).manual_seed(t),
                                   device=ctx.device).to(torch.bfloat16)
            weight = torch.ones(hidden, device=ctx.device, dtype=torch.bfloat16)
            normed, new_residual, out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
            rows.append(("allreduce:" + comm.select_algo(x.nbytes, x.dtype), t, _time_algo(comm, x, out, "auto", ctx.group, warm)))
            for algo in algos:
                kernel = algo if algo != "auto" else comm.select_fused_algo(t, hidden, x.dtype)
                label = algo if algo != "auto" else f"auto:{kernel}"
                if algo not in ("auto", "unfused") and not dispatch.fused_kernel_fits(
                        algo, t, hidden, x.dtype, comm.world_size, ll_capacity=comm.ll_capacity,
                        block_cap=comm.block_cap):
                    continue

                def call(algo=algo):
                    comm.all_reduce_rmsnorm(x, residual, weight, eps, out=normed, residual_out=new_residual, algo=algo)

                if variant is None:
                    rows.append((label, t, _time_call(comm, call, ctx.group, warm)))
                    continue

                def compile_variant(kernel=kernel):
                    if kernel != "unfused":  # the kernel the call runs (the pair's norm kernel waits on nobody)
                        _compile_on_every_rank(comm, ctx.group, kernel, x, residual, weight, eps, normed, new_residual,
                                               max_programs=comm.block_cap)

                rows.extend(_alternated(comm, ctx.group, label, t, call, variant, compile_variant, warm, rounds))
            if "unfused" in algos:
                rows.extend(_other_pairs(comm, ctx.group, x, out, residual, weight, eps, warm))
            for algo in (a for a in algos if a in DATA_AS_FLAG_ONESHOTS):
                rows.extend(_forced_rows(comm, ctx.group, algo, _forced_variants(comm, algo, x, chunks, quads), x,
                                         residual, weight, eps, normed, new_residual, warm))
    return rows


def _alternated(comm, group, label: str, tokens: int, call, variant, compile_variant, warm: int,
                rounds: int) -> list[tuple[str, int, float]]:
    """Rows ``label A<r>`` / ``label B<r>``: ``call`` with this checkout's kernels (A), then with the
    other checkout's (B, :mod:`bench.kernel_variant`), ``rounds`` times in turn on the same ranks
    and workspace; B's kernel compiled on every rank behind a barrier before its first timing (a
    first launch that compiles would leave its peers spinning)."""
    rows = []
    for r in range(1, rounds + 1):
        rows.append((f"{label} A{r}", tokens, _time_call(comm, call, group, warm)))
        with kernel_variant.swapped(variant):
            if r == 1:
                compile_variant()
            rows.append((f"{label} B{r}", tokens, _time_call(comm, call, group, warm)))
    return rows


def _other_pairs(comm, group, x, out, residual, weight, eps: float, warm: int) -> list[tuple[str, int, float]]:
    """Rows ``unfused+<kernel>``: our all-reduce, then each other library's in-place add + RMSNorm
    kernel that imports in this rank (:func:`bench.norm_ops.in_place_kernels`: FlashInfer's,
    sgl-kernel's), so the rows beside the fused call hold the harness's best one-kernel pair. Each
    repetition starts from the residual's own values (the kernel adds into it)."""
    from bench.norm_ops import in_place_kernels

    found, _ = in_place_kernels()
    running = residual.clone()
    rows = []
    for name, kernel in found.items():
        def call(kernel=kernel):
            comm.all_reduce(x, out)
            kernel(out, running, weight, eps)

        restore = lambda: running.copy_(residual)  # noqa: E731
        rows.append((f"unfused+{name}", x.shape[0], _time_call(comm, call, group, warm, restore)))
    return rows


def _forced_variants(comm, algo: str, x, chunks: list[int], quads: bool) -> list[tuple[str, dict]]:
    """(label, launch arguments) of each forced form of the data-as-flag kernel ``algo`` the run
    asks for and the call's shape allows: each chunk count whose programs fit the block cap, then
    with ``quads`` (``oneshot_full``) each of its two kernels, at the shape's own chunk count and
    at each forced one (the quads only where a chunk is whole quads)."""
    from pcie_allreduce.plan import fused_shapes

    tokens, hidden = x.shape
    both = quads and algo == DATA_AS_FLAG_ONESHOTS[1]
    variants = []
    for c in chunks:
        shape = fused_shapes.with_chunks_if_resident(tokens, hidden, c, comm.block_cap)
        if shape is not None:
            forced = dict(max_programs=comm.block_cap, chunks=shape[1])
            variants.extend(_kernels(f"{algo}/c{shape[1]}", forced, shape, hidden, both))
    shape = fused_shapes.data_as_flag(tokens, hidden, comm.world_size, comm.block_cap)
    if both and shape is not None:
        variants.extend(_kernels(algo, dict(max_programs=comm.block_cap), shape, hidden, True))
    return variants


def _kernels(label: str, kwargs: dict, shape, hidden: int, both: bool) -> list[tuple[str, dict]]:
    """``(label, kwargs)`` (the kernel the shape's call would choose), or with ``both`` each
    full-payload kernel forced instead (``label/quads`` where ``shape``'s chunks are whole quads,
    then ``label/words``)."""
    from pcie_allreduce.plan import fused_shapes

    if not both:
        return [(label, kwargs)]
    variants = [(f"{label}/quads", dict(kwargs, quads=True))] if fused_shapes.quad_warps(shape, hidden) else []
    return variants + [(f"{label}/words", dict(kwargs, quads=False))]


def _compile_on_every_rank(comm, group, algo: str, x, residual, weight, eps: float, normed, new_residual,
                           **kwargs) -> None:
    """The fused kernel ``algo`` compiled for this call (``kwargs``: :func:`pcie_allreduce.fused.path.launch`'s
    shape arguments) in the launch it will be timed with (PDL where ``$PCIE_AR_PDL``), launching
    nothing, then a barrier: a first launch that compiled would leave its peers spinning."""
    import torch.distributed as dist

    from pcie_allreduce.fused import path
    from pcie_allreduce.layout import WorkspaceView

    view = WorkspaceView.of(comm._workspace())  # noqa: SLF001 - the harness launches on the call's workspace
    path.launch(view, algo, x, residual, weight, eps, normed, new_residual, compile_only=True,
                dependent=comm.dependent_launch, **kwargs)
    dist.barrier(group=group)


def _forced_rows(comm, group, algo: str, variants: list[tuple[str, dict]], x, residual, weight, eps: float, normed,
                 new_residual, warm: int) -> list[tuple[str, int, float]]:
    """The data-as-flag kernel ``algo`` timed in each forced form of ``variants`` (:func:`_forced_variants`).

    A harness-only path: it launches the kernel directly on the workspace of the current stream
    (the communicator's own, read through its private accessor), compiled on every rank behind a
    barrier first, where ``all_reduce_rmsnorm`` would plan the shape itself."""
    from pcie_allreduce.fused import path
    from pcie_allreduce.layout import WorkspaceView

    if not variants or x.nbytes > (comm.capacity_of(algo) or x.nbytes):
        return []
    view = WorkspaceView.of(comm._workspace())  # noqa: SLF001 - the harness forces what the plan would choose
    rows = []
    for label, kwargs in variants:
        _compile_on_every_rank(comm, group, algo, x, residual, weight, eps, normed, new_residual, **kwargs)

        def call(kwargs=kwargs):
            path.launch(view, algo, x, residual, weight, eps, normed, new_residual, dependent=comm.dependent_launch,
                        **kwargs)

        rows.append((label, x.shape[0], _time_call(comm, call, group, warm)))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from pcie_allreduce.argtypes import typed_arg
    from pcie_allreduce.sizes import parse_size

    parser = argparse.ArgumentParser(prog="python -m bench.graph_loop", description=__doc__.split("\n\n")[1])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8], metavar="W")
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[1024, 14336, 57344, 458752], metavar="SIZE")
    parser.add_argument("--algos", nargs="+", default=["oneshot_ll", "oneshot_full", "auto"], metavar="ALGO")
    parser.add_argument("--transport", choices=("auto", "p2p", "host"), default="auto",
                        help="where the workspaces live (default auto: P2P where every pair passes a transfer test)")
    parser.add_argument("--fused", action="store_true", help="time the all-reduce + residual add + RMSNorm")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32], metavar="T")
    parser.add_argument("--hidden", type=int, default=7168, metavar="H")
    parser.add_argument("--fused-algos", nargs="+", default=["auto", "unfused"], metavar="ALGO")
    parser.add_argument("--chunks", type=typed_arg(int, lambda v: v >= 1, "a positive integer"), nargs="+", default=[],
                        metavar="C",
                        help="with --fused: also each data-as-flag kernel with C column chunks per row forced")
    parser.add_argument("--warm-replays", type=typed_arg(int, lambda v: v >= 0, "a non-negative integer"), default=0,
                        metavar="N", help="untimed replays of each point's graph before its timed ones (default 0, "
                        "as a bare yardstick is timed; e.g. 100 for an A/B of kernels, so the GPU is busy first)")
    parser.add_argument("--against", metavar="CHECKOUT",
                        help="with --fused: each --fused-algos row timed with this checkout's Triton kernels (A) and "
                        "with CHECKOUT's (B), alternated --rounds times in one run (kernel bodies only)")
    parser.add_argument("--rounds", type=typed_arg(int, lambda v: v >= 1, "a positive integer"), default=2,
                        metavar="N", help="with --against: A/B rounds per row (default 2)")
    parser.add_argument("--quads", action="store_true",
                        help="with --fused: also oneshot_full with its 16-byte quads kernel and its word kernel forced")
    args = parser.parse_args(argv)
    if (args.chunks or args.quads) and not set(args.fused_algos) & set(DATA_AS_FLAG_ONESHOTS):
        parser.error(f"--chunks and --quads force a data-as-flag kernel's shape: name "
                     f"{' or '.join(DATA_AS_FLAG_ONESHOTS)} in --fused-algos")
    if args.against is not None:
        if not args.fused:
            parser.error("--against swaps the fused Triton kernels: it needs --fused")
        try:
            kernel_variant.load(args.against)
        except (ValueError, ImportError, SyntaxError) as e:
            parser.error(f"--against: {e}")
    if args.quads and DATA_AS_FLAG_ONESHOTS[1] not in args.fused_algos:
        parser.error(f"--quads forces {DATA_AS_FLAG_ONESHOTS[1]}'s two kernels: name it in --fused-algos")

    from pcie_allreduce.tools import ranks

    reason = ranks.skip_reason_no_gpu()
    if reason is not None:
        print(f"python -m bench.graph_loop: {reason}", file=sys.stderr)
        return 3
    print(f"{'W':>2} {'algo':<22} {'tokens' if args.fused else 'size':>10} {'us':>8}   (bf16; {CALLS_PER_GRAPH} calls/graph x {REPLAYS} "
          f"replays, best of {REPETITIONS}, slowest rank; transport {args.transport}"
          f"{f'; {args.warm_replays} untimed replays first' if args.warm_replays else ''}"
          f"{f'; A: this checkout, B: {args.against}' if args.against else ''})")
    if args.fused:
        from bench.backends import quiet_env

        os.environ.update(quiet_env())  # the ranks inherit it: before they import FlashInfer
    for world in args.world:
        if args.fused:
            per_rank = ranks.run_ranks(_fused_rank, world, args.tokens, args.hidden, args.fused_algos, args.transport,
                                       args.chunks, args.quads, args.warm_replays, args.against, args.rounds,
                                       timeout_s=600)
        else:
            per_rank = ranks.run_ranks(_rank, world, args.sizes, args.algos, args.transport, args.warm_replays,
                                       timeout_s=600)
        for i, (label, nbytes, _) in enumerate(per_rank[0]):
            slowest = max(rows[i][2] for rows in per_rank)
            print(f"{world:>2} {label:<22} {nbytes:>10} {slowest:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
