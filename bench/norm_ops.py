"""Rank side of ``--fused`` and ``verify``: residual add + RMSNorm on top of any backend's all-reduce.

:class:`NormAdapter` wraps a backend and offers, besides its plain algorithms, the all-reduce
``y`` followed by ``new_residual = residual + y``, ``normed = rmsnorm(new_residual) * weight``:

- ``"<algo>+norm"``: as separate eager torch ops (several kernels; what a model does without a
  fused op);
- ``"<algo>+addnorm"``: ONE kernel, the library's :func:`pcie_allreduce.fused.path.add_rmsnorm`
  (out of place; after our own all-reduce launched as ``all_reduce_rmsnorm``'s unfused pair
  launches it);
- ``"<algo>+fi_addnorm"`` / ``"<algo>+sgl_addnorm"``: ONE kernel, FlashInfer's / sgl-kernel's
  ``fused_add_rmsnorm`` where the rank can import it (in place: ``residual += y``, then ``y`` is
  overwritten with the normed rows), else skipped with the reason;
- ``"fused"`` (ours only): :meth:`Communicator.all_reduce_rmsnorm`, one kernel; ``"fused:<name>"``
  the same with ``algo=<name>`` forced (a kernel that cannot take the shape: the case is skipped).

The one-kernel variants are the honest baselines of the fused kernel: the best a user can run
instead of it. The torch RMSNorm does its math in fp32 (variance, rsqrt, times the weight) and
rounds once, like the fused kernel, so the two agree to rounding. All buffers are allocated once
per case; the torch ops' temporaries come from the CUDA graph's private pool when captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Mapping

import torch

from pcie_allreduce.tools.ranks import RankContext

from bench.backends import Buffers
from bench.outcome import CaseSkipped
from bench.plan import Case, RankJob
from bench.results import (
    FLASHINFER_NORM_SUFFIX, FORCED_FUSED_PREFIX, NORM_SUFFIX, ONE_KERNEL_NORM_SUFFIX, ONE_KERNEL_NORM_SUFFIXES,
    SGL_NORM_SUFFIX, fused_kernel_name, is_fused_algo, split_norm,
)
from bench.results import is_norm_algo as is_norm

NORMED_RTOL = NORMED_ATOL = 2.0 ** -6  # a few bf16 ulps: two roundings and a different reduction order
CROSS_CHECK_SEED = 1234
# suffix -> (module, function) of the one-kernel residual add + RMSNorm it runs after the all-reduce.
ONE_KERNELS: Mapping[str, tuple[str, str]] = MappingProxyType({
    ONE_KERNEL_NORM_SUFFIX: ("pcie_allreduce.fused.path", "add_rmsnorm"),
    FLASHINFER_NORM_SUFFIX: ("flashinfer.norm", "fused_add_rmsnorm"),
    SGL_NORM_SUFFIX: ("sgl_kernel", "fused_add_rmsnorm"),
})
# Those whose contract is in place, fn(input, residual, weight, eps): residual += input, then
# input = rmsnorm(residual) * weight. Ours is fn(y, residual, weight, eps, normed, new_residual).
IN_PLACE_KERNELS: frozenset[str] = frozenset({FLASHINFER_NORM_SUFFIX, SGL_NORM_SUFFIX})


def load_kernel(suffix: str) -> Callable[..., Any]:
    """The one-kernel add + RMSNorm of ``suffix``, imported (raises when it does not import)."""
    module, name = ONE_KERNELS[suffix]
    return getattr(importlib.import_module(module), name)


def in_place_kernels() -> tuple[dict[str, Callable], dict[str, str]]:
    """The other libraries' in-place ``fused_add_rmsnorm(input, residual, weight, eps)`` kernels
    that import here, and why each other one does not: the one-kernel baselines of ``--fused``
    (:data:`ONE_KERNELS`), named as its rows are without the leading "+"."""
    found, missing = {}, {}
    for suffix in ONE_KERNELS:
        if suffix not in IN_PLACE_KERNELS:
            continue
        name = suffix.lstrip("+")
        try:
            found[name] = load_kernel(suffix)
        except Exception as exc:  # noqa: BLE001 - any import failure only leaves the row out
            missing[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    return found, missing


@dataclasses.dataclass
class NormBuffers(Buffers):
    """A norm variant's tensors; ``inp`` (flat x, the all-reduce's input) and ``out`` (flat normed).

    For an in-place kernel ``new_residual`` is ``residual`` and ``normed`` is the all-reduce's
    result ``y`` (set by each call: some backends return a new tensor)."""

    inner: Buffers | None   # the wrapped backend's all-reduce buffers (None for the fused kernel)
    residual: torch.Tensor  # [tokens, hidden]
    weight: torch.Tensor    # [hidden]
    normed: torch.Tensor    # [tokens, hidden]
    new_residual: torch.Tensor
    tokens: int
    hidden: int
    # An in-place kernel wrote the normed rows into the all-reduce's own input (an in-place
    # all-reduce): each call's input is then the previous call's output.
    feeds_back: bool = False


def torch_rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h * rsqrt(mean(h^2) + eps) * weight`` in fp32, rounded once to ``h``'s dtype."""
    x = h.float()
    variance = x.pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps) * weight.float()).to(h.dtype)


