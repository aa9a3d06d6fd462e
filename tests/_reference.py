"""Known per-rank inputs and the two references every correctness test compares against.

- ``exact``: the kernels' own formula on the CPU (fp32 accumulation in rank order 0..W-1, one
  rounding to the dtype). IEEE fp32 adds are the same on CPU and GPU, so results must be
  BITWISE equal to it, on every rank and for every algorithm.
- ``fp64``: the true sum in float64, to show the formula itself is accurate.
"""

from __future__ import annotations

import torch

TOLERANCE = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-6}


def rank_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input for test ``seed``: random normal values, different per rank (CPU)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank * 7919 + numel)
    return (torch.randn(numel, generator=gen, dtype=torch.float32) * (1 + rank)).to(dtype)


def all_inputs(seed: int, world: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [rank_input(seed, r, numel, dtype) for r in range(world)]


def misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (2-byte dtype) that starts one element past an allocation: its
    address is 2-byte but not 4-byte aligned, which kernels that move element pairs must handle."""
    assert t.element_size() == 2, "only 2-byte dtypes can start half-way into a 4-byte word"
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    copy = buf[1:].view(t.shape)
    copy.copy_(t)
    assert copy.data_ptr() % 4 == 2
    return copy


def exact(inputs: list[torch.Tensor]) -> torch.Tensor:
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    return acc.to(inputs[0].dtype)


def fp64(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in inputs]).sum(0)


def check(out: torch.Tensor, inputs: list[torch.Tensor], what: str) -> None:
    """Bitwise equal to ``exact`` and close to ``fp64``; raises AssertionError naming ``what``."""
    got = out.detach().cpu()
    want = exact(inputs)
    if not torch.equal(got.view(-1), want.view(-1)):
        bad = (got.view(-1) != want.view(-1)).nonzero()
        first = int(bad[0]) if len(bad) else -1
        raise AssertionError(f"{what}: {len(bad)} of {want.numel()} elements differ from the rank-order fp32 sum "
                             f"(first at {first}: got {got.view(-1)[first].item()!r}, want {want.view(-1)[first].item()!r})")
    ref = fp64(inputs)
    err = (got.double().view(-1) - ref.view(-1)).abs()
    bound = TOLERANCE[got.dtype] * ref.abs().view(-1) + 1e-5 * len(inputs)
    if bool((err > bound).any()):
        raise AssertionError(f"{what}: max error {err.max().item():.3g} beyond the {got.dtype} rounding bound")
