"""Known inputs whose sum every backend must get exactly right, whatever its reduction order.

Rank r's element i is a small integer in [-7, 7] from a hash of (seed, r, i). Sums of up to 16 of
them are integers of magnitude <= 112, exact in bfloat16 (every integer up to 256), float16 and
float32, and addition of such integers is exact in any order. So NCCL (ring order), torch
symmetric memory and ours can all be compared for EXACT equality with one expected tensor,
computed on the device from the formula.
The hash (not a short period) makes a misplaced chunk, a missing rank or a doubled rank show up.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def rank_values(count: int, rank: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank ``rank``'s values as int64 in [-7, 7] (``count`` of them)."""
    i = torch.arange(count, device=device, dtype=torch.int64)
    h = (i * 2654435761 + (rank + 1) * 40503 + seed * 2246822519) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 2246822519) & _MASK32  # int64 wrap-around keeps the low 32 bits right
    h = h ^ (h >> 13)
    return (h >> 8) % 15 - 7


def rank_input(count: int, rank: int, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank ``rank``'s input tensor."""
    return rank_values(count, rank, seed, device).to(dtype)


def expected_sum(count: int, world: int, seed: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The exact all-reduce (sum) of every rank's :func:`rank_input`."""
    total = rank_values(count, 0, seed, device)
    for rank in range(1, world):
        total += rank_values(count, rank, seed, device)
    return total.to(dtype)


def mismatch(out: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when ``out`` equals ``expected`` exactly, else a one-line description (NaN counts as wrong)."""
    bad = out.reshape(-1) != expected.reshape(-1)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    first = int(bad.nonzero()[0])
    return (f"{n_bad} of {expected.numel()} elements wrong (first at {first}: got "
            f"{out.reshape(-1)[first].item()!r}, want {expected.reshape(-1)[first].item()!r})")


# ---- the residual add + RMSNorm cases (--fused, verify) -------------------------------------

RESIDUAL_RANK = 1000  # the residual is replicated: every rank uses this "rank"'s values


def residual_input(count: int, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The residual, identical on every rank (as in a tensor-parallel model): integers in [-7, 7]."""
    return rank_values(count, RESIDUAL_RANK, seed, device).to(dtype)


def weight_values(hidden: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """RMSNorm weights in [0.75, 1.25], multiples of 1/16 (exact in every dtype)."""
    i = torch.arange(hidden, device=device, dtype=torch.int64)
    return (1 + ((i * 7) % 9 - 4).to(torch.float32) / 16).to(dtype)


def expected_norm(new_residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the exact new residual (fp32 math, rounded once) to compare within tolerance."""
    x = new_residual.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(new_residual.dtype)
