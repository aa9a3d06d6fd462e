"""Rank side of ``--fused`` and ``verify``: residual add + RMSNorm on top of any backend's all-reduce.

:class:`NormAdapter` wraps a backend and offers, besides its plain algorithms:

- ``"<algo>+norm"``: the backend's all-reduce ``y``, then ``new_residual = residual + y`` and
  ``normed = rmsnorm(new_residual) * weight`` as separate torch ops (what a model does today);
- ``"fused"`` (ours only): :meth:`Communicator.all_reduce_rmsnorm`, one kernel.

The torch RMSNorm does its math in fp32 (variance, rsqrt, times the weight) and rounds once, like
the fused kernel, so the two agree to rounding. All buffers are allocated once per case; the
torch ops' temporaries come from the CUDA graph's private pool when captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager

import torch

from pcie_allreduce.ranks import RankContext

from bench.backends import Buffers
from bench.plan import Case, RankJob
from bench.results import FUSED_ALGO, NORM_SUFFIX
from bench.results import is_norm_algo as is_norm

NORMED_RTOL = NORMED_ATOL = 2.0 ** -6  # a few bf16 ulps: two roundings and a different reduction order
CROSS_CHECK_SEED = 1234


@dataclasses.dataclass
class NormBuffers(Buffers):
    """A norm variant's tensors; ``inp`` (flat x, the all-reduce's input) and ``out`` (flat normed)."""

    inner: Buffers | None   # the wrapped backend's all-reduce buffers (None for the fused kernel)
    residual: torch.Tensor  # [tokens, hidden]
    weight: torch.Tensor    # [hidden]
    normed: torch.Tensor    # [tokens, hidden]
    new_residual: torch.Tensor
    tokens: int
    hidden: int


def torch_rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h * rsqrt(mean(h^2) + eps) * weight`` in fp32, rounded once to ``h``'s dtype."""
    x = h.float()
    variance = x.pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps) * weight.float()).to(h.dtype)


def torch_add_rmsnorm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      normed: torch.Tensor, new_residual: torch.Tensor) -> None:
    """The unfused baseline: ``new_residual = residual + y`` (one rounding, like the fused kernel's
    contract), then the RMSNorm into ``normed``."""
    torch.add(residual, y, out=new_residual)
    normed.copy_(torch_rmsnorm(new_residual, weight, eps))


def base_algo(algo: str) -> str:
    """The all-reduce inside a variant: "one_shot+norm" -> "one_shot"; "fused" -> "auto"."""
    if algo == FUSED_ALGO:
        return "auto"
    return algo[:-len(NORM_SUFFIX)] if algo.endswith(NORM_SUFFIX) else algo


