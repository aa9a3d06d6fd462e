"""What a backend run hands to its ranks: the cases and the timing knobs (picklable, pure)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pcie_allreduce.bench.options import DTYPE_SIZES, BenchConfig


@dataclasses.dataclass(frozen=True)
class Case:
    """One (size, algo) of a backend run; ``index`` is its position in the run's full case list."""

    index: int
    size_bytes: int
    count: int
    algo: str


@dataclasses.dataclass(frozen=True)
class RankJob:
    """Everything :func:`pcie_allreduce.bench.rank.bench_rank` needs, pickled into each rank."""

    backend: str
    dtype: str
    cases: tuple[Case, ...]
    max_bytes: int
    progress_dir: str
    seed: int = 0
    iters: int = 100
    warmup: int = 10
    calls_per_graph: int = 16
    eager: bool = False
    time_budget_s: float = 1.0
    case_timeout_s: float = 30.0
    setup_timeout_s: float = 90.0


def make_cases(sizes: Sequence[int], algos: Sequence[str], dtype: str) -> tuple[Case, ...]:
    """Size-major order (all algos of a size together, so inputs are built once per size)."""
    element = DTYPE_SIZES[dtype]
    cases = []
    for size in sizes:
        for algo in algos:
            cases.append(Case(len(cases), size, size // element, algo))
    return tuple(cases)


def make_job(cfg: BenchConfig, backend: str, cases: Sequence[Case], progress_dir: str) -> RankJob:
    return RankJob(
        backend=backend, dtype=cfg.dtype, cases=tuple(cases), max_bytes=cfg.max_bytes, progress_dir=progress_dir,
        seed=cfg.seed, iters=cfg.iters, warmup=cfg.warmup, calls_per_graph=cfg.calls_per_graph, eager=cfg.eager,
        time_budget_s=cfg.time_budget_s, case_timeout_s=cfg.case_timeout_s, setup_timeout_s=cfg.setup_timeout_s,
    )
