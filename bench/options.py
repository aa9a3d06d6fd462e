"""Command-line options of ``python -m bench`` and the validated configuration they become.

Pure (no torch import): the CLI tests exercise it on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

from pcie_allreduce import sizes
from pcie_allreduce.plan.algorithms import (ALGORITHMS, FUSED_ALGORITHMS, HOST_ONLY_ALGORITHMS, ISLAND_ALGORITHMS,
                                            LOSSY_ALGORITHMS)
from pcie_allreduce.tools.cli import non_negative_int, positive_float, positive_int, typed_arg
from pcie_allreduce.sizes import DTYPE_SIZES
from pcie_allreduce.tools.tune.cli import add_world_argument, default_worlds

from bench.backends import BACKENDS, DEFAULT_BACKENDS, OPT_IN
from bench.plan import TUNING_SETUPS
from bench.results import ALLREDUCE, FUSED

# twoshot_fp8 (the FP8 wire, checked against its own bits) runs where named: it is not lossless.
OUR_ALGOS: tuple[str, ...] = ALGORITHMS + LOSSY_ALGORITHMS + ("auto",)
# Without --algos: those that run on every transport and fabric (ours_host adds the host transport's
# own; the island algorithms run where named, on a communicator with islands).
DEFAULT_OUR_ALGOS: tuple[str, ...] = tuple(a for a in OUR_ALGOS
                                          if a not in HOST_ONLY_ALGORITHMS + ISLAND_ALGORITHMS + LOSSY_ALGORITHMS)
DEFAULT_MIN_BYTES, DEFAULT_MAX_BYTES = "1K", "64M"
# Seconds of timed replays per case: the default sweep (17 sizes x every backend's variants x
# W = 2, 4, 8) then takes a few minutes; small sizes stop at --iters long before it runs out.
DEFAULT_TIME_BUDGET_S = 0.25
NORM_DTYPES: tuple[str, ...] = ("bfloat16", "float16")  # what the fused kernel takes
DEFAULT_TOKENS: tuple[int, ...] = (1, 4, 32, 128)
DEFAULT_HIDDEN = 7168  # DeepSeek-V3 / Kimi-K2.5
MAX_HIDDEN = 16384     # the fused kernel's limit
DEFAULT_EPS = 1e-6
DEFAULT_COMPUTE_MS = 5.0
DEFAULT_FUSED_ALGOS: tuple[str, ...] = ("auto",)


def fused_algo_names() -> tuple[str, ...]:
    """What ``--fused-algos`` accepts: "auto", the library's fused kernels and "unfused" (our
    plain all-reduce, then the library's add_rmsnorm kernel)."""
    return ("auto", *FUSED_ALGORITHMS)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One [tokens, hidden] activation of ``--fused`` / ``verify``; ``layers`` and ``model`` for verify."""

    tokens: int
    hidden: int
    layers: int = 0
    model: str = ""

    def nbytes(self, dtype: str) -> int:
        return self.tokens * self.hidden * DTYPE_SIZES[dtype]


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything a sweep needs, validated. Times are seconds; sizes bytes.

    ``workload`` says what a case is (see :mod:`.results`): plain all-reduces of ``sizes``;
    ``fused`` / ``verify``: the ``shapes`` (``sizes`` then holds their byte sizes).
    """

    worlds: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str = "bfloat16"
    algos: tuple[str, ...] = DEFAULT_OUR_ALGOS
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    backends_explicit: bool = False  # False: "all available", so a missing backend is skipped quietly
    iters: int = 100
    warmup: int = 10
    calls_per_graph: int = 16
    eager: bool = False
    time_budget_s: float = DEFAULT_TIME_BUDGET_S
    rounds: int = 1
    case_timeout_s: float = 30.0
    setup_timeout_s: float = 90.0
    tune_baselines: bool = True  # False: --untuned-baselines
    retries: int = 1
    seed: int = 0
    out: str | None = None
    verbose: bool = False
    workload: str = ALLREDUCE
    shapes: tuple[Shape, ...] = ()
    eps: float = DEFAULT_EPS
    compute_ms: float = DEFAULT_COMPUTE_MS  # verify: model compute per pass, for the projected verify time
    norm: bool = False                      # verify: also the residual add + RMSNorm variants
    gemms: bool = False                     # verify: each layer's GEMMs between its collectives (layer_gemms.py)
    fused_algos: tuple[str, ...] = DEFAULT_FUSED_ALGOS  # --fused: our fused call's algo= values, one row each

    @property
    def mode(self) -> str:
        """"graph" (CUDA-graph replay) or "eager"."""
        return "eager" if self.eager else "graph"

    @property
    def max_bytes(self) -> int:
        return max(self.sizes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy (tuples become lists)."""
        data = dataclasses.asdict(self)
        data["mode"] = self.mode
        return data


hidden_arg = typed_arg(int, lambda v: 1 <= v <= MAX_HIDDEN, f"an integer in [1, {MAX_HIDDEN}]")


def add_run_arguments(parser: argparse.ArgumentParser, *, backends: bool = True,
                      dtypes: Sequence[str] = tuple(DTYPE_SIZES)) -> argparse._ArgumentGroup:
    """--world, --dtype and (optionally) --backends; returns the group for more options."""
    what = parser.add_argument_group("what to measure")
    add_world_argument(what)
    what.add_argument("--dtype", choices=tuple(dtypes), default="bfloat16")
    if backends:
        what.add_argument("--backends", choices=BACKENDS, nargs="+", metavar="BACKEND",
                          help=f"backends ({' '.join(BACKENDS)}; default all that are available except "
                               f"{' and '.join(OPT_IN)}, the rows for boxes without usable P2P)")
    return what


def add_timing_arguments(parser: argparse.ArgumentParser, *, iters: int = 100, warmup: int = 10,
                         time_budget: float = DEFAULT_TIME_BUDGET_S, calls_per_graph: bool = True) -> None:
    """How cases are timed."""
    how = parser.add_argument_group("how to time")
    how.add_argument("--iters", type=positive_int, default=iters, metavar="N",
                     help=f"timed replays per case, at most (fewer if --time-budget runs out; default {iters})")
    how.add_argument("--warmup", type=non_negative_int, default=warmup, metavar="N",
                     help=f"untimed replays first (default {warmup})")
    if calls_per_graph:
        how.add_argument("--calls-per-graph", type=positive_int, default=16, metavar="N",
                         help="all-reduces captured in one CUDA graph (or issued per timed block with --eager); "
                              "time per call = block time / this (default 16)")
    how.add_argument("--eager", action="store_true", help="time eager launches instead of CUDA-graph replay")
    how.add_argument("--time-budget", type=positive_float, default=time_budget, metavar="S",
                     help=f"seconds of timed replays per case before --iters is cut short (default {time_budget:g})")
    how.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                     help="time the cases in N interleaved rounds (every case, then every case again, ...), each "
                          "round with 1/N of --iters and --time-budget, and pool each case's replays: rows then "
                          "sample the same minutes, so a drifting machine (up to ~20%% between minutes on a GPU "
                          "shared under MPS) cannot favour one row (default 1)")
    how.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the input pattern (default 0)")


def add_output_arguments(parser: argparse.ArgumentParser, files: str) -> None:
    """Time-outs, retries, --out and -v."""
    robust = parser.add_argument_group("robustness and output")
    robust.add_argument("--case-timeout", type=positive_float, default=30.0, metavar="S",
                        help="a rank stuck this long in one case is killed and the case marked hung (default 30)")
    robust.add_argument("--setup-timeout", type=positive_float, default=90.0, metavar="S",
                        help="same, for a backend's set-up after the ranks started: communicator / rendezvous / "
                             f"NCCL init; a library's own tuning (--untuned-baselines) gets {TUNING_SETUPS}x this "
                             "(default 90)")
    robust.add_argument("--untuned-baselines", action="store_true",
                        help="time other libraries with their shipped launch configurations, skipping the "
                             "per-machine tuning they tell their users to run (FlashInfer's workspace.tune), which "
                             "the bench otherwise runs first, into a cache file of the run's own")
    robust.add_argument("--retries", type=non_negative_int, default=1, metavar="N",
                        help="after a failed or hung case, restart the backend this many times for the cases "
                             "left (default 1)")
    robust.add_argument("--out", metavar="DIR", help=f"write {files} into DIR (and a PNG plot if matplotlib imports)")
    robust.add_argument("-v", "--verbose", action="store_true", help="print every case as it finishes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of the default benchmark (the all-reduce sweep, or ``--fused``) on ``parser``."""
    what = add_run_arguments(parser)
    sizes.add_size_arguments(what, default_min=DEFAULT_MIN_BYTES, default_max=DEFAULT_MAX_BYTES)
    what.add_argument("--algos", choices=OUR_ALGOS, nargs="+", metavar="ALGO",
                      help=f"our algorithms ({' '.join(OUR_ALGOS)}; default all but "
                           f"{' '.join(HOST_ONLY_ALGORITHMS)}, which ours_host adds)")
    fused = parser.add_argument_group("--fused: all-reduce + residual add + RMSNorm on [tokens, hidden]")
    fused.add_argument("--fused", action="store_true",
                       help="compare our fused all-reduce + residual add + RMSNorm with every backend's all-reduce "
                            "followed by one add + RMSNorm kernel (ours, FlashInfer's, sgl-kernel's) or by eager "
                            "torch ops, and with our plain all-reduce alone")
    fused.add_argument("--tokens", type=positive_int, nargs="+", metavar="T",
                       help=f"--fused: token counts (default {' '.join(map(str, DEFAULT_TOKENS))})")
    fused.add_argument("--hidden", type=hidden_arg, nargs="+", default=None, metavar="H",
                       help=f"--fused: hidden sizes, each with every token count in one run (default {DEFAULT_HIDDEN})")
    fused.add_argument("--eps", type=positive_float, default=DEFAULT_EPS, metavar="EPS",
                       help=f"--fused: RMSNorm epsilon (default {DEFAULT_EPS:g})")
    fused.add_argument("--fused-algos", nargs="+", metavar="ALGO",
                       help="--fused: also time our fused call with each of these algo= values forced, one row "
                            "\"fused:ALGO\" each (a kernel that cannot take a shape is skipped there): 'auto' or a "
                            "name of pcie_allreduce.plan.algorithms.FUSED_ALGORITHMS, or 'unfused' (our all-reduce, then "
                            "the library's add_rmsnorm kernel); the row \"fused\" (auto) always runs (default auto)")
    add_timing_arguments(parser)
    add_output_arguments(parser, "bench.csv, bench.json and bench.txt (fused.* with --fused)")


def unique(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(values))


def sweep_sizes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, ...]:
    """--sizes, or the doubling sweep --min-bytes .. --max-bytes, checked against the dtype."""
    return sizes.requested_sizes(args.sizes, args.min_bytes, args.max_bytes, default_min=DEFAULT_MIN_BYTES,
                                 default_max=DEFAULT_MAX_BYTES, dtype=args.dtype, error=parser.error)


