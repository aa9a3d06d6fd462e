"""Backend registry: which algorithms each backend offers, whether it can run here, the
environment its ranks need, and (inside a rank) the object that issues its all-reduces.

Every backend runs in its own ``run_ranks`` call (fresh processes, fresh MPS daemon), so one that
fails or hangs cannot take the others' results with it. Adding a backend means one
``backend_<name>.py`` with a :class:`Backend` subclass (its declarations as class attributes, the
rank-side methods of :class:`RankBackend`) plus one line in :data:`REGISTRY`. The parent loads a
class only to read its declarations; third-party packages are imported inside the ranks only.

With ``--fused`` and ``verify`` every backend is wrapped in :class:`~.norm_ops.NormAdapter`,
which adds the norm variants (all-reduce, then a residual add + RMSNorm: "+norm" as eager torch
ops, "+addnorm" / "+fi_addnorm" / "+sgl_addnorm" as one kernel) and our fused kernel.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, Sequence

from pcie_allreduce.plan.algorithms import HOST_ONLY_ALGORITHMS
from pcie_allreduce.tools.cli import resolve

from bench.results import ALLREDUCE, FUSED, FUSED_ALGO, NORM_SUFFIXES, OURS_HIER, VERIFY, forced_fused_algo

if TYPE_CHECKING:  # torch only inside ranks and availability probes
    import torch

    from pcie_allreduce.tools.ranks import RankContext

    from bench.plan import RankJob

OURS = "ours"  # our Communicator: --algos picks its variants, and it alone has the fused kernel
OURS_HOST = "ours_host"  # the same on the host transport (pinned host memory), whatever P2P the box has
OUR_BACKENDS: tuple[str, ...] = (OURS, OURS_HOST)
# name -> "module:Class", in the order backends run and appear in tables. One line per backend.
REGISTRY: Mapping[str, str] = MappingProxyType({
    OURS: "bench.backend_ours:OursBackend",
    OURS_HOST: "bench.backend_ours:OursHostBackend",
    OURS_HIER: "bench.backend_ours_hier:OursHierBackend",
    "torch_symm": "bench.backend_torch_symm:TorchSymmBackend",
    "nccl": "bench.backend_nccl:NcclBackend",
    "nccl_ll": "bench.backend_nccl:NcclLowLatencyBackend",
    "nccl_shm": "bench.backend_nccl:NcclSharedMemoryBackend",
    "flashinfer": "bench.backend_flashinfer:FlashInferPcieIpcBackend",
    "vllm": "bench.backend_custom_ar:VllmCustomAllreduceBackend",
    "sgl_kernel": "bench.backend_custom_ar:SglKernelCustomAllreduceBackend",
})
BACKENDS: tuple[str, ...] = tuple(REGISTRY)
# Rows of the comparison for boxes without usable P2P, run when named (on such a box the default
# rows already are: "ours" takes the host transport there, and NCCL its shared-memory path).
# The hierarchy across nodes, run when named (on one host it emulates two nodes).
OPT_IN: tuple[str, ...] = (OURS_HOST, "nccl_shm", OURS_HIER)
DEFAULT_BACKENDS: tuple[str, ...] = tuple(b for b in BACKENDS if b not in OPT_IN)


@dataclasses.dataclass
class Buffers:
    """Device buffers of one case. ``out`` is ``inp`` for backends that reduce in place."""

    inp: "torch.Tensor"
    out: "torch.Tensor"


class RankBackend(Protocol):
    """What the timing loop needs from a backend, inside one rank."""

    def buffers(self, count: int, dtype: "torch.dtype", algo: str) -> Buffers:
        """Input/output buffers for ``count`` elements (the input may have to be special memory)."""

    def call(self, bufs: Buffers, algo: str) -> "torch.Tensor":
        """Enqueue one sum all-reduce of ``bufs.inp`` on the current stream; returns the result tensor."""

    def mutates_input(self, algo: str) -> bool:
        """Whether ``call`` overwrites its input (then the input is zeroed before timing)."""

    def resolved_algo(self, size_bytes: int, dtype: "torch.dtype", algo: str) -> str:
        """What ``algo`` runs as (``auto`` -> the chosen algorithm)."""

    def prepare_capture(self, stream: "torch.cuda.Stream") -> None:
        """Collective set-up the capture stream needs before any graph capture on it."""

    def device_sync(self) -> None:
        """A tiny all-reduce that lines the ranks' GPUs up before a timed block."""

    def check(self) -> None:
        """Raise an error the backend recorded asynchronously (after a device sync), if any."""

    def close(self) -> None:
        """Collective teardown."""

    # Optional, looked up with getattr by the rank loop:
    #   skip_reason(case) -> str | None   a case this backend cannot run here (status "skipped")
    #   facts() -> dict                  JSON-able facts for the run's "setup" event; "baseline_tuning"
    #                                    (text) is also printed under the backend's rows
    #   tune() -> None                   the library's own per-machine tuning, which its users are told
    #                                    to run, before the first case (skipped with --untuned-baselines)
    #   cross_check(bufs, algo) -> str | None   an extra correctness check before timing
    #   checks_after_timing(bufs, algo) -> bool  False: the last timed output cannot be checked
    #   (raising bench.outcome.CaseSkipped inside a case makes it "skipped" with that message)
    #   capture_context() -> context manager     entered around every CUDA-graph capture


