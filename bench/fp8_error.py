"""The FP8 wire's error against the exact sum, on activation-like inputs (CPU, seconds).

    python -m bench.fp8_error [--world 2 4 8 16] [--numel 229376] [--seed 0]

``all_reduce(x, wire="fp8")`` returns, on every rank, the bits of the reference
``pcie_allreduce.fp8_wire.all_reduce`` (tests/test_fp8_wire_gpu.py asserts that bit for bit on
GPUs), so the reference's error is the kernel's. The inputs: per rank normal values of a
per-rank scale, 0.1% outliers 100x larger, 2% exact zeros, the pattern of the GPU tests. Columns,
for bf16 and fp16, against the fp64 sum of the same inputs:

- ``normwise``: ||result - exact|| / ||exact|| over the whole message;
- ``rel mean / p99 / max``: |result - exact| / |exact| over the elements whose exact sum is at
  least 1/16 of the largest in its 128-element block (where e4m3's 3 mantissa bits set the
  precision; smaller ones carry an error of the block's scale, the next column);
- ``abs max / block max``: the largest error over all elements, relative to the largest exact
  value of the element's block;
- ``max/sum|x|``: the largest error relative to the sum of the terms' magnitudes (what the coding
  of each term bounds, so the large ``rel max`` figures are elements whose terms cancel); 1.0
  where every term is below 2^-10 of its block's scale and arrives as zero;
- ``lossless normwise``: the same message through the lossless wire (fp32 sum rounded once to the
  dtype), for scale.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

from pcie_allreduce import fp8_wire

DTYPES = (torch.bfloat16, torch.float16)
WIDTHS = (3, 10, 11, 10, 10, 10, 19, 12, 19, 14)


def activations(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values of a per-rank scale, 0.1% outliers 100x larger, 2% exact zeros."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(numel, generator=gen) * (0.5 + rank % 3)
    x = torch.where(torch.rand(numel, generator=gen) < 1e-3, x * 100, x)
    return torch.where(torch.rand(numel, generator=gen) < 0.02, torch.zeros_like(x), x).to(dtype)


def error_row(world: int, numel: int, dtype: torch.dtype, seed: int) -> dict[str, float]:
    """The error figures of one (W, dtype) case."""
    inputs = [activations(seed, r, numel, dtype) for r in range(world)]
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    got = fp8_wire.all_reduce(inputs).double()
    lossless = torch.stack([x.float() for x in inputs]).sum(0).to(dtype).double()
    err = (got - exact).abs()
    blocks = -(-numel // fp8_wire.BLOCK)
    padded = torch.zeros(blocks * fp8_wire.BLOCK, dtype=torch.float64)
    padded[:numel] = exact.abs()
    block_max = padded.view(blocks, fp8_wire.BLOCK).amax(1).repeat_interleave(fp8_wire.BLOCK)[:numel]
    big = exact.abs() >= block_max / 16
    rel = err[big] / exact.abs()[big]
    nonzero = block_max > 0
    magnitudes = torch.stack([x.double().abs() for x in inputs]).sum(0)
    return {
        "normwise": float(err.norm() / exact.norm()),
        "rel_mean": float(rel.mean()),
        "rel_p99": float(rel.quantile(0.99)),
        "rel_max": float(rel.max()),
        "abs_max_over_block_max": float((err[nonzero] / block_max[nonzero]).max()),
        "max_over_magnitudes": float((err[magnitudes > 0] / magnitudes[magnitudes > 0]).max()),
        "lossless_normwise": float((lossless - exact).norm() / exact.norm()),
        "within_bound": float(bool((err <= fp8_wire.error_bound(inputs)).all())),
        "share_big": float(big.double().mean()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_error", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--numel", type=int, default=7168 * 32, help="elements per message (default 32 x 7168)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"# FP8 wire error against the fp64 sum | {args.numel} elements | seed {args.seed} | "
          "activations: normal, per-rank scale, 0.1% outliers x100, 2% zeros")
    header = ("W", "dtype", "normwise", "rel mean", "rel p99", "rel max", "abs max/block max", "max/sum|x|",
              "lossless normwise", "within bound")
    print("#" + "".join(h.rjust(w) for h, w in zip(header, WIDTHS)))
    for world in args.world:
        for dtype in DTYPES:
            r = error_row(world, args.numel, dtype, args.seed)
            cells = (str(world), str(dtype).removeprefix("torch."), f"{r['normwise']:.4f}", f"{r['rel_mean']:.4f}",
                     f"{r['rel_p99']:.4f}", f"{r['rel_max']:.4f}", f"{r['abs_max_over_block_max']:.4f}",
                     f"{r['max_over_magnitudes']:.4f}", f"{r['lossless_normwise']:.5f}", "yes" if r["within_bound"] else "NO")
            print(" " + "".join(c.rjust(w) for c, w in zip(cells, WIDTHS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
