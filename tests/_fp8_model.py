"""An independent model of the FP8 wire, and the inputs that probe its edges.

The model is written from the format's rules (pcie_allreduce/fp8_wire.py's docstring), not from
its code: e4m3 values come from their bit fields, a code is the nearest value found by search in
fp64 (ties to the even code), a scale is the smallest power of two that holds the block's largest
finite magnitude within 416, and the fp32 additions are fp64 additions rounded to fp32 (correct:
fp64 has more than 2 * 24 + 2 bits, so the double rounding is innocuous). It shares nothing with
the reference but torch's fp64 arithmetic and the final rounding to the output dtype, so tests
that compare the two can fail.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128
CODE_MAX = 416.0
INF_CODE = 448.0
LARGEST = 240.0 * 2.0 ** 120
MIN_SCALE = 2.0 ** -126
FLT_MAX = torch.finfo(torch.float32).max
NAN_CODE = 0x7F


def e4m3_value(code: int) -> float:
    """The value of an e4m3fn code from its bit fields: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal; S.1111.111 is NaN; there is no infinity."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


#: The finite non-negative values with their codes, ascending.
_GRID_CODES = sorted((c for c in range(0x80) if not math.isnan(e4m3_value(c))), key=e4m3_value)
_GRID = torch.tensor([e4m3_value(c) for c in _GRID_CODES], dtype=torch.float64)
_GRID_CODE = torch.tensor(_GRID_CODES, dtype=torch.int64)
_VALUE = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)


def scale(amax: float) -> float:
    """The smallest power of two, at least 2^-126, that takes ``amax`` to at most 416; 1 for 0."""
    if not amax > 0:
        return 1.0
    k = max(-126, math.ceil(math.log2(amax / CODE_MAX)))
    while amax > CODE_MAX * 2.0 ** k:
        k += 1
    while k > -126 and amax <= CODE_MAX * 2.0 ** (k - 1):
        k -= 1
    return 2.0 ** k


def _nearest_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes (int64, no sign) of the e4m3 values nearest to ``q`` (fp64, 0 <= q <= 448), ties to
    the even code."""
    hi = torch.searchsorted(_GRID, q).clamp(max=len(_GRID) - 1)
    lo = (hi - 1).clamp(min=0)
    below, above = q - _GRID[lo], _GRID[hi] - q
    pick_hi = (above < below) | ((above == below) & (_GRID_CODE[hi] % 2 == 0))
    return torch.where(pick_hi, _GRID_CODE[hi], _GRID_CODE[lo])


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1-D) as (codes: uint8 [blocks * BLOCK], scales: fp64 [blocks])."""
    x = x.reshape(-1).double()
    x = torch.cat([x, torch.zeros((-x.numel()) % BLOCK, dtype=torch.float64)])
    blocks = x.view(-1, BLOCK)
    finite = torch.where(torch.isfinite(blocks), blocks, torch.zeros_like(blocks))
    scales = torch.tensor([scale(float(a)) for a in finite.abs().amax(1)], dtype=torch.float64)
    q = finite.abs().clamp(max=LARGEST) / scales[:, None]
    codes = _nearest_codes(q.reshape(-1)).view_as(q)
    codes = torch.where(torch.isinf(blocks), torch.full_like(codes, 0x7E), codes)
    codes = codes | torch.where(torch.signbit(blocks), 0x80, 0)
    codes = torch.where(torch.isnan(blocks), torch.full_like(codes, NAN_CODE), codes)
    return codes.reshape(-1).to(torch.uint8), scales


def decode(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """fp64 values of coded elements: the code's value times its scale, +-Inf for +-448."""
    values = _VALUE[codes.long()].view(-1, BLOCK)
    out = torch.where(values.abs() == INF_CODE, values * math.inf, values * scales[:, None])
    return out.reshape(-1)[:numel]


def round_trip(x: torch.Tensor) -> torch.Tensor:
    return decode(*encode(x), x.numel())


def fp32(x: torch.Tensor) -> torch.Tensor:
    """fp64 values rounded to fp32 (nearest even, overflow to +-Inf), kept in fp64."""
    return x.float().double()


def all_reduce(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The wire's result: coded contributions summed in fp32 in rank order, coded, rounded."""
    acc = round_trip(inputs[0])
    for x in inputs[1:]:
        acc = fp32(acc + round_trip(x))
    return round_trip(acc).to(inputs[0].dtype).view(inputs[0].shape)


def exact_wire(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The lossless wire's result: the inputs summed in fp32 in rank order, rounded once."""
    acc = inputs[0].double()
    for x in inputs[1:]:
        acc = fp32(acc + x.double())
    return acc.to(inputs[0].dtype)


def fp64_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in inputs]).sum(0)


# ---- inputs at the edges of the format (shared with tests/test_fp8_wire_gpu.py)

#: A large finite magnitude of each dtype, as a value of that dtype: two of them overflow.
BIG = {torch.bfloat16: 3.3e38, torch.float16: 60000.0, torch.float32: 3.3e38}


def large_inputs(world: int, numel: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-rank inputs near the dtype's largest value, and the mask of the elements whose sum
    overflows (every rank +big or every rank -big). The other elements: +big and -big on ranks 0
    and 1 (sum 0), +-big on rank 0 alone, one rank's values spread over the top binades with
    small values elsewhere, ordinary values, tiny ones (subnormal in the dtype); cycled element by
    element in the first half of the message (so huge and ordinary values share blocks) and block
    by block in the second. For fp32, +-fp32's largest value too."""
    gen = torch.Generator().manual_seed(world * 131 + numel)
    big = float(torch.tensor(BIG[dtype]).to(dtype))
    top = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    index = torch.arange(numel)
    case = torch.where(index < numel // 2, index % 8, (index // BLOCK) % 8)
    sign = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0).double()
    spread = big * (0.5 + 0.5 * torch.rand(numel, generator=gen).double())
    xs = [torch.randn(numel, generator=gen).double() for _ in range(world)]
    overflow = (case == 2) | (case == 3)
    for r, x in enumerate(xs):
        x[case == 0] = {0: big, 1: -big}.get(r, 0.0)
        x[case == 1] = (sign * big)[case == 1] if r == 0 else 0.0
        x[case == 2] = big
        x[case == 3] = -big
        x[case == 4] = spread[case == 4] * sign[case == 4] if r == world - 1 else x[case == 4]
        x[case == 5] = {0: top, 1: -top}.get(r, 0.0) if dtype == torch.float32 else x[case == 5] * 1e3
        x[case == 6] = x[case == 6] * tiny * 2.0 ** -4
    return [x.to(dtype) for x in xs], overflow


def special_inputs(world: int, numel: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """Ordinary per-rank values with a NaN, +-Inf on one rank, +Inf meeting -Inf, and +Inf beside a
    huge value in one block; returns the inputs and where each lies."""
    gen = torch.Generator().manual_seed(world * 7 + numel)
    xs = [torch.randn(numel, generator=gen).to(dtype) for _ in range(world)]
    where = {"nan": [5, numel - 1], "inf": [BLOCK + 3], "-inf": [BLOCK + 4], "inf-inf": [2 * BLOCK]}
    for i in where["nan"]:
        xs[i % world][i] = math.nan
    xs[world - 1][where["inf"][0]] = math.inf
    xs[0][where["-inf"][0]] = -math.inf
    xs[0][where["inf-inf"][0]] = math.inf
    xs[world - 1][where["inf-inf"][0]] = -math.inf
    xs[0][BLOCK + 10] = BIG[dtype]
    return xs, where
