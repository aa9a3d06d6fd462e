"""The FP8 wire format of ``all_reduce(x, wire="fp8")``, as a reference the kernels must match bit
for bit.

A message travels as blocks of ``BLOCK`` elements, each block one fp32 scale and ``BLOCK`` FP8
e4m3 codes: 132 bytes per 128 values instead of 256 for bf16 / fp16 (0.52x on the wire). Every
step is exact or correctly rounded, so any implementation that follows it gets the same bits:

- **Infinity**: e4m3 (the ``fn`` variant) has no infinity, so the wire takes the codes +-448 for
  +-Inf and finite values code within +-416 (``CODE_MAX``); its NaN codes stay NaN.
- **Scale**: the power of two ``s`` that takes the block's largest finite magnitude ``a`` to at
  most 416: with ``a = m * 2^E`` (``frexp``, 0.5 <= m < 1), ``s = 2^(E-9)`` when ``m <= 0.8125``
  and ``2^(E-8)`` otherwise; ``s = 1`` for a block without a nonzero finite value; the exponent
  never below -126 (fp32's smallest normal). ``x / s`` is exact (a power of two), and its rounding
  never passes 416: 416 is an e4m3 value, and the ``m > 0.8125`` side lies below 256, which is one.
- **Saturation at fp32's top**: rounding to e4m3's four significant bits takes a finite value of
  at least 1.9375 * 2^127 to 2^128, beyond fp32; so a finite value first clamps to +-``LARGEST``
  = 1.875 * 2^127 = 240 * 2^120, the largest fp32 value of four significant bits. Only blocks of
  scale 2^120 hold such values (any ``a`` from 0.8125 * 2^128 gives that scale, clamped or not),
  and the clamp does not change their scale.
- **Code**: the clamped ``x / s`` rounded to nearest even e4m3; +-Inf codes as +-448, NaN as NaN.
  Neither distorts its block's scale.
- **Value**: ``code * s`` in fp32, exact; the codes +-448 give +-Inf.
- **All-reduce** (the two-shot's dataflow): every rank encodes its contribution; the owner of each
  shard decodes every rank's blocks of it and sums them in fp32 in rank order (the library's
  invariant, so the sum is the same whichever rank computes it), encodes that sum again, and
  every rank decodes the encoded sums and rounds them once to the message's dtype. Every rank
  thus ends with the same bits, whatever the launch shape. Non-finite values follow fp32
  arithmetic as on the exact wire: an input's +-Inf arrives as +-Inf, a sum that overflows fp32
  is +-Inf, NaN comes only from a NaN input or from +Inf meeting -Inf.

Error: an element ``x`` of a block with scale ``s`` is coded within ``max(2^-4 |x|, 2^-10 s)``
(half an e4m3 ulp: 3 mantissa bits; the second term below e4m3's smallest normal, 2^-6 s). That
holds where the top saturates too: ``|x| - LARGEST <= 2^-4 |x|`` for every ``|x| <= 2^128``.
:func:`error_bound` adds that up over the ranks' codes, the fp32 sum, the second coding and the
final rounding. A sum within that error of fp32's largest value may land on either side of the
overflow: the exact wire's fp32 sum and this one's differ by the coding.
"""

from __future__ import annotations

import torch

from pcie_allreduce.plan.algorithms import fp8_wire_bytes
from pcie_allreduce.constants import FP8_BLOCK

#: Elements per scale (csrc/protocol_constants.h's kFp8Block).
BLOCK = FP8_BLOCK
#: The largest magnitude a finite value codes as (in units of its block's scale).
CODE_MAX = 416.0
#: The code of +-Inf (e4m3's largest finite magnitude, which the wire gives to infinity).
INF_CODE = 448.0
#: The largest fp32 value of four significant bits: finite values saturate there.
LARGEST = 1.875 * 2.0 ** 127
_MIN_EXPONENT = -126
_FLT_MAX = torch.finfo(torch.float32).max


