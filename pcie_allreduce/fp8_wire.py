"""The FP8 wire format of ``all_reduce(x, wire="fp8")``, as a reference the kernels must match bit
for bit.

A message travels as blocks of ``BLOCK`` elements, each block one fp32 scale and ``BLOCK`` FP8
e4m3 codes: 132 bytes per 128 values instead of 256 for bf16 / fp16 (0.52x on the wire). Every
step is exact or correctly rounded, so any implementation that follows it gets the same bits:

- **Scale**: the power of two ``s`` that takes the block's largest finite magnitude ``a`` to at
  most 448 (e4m3's largest finite value): with ``a = m * 2^E`` (``frexp``, 0.5 <= m < 1),
  ``s = 2^(E-9)`` when ``m <= 0.875`` and ``2^(E-8)`` otherwise; ``s = 1`` for an all-zero block;
  the exponent never below -126 (fp32's smallest normal). No division rounds: ``x / s`` is exact.
- **Code**: ``x / s`` rounded to nearest even e4m3 (never above 448 in magnitude, by the scale);
  a NaN or an infinity becomes e4m3's NaN (the format has no infinity: an Inf arrives as NaN, and
  it does not distort its block's scale).
- **Value**: ``code * s`` in fp32, exact.
- **All-reduce** (the two-shot's dataflow): every rank encodes its contribution; the owner of each
  shard decodes every rank's blocks of it and sums them in fp32 in rank order (the library's
  invariant, so the sum is the same whichever rank computes it), encodes that sum again, and
  every rank decodes the encoded sums and rounds them once to the message's dtype. Every rank
  thus ends with the same bits, whatever the launch shape.

Error: an element ``x`` of a block with scale ``s`` is coded within ``max(2^-4 |x|, 2^-10 s)``
(half an e4m3 ulp: 3 mantissa bits; the second term below e4m3's smallest normal, 2^-6 s).
:func:`error_bound` adds that up over the ranks' codes, the fp32 sum and the second coding.
"""

from __future__ import annotations

import torch

from pcie_allreduce.algo import fp8_wire_bytes
from pcie_allreduce.constants import FP8_BLOCK

#: Elements per scale (csrc/protocol_constants.h's kFp8Block).
BLOCK = FP8_BLOCK
#: e4m3's largest finite magnitude.
FP8_MAX = 448.0
_MIN_EXPONENT = -126


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
    exponent = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    exponent = torch.clamp(exponent, min=_MIN_EXPONENT)
    scales = torch.ldexp(torch.ones_like(amax), exponent)
    return torch.where(amax > 0, scales, torch.ones_like(amax))


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any float dtype, 1-D) as (codes: float8_e4m3fn [blocks * BLOCK], scales: fp32 [blocks])."""
    x = x.reshape(-1).to(torch.float32)
    scales = block_scales(x)
    scaled = _blocks(x) / scales[:, None]  # exact: a power of two
    codes = scaled.to(torch.float8_e4m3fn)  # round to nearest even; |scaled| <= 448 by the scale
    nonfinite = ~torch.isfinite(_blocks(x))
    codes = torch.where(nonfinite, torch.full_like(codes, float("nan")), codes)
    return codes.reshape(-1), scales


def decode(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of ``numel`` elements coded as ``(codes, scales)``."""
    values = codes.view(-1, BLOCK).to(torch.float32) * scales[:, None]  # exact: a power of two
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


def coding_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Per element of ``x`` (1-D fp32): how far its coded value may be from it."""
    scales = block_scales(x)
    per_element = scales.repeat_interleave(BLOCK)[:x.numel()]
    return torch.maximum(x.abs() * 2.0 ** -4, per_element * 2.0 ** -10)


def error_bound(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Per element: how far :func:`all_reduce` may be from the exact (fp64) sum of ``inputs``,
    in fp64: each rank's coding, the fp32 additions, the sum's coding and the final rounding."""
    xs = [x.reshape(-1).to(torch.float32) for x in inputs]
    coded = [round_trip(x) for x in xs]
    bound = sum(coding_error_bound(x).double() for x in xs)
    coded_sum = coded[0]
    for c in coded[1:]:
        coded_sum = coded_sum + c  # the fp32 sum in rank order, as all_reduce adds
    eps32 = 2.0 ** -24
    bound = bound + (len(xs) - 1) * eps32 * sum(c.double().abs() for c in coded)
    bound = bound + coding_error_bound(coded_sum).double() * (1 + 2.0 ** -4)
    unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[inputs[0].dtype]
    return bound + round_trip(coded_sum).double().abs() * unit
