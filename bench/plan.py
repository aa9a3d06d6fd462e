"""What a backend run hands to its ranks: the cases and the timing knobs (picklable, pure; the parent
chooses them from its configuration, :func:`bench.runner.cases_for`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pcie_allreduce.sizes import DTYPE_SIZES

from bench.results import ALLREDUCE


@dataclasses.dataclass(frozen=True)
class Case:
    """One (size, algo) of a backend run; ``index`` is its position in the run's full case list.

    ``tokens``/``hidden`` (fused, verify): the activation is [tokens, hidden]; ``calls``: calls per
    timed block when not the job's ``calls_per_graph`` (verify: 2 x layers); ``model``: the
    verify preset.
    """

    index: int
    size_bytes: int
    count: int
    algo: str
    tokens: int = 0
    hidden: int = 0
    calls: int = 0
    model: str = ""


TUNING_SETUPS = 3  # a backend's tuning (its tune()) may take this many times the set-up timeout


@dataclasses.dataclass(frozen=True)
class RankJob:
    """Everything :func:`bench.rank.bench_rank` needs, pickled into each rank."""

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
    rounds: int = 1
    case_timeout_s: float = 30.0
    setup_timeout_s: float = 90.0
    tune_baselines: bool = True  # run a third-party backend's per-machine tuning (its tune()) before the cases
    workload: str = ALLREDUCE
    eps: float = 1e-6
    gemms: bool = False  # verify: each layer's GEMMs before its collectives (bench.layer_gemms)

    def calls(self, case: Case) -> int:
        """Calls per timed block (per CUDA graph) of ``case``."""
        return case.calls or self.calls_per_graph


def make_cases(sizes: Sequence[int], algos: Sequence[str], dtype: str) -> tuple[Case, ...]:
    """Size-major order (all algos of a size together, so inputs are built once per size)."""
    element = DTYPE_SIZES[dtype]
    cases = []
    for size in sizes:
        for algo in algos:
            cases.append(Case(len(cases), size, size // element, algo))
    return tuple(cases)
