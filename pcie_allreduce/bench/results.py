"""The result-row data model of a sweep: one :class:`Result` per (world, size, backend, algo).

Pure Python (no torch): the formatting tests build fake result sets from these.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

OK = "ok"
WRONG = "wrong"      # the all-reduce returned a wrong sum: not timed
FAILED = "failed"    # raised, or hung and was killed by the watchdog
NOT_RUN = "not run"  # never reached: an earlier case of the same backend run failed for good
STATUSES: tuple[str, ...] = (OK, WRONG, FAILED, NOT_RUN)

# Speed-ups are against NCCL where it ran (distinct GPUs), else against torch symmetric memory.
REFERENCE_ORDER: tuple[str, ...] = ("nccl", "torch_symm")


@dataclasses.dataclass(frozen=True)
class Result:
    """One measured (or failed) case.

    Times are per all-reduce call in microseconds: each timed replay of a CUDA graph of
    ``calls_per_graph`` calls is timed with CUDA events on every rank; a replay's time is the
    slowest rank's, divided by ``calls_per_graph``; ``p50_us``/``p99_us`` are over replays.
    ``rank0_p50_us`` is rank 0's own median, for comparison with single-rank figures.
    """

    world: int
    backend: str
    algo: str
    size_bytes: int
    count: int
    dtype: str
    status: str = OK
    p50_us: float | None = None
    p99_us: float | None = None
    rank0_p50_us: float | None = None
    replays: int = 0
    calls_per_graph: int = 0
    mode: str = "graph"
    resolved_algo: str = ""  # what "auto" (or NCCL's env) picked; else the algo itself
    error: str = ""
    speedup: float | None = None  # reference p50 / this p50
    reference: str = ""           # backend the speed-up is against

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == OK and self.p50_us is not None

    @property
    def algbw_gbps(self) -> float | None:
        """Message bytes / p50 time, in GB/s (1e9), as nccl-tests' algbw."""
        return algbw_gbps(self.size_bytes, self.p50_us)

    @property
    def busbw_gbps(self) -> float | None:
        """algbw * 2(W-1)/W: the per-link traffic of a ring all-reduce, as nccl-tests' busbw."""
        return busbw_gbps(self.algbw_gbps, self.world)

    @property
    def label(self) -> str:
        """The algo column: "auto(oneshot)" when auto resolved to something."""
        if self.resolved_algo and self.resolved_algo != self.algo:
            return f"{self.algo}({self.resolved_algo})"
        return self.algo

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["algbw_gbps"] = self.algbw_gbps
        data["busbw_gbps"] = self.busbw_gbps
        return data


@dataclasses.dataclass(frozen=True)
class Note:
    """Something about a whole (world, backend) run: skipped (unavailable) or failed."""

    world: int
    backend: str
    kind: str  # "skipped" or "failed"
    reason: str
    detail: str = ""  # full text (tracebacks, stacks) for the JSON; never printed in the table


@dataclasses.dataclass
class Report:
    """A whole sweep: environment, configuration, placements per world, rows and notes."""

    environment: dict[str, Any]
    config: dict[str, Any]
    placements: dict[int, str]  # world -> "emulation: 4 ranks on one GPU under MPS" / "4 ranks on 4 GPUs"
    results: list[Result]
    notes: list[Note] = dataclasses.field(default_factory=list)


def algbw_gbps(size_bytes: int, time_us: float | None) -> float | None:
    if time_us is None or time_us <= 0:
        return None
    return size_bytes / time_us / 1e3


def busbw_gbps(algbw: float | None, world: int) -> float | None:
    if algbw is None:
        return None
    return algbw * 2 * (world - 1) / world


def _group_key(r: Result) -> tuple[int, str, int, str]:
    return (r.world, r.dtype, r.size_bytes, r.mode)


def best_per_backend(results: Iterable[Result]) -> dict[tuple[tuple[int, str, int, str], str], Result]:
    """(world, dtype, size, mode), backend -> that backend's fastest ok row."""
    best: dict[tuple[tuple[int, str, int, str], str], Result] = {}
    for r in results:
        if not r.ok:
            continue
        key = (_group_key(r), r.backend)
        if key not in best or r.p50_us < best[key].p50_us:  # type: ignore[operator]
            best[key] = r
    return best


def add_speedups(results: list[Result]) -> list[Result]:
    """Copies of ``results`` with ``speedup``/``reference`` set: the reference backend's best
    p50 for the same (world, dtype, size, mode) divided by the row's p50."""
    best = best_per_backend(results)
    out = []
    for r in results:
        ref = next((best[(_group_key(r), name)] for name in REFERENCE_ORDER if (_group_key(r), name) in best), None)
        if ref is None or not r.ok:
            out.append(dataclasses.replace(r, speedup=None, reference=ref.backend if ref else ""))
        else:
            out.append(dataclasses.replace(r, speedup=ref.p50_us / r.p50_us, reference=ref.backend))  # type: ignore[operator]
    return out


def sort_key(r: Result) -> tuple[Any, ...]:
    """Table order: world, size, then backends as listed in the run, then algo."""
    return (r.world, r.dtype, r.mode, r.size_bytes)
