"""Rank side of the ``torch_symm`` backend: PyTorch symmetric memory's one-shot / two-shot all-reduce.

The input must live in a symmetric-memory buffer that every rank rendezvoused on; we allocate one
of the largest size and use its leading ``count`` elements, as vLLM's wrapper does. Under
emulation (ranks sharing a GPU) the ranks need TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, which
the runner sets. The ``*_out`` variants are used when this torch has them (no input copy, no
allocation per call); older ones fall back to the allocating / in-place ops.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from pcie_allreduce.sizes import DTYPE_SIZES
from pcie_allreduce.tools.ranks import RankContext

from bench.backends import Backend, Buffers
from bench.outcome import CaseSkipped
from bench.plan import RankJob

SYNC_COUNT = 64
# torch has some of its kernels for a few world sizes only (its two-shot has none for 16 ranks) and
# says so before it launches anything, so the backend stays usable: such a case is skipped, and
# the backend's other cases run.
UNSUPPORTED_WORLD = "Not implemented for world_size"


def _op(name: str) -> Any | None:
    try:
        return getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return None


class TorchSymmBackend(Backend):
    """one_shot_all_reduce(_out) and two_shot_all_reduce_(out) over a gloo group's name."""

    algorithms = ("one_shot", "two_shot")

    @classmethod
    def runtime_problem(cls, world: int, gpu_count: int) -> str | None:
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is built without CUDA"
        try:
            importlib.import_module("torch.distributed._symmetric_memory")  # registers the ops' Python side
        except ImportError as exc:
            return f"torch.distributed._symmetric_memory does not import ({exc})"
        for op in ("one_shot_all_reduce", "two_shot_all_reduce_"):
            if _op(op) is None:
                return f"torch {torch.__version__} has no torch.ops.symm_mem.{op}"
        return None

    @classmethod
    def rank_env(cls, world: int, gpu_count: int) -> dict[str, str]:
        # Without it torch symmetric memory refuses two ranks whose tensors live on one device.
        return {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"} if world > gpu_count else {}

    def __init__(self, ctx: RankContext, job: RankJob) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self._device = ctx.device
        self._group = ctx.group
        self._group_name = ctx.group.group_name
        dtype = getattr(torch, job.dtype)
        count = max(job.max_bytes // DTYPE_SIZES[job.dtype], SYNC_COUNT)
        self._buf = symm_mem.empty(count, dtype=dtype, device=ctx.device)
        symm_mem.rendezvous(self._buf, self._group_name)
        self._sync = symm_mem.empty(SYNC_COUNT, dtype=dtype, device=ctx.device)
        self._sync.zero_()
        symm_mem.rendezvous(self._sync, self._group_name)
        self._one_shot_out = _op("one_shot_all_reduce_out")
        self._two_shot_out = _op("two_shot_all_reduce_out")
        torch.cuda.synchronize(ctx.device)

    def buffers(self, count: int, dtype: torch.dtype, algo: str) -> Buffers:
        if dtype != self._buf.dtype:
            raise ValueError(f"symmetric buffer is {self._buf.dtype}, case wants {dtype}")
        inp = self._buf[:count]
        if algo == "two_shot" and self._two_shot_out is None:
            return Buffers(inp, inp)
        return Buffers(inp, torch.empty_like(inp))

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        try:
            return self._call(bufs, algo)
        except RuntimeError as exc:
            if UNSUPPORTED_WORLD in str(exc):
                raise CaseSkipped(f"torch symmetric memory's {algo}: {' '.join(str(exc).split())}") from exc
            raise

    def _call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        ops = torch.ops.symm_mem
        if algo == "one_shot":
            if self._one_shot_out is not None:
                return self._one_shot_out(bufs.inp, "sum", self._group_name, bufs.out)
            return ops.one_shot_all_reduce(bufs.inp, "sum", self._group_name)
        if algo == "two_shot":
            if self._two_shot_out is not None:
                return self._two_shot_out(bufs.inp, "sum", self._group_name, bufs.out)
            return ops.two_shot_all_reduce_(bufs.inp, "sum", self._group_name)
        raise ValueError(f"torch_symm has no algorithm {algo!r}")

    def mutates_input(self, algo: str) -> bool:
        # two_shot's schema marks its input as written (reduce-scatter lands there) even in the _out form.
        return algo == "two_shot"

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return algo

    def prepare_capture(self, stream: torch.cuda.Stream) -> None:
        pass

    def device_sync(self) -> None:
        torch.ops.symm_mem.one_shot_all_reduce(self._sync, "sum", self._group_name)

    def check(self) -> None:
        pass  # its kernels have no asynchronous error record

    def close(self) -> None:
        import torch.distributed as dist

        torch.cuda.synchronize(self._device)
        dist.barrier(group=self._group)  # no rank frees its buffer while a peer may still read it
