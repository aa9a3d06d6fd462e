"""The row statistic of every fused kernel (``pcie_allreduce.fused.add_rmsnorm.sum_of_squares``)
written out a second way, in torch's CPU fp32 and Python integers, from its specification: the
same bits are expected of the kernel compiled or interpreted, so any rewrite of the kernel's
statistic (a cheaper instruction sequence) is held to the contract rather than to its own output.

The specification, per row of bf16/fp16 values v: q = fp32(v * v); the row's largest |q| fixes
k = 48 + 127 - max(exponent field, 1); each q is scaled by 2^(k >> 1), then by 2^(k - (k >> 1))
(fp32, each rounding as IEEE does), truncated to an int64; the int64 sum, converted to fp32
(round to nearest), is scaled back by 2^-(k >> 1) and 2^((k >> 1) - k). A row holding inf or NaN
(or whose square overflows fp32) gets inf or NaN. ``SPECIAL_ROWS`` takes every branch: k above
127 (zeros, tiny values whose squares are subnormal), k below 0, terms truncated to zero beside a huge one, a sum just
below 2^63 at the largest hidden size, sums on an fp32 rounding tie (where truncating each term
rather than rounding it, or a coarser grid, changes the result), inf and NaN.
"""

from __future__ import annotations

import pytest
import torch

from pcie_allreduce.validation import MAX_RMSNORM_HIDDEN

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
norm = pytest.importorskip("pcie_allreduce.fused.add_rmsnorm")

# The grid of the specification, stated here rather than read from the kernel: a change to the
# kernel's grid must fail this test, not follow it.
GRID_TOP = 48


def _pow2(n: int) -> torch.Tensor:
    return torch.tensor(2.0 ** n, dtype=torch.float32)


def specified_sum_of_squares(row: torch.Tensor) -> torch.Tensor:
    """The statistic of one row (a 1-D bf16/fp16 tensor) as the specification defines it: an fp32
    scalar tensor, on the CPU."""
    v = row.detach().cpu().to(torch.float32)
    q = v * v
    top = int((q.view(torch.int32) & 0x7FFFFFFF).max()) if q.numel() else 0
    if top >= 0x7F800000:
        return q.sum()  # inf or NaN: whatever the order, the same class of value
    k = GRID_TOP + 127 - max(top >> 23, 1)
    k1 = k >> 1
    terms = ((q * _pow2(k1)) * _pow2(k - k1)).to(torch.int64)
    total = sum(int(t) for t in terms.tolist())  # Python integers: exact, no order
    assert total < 2 ** 63, "the grid keeps every row of up to MAX_RMSNORM_HIDDEN terms below 2^63"
    return (torch.tensor(total, dtype=torch.int64).to(torch.float32) * _pow2(-k1)) * _pow2(k1 - k)


def _row(values, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``values`` at random places of an n-element row of small normal values."""
    row = (torch.randn(n, generator=gen, dtype=torch.float64) * 1e-3).to(dtype)
    places = torch.randperm(n, generator=gen)[:len(values)]
    row[places] = torch.tensor(values, dtype=torch.float64).to(dtype)
    return row


def _tie_row(values, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (exact in bf16 and fp16) and zeros, 100 elements."""
    row = torch.zeros(100, dtype=torch.float64)
    row[torch.arange(len(values)) * 7] = torch.tensor(values, dtype=torch.float64)
    assert torch.equal(row.to(dtype).double(), row), "tie rows hold exact values"
    return row.to(dtype)


def special_rows(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """(name, row) pairs that take each branch of the statistic, for ``dtype``."""
    gen = torch.Generator().manual_seed(17 + (dtype == torch.float16))
    finfo = torch.finfo(dtype)
    rows = [
        ("zeros (k = 174)", torch.zeros(333, dtype=dtype)),
        ("the smallest normal values", torch.tensor([finfo.tiny, -finfo.tiny * 3, 0.0], dtype=torch.float64).to(dtype)),
        ("wide exponents", (torch.randn(3001, generator=gen, dtype=torch.float64)
                            * torch.exp2(torch.randint(-14, 14, (3001,), generator=gen).double())).to(dtype)),
        ("one huge, the rest truncated", _row([finfo.max / 4 if dtype == torch.float16 else 1e18], 2050, dtype, gen)),
        ("odd length, mixed signs", (torch.randn(77, generator=gen, dtype=torch.float64) * 3).to(dtype)),
        ("the largest hidden at the grid's top",
         torch.full((MAX_RMSNORM_HIDDEN,), float(torch.tensor(1.99, dtype=dtype)), dtype=dtype)),
        # 16^2 lands at 2^48 on the grid, 2^-8 squared at 2^24: half an fp32 ulp of the sum. Whether
        # the int64 total converts up or down then turns on a term of 1 (2^-20 squared) and on a
        # fraction (0.875 * 2^-20 squared, 0.77) being truncated, not rounded.
        ("an fp32 tie, broken by a term of one", _tie_row([16.0, 2.0 ** -8, 2.0 ** -20, 0.875 * 2.0 ** -20], dtype)),
        ("an fp32 tie, held by a truncated fraction", _tie_row([16.0, 2.0 ** -8, 0.875 * 2.0 ** -20], dtype)),
        ("inf", _row([float("inf")], 100, dtype, gen)),
        ("nan", _row([float("nan")], 100, dtype, gen)),
    ]
    if dtype == torch.bfloat16:  # bf16's range reaches squares near and past fp32's limits
        rows += [
            ("tiny values, some squares subnormal (k > 127)",
             (torch.randn(500, generator=gen, dtype=torch.float64) * 3e-19).to(dtype)),
            ("squares near 2^-90 (k > 127)", (torch.randn(500, generator=gen, dtype=torch.float64) * 2e-14).to(dtype)),
            ("huge values (k < 0)", (torch.randn(500, generator=gen, dtype=torch.float64) * 1e17).to(dtype)),
            ("a square past fp32's range", _row([1e20], 64, dtype, gen)),
        ]
    return rows


@triton.jit
def _sum_kernel(v_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    v = tl.load(v_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr, norm.sum_of_squares(v, ok))


def kernel_sum_of_squares(row: torch.Tensor) -> torch.Tensor:
    """The library's statistic of ``row`` (on the row's device): one program over the whole row."""
    out = torch.full((1,), float("nan"), dtype=torch.float32, device=row.device)
    _sum_kernel[(1,)](row, out, N=row.numel(), BLOCK=triton.next_power_of_2(row.numel()))
    return out[0]


def mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` is the specified value (bitwise; any NaN for a NaN); else what differs."""
    got, want = got.detach().cpu().reshape(()), want.reshape(())
    if torch.isnan(want):
        return None if torch.isnan(got) else f"{float(got)!r}, not NaN"
    if int(got.view(torch.int32)) != int(want.view(torch.int32)):
        return f"{float(got)!r} (bits {int(got.view(torch.int32)):#010x}), specified {float(want)!r} " \
               f"(bits {int(want.view(torch.int32)):#010x})"
    return None


def contract_violations(dtype: torch.dtype, device: torch.device | str = "cpu") -> list[str]:
    """Every special row, forwards and reversed, whose statistic computed on ``device`` is not the
    specified one: '<row>: <what differs>' lines (empty when the contract holds)."""
    wrong = []
    for name, row in special_rows(dtype):
        want = specified_sum_of_squares(row)
        for label, v in ((name, row), (name + ", reversed", row.flip(0).contiguous())):
            problem = mismatch(kernel_sum_of_squares(v.to(device)), want)
            if problem:
                wrong.append(f"{label}: {problem}")
    return wrong