def torch_add_rmsnorm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      normed: torch.Tensor, new_residual: torch.Tensor) -> None:
    """The eager unfused baseline: ``new_residual = residual + y`` (one rounding, like the fused
    kernel's contract), then the RMSNorm into ``normed``."""
    torch.add(residual, y, out=new_residual)
    normed.copy_(torch_rmsnorm(new_residual, weight, eps))


def base_algo(algo: str) -> str:
    """The all-reduce inside a variant: "one_shot+norm" -> "one_shot"; "fused" -> "auto"."""
    if is_fused_algo(algo):
        return "auto"
    return split_norm(algo)[0]


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


def bitwise_mismatch(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    """None when ``got`` has exactly ``want``'s bits, else a one-line description."""
    differ = got != want
    if not bool(differ.any()):
        return None
    first = int(differ.reshape(-1).nonzero()[0])
    return f"{what}: {int(differ.sum())} of {differ.numel()} elements differ (first at {first})"


class NormAdapter:
    """A :class:`~.backends.RankBackend` whose variants may include the residual add + RMSNorm."""

    def __init__(self, inner: Any, ctx: RankContext, job: RankJob) -> None:
        self.inner = inner
        self._ctx = ctx
        self._eps = job.eps
        self._dtype = getattr(torch, job.dtype)
        # suffix -> the one-kernel add + RMSNorm, or why it cannot run here. Loaded (and the
        # third-party ones run once: a JIT build can take a minute) in set-up, not in a timed case.
        self._kernels: dict[str, Callable[..., Any] | str] = {}
        # Ours after our own all-reduce launches as the unfused pair launches it: as that kernel's
        # programmatic dependent where the communicator does so ($PCIE_AR_PDL), as FlashInfer's and
        # sgl-kernel's launch by default; after another backend's all-reduce, ordinarily.
        self._norm_dependent = bool(getattr(getattr(inner, "comm", None), "dependent_launch", False))
        for suffix in dict.fromkeys(split_norm(c.algo)[1] for c in job.cases if c.hidden):
            if suffix in ONE_KERNEL_NORM_SUFFIXES:
                self._kernels[suffix] = self._load(suffix, next(c.hidden for c in job.cases if c.hidden))

    def _load(self, suffix: str, hidden: int) -> Callable[..., Any] | str:
        module = ONE_KERNELS[suffix][0]
        try:
            kernel = load_kernel(suffix)
        except Exception as exc:  # noqa: BLE001 - any import failure (missing, ABI mismatch) means "skip"
            return f"{module} does not import here ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        if suffix in IN_PLACE_KERNELS:
            try:
                y = torch.zeros((1, hidden), dtype=self._dtype, device=self._ctx.device)
                kernel(y, torch.ones_like(y), torch.ones(hidden, dtype=self._dtype, device=self._ctx.device),
                       self._eps)
                torch.cuda.synchronize(self._ctx.device)
            except Exception as exc:  # noqa: BLE001
                return f"{module}.{ONE_KERNELS[suffix][1]} failed its first call ({type(exc).__name__}: " \
                       f"{' '.join(str(exc).split())[:200]})"
        return kernel

    def _kernel(self, suffix: str) -> Callable[..., Any]:
        kernel = self._kernels.get(suffix)
        if kernel is None:
            kernel = self._kernels[suffix] = load_kernel(suffix)
        if isinstance(kernel, str):
            raise CaseSkipped(kernel)
        return kernel

    # -- the RankBackend interface; ``hidden`` comes from the case (the rank loop passes it) --

    def buffers(self, count: int, dtype: torch.dtype, algo: str, *, hidden: int = 0) -> Buffers:
        if not is_norm(algo):
            return self.inner.buffers(count, dtype, algo)
        if hidden <= 0 or count % hidden:
            raise ValueError(f"{algo}: {count} elements are not [tokens, {hidden}]")
        tokens, device = count // hidden, self._ctx.device
        shape = (tokens, hidden)
        suffix = split_norm(algo)[1]
        if is_fused_algo(algo):
            inner = None
            x = torch.empty(count, dtype=dtype, device=device)
        else:
            inner = self.inner.buffers(count, dtype, base_algo(algo))
            x = inner.inp
        residual = torch.empty(shape, dtype=dtype, device=device)
        weight = torch.empty(hidden, dtype=dtype, device=device)
        if suffix in IN_PLACE_KERNELS:
            assert inner is not None
            normed, new_residual = inner.out.view(shape), residual  # until a call says where y is
        else:
            normed = torch.empty(shape, dtype=dtype, device=device)
            new_residual = torch.empty(shape, dtype=dtype, device=device)
        bufs = NormBuffers(inp=x, out=normed.view(-1), inner=inner, residual=residual, weight=weight,
                           normed=normed, new_residual=new_residual, tokens=tokens, hidden=hidden)
        if suffix == ONE_KERNEL_NORM_SUFFIX:  # compile now: Triton's first call of a shape is not a kernel time
            self._kernel(suffix)(normed, residual, weight, self._eps, normed, new_residual, compile_only=True,
                                 after_all_reduce=self._norm_dependent)
        return bufs

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        if not is_norm(algo):
            return self.inner.call(bufs, algo)
        assert isinstance(bufs, NormBuffers)
        x = bufs.inp.view(bufs.tokens, bufs.hidden)
        if is_fused_algo(algo):
            try:
                self.inner.comm.all_reduce_rmsnorm(x, bufs.residual, bufs.weight, self._eps, out=bufs.normed,
                                                   residual_out=bufs.new_residual, algo=fused_kernel_name(algo))
            except ValueError as exc:
                if algo.startswith(FORCED_FUSED_PREFIX):  # a forced kernel that cannot take this shape
                    raise CaseSkipped(f"{algo}: {' '.join(str(exc).split())}") from exc
                raise
            return bufs.out
        assert bufs.inner is not None
        y = self.inner.call(bufs.inner, base_algo(algo)).view(bufs.tokens, bufs.hidden)
        suffix = split_norm(algo)[1]
        if suffix == NORM_SUFFIX:
            torch_add_rmsnorm(y, bufs.residual, bufs.weight, self._eps, bufs.normed, bufs.new_residual)
        elif suffix in IN_PLACE_KERNELS:
            self._kernel(suffix)(y, bufs.residual, bufs.weight, self._eps)
            bufs.normed, bufs.out = y, y.view(-1)
            bufs.feeds_back = y.data_ptr() == bufs.inp.data_ptr()
        else:
            self._kernel(suffix)(y, bufs.residual, bufs.weight, self._eps, bufs.normed, bufs.new_residual,
                                 after_all_reduce=self._norm_dependent)
        return bufs.out

    def mutates_input(self, algo: str) -> bool:
        if is_fused_algo(algo):
            return False
        # An in-place kernel adds y into the residual on every call: timed on zeros, the residual stays put.
        return split_norm(algo)[1] in IN_PLACE_KERNELS or bool(self.inner.mutates_input(base_algo(algo)))

    def checks_after_timing(self, bufs: Buffers, algo: str) -> bool:
        """Whether the last timed call's output can be checked: not when an in-place kernel wrote
        each call's normed rows into the next call's input (an in-place all-reduce, e.g. NCCL's).
        Such a variant is checked exactly before timing, and on random data (:meth:`cross_check`)."""
        return not (isinstance(bufs, NormBuffers) and bufs.feeds_back)

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str, *, hidden: int = 0) -> str:
        if is_fused_algo(algo):
            name = fused_kernel_name(algo)
            if name == "auto":
                element = torch.empty((), dtype=dtype).element_size()
                tokens = size_bytes // element // max(hidden, 1)
                return self.inner.comm.select_fused_algo(tokens, hidden, dtype)
            if name == "unfused":  # our plain all-reduce (auto), then the add_rmsnorm kernel
                return self.inner.comm.select_algo(size_bytes, dtype)
            return name
        base, suffix = split_norm(algo)
        return self.inner.resolved_algo(size_bytes, dtype, base) + suffix

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
        if is_fused_algo(case.algo) and not hasattr(self.inner, "comm"):
            return "the fused kernel is ours only"
        kernel = self._kernels.get(split_norm(case.algo)[1])
        if isinstance(kernel, str):
            return kernel
        skip = getattr(self.inner, "skip_reason", None)
        return skip(case) if skip is not None else None

    def facts(self) -> dict[str, Any]:
        facts = getattr(self.inner, "facts", None)
        return facts() if facts is not None else {}

    def tune(self) -> None:
        """The wrapped all-reduce's per-machine tuning, if it has one (bench.rank calls it)."""
        tune = getattr(self.inner, "tune", None)
        if tune is not None:
            tune()

    def _random_inputs(self, bufs: NormBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's x, the replicated residual) on random data, for the cross-checks."""
        device, dtype, shape = self._ctx.device, bufs.inp.dtype, (bufs.tokens, bufs.hidden)
        mine = torch.Generator(device=device).manual_seed(CROSS_CHECK_SEED + self._ctx.rank)
        shared = torch.Generator(device=device).manual_seed(CROSS_CHECK_SEED - 1)  # the residual is replicated
        x = torch.randn(shape, generator=mine, device=device).to(dtype)
        residual = torch.randn(shape, generator=shared, device=device).to(dtype)
        return x, residual

    def cross_check(self, bufs: Buffers, algo: str) -> str | None:
        """On random (not integer) data. The fused kernel (auto or forced): its new residual must be
        BITWISE equal to ``residual + comm.all_reduce(x)``, its normed output close to the torch
        RMSNorm's. A one-kernel add + RMSNorm: its new residual bitwise equal to ``residual + y``
        (ours; the others' within the RMSNorm tolerance), its normed output close to the torch RMSNorm's."""
        if not isinstance(bufs, NormBuffers):
            return None
        if is_fused_algo(algo):
            return self._fused_cross_check(bufs, algo)
        suffix = split_norm(algo)[1]
        return self._one_kernel_cross_check(bufs, suffix) if suffix in ONE_KERNEL_NORM_SUFFIXES else None

    def _fused_cross_check(self, bufs: NormBuffers, algo: str) -> str | None:
        comm = self.inner.comm
        x, residual = self._random_inputs(bufs)
        normed, new_residual = comm.all_reduce_rmsnorm(x, residual, bufs.weight, self._eps,
                                                       algo=fused_kernel_name(algo))
        plain_residual = residual + comm.all_reduce(x)
        torch.cuda.synchronize(self._ctx.device)
        comm.check()
        problem = bitwise_mismatch(new_residual, plain_residual, f"{algo} new_residual is not bitwise equal to "
                                                                 "residual + all_reduce(x) on random data")
        if problem is not None:
            return problem
        problem = close_enough(normed, torch_rmsnorm(plain_residual, bufs.weight, self._eps))
        return None if problem is None else f"{algo} vs torch RMSNorm on random data: {problem}"

    def _one_kernel_cross_check(self, bufs: NormBuffers, suffix: str) -> str | None:
        """Not collective: the kernel alone, on a random y (as if all-reduced) and residual."""
        kernel = self._kernel(suffix)
        y, residual = self._random_inputs(bufs)
        want = residual + y  # one rounding, as torch adds
        if suffix in IN_PLACE_KERNELS:
            normed, new_residual = y.clone(), residual.clone()
            kernel(normed, new_residual, bufs.weight, self._eps)
        else:
            normed, new_residual = torch.empty_like(y), torch.empty_like(residual)
            kernel(y, residual, bufs.weight, self._eps, normed, new_residual)
        torch.cuda.synchronize(self._ctx.device)
        name = ".".join(ONE_KERNELS[suffix])
        if suffix == ONE_KERNEL_NORM_SUFFIX:
            problem = bitwise_mismatch(new_residual, want, f"{name} new_residual is not bitwise equal to "
                                                           "residual + y on random data")
        else:
            off = close_enough(new_residual, want)
            problem = None if off is None else f"{name} new_residual vs residual + y on random data: " \
                                               f"{off.removeprefix('normed: ')}"
        if problem is not None:
            return problem
        off = close_enough(normed, torch_rmsnorm(want, bufs.weight, self._eps))
        return None if off is None else f"{name} vs torch RMSNorm on random data: {off}"
