"""CPU stand-ins for the bench's rank side (used by tests/test_bench_*.py).

Ranks run on the CPU with a gloo group; the CUDA calls the rank loop makes are stubbed, and the
backends are fakes built on gloo all-reduce:

- ``ours``: a fake communicator with ``all_reduce``, ``all_reduce_rmsnorm`` (torch reference math),
  ``select_fused_algo``, ``check``; scripted faults by token count: T=2 rank 1 corrupts the new
  residual (the exact check must catch it); T=3 the fused path rounds differently, which only
  random data shows (the bitwise cross-check must catch it).
  Forced kernels (``algo=``): "oneshot_ll" cannot take more than 1 token (ValueError, as the
  library's shape check), others run the same math.
- ``torch_symm``: gloo all-reduce whose ``two_shot`` overwrites its input (the zeroing path).
- ``nccl``: gloo all-reduce in place (its output is its input).
- One-kernel add + RMSNorm baselines (``norm_ops.load_kernel``): ours and FlashInfer's as torch
  math (FlashInfer's in place), sgl-kernel's not importable.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.distributed as dist

from pcie_allreduce.tools import ranks

from bench import backends
from bench.backends import Buffers
from bench import norm_ops
from bench.norm_ops import torch_add_rmsnorm, torch_rmsnorm
from bench.results import FLASHINFER_NORM_SUFFIX, ONE_KERNEL_NORM_SUFFIX

FAKE_BLOCK_CAP = 4
FAKE_FUSED_ALGOS = ("auto", "oneshot", "twoshot", "oneshot_ll", "oneshot_full", "unfused")


class FakeEvent:
    def __init__(self, **_: object) -> None:
        self.t = 0.0

    def record(self, *_: object) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1e3


class FakeComm:
    """The part of Communicator the bench uses, on gloo."""

    block_cap = FAKE_BLOCK_CAP

    def __init__(self, ctx: ranks.RankContext) -> None:
        self.ctx = ctx
        self.device = ctx.device

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        out = torch.empty_like(x) if out is None else out
        out.copy_(x)
        dist.all_reduce(out, group=self.ctx.group)
        return out

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                           out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                           algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        if algo not in FAKE_FUSED_ALGOS:
            raise ValueError(f"unknown fused algo {algo!r}")
        if algo == "oneshot_ll" and x.shape[0] > 1:
            raise ValueError(f"fused oneshot_ll cannot take [{x.shape[0]}, {x.shape[1]}] {x.dtype}")
        out = torch.empty_like(x) if out is None else out
        residual_out = torch.empty_like(residual) if residual_out is None else residual_out
        y = self.all_reduce(x)
        tokens = x.shape[0]
        if tokens == 3:  # a different rounding: invisible on small integers, visible on random data
            v = residual.float() + y.float()
            residual_out.copy_(torch.where(v.abs() >= 1, v + 1e-3 * v.sign(), v).to(residual.dtype))
        else:
            torch.add(residual, y, out=residual_out)
        if tokens == 2 and self.ctx.rank == 1:
            residual_out.view(-1)[5] += 1
        out.copy_(torch_rmsnorm(residual_out, weight, eps))
        return out, residual_out

    def select_fused_algo(self, tokens: int, hidden: int, dtype: torch.dtype) -> str:
        return "oneshot" if tokens < 3 else "twoshot"

    def select_algo(self, nbytes: int, dtype: torch.dtype) -> str:
        return "oneshot"

    def check(self) -> None:
        pass


class QuietBackendHooks:
    """The RankBackend hooks a CPU fake has nothing to do for (capture, GPU sync, checks, teardown)."""

    def prepare_capture(self, stream: object) -> None:
        pass

    def device_sync(self) -> None:
        pass

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeBackend(QuietBackendHooks):
    """gloo all-reduce; ``comm`` only for "ours"."""

    def __init__(self, ctx: ranks.RankContext, job: Any) -> None:
        self.ctx = ctx
        self.name = job.backend
        if job.backend == "ours":
            self.comm = FakeComm(ctx)

    def buffers(self, count: int, dtype: torch.dtype, algo: str) -> Buffers:
        inp = torch.empty(count, dtype=dtype)
        return Buffers(inp, inp if self.mutates_input(algo) else torch.empty_like(inp))

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        if bufs.out is not bufs.inp:
            bufs.out.copy_(bufs.inp)
        dist.all_reduce(bufs.out, group=self.ctx.group)
        return bufs.out

    def mutates_input(self, algo: str) -> bool:
        return algo == "two_shot" or self.name == "nccl"

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str) -> str:
        return "oneshot" if algo == "auto" else algo

    def facts(self) -> dict[str, Any]:
        return {"block_cap": FAKE_BLOCK_CAP, "gpu_name": "Fake GPU", "fingerprint": "0123456789ab"}


def fake_add_rmsnorm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     normed: torch.Tensor, new_residual: torch.Tensor, *, compile_only: bool = False,
                     after_all_reduce: bool = False) -> None:
    """The library's add_rmsnorm contract, in torch math (out of place; nothing to compile)."""
    if not compile_only:
        torch_add_rmsnorm(y, residual, weight, eps, normed, new_residual)


def fake_fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """FlashInfer's in-place contract: residual += x; x = rmsnorm(residual) * weight."""
    residual.add_(x)
    x.copy_(torch_rmsnorm(residual, weight, eps))


def fake_load_kernel(suffix: str) -> Any:
    kernels = {ONE_KERNEL_NORM_SUFFIX: fake_add_rmsnorm, FLASHINFER_NORM_SUFFIX: fake_fused_add_rmsnorm}
    if suffix not in kernels:
        raise ModuleNotFoundError(f"No module named {norm_ops.ONE_KERNELS[suffix][0]!r}")
    return kernels[suffix]


def cpu_bench_rank(ctx: ranks.RankContext, job: Any, backend_class: Any = None) -> dict:
    """bench_rank with the CUDA calls stubbed and ``backend_class`` (default :class:`FakeBackend`)
    serving every backend, in a CPU rank."""
    from bench import environment, rank

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = lambda *a, **k: object()
    torch.cuda.Event = FakeEvent
    torch.cuda._sleep = lambda cycles: None
    backends.open_backend = backend_class or FakeBackend
    norm_ops.load_kernel = fake_load_kernel
    environment.rank_environment = lambda c: {"mps": False, "shared_gpu": True}
    return rank.bench_rank(ctx, job)


def use_cpu_ranks(monkeypatch: Any, backend_class: Any = None) -> None:
    """Make the runner spawn CPU ranks running :func:`cpu_bench_rank` (with ``backend_class``),
    every backend available."""
    real_run_ranks = ranks.run_ranks

    def cpu_run_ranks(fn: Any, world: int, *args: Any, **kw: Any) -> Any:
        kw["gpu"] = False
        return real_run_ranks(functools.partial(cpu_bench_rank, backend_class=backend_class), world, *args, **kw)

    monkeypatch.setattr(ranks, "run_ranks", cpu_run_ranks)
    monkeypatch.setattr(backends, "skip_reason", lambda b, w, g: None)


class RecordingBar:
    """A progress sink that remembers how far it got."""

    def __init__(self) -> None:
        self.done = 0

    def advance(self, cases: int) -> None:
        self.done += cases