def close_enough(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` is within the RMSNorm tolerance of ``want``, else a one-line description."""
    g, w = got.float().reshape(-1), want.float().reshape(-1)
    bad = ~torch.isclose(g, w, rtol=NORMED_RTOL, atol=NORMED_ATOL)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    first = int(bad.nonzero()[0])
    return (f"normed: {n_bad} of {w.numel()} elements off (first at {first}: got {g[first].item():.5g}, "
            f"want {w[first].item():.5g})")


class NormAdapter:
    """A :class:`~.backends.RankBackend` whose variants may include the residual add + RMSNorm."""

    def __init__(self, inner: Any, ctx: RankContext, job: RankJob) -> None:
        self.inner = inner
        self._ctx = ctx
        self._eps = job.eps

    # -- the RankBackend interface; ``hidden`` comes from the case (the rank loop passes it) --

    def buffers(self, count: int, dtype: torch.dtype, algo: str, *, hidden: int = 0) -> Buffers:
        if not is_norm(algo):
            return self.inner.buffers(count, dtype, algo)
        if hidden <= 0 or count % hidden:
            raise ValueError(f"{algo}: {count} elements are not [tokens, {hidden}]")
        tokens, device = count // hidden, self._ctx.device
        if algo == FUSED_ALGO:
            inner = None
            x = torch.empty(count, dtype=dtype, device=device)
        else:
            inner = self.inner.buffers(count, dtype, base_algo(algo))
            x = inner.inp
        shape = (tokens, hidden)
        normed = torch.empty(shape, dtype=dtype, device=device)
        return NormBuffers(inp=x, out=normed.view(-1), inner=inner,
                           residual=torch.empty(shape, dtype=dtype, device=device),
                           weight=torch.empty(hidden, dtype=dtype, device=device), normed=normed,
                           new_residual=torch.empty(shape, dtype=dtype, device=device), tokens=tokens, hidden=hidden)

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        if not is_norm(algo):
            return self.inner.call(bufs, algo)
        assert isinstance(bufs, NormBuffers)
        x = bufs.inp.view(bufs.tokens, bufs.hidden)
        if algo == FUSED_ALGO:
            self.inner.comm.all_reduce_rmsnorm(x, bufs.residual, bufs.weight, self._eps, out=bufs.normed,
                                               residual_out=bufs.new_residual)
            return bufs.out
        assert bufs.inner is not None
        y = self.inner.call(bufs.inner, base_algo(algo)).view(bufs.tokens, bufs.hidden)
        torch_add_rmsnorm(y, bufs.residual, bufs.weight, self._eps, bufs.normed, bufs.new_residual)
        return bufs.out

    def mutates_input(self, algo: str) -> bool:
        return False if algo == FUSED_ALGO else bool(self.inner.mutates_input(base_algo(algo)))

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str, *, hidden: int = 0) -> str:
        if algo == FUSED_ALGO:
            element = torch.empty((), dtype=dtype).element_size()
            tokens = size_bytes // element // max(hidden, 1)
            return self.inner.comm.select_fused_algo(tokens, hidden, dtype)
        resolved = self.inner.resolved_algo(size_bytes, dtype, base_algo(algo))
        return resolved + NORM_SUFFIX if is_norm(algo) else resolved

    def prepare_capture(self, stream: torch.cuda.Stream) -> None:
        self.inner.prepare_capture(stream)

    def capture_context(self) -> ContextManager[Any]:
        inner = getattr(self.inner, "capture_context", None)
        return inner() if inner is not None else contextlib.nullcontext()

    def device_sync(self) -> None:
        self.inner.device_sync()

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        self.inner.close()

    def skip_reason(self, case: Case) -> str | None:
        if case.algo == FUSED_ALGO and not hasattr(self.inner, "comm"):
            return "the fused kernel is ours only"
        skip = getattr(self.inner, "skip_reason", None)
        return skip(case) if skip is not None else None

    def facts(self) -> dict[str, Any]:
        facts = getattr(self.inner, "facts", None)
        return facts() if facts is not None else {}

    def cross_check(self, bufs: Buffers, algo: str) -> str | None:
        """For the fused kernel, on random (not integer) data: its new residual must be BITWISE equal
        to ``residual + comm.all_reduce(x)``, and its normed output close to the torch RMSNorm's."""
        if algo != FUSED_ALGO:
            return None
        assert isinstance(bufs, NormBuffers)
        comm, device, dtype = self.inner.comm, self._ctx.device, bufs.inp.dtype
        shape = (bufs.tokens, bufs.hidden)
        mine = torch.Generator(device=device).manual_seed(CROSS_CHECK_SEED + self._ctx.rank)
        shared = torch.Generator(device=device).manual_seed(CROSS_CHECK_SEED - 1)  # the residual is replicated
        x = torch.randn(shape, generator=mine, device=device).to(dtype)
        residual = torch.randn(shape, generator=shared, device=device).to(dtype)
        normed, new_residual = comm.all_reduce_rmsnorm(x, residual, bufs.weight, self._eps)
        plain_residual = residual + comm.all_reduce(x)
        torch.cuda.synchronize(device)
        comm.check()
        differ = new_residual != plain_residual
        if bool(differ.any()):
            first = int(differ.reshape(-1).nonzero()[0])
            return (f"fused new_residual is not bitwise equal to residual + all_reduce(x) on random data: "
                    f"{int(differ.sum())} of {differ.numel()} elements differ (first at {first})")
        problem = close_enough(normed, torch_rmsnorm(plain_residual, bufs.weight, self._eps))
        return None if problem is None else f"fused vs torch RMSNorm on random data: {problem}"
