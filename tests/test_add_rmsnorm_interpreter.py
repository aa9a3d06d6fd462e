"""The library's own residual add + RMSNorm kernel and its exact row statistic, under Triton's CPU
interpreter (a run without TRITON_INTERPRET runs this file in an interpreted child:
tests/_interpreted.py).

Checked against an fp64 reference from fresh random inputs per case, outputs poisoned first, odd
and even hidden sizes, both dtypes, fp32 weights, in place, misaligned views; the statistic is
checked to give the same bits for any order of the row's elements.
"""

from __future__ import annotations

import pytest
import torch

from tests import _reference as ref
from tests import _statistic as stat
from tests._interpreted import interpreted

norm = pytest.importorskip("pcie_allreduce.fused.add_rmsnorm")
path = pytest.importorskip("pcie_allreduce.fused.path")
protocol = pytest.importorskip("pcie_allreduce.fused.protocol")
pytestmark = interpreted

EPS = 1e-6


def _reference(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(normed, new_residual): the new residual as torch adds (one rounding), the norm in fp64."""
    new_residual = residual + y
    h = new_residual.double()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * rstd * weight.double()), new_residual


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def _activations(tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Realistic activations: normal values, a few large outliers, some exact zeros."""
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    outliers = torch.rand(tokens, hidden, generator=gen) < 0.01
    x[outliers] *= 50
    x[torch.rand(tokens, hidden, generator=gen) < 0.02] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 7168), (3, 2050), (5, 77), (2, 4096), (1, 1)])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_add_rmsnorm_matches_fp64(dtype: torch.dtype, tokens: int, hidden: int, weight_fp32: bool) -> None:
    gen = torch.Generator().manual_seed(tokens * 100003 + hidden * 7 + (dtype == torch.float16) + 2 * weight_fp32)
    y = _activations(tokens, hidden, dtype, gen)
    residual = _activations(tokens, hidden, dtype, gen)
    weight = (torch.rand(hidden, generator=gen, dtype=torch.float64) + 0.5).to(torch.float32 if weight_fp32 else dtype)
    normed, new_residual = _poisoned((tokens, hidden), dtype), _poisoned((tokens, hidden), dtype)
    path.add_rmsnorm(y, residual, weight, EPS, normed, new_residual)
    _, want_residual = _reference(y, residual, weight, EPS)
    assert torch.equal(new_residual, want_residual), "new residual must be bitwise residual + y"
    assert not torch.isnan(normed).any(), "every element of normed written"
    ref.check_rmsnorm(normed, new_residual, weight, EPS, f"add_rmsnorm [{tokens}, {hidden}] {dtype}")


def test_add_rmsnorm_in_place_and_misaligned() -> None:
    """normed may be y and new_residual may be residual; views one element off 16-byte alignment
    take the scalar variant and give the same bits as aligned copies."""
    gen = torch.Generator().manual_seed(7)
    tokens, hidden = 4, 1032
    y = _activations(tokens, hidden, torch.bfloat16, gen)
    residual = _activations(tokens, hidden, torch.bfloat16, gen)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(torch.bfloat16)
    normed, new_residual = _poisoned((tokens, hidden), torch.bfloat16), _poisoned((tokens, hidden), torch.bfloat16)
    path.add_rmsnorm(y, residual, weight, EPS, normed, new_residual)
    assert path.is_aligned(hidden, y, residual, weight, normed, new_residual)

    flat = [torch.empty(tokens * hidden + 1, dtype=torch.bfloat16) for _ in range(2)]
    y2, r2 = (f[1:].view(tokens, hidden) for f in flat)
    y2.copy_(y)
    r2.copy_(residual)
    assert not path.is_aligned(hidden, y2, r2, weight, y2, r2)
    path.add_rmsnorm(y2, r2, weight, EPS, y2, r2)  # in place, misaligned
    assert torch.equal(r2, new_residual)
    assert torch.equal(y2, normed), "the scalar and the vector variant must give the same bits"


def _sum(v: torch.Tensor) -> torch.Tensor:
    return stat.kernel_sum_of_squares(v).reshape(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_statistic_is_order_independent_and_accurate(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    # a wide dynamic range: the fixed-point grid must hold the small terms next to the large ones
    v = (torch.randn(3001, generator=gen, dtype=torch.float64)
         * torch.exp2(torch.randint(-12, 12, (3001,), generator=gen).double())).to(dtype)
    want = float((v.double() ** 2).sum())
    first = _sum(v)
    assert abs(float(first) - want) <= 2.0 ** -23 * want, (float(first), want)
    for seed in range(3):
        perm = torch.randperm(v.numel(), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(_sum(v[perm].contiguous()), first), "the sum must not depend on the order"


# sum_of_squares computes the fixed-point sum of every row and replaces it with fp32's own sum
# when the row holds inf or NaN: for those rows the discarded part converts inf or NaN to int64
# (a GPU saturates; numpy, running the interpreter, warns "invalid value encountered in cast")
# and scales that back up past fp32's range ("overflow encountered in multiply"). The result is
# checked below; the two warnings are of that discarded arithmetic alone.
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning",
                            "ignore:overflow encountered in multiply:RuntimeWarning")
def test_statistic_special_values() -> None:
    assert float(_sum(torch.zeros(5, dtype=torch.bfloat16))) == 0.0
    tiny = torch.tensor([1e-30, -2e-30, 3e-38], dtype=torch.float32).to(torch.bfloat16)
    want = float((tiny.double() ** 2).sum())
    assert float(_sum(tiny)) == pytest.approx(want, rel=2.0 ** -20, abs=1e-44)
    assert float(_sum(torch.tensor([1.0, float("inf"), 2.0], dtype=torch.bfloat16))) == float("inf")
    assert torch.isnan(_sum(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16))).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning",
                            "ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_statistic_is_its_specification_bit_for_bit(dtype: torch.dtype) -> None:
    """Every branch of the statistic (tests/_statistic.py: k above 127 and below 0, truncated
    terms, a sum just below 2^63, inf, NaN) gives the bits its specification, computed in Python
    integers, gives; and so do rows reversed (the order must not matter)."""
    wrong = stat.contract_violations(dtype, "cpu")
    assert not wrong, "\n".join(wrong)