def wire_bytes(numel: int) -> int:
    """Bytes an ``numel``-element message takes in this format (a last partial block included)."""
    return fp8_wire_bytes(numel)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D fp32) as [blocks, BLOCK], the last block padded with zeros."""
    pad = (-x.numel()) % BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale of each block of ``x`` (1-D fp32), as fp32."""
    finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    amax = _blocks(finite).abs().amax(dim=1)
    mantissa, exponent = torch.frexp(amax)
    exponent = exponent - 9 + (mantissa > CODE_MAX / 512).to(exponent.dtype)
    exponent = torch.clamp(exponent, min=_MIN_EXPONENT)
    scales = torch.ldexp(torch.ones_like(amax), exponent)
    return torch.where(amax > 0, scales, torch.ones_like(amax))


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any float dtype, 1-D) as (codes: float8_e4m3fn [blocks * BLOCK], scales: fp32 [blocks])."""
    x = x.reshape(-1).to(torch.float32)
    scales = block_scales(x)
    blocks = _blocks(x)
    scaled = blocks.clamp(-LARGEST, LARGEST) / scales[:, None]  # exact: a power of two
    codes = scaled.to(torch.float8_e4m3fn)  # round to nearest even; |scaled| <= CODE_MAX by the scale
    infinity = torch.where(blocks > 0, torch.full_like(codes, INF_CODE), torch.full_like(codes, -INF_CODE))
    codes = torch.where(torch.isinf(blocks), infinity, codes)
    codes = torch.where(torch.isnan(blocks), torch.full_like(codes, float("nan")), codes)
    return codes.reshape(-1), scales


def decode(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of ``numel`` elements coded as ``(codes, scales)``."""
    codes = codes.view(-1, BLOCK).to(torch.float32)
    values = codes * scales[:, None]  # exact: a power of two
    values = torch.where(codes.abs() == INF_CODE, codes * float("inf"), values)
    return values.reshape(-1)[:numel]


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as it arrives through the wire, in fp32."""
    return decode(*encode(x), x.numel())


def all_reduce(inputs: list[torch.Tensor]) -> torch.Tensor:
    """What every rank's ``all_reduce(x, wire="fp8")`` returns for these per-rank inputs (CPU
    tensors of one shape and dtype): the coded contributions summed in fp32 in rank order, coded
    again, decoded and rounded once to the dtype."""
    acc = round_trip(inputs[0])
    for x in inputs[1:]:
        acc = acc + round_trip(x)
    return round_trip(acc).to(inputs[0].dtype).view(inputs[0].shape)


def _coding_error(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per element of ``x`` (1-D) coded in blocks of ``scales``: the module docstring's bound, fp64."""
    per_element = scales.double().repeat_interleave(BLOCK)[:x.numel()]
    return torch.maximum(x.double().abs() * 2.0 ** -4, per_element * 2.0 ** -10)


def coding_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Per element of ``x`` (1-D fp32): how far its coded value may be from it, in fp64."""
    return _coding_error(x, block_scales(x))


def error_bound(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Per element: how far :func:`all_reduce` may be from the exact (fp64) sum of ``inputs``,
    in fp64: each rank's coding, the fp32 additions, the sum's coding and the final rounding.

    Finite wherever the inputs are. Where the fp32 sum of the coded values overflows, the result
    is +-Inf (as the exact wire's is where its own fp32 sum overflows) and no finite figure
    bounds its error: the terms of the sum's coding and rounding are then those of fp32's
    largest value, which keeps the figure finite."""
    xs = [x.reshape(-1).to(torch.float32) for x in inputs]
    coded = [round_trip(x) for x in xs]
    bound = sum(coding_error_bound(x) for x in xs)
    coded_sum = coded[0]
    for c in coded[1:]:
        coded_sum = coded_sum + c  # the fp32 sum in rank order, as all_reduce adds
    bound = bound + (len(xs) - 1) * 2.0 ** -24 * sum(c.double().abs() for c in coded)
    overflowed = torch.isinf(coded_sum) & torch.isfinite(bound)
    held = torch.where(overflowed, coded_sum.clamp(-_FLT_MAX, _FLT_MAX), coded_sum)
    bound = bound + _coding_error(held, block_scales(coded_sum)) * (1 + 2.0 ** -4)
    arrived = torch.where(overflowed, torch.full_like(coded_sum, _FLT_MAX), round_trip(coded_sum)).double().abs()
    unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[inputs[0].dtype]
    return bound + arrived * unit