def common_fields(args: argparse.Namespace, gpu_count: int) -> dict[str, Any]:
    """The BenchConfig fields every mode shares (world, timing, robustness, output)."""
    return dict(
        worlds=unique(args.world) if args.world else default_worlds(gpu_count),
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        eager=args.eager,
        time_budget_s=args.time_budget,
        rounds=args.rounds,
        case_timeout_s=args.case_timeout,
        setup_timeout_s=args.setup_timeout,
        tune_baselines=not args.untuned_baselines,
        retries=args.retries,
        seed=args.seed,
        out=args.out,
        verbose=args.verbose,
    )


def check_norm_dtype(args: argparse.Namespace, parser: argparse.ArgumentParser, flag: str) -> None:
    if args.dtype not in NORM_DTYPES:
        parser.error(f"{flag} needs --dtype {' or '.join(NORM_DTYPES)} (the fused kernel's), not {args.dtype}")


def _fused_config(args: argparse.Namespace, parser: argparse.ArgumentParser, gpu_count: int) -> BenchConfig:
    given = [flag for flag, value in (("--sizes", args.sizes), ("--min-bytes", args.min_bytes),
                                      ("--max-bytes", args.max_bytes), ("--algos", args.algos)) if value]
    if given:
        parser.error(f"--fused measures [tokens, hidden] shapes: use --tokens/--hidden, not {' '.join(given)}")
    check_norm_dtype(args, parser, "--fused")
    fused_algos = unique(args.fused_algos) if args.fused_algos else DEFAULT_FUSED_ALGOS
    if any(a != "auto" for a in fused_algos):
        known = fused_algo_names()
        unknown = [a for a in fused_algos if a not in known]
        if unknown:
            parser.error(f"--fused-algos: unknown {' '.join(unknown)} (choose from {' '.join(known)})")
    shapes = tuple(Shape(t, h) for h in unique(args.hidden or (DEFAULT_HIDDEN,))
                   for t in sorted(unique(args.tokens or DEFAULT_TOKENS)))
    return BenchConfig(
        sizes=tuple(s.nbytes(args.dtype) for s in shapes),
        backends=unique(args.backends) if args.backends else DEFAULT_BACKENDS,
        backends_explicit=bool(args.backends),
        calls_per_graph=args.calls_per_graph,
        workload=FUSED, shapes=shapes, eps=args.eps, fused_algos=fused_algos,
        **common_fields(args, gpu_count),
    )


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, gpu_count: int) -> BenchConfig:
    """Cross-check the parsed options and fill defaults; bad combinations call ``parser.error`` (exit 2)."""
    if args.fused:
        return _fused_config(args, parser, gpu_count)
    if args.tokens or args.hidden:
        parser.error("--tokens and --hidden only apply with --fused (or to `python -m bench verify`)")
    if args.fused_algos:
        parser.error("--fused-algos only applies with --fused")
    return BenchConfig(
        sizes=sweep_sizes(args, parser),
        algos=unique(args.algos) if args.algos else DEFAULT_OUR_ALGOS,
        backends=unique(args.backends) if args.backends else DEFAULT_BACKENDS,
        backends_explicit=bool(args.backends),
        calls_per_graph=args.calls_per_graph,
        **common_fields(args, gpu_count),
    )
