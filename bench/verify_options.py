"""Options of ``python -m bench verify``: the collectives of one speculative-decoding verify pass.

A verify forward runs L transformer layers on [T, H] activations (T = batch x draft tokens); with
tensor parallelism each layer ends its attention and its MLP/MoE with an all-reduce, each
then a residual add + RMSNorm. The benchmark captures those 2L collectives (optionally with
the add + norm) in ONE CUDA graph per backend and reports the pass time, the projected verify
time (pass + the model's compute) and the speed-up. Pure (no torch import).
"""

from __future__ import annotations

import argparse
from types import MappingProxyType
from typing import Sequence

from pcie_allreduce.tools.cli import typed_arg

from bench import options
from bench.backends import DEFAULT_BACKENDS
from bench.options import BenchConfig, Shape
from bench.results import VERIFY

DETAILS = ("Projected verify time = pass time + --compute-ms; speed-up = the reference backend's (NCCL where it "
           "runs, else torch symmetric memory) projected verify time / this one's. With --gemms the pass also runs "
           "each layer's own GEMMs (the model's per-rank shapes) before its collectives, and --compute-ms "
           "defaults to 0.")

# name -> (layers, hidden). Kimi-K2.5 has DeepSeek-V3's shape.
PRESETS = MappingProxyType({
    "kimi-k2.5": (61, 7168),
    "deepseek-v3": (61, 7168),
    "llama-3-70b": (80, 8192),
    "qwen3-235b-a22b": (94, 4096),
})
DEFAULT_MODELS: tuple[str, ...] = ("kimi-k2.5", "llama-3-70b", "qwen3-235b-a22b")
MAX_LAYERS = 512
# T = batch x draft tokens: 4 (one sequence, the latency case) and 32 (eight sequences) by default.
DEFAULT_BATCH: tuple[int, ...] = (1, 8)
DEFAULT_DRAFT_TOKENS: tuple[int, ...] = (4,)

layers_arg = typed_arg(int, lambda v: 1 <= v <= MAX_LAYERS, f"an integer in [1, {MAX_LAYERS}]")
compute_arg = typed_arg(float, lambda v: v >= 0, "a number >= 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the verify options on ``parser`` (and add the details to its description)."""
    parser.description = f"{parser.description}. {DETAILS}" if parser.description else DETAILS
    what = options.add_run_arguments(parser, dtypes=options.NORM_DTYPES)
    what.add_argument("--model", choices=tuple(PRESETS), nargs="+", metavar="MODEL",
                      help=f"presets ({', '.join(f'{k}: L={v[0]} H={v[1]}' for k, v in PRESETS.items())}; "
                           f"default {' '.join(DEFAULT_MODELS)})")
    what.add_argument("--layers", type=layers_arg, metavar="L", help="a custom model: layers (with --hidden)")
    what.add_argument("--hidden", type=options.hidden_arg, metavar="H",
                      help="a custom model: hidden size (with --layers)")
    what.add_argument("--batch", type=options.positive_int, nargs="+", default=list(DEFAULT_BATCH), metavar="B",
                      help=f"sequences per verify pass (default {' '.join(map(str, DEFAULT_BATCH))})")
    what.add_argument("--draft-tokens", type=options.positive_int, nargs="+", default=list(DEFAULT_DRAFT_TOKENS),
                      metavar="D", help="tokens verified per sequence; T = every batch x every draft tokens "
                                        f"(default {' '.join(map(str, DEFAULT_DRAFT_TOKENS))}: T = 4 and 32)")
    what.add_argument("--compute-ms", type=compute_arg, default=None, metavar="MS",
                      help=f"model compute per verify pass, added to the pass time (default "
                           f"{options.DEFAULT_COMPUTE_MS:g}, or 0 with --gemms)")
    what.add_argument("--gemms", action="store_true",
                      help="put each layer's GEMMs (attention projections, MLP/MoE experts; the preset's per-rank "
                           "shapes at TP = W, bench/layer_gemms.py) before its two collectives in the pass, so "
                           "collectives and fusion are timed in context")
    what.add_argument("--fused", action="store_true",
                      help="also time each collective with its residual add + RMSNorm: our fused kernel, and every "
                           "backend's all-reduce + eager torch ops / + one add + RMSNorm kernel (ours, FlashInfer's, "
                           "sgl-kernel's)")
    what.add_argument("--eps", type=options.positive_float, default=options.DEFAULT_EPS, metavar="EPS",
                      help=f"RMSNorm epsilon (default {options.DEFAULT_EPS:g})")
    options.add_timing_arguments(parser, iters=50, calls_per_graph=False)
    options.add_output_arguments(parser, "verify.csv, verify.json and verify.txt")


def shapes_from(models: Sequence[str], layers: int | None, hidden: int | None, batches: Sequence[int],
                drafts: Sequence[int]) -> tuple[Shape, ...]:
    """One Shape per (distinct model shape, T); presets of the same shape share a row ("kimi-k2.5/deepseek-v3")."""
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name in models:
        by_shape.setdefault(PRESETS[name], []).append(name)
    if layers is not None and hidden is not None:
        by_shape.setdefault((layers, hidden), []).append(f"custom-L{layers}-H{hidden}")
    tokens = sorted({b * d for b in batches for d in drafts})
    return tuple(Shape(t, h, layers=l, model="/".join(names))
                 for (l, h), names in by_shape.items() for t in tokens)


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, gpu_count: int) -> BenchConfig:
    """The validated verify configuration; bad combinations call ``parser.error`` (exit 2)."""
    if (args.layers is None) != (args.hidden is None):
        parser.error("a custom model needs both --layers and --hidden")
    custom = args.layers is not None
    models = options.unique(args.model) if args.model else (() if custom else DEFAULT_MODELS)
    shapes = shapes_from(models, args.layers, args.hidden, options.unique(args.batch),
                         options.unique(args.draft_tokens))
    too_big = [s for s in shapes if s.tokens > 1 << 16]
    if too_big:
        parser.error(f"T = batch x draft tokens = {too_big[0].tokens} is too large for a verify pass")
    if args.gemms and custom and not models:
        parser.error("--gemms needs a preset --model (a custom --layers/--hidden model has no known GEMM shapes)")
    compute_ms = args.compute_ms if args.compute_ms is not None else (0.0 if args.gemms else options.DEFAULT_COMPUTE_MS)
    return BenchConfig(
        sizes=tuple(sorted({s.nbytes(args.dtype) for s in shapes})),
        algos=("auto",),
        backends=options.unique(args.backends) if args.backends else DEFAULT_BACKENDS,
        backends_explicit=bool(args.backends),
        calls_per_graph=2 * max(s.layers for s in shapes),
        workload=VERIFY, shapes=shapes, eps=args.eps, compute_ms=compute_ms, norm=args.fused, gemms=args.gemms,
        **options.common_fields(args, gpu_count),
    )
