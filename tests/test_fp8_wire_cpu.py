"""CPU tests of the FP8 wire format's reference (pcie_allreduce/fp8_wire.py): the exact rules the
kernels follow, the error against the fp64 sum on realistic activations, and that the result
does not depend on how the message is split into shards (block-aligned)."""

from __future__ import annotations

import pytest
import torch

from pcie_allreduce import fp8_wire
from pcie_allreduce.fp8_wire import BLOCK


def _activations(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values of a per-rank scale, 0.1% outliers 100x larger, 2% exact zeros."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(numel, generator=gen) * (0.5 + rank % 3)
    outliers = torch.rand(numel, generator=gen) < 1e-3
    x = torch.where(outliers, x * 100, x)
    zeros = torch.rand(numel, generator=gen) < 0.02
    return torch.where(zeros, torch.zeros_like(x), x).to(dtype)


def test_scales_are_the_smallest_power_of_two_within_448() -> None:
    x = torch.tensor([448.0, 1.0, -3.0] + [0.0] * (BLOCK - 3) + [449.0] + [0.0] * (BLOCK - 1)
                     + [0.0] * BLOCK + [2.0 ** -140] + [0.0] * (BLOCK - 1))
    scales = fp8_wire.block_scales(x)
    assert scales.tolist() == [1.0, 2.0, 1.0, 2.0 ** -126]
    for a in torch.cat([torch.rand(1000) * 10.0 ** torch.randint(-20, 20, (1000,)).float(), torch.tensor([448.0])]):
        s = fp8_wire.block_scales(torch.tensor([float(a)]))[0]
        assert a / s <= 448 and (a / (s / 2) > 448 or s == 2.0 ** -126), (float(a), float(s))
        assert torch.frexp(s)[0] == 0.5  # a power of two


def test_codes_round_to_nearest_even_and_nonfinite_becomes_nan() -> None:
    x = torch.tensor([448.0, 15.0, 17.0, 2.0 ** -10, 3 * 2.0 ** -10, -0.0, float("inf"), float("-inf"), float("nan"), 1.0])
    got = fp8_wire.round_trip(x)
    # scale 1 (448 is the block's largest finite); 17 is a tie between 16 and 18 -> 16 (even)
    assert got[:6].tolist() == [448.0, 15.0, 16.0, 0.0, 2.0 ** -8, 0.0]
    assert bool(torch.isnan(got[6:9]).all()) and got[9] == 1.0
    assert fp8_wire.round_trip(torch.zeros(5)).tolist() == [0.0] * 5
    assert fp8_wire.wire_bytes(1) == 132 and fp8_wire.wire_bytes(128) == 132 and fp8_wire.wire_bytes(129) == 264


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [1, 127, 7168 * 4 + 5])
def test_one_coding_is_within_its_bound(dtype: torch.dtype, numel: int) -> None:
    x = _activations(1, 0, numel, dtype).float()
    err = (fp8_wire.round_trip(x).double() - x.double()).abs()
    assert bool((err <= fp8_wire.coding_error_bound(x).double()).all())


@pytest.mark.parametrize("world", [2, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_reduce_error_against_fp64_is_bounded_and_small(world: int, dtype: torch.dtype) -> None:
    numel = 7168 * 32 + 3
    inputs = [_activations(world, r, numel, dtype) for r in range(world)]
    got = fp8_wire.all_reduce(inputs).double()
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    err = (got - exact).abs()
    assert bool((err <= fp8_wire.error_bound(inputs)).all()), float((err - fp8_wire.error_bound(inputs)).max())
    # The figures the docs quote: relative to the exact sum, where it is not tiny against its block.
    big = exact.abs() > 0.05 * exact.abs().max()
    rel = err[big] / exact.abs()[big]
    assert float(rel.max()) < 0.2 and float(rel.mean()) < 0.04, (float(rel.max()), float(rel.mean()))


def test_every_rank_and_every_block_aligned_split_gives_the_same_bits() -> None:
    """The owners of a two-shot reduce block-aligned shards: summing shard by shard (any split on
    block boundaries) gives the whole message's bits."""
    world, numel = 4, BLOCK * 10 + 7
    inputs = [_activations(3, r, numel, torch.bfloat16) for r in range(world)]
    whole = fp8_wire.all_reduce(inputs)
    for cuts in ([0, 3 * BLOCK, 5 * BLOCK, numel], [0, BLOCK, numel], [0, 9 * BLOCK, 10 * BLOCK, numel]):
        parts = [fp8_wire.all_reduce([x[a:b] for x in inputs]) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts).view(torch.int16), whole.view(torch.int16))
    assert torch.equal(fp8_wire.all_reduce(inputs).view(torch.int16), whole.view(torch.int16))


def test_the_error_report_runs_and_every_case_is_within_the_bound(capsys: pytest.CaptureFixture) -> None:
    from bench import fp8_error

    assert fp8_error.main(["--world", "2", "3", "--numel", "4099", "--seed", "5"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [(r[0], r[1]) for r in rows] == [("2", "bfloat16"), ("2", "float16"), ("3", "bfloat16"), ("3", "float16")]
    assert all(r[-1] == "yes" and 0 < float(r[2]) < 0.05 for r in rows), rows
