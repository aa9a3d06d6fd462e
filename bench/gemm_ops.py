"""Rank side of ``verify --gemms``: the served model's per-rank dense GEMMs between the collectives.

:class:`GemmAdapter` wraps a verify backend (a :class:`~.norm_ops.NormAdapter`): before each
collective it enqueues the GEMMs that precede that collective in a layer
(:func:`bench.verify_options.layer_gemms`: the attention output projection before the first, the
MLP before the second), so they are captured in the same CUDA graph and the collectives are
timed between real kernels (their L2 state, their launch gaps). The GEMMs write into their own
outputs: the collectives' inputs stay the checked pattern (stream order is the same as a model's).

Weights are random, allocated once per case; layers cycle through enough weight copies that a
pass reads at least :data:`WEIGHT_BYTES_PER_SLOT` per slot, so small weights do not sit in L2
across layers as they never would in a model.
"""

from __future__ import annotations

from typing import Any

import torch

from pcie_allreduce.ranks import RankContext

from bench.backends import Buffers
from bench.plan import Case, RankJob
from bench.verify_options import layer_gemms

WEIGHT_BYTES_PER_SLOT = 256 << 20  # a few times an H200's 50 MiB L2
GEMM_SEED = 4321

_Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # activation, weight, output


class GemmAdapter:
    """A backend whose every ``call`` is preceded by the GEMMs of its position in the layer.

    Calls alternate: the first collective of a layer (after the attention output projection), then
    the second (after the MLP); the block of 2L calls holds L of each. Everything else is the
    wrapped backend's (attribute access falls through, optional hooks included)."""

    def __init__(self, inner: Any, ctx: RankContext, job: RankJob) -> None:
        self.inner = inner
        self._ctx = ctx
        self._dtype = getattr(torch, job.dtype)
        self._slots: tuple[list[list[_Operands]], ...] = ([], [])  # per slot: weight copies x GEMMs
        self._position = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin_case(self, case: Case) -> None:
        """Allocate ``case``'s GEMM operands (the previous case's are freed first)."""
        self._slots = ([], [])
        self._position = 0
        if not case.model or not case.tokens:
            return
        generator = torch.Generator(device=self._ctx.device).manual_seed(GEMM_SEED + self._ctx.rank)
        layers = max(1, case.calls // 2)
        for slot, gemms in zip(self._slots, layer_gemms(case.model, case.tokens, self._ctx.world_size)):
            weight_bytes = sum(g.batch * g.k * g.n for g in gemms) * torch.empty((), dtype=self._dtype).element_size()
            copies = min(layers, max(1, -(-WEIGHT_BYTES_PER_SLOT // max(weight_bytes, 1))))
            activations = [self._random((g.batch, g.m, g.k), generator) for g in gemms]  # shared by the copies
            for _ in range(copies):
                slot.append([(a, self._random((g.batch, g.k, g.n), generator, scale=g.k ** -0.5),
                              torch.empty((g.batch, g.m, g.n), dtype=self._dtype, device=self._ctx.device))
                             for a, g in zip(activations, gemms)])

    def _random(self, shape: tuple[int, ...], generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=generator, device=self._ctx.device) * scale).to(self._dtype)

    def call(self, bufs: Buffers, algo: str) -> torch.Tensor:
        slot = self._slots[self._position % 2]
        if slot:
            for activation, weight, out in slot[(self._position // 2) % len(slot)]:
                torch.bmm(activation, weight, out=out)
        self._position += 1
        return self.inner.call(bufs, algo)
