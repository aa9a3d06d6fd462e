"""The result-row data model of a sweep: one :class:`Result` per (world, size, backend, algo).

Pure Python (no torch): the formatting tests build fake result sets from these.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from pcie_allreduce.plan.algorithms import WireBytes, wire_bytes

OK = "ok"
WRONG = "wrong"      # the all-reduce returned a wrong sum: not timed
FAILED = "failed"    # raised, or hung and was killed by the watchdog
NOT_RUN = "not run"  # never reached: an earlier case of the same backend run failed for good
SKIPPED = "skipped"  # the backend cannot run this case here (e.g. over its capacity): not an error
STATUSES: tuple[str, ...] = (OK, WRONG, FAILED, NOT_RUN, SKIPPED)

# What a run measures (BenchConfig.workload): plain all-reduces (the sweep), all-reduce + residual
# add + RMSNorm (``--fused``), or one verify forward's collectives (``verify``).
ALLREDUCE, FUSED, VERIFY = "allreduce", "fused", "verify"
OURS_HIER = "ours_hier"  # the hierarchical communicator's backend (its wire: the inter-node link)
WORKLOADS: tuple[str, ...] = (ALLREDUCE, FUSED, VERIFY)
# A norm variant's algo is "<all-reduce algo><suffix>": the backend's all-reduce, then the
# residual add + RMSNorm done one of these ways (baselines for our fused kernel):
NORM_SUFFIX = "+norm"                   # eager torch ops (several kernels): what a model does without a fused op
ONE_KERNEL_NORM_SUFFIX = "+addnorm"     # our pcie_allreduce.fused.path.add_rmsnorm: one kernel, out of place
FLASHINFER_NORM_SUFFIX = "+fi_addnorm"  # flashinfer.norm.fused_add_rmsnorm: one kernel, in place
SGL_NORM_SUFFIX = "+sgl_addnorm"        # sgl_kernel.fused_add_rmsnorm: one kernel, in place
# The one-kernel baselines: the best of them is what the fused kernel is judged against.
ONE_KERNEL_NORM_SUFFIXES: tuple[str, ...] = (ONE_KERNEL_NORM_SUFFIX, FLASHINFER_NORM_SUFFIX, SGL_NORM_SUFFIX)
NORM_SUFFIXES: tuple[str, ...] = (NORM_SUFFIX, *ONE_KERNEL_NORM_SUFFIXES)
FUSED_ALGO = "fused"   # our fused all-reduce + residual add + RMSNorm kernel, algo="auto"
# "fused:<name>": the same call with algo=<name> forced (--fused-algos).
FORCED_FUSED_PREFIX = "fused:"


def split_norm(algo: str) -> tuple[str, str]:
    """(all-reduce algo, norm suffix): "one_shot+addnorm" -> ("one_shot", "+addnorm"); ("auto", "")
    for a plain algo. Fused rows have no suffix: see :func:`is_fused_algo`."""
    for suffix in sorted(NORM_SUFFIXES, key=len, reverse=True):  # no suffix ends another today; stay safe
        if algo.endswith(suffix):
            return algo[:-len(suffix)], suffix
    return algo, ""


def is_fused_algo(algo: str) -> bool:
    """Whether ``algo`` is our fused kernel: "fused" (auto) or "fused:<name>" (forced)."""
    return algo == FUSED_ALGO or algo.startswith(FORCED_FUSED_PREFIX)


def forced_fused_algo(name: str) -> str:
    """The row of our fused call with ``algo=name`` forced: "fused" for "auto", else "fused:<name>"."""
    return FUSED_ALGO if name == "auto" else FORCED_FUSED_PREFIX + name


def fused_kernel_name(algo: str) -> str:
    """The ``algo=`` a fused row passes to ``all_reduce_rmsnorm``: "auto" for "fused"."""
    return "auto" if algo == FUSED_ALGO else algo.removeprefix(FORCED_FUSED_PREFIX)


def is_norm_algo(algo: str) -> bool:
    """Whether ``algo`` includes the residual add + RMSNorm (fused, or after the all-reduce)."""
    return is_fused_algo(algo) or bool(split_norm(algo)[1])


def is_one_kernel_norm(algo: str) -> bool:
    """Whether ``algo`` is an all-reduce followed by ONE residual add + RMSNorm kernel."""
    return split_norm(algo)[1] in ONE_KERNEL_NORM_SUFFIXES

# Speed-ups are against NCCL where it ran (distinct GPUs), else against torch symmetric memory.
REFERENCE_ORDER: tuple[str, ...] = ("nccl", "torch_symm")


@dataclasses.dataclass(frozen=True)
class Result:
    """One measured (or failed) case.

    Times are per all-reduce call in microseconds: each timed replay of a CUDA graph of
    ``calls_per_graph`` calls is timed with CUDA events on every rank; a replay's time is the
    slowest rank's, divided by ``calls_per_graph``; ``p50_us``/``p99_us`` are over replays.
    ``rank0_p50_us`` is rank 0's own median, for comparison with single-rank figures; ``min_us``
    the fastest replay, for comparison with a bare kernel loop (``python -m bench.graph_loop``'s
    best of several runs): a p50 well above it means the replays spread, not that every call is slow.
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
    min_us: float | None = None
    replays: int = 0
    calls_per_graph: int = 0
    mode: str = "graph"
    resolved_algo: str = ""  # what "auto" (or NCCL's env) picked; else the algo itself
    error: str = ""
    speedup: float | None = None  # reference p50 / this p50 (verify: projected verify times)
    reference: str = ""           # backend the speed-up is against
    workload: str = ALLREDUCE
    tokens: int = 0               # fused / verify: rows of the [tokens, hidden] activation
    hidden: int = 0
    model: str = ""               # verify: the preset's name
    island_ranks: int = 0         # ours: ranks per island where they formed equal islands (wire of island_*)
    nodes: int = 0                # ours_hier: the nodes (equal runs of consecutive ranks) the hierarchy spans

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")

    @property
    def op(self) -> str:
        """What one call does: "allreduce" or "allreduce+norm"; only rows of the same op are compared."""
        return "allreduce+norm" if is_norm_algo(self.algo) else "allreduce"

    @property
    def layers(self) -> int:
        """verify: transformer layers of the pass (2 collectives each)."""
        return self.calls_per_graph // 2

    @property
    def pass_ms(self) -> float | None:
        """verify: the p50 of one whole pass (all ``calls_per_graph`` calls), in ms."""
        return None if self.p50_us is None else self.p50_us * self.calls_per_graph / 1e3

    @property
    def pass_p99_ms(self) -> float | None:
        return None if self.p99_us is None else self.p99_us * self.calls_per_graph / 1e3

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
    def wire(self) -> WireBytes | None:
        """Bytes on one rank's link per call, for our rows of the sweep and of ``--fused`` (None
        for other backends, whose formats are theirs, and for verify rows). The fused kernels move
        what the plain algorithm of the same name moves (the token-split two-shot gathers the new
        residual rows where the plain one gathers the sums); norm rows, their all-reduce."""
        if not self.backend.startswith("ours") or self.workload not in (ALLREDUCE, FUSED):
            return None
        if self.backend == OURS_HIER:  # the inter-node link: what a rank sends off its node and receives
            if not self.nodes or self.world % self.nodes:
                return None
            from pcie_allreduce.fabric.nodes import off_node_wire
            from pcie_allreduce.fabric.nodes import equal_nodes

            elem = max(1, self.size_bytes // max(1, self.count))
            return off_node_wire(self.count, elem, equal_nodes(self.world, self.nodes))
        algo = split_norm(self.resolved_algo or self.algo)[0]
        try:
            return wire_bytes(algo, self.size_bytes, self.world, self.island_ranks,
                              elem_size=max(1, self.size_bytes // max(1, self.count)))
        except ValueError:  # not one of ours (an "auto" that did not resolve), or islands unknown
            return None

    @property
    def wire_gbps(self) -> float | None:
        """The busier direction of :attr:`wire` over the p50 time: the link rate the call implies."""
        wire = self.wire
        return None if wire is None else algbw_gbps(wire.busiest, self.p50_us)

    @property
    def label(self) -> str:
        """The algo column: "auto(oneshot)" when auto resolved to something, "auto(oneshot)+addnorm",
        "fused(oneshot)"; a forced fused kernel shows its name ("fused:twoshot"), and what it ran as
        when that differs ("fused:unfused(oneshot)")."""
        if self.algo.startswith(FORCED_FUSED_PREFIX):
            name = fused_kernel_name(self.algo)
            return self.algo if self.resolved_algo in ("", name) else f"{self.algo}({self.resolved_algo})"
        base, suffix = split_norm(self.algo)
        resolved = split_norm(self.resolved_algo)[0]
        if resolved and resolved != base:
            return f"{base}({resolved}){suffix}"
        return self.algo

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["algbw_gbps"] = self.algbw_gbps
        data["busbw_gbps"] = self.busbw_gbps
        wire = self.wire
        data["wire_out_bytes"] = None if wire is None else wire.out
        data["wire_in_bytes"] = None if wire is None else wire.into
        data["wire_gbps"] = self.wire_gbps
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Result":
        """Inverse of :meth:`to_dict` (derived fields are dropped; fields a newer file lacks default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Note:
    """Something about a whole (world, backend) run: skipped (unavailable) or failed."""

    world: int
    backend: str
    kind: str  # "skipped", "failed" or "tuning" (how a third-party backend was tuned: printed, not an error)
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


GroupKey = tuple[Any, ...]


def group_key(r: Result) -> GroupKey:
    """Rows that measure the same thing: (world, dtype, size, mode, workload, model, tokens, hidden, op)."""
    return (r.world, r.dtype, r.size_bytes, r.mode, r.workload, r.model, r.tokens, r.hidden, r.op)


def best_per_backend(results: Iterable[Result]) -> dict[tuple[GroupKey, str], Result]:
    """(group key, backend) -> that backend's fastest ok row."""
    best: dict[tuple[GroupKey, str], Result] = {}
    for r in results:
        if not r.ok:
            continue
        key = (group_key(r), r.backend)
        if key not in best or r.p50_us < best[key].p50_us:  # type: ignore[operator]
            best[key] = r
    return best


def _cost(r: Result, compute_ms: float | None) -> float:
    """What a speed-up compares: p50 per call, or for verify rows the projected verify time."""
    if r.workload == VERIFY and compute_ms is not None:
        return r.pass_ms + compute_ms  # type: ignore[operator]
    return r.p50_us  # type: ignore[return-value]


def add_speedups(results: list[Result], compute_ms: float | None = None) -> list[Result]:
    """Copies of ``results`` with ``speedup``/``reference`` set: the reference backend's best row of
    the same group (see :func:`group_key`) over the row, by p50 per call, or for verify rows by
    projected verify time (pass + ``compute_ms``)."""
    best = best_per_backend(results)
    out = []
    for r in results:
        key = group_key(r)
        ref = next((best[(key, name)] for name in REFERENCE_ORDER if (key, name) in best), None)
        if ref is None or not r.ok:
            out.append(dataclasses.replace(r, speedup=None, reference=ref.backend if ref else ""))
        else:
            out.append(dataclasses.replace(r, speedup=_cost(ref, compute_ms) / _cost(r, compute_ms),
                                           reference=ref.backend))
    return out


def sort_key(r: Result) -> tuple[Any, ...]:
    """Table order: world, size, then backends as listed in the run, then algo (a stable sort)."""
    return (r.world, r.dtype, r.mode, r.workload, r.model, r.size_bytes)


def backend_order(report: Report, results: Iterable[Result] | None = None) -> list[str]:
    """The backends that have rows, in the run's order (config), then any others as they appear."""
    present = list(dict.fromkeys(r.backend for r in (report.results if results is None else results)))
    configured = [b for b in report.config.get("backends", ()) if b in present]
    return configured + [b for b in present if b not in configured]
