"""``python -m bench.norm_loop``: the residual add + RMSNorm kernels alone, side by side, on one GPU.

The unfused half of the fused op's baseline is ONE add + RMSNorm kernel after the all-reduce:
the library's own (:func:`pcie_allreduce.fused.path.add_rmsnorm`), FlashInfer's or sgl-kernel's
``fused_add_rmsnorm``, whichever is fastest. This times each of them on ``[T, H]`` for every
``--tokens`` T and ``--hidden`` H, the way :mod:`bench.graph_loop` times a bare kernel
(:func:`bench.graph_loop.time_in_graph`: 20 calls in one CUDA graph, replayed 20 times, the best
of three repetitions), in one process and one run, so the rows compare. ``--warps`` adds rows of
the library's kernel with that many warps forced (its built-in choice is the plain ``ours``
row), to tune :func:`pcie_allreduce.plan.fused_shapes.add_rmsnorm` from a measurement.

    python -m bench.norm_loop --tokens 1 4 8 16 32 64 128 --hidden 2048 4096 7168 8192 --warps 4 8 16 32

Every kernel's output is checked before it is timed, on fresh random inputs (outputs poisoned
first), against an fp64 reference: ``wrong`` instead of a time where it is off by more than the
dtype's rounding (``failed`` where another library's kernel raised: its cell only). The
in-place kernels (FlashInfer's, sgl-kernel's) write their inputs, so each repetition starts from
a copy; the library's kernel runs out of place, as the all-reduce's epilogue does, and launches
as the unfused pair launches it: as the previous kernel's programmatic dependent on Hopper and
later unless ``PCIE_AR_PDL=0`` (FlashInfer's and sgl-kernel's launch so by default there too). A
kernel whose module does not import is left out with the reason.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from bench.backends import quiet_env
from bench.graph_loop import CALLS_PER_GRAPH, REPETITIONS, REPLAYS, time_in_graph

EPS = 1e-6
# |error| bound of a bf16 result whose math ran in fp32 and rounded once, relative to the
# magnitude of the reference: half an ulp of bf16 (2^-8) plus fp32's share, with room.
BF16_TOLERANCE = 2.0 ** -7
FP16_TOLERANCE = 2.0 ** -10



def reference(y, residual, weight):
    """(normed, new_residual) in fp64 from the same bf16/fp16 inputs; new_residual rounded to the
    dtype first, as every kernel stores it and normalises what it stored."""
    import torch

    new_residual = (residual.double() + y.double()).to(y.dtype)
    v = new_residual.double()
    rstd = torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return v * rstd * weight.double(), new_residual


def close_enough(got, want) -> bool:
    """Every element within the dtype's rounding of the fp64 reference (relative to the row's scale)."""
    import torch

    tol = BF16_TOLERANCE if got.dtype == torch.bfloat16 else FP16_TOLERANCE
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return bool(torch.isfinite(got).all()) and bool(((got.double() - want).abs() <= tol * scale).all())


def case(tokens: int, hidden: int, dtype, warps: Sequence[int], others: dict[str, Callable],
         dependent: bool = False) -> dict[str, object]:
    """Each kernel's time (us) on [tokens, hidden], or "wrong" where its check failed. ``dependent``:
    ours launches as the previous kernel's programmatic dependent, as the unfused pair launches it
    after the all-reduce (the other libraries' kernels launch so by default on Hopper)."""
    import torch

    from pcie_allreduce.fused import path
    from pcie_allreduce.plan import fused_shapes

    gen = torch.Generator(device="cuda").manual_seed(7919 * tokens + hidden)
    y = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    residual = (4 * torch.randn(tokens, hidden, generator=gen, device="cuda")).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    want_normed, want_residual = reference(y, residual, weight)
    block, default_warps = fused_shapes.add_rmsnorm(hidden)
    rows: dict[str, object] = {}

    shapes = {"ours": (block, default_warps)}
    shapes.update({f"ours_w{w}": (block, w) for w in warps if w != default_warps})
    for name, shape in shapes.items():
        normed = torch.full_like(y, float("nan"))
        new_residual = torch.full_like(y, float("nan"))

        def ours(shape=shape, normed=normed, new_residual=new_residual):
            path._norm(y, residual, weight, EPS, normed, new_residual, shape, after_all_reduce=dependent)

        ours()
        torch.cuda.synchronize()
        ok = close_enough(normed, want_normed) and torch.equal(new_residual, want_residual)
        rows[name] = time_in_graph(ours) if ok else "wrong"

    for name, kernel in others.items():
        x, r = y.clone(), residual.clone()

        def theirs(kernel=kernel, x=x, r=r):
            kernel(x, r, weight, EPS)

        def reset(x=x, r=r):
            x.copy_(y)
            r.copy_(residual)

        try:
            kernel(x, r, weight, EPS)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - their build or launch failing leaves only their row out
            print(f"# {name} [{tokens}, {hidden}]: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            rows[name] = "failed"
            continue
        ok = close_enough(x, want_normed) and torch.equal(r, want_residual)
        rows[name] = time_in_graph(theirs, reset) if ok else "wrong"
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.norm_loop", description=__doc__.split("\n\n")[1])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128], metavar="T")
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 7168, 8192], metavar="H")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--warps", type=int, nargs="*", default=[], metavar="N",
                        help="also time the library's kernel with N warps forced (rows ours_wN)")
    args = parser.parse_args(argv)
    if any(w not in (1, 2, 4, 8, 16, 32) for w in args.warps):
        parser.error("--warps: each must be a power of two from 1 to 32")

    from pcie_allreduce.tools import ranks

    reason = ranks.skip_reason_no_gpu()
    if reason is not None:
        print(f"python -m bench.norm_loop: {reason}", file=sys.stderr)
        return 3
    import torch

    os.environ.update(quiet_env())  # before FlashInfer is imported
    from bench.norm_ops import in_place_kernels

    others, missing = in_place_kernels()
    for name, why in missing.items():
        print(f"# {name}: left out ({why})")
    from pcie_allreduce import rendezvous

    dependent = rendezvous.dependent_launch(torch.device("cuda", torch.cuda.current_device()))
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}; us per call ({CALLS_PER_GRAPH} calls/graph x {REPLAYS} "
          f"replays, best of {REPETITIONS}); ratio: ours / the fastest other kernel; ours launched as the pair "
          f"launches it, dependent launch {'on' if dependent else 'off'} ($PCIE_AR_PDL)")
    names: list[str] | None = None
    wrong = False
    for hidden in args.hidden:
        for tokens in args.tokens:
            rows = case(tokens, hidden, getattr(torch, args.dtype), args.warps, others, dependent)
            if names is None:
                names = list(rows)
                print(f"{'H':>5} {'T':>4} " + " ".join(f"{n:>11}" for n in names) + f" {'ratio':>6}")
            wrong |= any(v == "wrong" for v in rows.values())
            best_other = min((v for n, v in rows.items() if n in others and isinstance(v, float)), default=None)
            ratio = f"{rows['ours'] / best_other:6.2f}" if best_other and isinstance(rows["ours"], float) else "     -"
            cells = " ".join(f"{v:11.2f}" if isinstance(v, float) else f"{v:>11}" for v in rows.values())
            print(f"{hidden:>5} {tokens:>4} {cells} {ratio}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