class Backend:
    """Base of the backend classes: what the parent reads before any rank starts.

    Class attributes: ``algorithms`` (the variants it is timed with), ``packages`` (modules that
    must be importable, checked without importing them) and ``install_hint``, ``env`` (variables
    its ranks need from their start). Override :meth:`runtime_problem` / :meth:`rank_env` for
    checks and variables that depend on the placement.
    """

    algorithms: ClassVar[tuple[str, ...]] = ()
    packages: ClassVar[tuple[str, ...]] = ()
    install_hint: ClassVar[str] = ""
    env: ClassVar[Mapping[str, str]] = MappingProxyType({})

    @classmethod
    def unavailable_reason(cls, world: int, gpu_count: int) -> str | None:
        """Why ``world`` ranks on ``gpu_count`` local GPUs cannot run it, or None."""
        missing = [name for name in cls.packages if importlib.util.find_spec(name) is None]
        if missing:
            return f"{' and '.join(missing)} not installed ({cls.install_hint})"
        return cls.runtime_problem(world, gpu_count)

    @classmethod
    def runtime_problem(cls, world: int, gpu_count: int) -> str | None:
        """A reason beyond missing packages (no CUDA torch, ranks sharing a GPU, ...), or None."""
        return None

    @classmethod
    def rank_env(cls, world: int, gpu_count: int) -> dict[str, str]:
        """Environment variables its ranks need from their start."""
        return dict(cls.env)


def backend_class(name: str) -> type[Backend]:
    """The class of backend ``name`` (imports its module, never a third-party package)."""
    try:
        path = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}") from None
    return resolve(path)  # type: ignore[return-value]


def algos_for(backend: str, our_algos: Sequence[str], workload: str = ALLREDUCE, *,
              norm: bool = False, fused_algos: Sequence[str] = ("auto",)) -> tuple[str, ...]:
    """The variants a backend is timed with.

    allreduce: its algorithms (``--algos`` applies to ours only). fused: ours runs the fused
    kernel ("fused" = auto, always; "fused:<name>" for every other name of ``fused_algos``), then
    "auto" + each residual add + RMSNorm (eager torch ops and each one-kernel baseline) and plain
    "auto" (the rows the fused kernel is judged against); the others their algorithms + each
    norm. verify: the plain algorithms (ours: "auto"), and with ``norm`` the same + each norm
    (ours: the fused kernel first).
    """
    ours = backend in OUR_BACKENDS
    if workload == ALLREDUCE:
        if backend == OURS_HOST:  # the host transport's own algorithms, whatever --algos said
            return tuple(dict.fromkeys((*our_algos, *HOST_ONLY_ALGORITHMS)))
        return tuple(our_algos) if ours else backend_class(backend).algorithms
    plain = ("auto",) if ours else backend_class(backend).algorithms
    normed = tuple(a + suffix for a in plain for suffix in NORM_SUFFIXES)
    if ours:
        fused = (FUSED_ALGO, *(forced_fused_algo(a) for a in fused_algos)) if workload == FUSED else (FUSED_ALGO,)
        normed = (*dict.fromkeys(fused), *normed)
    if workload == FUSED:
        return normed + (("auto",) if ours else ())
    if workload == VERIFY:
        return plain + (normed if norm else ())
    raise ValueError(f"no variants for workload {workload!r}")


def skip_reason(backend: str, world: int, gpu_count: int) -> str | None:
    """Why ``backend`` cannot run ``world`` ranks on ``gpu_count`` local GPUs, or None."""
    return backend_class(backend).unavailable_reason(world, gpu_count)


# What third-party packages print while they build and tune would bury the bench's rows: FlashInfer
# logs every JIT build and autotuner step at INFO and draws a progress bar per tuned shape. Ranks
# (and the one-process loops) start with these values, except for a variable the user set.
QUIET_THIRD_PARTY: Mapping[str, str] = MappingProxyType({"FLASHINFER_LOGGING_LEVEL": "WARNING", "TQDM_DISABLE": "1"})


def quiet_env() -> dict[str, str]:
    """:data:`QUIET_THIRD_PARTY`, where the user set a variable its value instead."""
    return {name: os.environ.get(name, value) for name, value in QUIET_THIRD_PARTY.items()}


def rank_env(backend: str, world: int, gpu_count: int) -> dict[str, str]:
    """Environment variables the ranks of ``backend`` need from their start."""
    return backend_class(backend).rank_env(world, gpu_count)


def open_backend(ctx: "RankContext", job: "RankJob") -> Any:
    """Inside a rank: construct (collectively) the backend object of ``job.backend``."""
    return backend_class(job.backend)(ctx, job)
