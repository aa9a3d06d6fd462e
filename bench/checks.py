"""Rank side: the inputs of a case and how its result is judged, built once per shape.

- :class:`PlainCheck`: an all-reduce must return the exact sum of the ranks' integer patterns.
- :class:`NormCheck` (``--fused``, verify): the same for the plain variants; the norm variants
  must produce the exact new residual (integers: exact in any order) and a normed output within a
  few ulps of fp32 RMSNorm math.

After timing, backends that overwrite their input run on zeros (timed calls would otherwise keep
summing sums); ``zeroed=True`` asks for the results that zeros give.
"""

from __future__ import annotations

import torch

from pcie_allreduce import fp8_wire
from pcie_allreduce.plan.algorithms import LOSSY_ALGORITHMS
from pcie_allreduce.tools.ranks import RankContext

from bench import pattern
from bench.backends import Buffers
from bench.norm_ops import NormBuffers, close_enough
from bench.plan import Case, RankJob


class PlainCheck:
    """One size's source pattern and expected sum, shared by every algo of the size."""

    def __init__(self, ctx: RankContext, job: RankJob, case: Case) -> None:
        dtype = getattr(torch, job.dtype)
        self.key = check_key(case)
        self.src = pattern.rank_input(case.count, ctx.rank, job.seed, dtype, ctx.device)
        if case.algo in LOSSY_ALGORITHMS:  # the wire's own bits (fp8_wire.py), not the exact sum
            inputs = [pattern.rank_input(case.count, r, job.seed, dtype) for r in range(ctx.world_size)]
            self.expected = fp8_wire.all_reduce(inputs).to(ctx.device)
        else:
            self.expected = pattern.expected_sum(case.count, ctx.world_size, job.seed, dtype, ctx.device)

    def load(self, bufs: Buffers) -> None:
        """Put this rank's inputs into the case's buffers."""
        bufs.inp.copy_(self.src)

    def mismatch(self, bufs: Buffers, result: torch.Tensor, *, zeroed: bool = False) -> str | None:
        """None when ``result`` is right, else a one-line description."""
        return pattern.mismatch(result, torch.zeros_like(self.expected) if zeroed else self.expected)


class NormCheck(PlainCheck):
    """Adds the replicated residual, the weight and the expected new residual / normed output."""

    def __init__(self, ctx: RankContext, job: RankJob, case: Case) -> None:
        super().__init__(ctx, job, case)
        dtype = getattr(torch, job.dtype)
        shape = (case.tokens, case.hidden)
        self.residual = pattern.residual_input(case.count, job.seed, dtype, ctx.device).view(shape)
        self.weight = pattern.weight_values(case.hidden, dtype, ctx.device)
        self.expected_residual = self.residual + self.expected.view(shape)  # small integers: exact
        self.expected_normed = pattern.expected_norm(self.expected_residual, self.weight, job.eps)
        self.zeroed_normed = pattern.expected_norm(self.residual, self.weight, job.eps)

    def load(self, bufs: Buffers) -> None:
        super().load(bufs)
        if isinstance(bufs, NormBuffers):
            bufs.residual.copy_(self.residual)
            bufs.weight.copy_(self.weight)

    def mismatch(self, bufs: Buffers, result: torch.Tensor, *, zeroed: bool = False) -> str | None:
        if not isinstance(bufs, NormBuffers):
            return super().mismatch(bufs, result, zeroed=zeroed)
        want = self.residual if zeroed else self.expected_residual
        problem = pattern.mismatch(bufs.new_residual, want)
        if problem is not None:
            return f"new_residual: {problem}"
        return close_enough(bufs.normed, self.zeroed_normed if zeroed else self.expected_normed)


def check_key(case: Case) -> tuple[int, int, bool]:
    """What a check depends on: the shape, and whether the case's wire is lossy."""
    return (case.count, case.hidden, case.algo in LOSSY_ALGORITHMS)


def make_check(ctx: RankContext, job: RankJob, case: Case) -> PlainCheck:
    """The check for ``case``: with a [tokens, hidden] shape, a :class:`NormCheck`."""
    return NormCheck(ctx, job, case) if case.hidden else PlainCheck(ctx, job, case)
