"""Backend registry: which algorithms each backend offers, whether it can run here, the
environment its ranks need, and (inside a rank) the object that issues its all-reduces.

Every backend runs in its own ``run_ranks`` call (fresh processes, fresh MPS daemon), so one that
fails or hangs cannot take the others' results with it. Adding a backend (issue 5: FlashInfer
pcie_ipc, vLLM and sgl-kernel were added this way) means one ``backend_<name>.py`` with a class
following :class:`RankBackend` plus one entry in each function below.

With ``--fused`` and ``verify`` every backend is wrapped in :class:`~.norm_ops.NormAdapter`,
which adds the "+norm" variants (all-reduce, then torch residual add + RMSNorm) and our fused kernel.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:  # torch only inside ranks and availability probes
    import torch

    from bench.plan import RankJob
    from pcie_allreduce.ranks import RankContext

from bench.results import ALLREDUCE, FUSED, FUSED_ALGO, NORM_SUFFIX, VERIFY

TORCH_SYMM_ALGOS: tuple[str, ...] = ("one_shot", "two_shot")
NCCL_ALGOS: tuple[str, ...] = ("default",)  # NCCL picks ring/tree and protocol itself
NCCL_LL = "nccl_ll"  # NCCL with NCCL_PROTO=LL: the tuned-NCCL row (its low-latency protocol for small messages)
NCCL_BACKENDS: tuple[str, ...] = ("nccl", NCCL_LL)
CUSTOM_AR_ALGOS: tuple[str, ...] = ("custom_ar",)  # vLLM's / sgl-kernel's custom all-reduce
CUSTOM_AR_BACKENDS: tuple[str, ...] = ("vllm", "sgl_kernel")
FLASHINFER = "flashinfer"
FLASHINFER_ALGOS: tuple[str, ...] = ("pcie_ipc",)
# backend -> (modules it needs installed, how to install them); checked without importing them
THIRD_PARTY_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "vllm": (("vllm",), "pip install vllm"),
    "sgl_kernel": (("sgl_kernel", "sglang"), "pip install sglang sgl-kernel"),
    FLASHINFER: (("flashinfer",), "pip install flashinfer-python; its PCIe IPC all-reduce needs >= 0.7"),
}


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
    #   facts() -> dict                  JSON-able facts for the run's "setup" event
    #   cross_check(bufs, algo) -> str | None   an extra correctness check before timing
    #   capture_context() -> context manager     entered around every CUDA-graph capture


def _plain_algos(backend: str, our_algos: Sequence[str]) -> tuple[str, ...]:
    if backend == "ours":
        return tuple(our_algos)
    if backend == "torch_symm":
        return TORCH_SYMM_ALGOS
    if backend in NCCL_BACKENDS:
        return NCCL_ALGOS
    if backend in CUSTOM_AR_BACKENDS:
        return CUSTOM_AR_ALGOS
    if backend == FLASHINFER:
        return FLASHINFER_ALGOS
    raise ValueError(f"unknown backend {backend!r}")


def algos_for(backend: str, our_algos: Sequence[str], workload: str = ALLREDUCE, *,
              norm: bool = False) -> tuple[str, ...]:
    """The variants a backend is timed with.

    allreduce: its algorithms (``--algos`` applies to ours only). fused: ours runs the fused
    kernel, "auto+norm" and plain "auto" (the two ratios the fused kernel is judged by); the
    others their algorithms + norm. verify: the plain algorithms (ours: "auto"), and with ``norm``
    the same + norm (ours: the fused kernel and "auto+norm").
    """
    if workload == ALLREDUCE:
        return _plain_algos(backend, our_algos)
    plain = ("auto",) if backend == "ours" else _plain_algos(backend, our_algos)
    normed = tuple(a + NORM_SUFFIX for a in plain)
    if backend == "ours":
        normed = (FUSED_ALGO, *normed)
    if workload == FUSED:
        return normed + (("auto",) if backend == "ours" else ())
    if workload == VERIFY:
        return plain + (normed if norm else ())
    raise ValueError(f"no variants for workload {workload!r}")


def _torch_symm_problem() -> str | None:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401 - registers the Python side of the ops
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory does not import ({exc})"
    for op in ("one_shot_all_reduce", "two_shot_all_reduce_"):
        try:
            getattr(torch.ops.symm_mem, op)
        except (AttributeError, RuntimeError):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.{op}"
    return None


def _nccl_problem() -> str | None:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "this torch has no NCCL backend"
    return None


def _packages_problem(backend: str) -> str | None:
    needed, hint = THIRD_PARTY_PACKAGES[backend]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not installed ({hint})" if missing else None


def skip_reason(backend: str, world: int, gpu_count: int) -> str | None:
    """Why ``backend`` cannot run ``world`` ranks on ``gpu_count`` local GPUs, or None."""
    if backend == "ours":
        import pcie_allreduce

        reason = pcie_allreduce.unavailable_reason()
        return None if reason is None else f"pcie_allreduce kernels unavailable: {reason}"
    if backend == "torch_symm":
        return _torch_symm_problem()
    if backend in NCCL_BACKENDS:
        if world > gpu_count:
            return (f"NCCL refuses two ranks on one GPU ({world} ranks on {gpu_count} GPU"
                    f"{'s' if gpu_count != 1 else ''}); it runs only when every rank has its own GPU")
        return _nccl_problem()
    if backend in THIRD_PARTY_PACKAGES:
        return _packages_problem(backend)
    raise ValueError(f"unknown backend {backend!r}")


def rank_env(backend: str, world: int, gpu_count: int) -> dict[str, str]:
    """Environment variables the ranks of ``backend`` need from their start."""
    if backend == "torch_symm" and world > gpu_count:
        # Without it torch symmetric memory refuses two ranks whose tensors live on one device.
        return {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    if backend == NCCL_LL:
        return {"NCCL_PROTO": "LL"}
    return {}


def open_backend(ctx: "RankContext", job: "RankJob") -> Any:
    """Inside a rank: construct (collectively) the backend object of ``job.backend``."""
    if job.backend == "ours":
        from bench.backend_ours import OursBackend

        return OursBackend(ctx, job)
    if job.backend == "torch_symm":
        from bench.backend_torch_symm import TorchSymmBackend

        return TorchSymmBackend(ctx, job)
    if job.backend in NCCL_BACKENDS:
        from bench.backend_nccl import NcclBackend

        return NcclBackend(ctx, job)
    if job.backend in CUSTOM_AR_BACKENDS:
        from bench.backend_custom_ar import CustomAllreduceBackend

        return CustomAllreduceBackend(ctx, job)
    if job.backend == FLASHINFER:
        from bench.backend_flashinfer import FlashInferPcieIpcBackend

        return FlashInferPcieIpcBackend(ctx, job)
    raise ValueError(f"unknown backend {job.backend!r}")
