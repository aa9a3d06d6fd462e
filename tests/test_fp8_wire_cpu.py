"""CPU tests of the FP8 wire format's reference (pcie_allreduce/fp8_wire.py): its codes, scales
and sums are those of an independent model of the format (tests/_fp8_model.py), its error is
within its bound of the fp64 sum, the result of every owner's shard computed alone is that
shard of the whole, and at the edges of fp32 it stays finite where the sum is, gives +-Inf where
the sum overflows, NaN only from a NaN input, and a finite bound wherever the inputs are."""

from __future__ import annotations

import pytest
import torch

from pcie_allreduce import fp8_wire
from pcie_allreduce.fp8_wire import BLOCK
from tests import _fp8_model as model
from tests import _reference as ref

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _activations(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values of a per-rank scale, 0.1% outliers 100x larger, 2% exact zeros."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(numel, generator=gen) * (0.5 + rank % 3)
    outliers = torch.rand(numel, generator=gen) < 1e-3
    x = torch.where(outliers, x * 100, x)
    zeros = torch.rand(numel, generator=gen) < 0.02
    return torch.where(zeros, torch.zeros_like(x), x).to(dtype)


def _any_floats(seed: int, numel: int) -> torch.Tensor:
    """fp32 values of every kind: random bit patterns (NaN, Inf, subnormals, any exponent), values
    at the top binades, exact ties of e4m3 at any scale, tiny and bf16-like values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2 ** 31, 2 ** 31, (numel,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    k = numel // 5
    sign = torch.where(torch.rand(k, generator=gen) < 0.5, -1.0, 1.0)
    x[:k] = (torch.rand(k, generator=gen) * 0.25 + 0.75) * 2.0 ** 127 * 2 * sign
    halves = torch.randint(-448 * 4, 448 * 4, (k,), generator=gen).float() / 4
    x[k:2 * k] = halves * 2.0 ** torch.randint(-140, 118, (k,), generator=gen).float()
    x[2 * k:3 * k] = torch.randn(k, generator=gen) * 2.0 ** -128
    x[3 * k:4 * k] = torch.randn(k, generator=gen).to(torch.bfloat16).float()
    return x


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal, any NaN equal to any NaN (payloads may differ)."""
    got, want = got.reshape(-1), want.reshape(-1)
    if got.dtype != want.dtype:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return bool(((got.view(view) == want.view(view)) | (torch.isnan(got) & torch.isnan(want))).all())


def test_the_model_s_e4m3_values_are_torch_s() -> None:
    """The model's values from bit fields agree with torch's own float8_e4m3fn (a check of the
    model, which the tests below hold the reference to)."""
    torch_values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    model_values = torch.tensor([model.e4m3_value(c) for c in range(256)], dtype=torch.float64)
    assert _same_bits(model_values, torch_values)


def test_scales_are_the_smallest_power_of_two_within_416() -> None:
    x = torch.tensor([416.0, 1.0, -3.0] + [0.0] * (BLOCK - 3) + [417.0] + [0.0] * (BLOCK - 1)
                     + [0.0] * BLOCK + [2.0 ** -140] + [0.0] * (BLOCK - 1) + [448.0] + [float("inf")] * (BLOCK - 1))
    assert fp8_wire.block_scales(x).tolist() == [1.0, 2.0, 1.0, 2.0 ** -126, 2.0]
    top = torch.finfo(torch.float32).max
    magnitudes = torch.rand(1000) * 10.0 ** torch.randint(-20, 20, (1000,)).float()
    for a in torch.cat([magnitudes, torch.tensor([416.0, top])]):
        s = fp8_wire.block_scales(torch.tensor([float(a)]))[0]
        assert s == model.scale(float(a)), (float(a), float(s))
        assert a / s <= 416 and (a / (s / 2) > 416 or s == 2.0 ** -126), (float(a), float(s))


def test_codes_round_to_nearest_even_and_infinities_have_their_codes() -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([416.0, 15.0, 17.0, 2.0 ** -10, 3 * 2.0 ** -10, -0.0, inf, -inf, nan, 1.0])
    codes, scales = fp8_wire.encode(x)
    got = fp8_wire.decode(codes, scales, x.numel())
    # scale 1 (416 is the block's largest finite); 17 is a tie between 16 and 18 -> 16 (even)
    assert got[:6].tolist() == [416.0, 15.0, 16.0, 0.0, 2.0 ** -8, 0.0]
    assert got[6:8].tolist() == [inf, -inf] and bool(torch.isnan(got[8])) and got[9] == 1.0
    assert codes.view(torch.uint8)[5:9].tolist() == [0x80, 0x7E, 0xFE, 0x7F]
    assert fp8_wire.round_trip(torch.zeros(5)).tolist() == [0.0] * 5
    assert fp8_wire.wire_bytes(1) == 132 and fp8_wire.wire_bytes(128) == 132 and fp8_wire.wire_bytes(129) == 264


@pytest.mark.parametrize("seed", [0, 1])
def test_codes_and_scales_are_the_independent_model_s(seed: int) -> None:
    x = _any_floats(seed, BLOCK * 400 + 17)
    codes, scales = fp8_wire.encode(x)
    want_codes, want_scales = model.encode(x)
    assert torch.equal(scales.double(), want_scales)
    bad = (codes.view(torch.uint8) != want_codes).nonzero().flatten()
    assert len(bad) == 0, f"{len(bad)} codes differ, first at {int(bad[0])}: x = {float(x[bad[0]])!r}"
    want = model.decode(want_codes, want_scales, x.numel())
    assert _same_bits(fp8_wire.decode(codes, scales, x.numel()).double(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 3, 8])
def test_all_reduce_is_the_independent_model_s_bits(world: int, dtype: torch.dtype) -> None:
    numel = BLOCK * 24 + 5
    cases = [[_activations(world, r, numel, dtype) for r in range(world)],
             [_any_floats(100 * world + r, numel).to(dtype) for r in range(world)],
             model.large_inputs(world, numel, dtype)[0], model.special_inputs(world, numel, dtype)[0]]
    for i, inputs in enumerate(cases):
        got, want = fp8_wire.all_reduce(inputs), model.all_reduce(inputs)
        bad = ref.bitwise_mismatches(got, want)
        assert not bad.any(), f"case {i}: {int(bad.sum())} elements differ, first at {int(bad.nonzero()[0])}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 127, 7168 * 4 + 5])
def test_one_coding_is_within_its_bound_and_the_bound_is_tight(dtype: torch.dtype, numel: int) -> None:
    x = _activations(1, 0, numel, dtype).float()
    err = (fp8_wire.round_trip(x).double() - x.double()).abs()
    bound = fp8_wire.coding_error_bound(x)
    assert bool((err <= bound).all())
    if numel > 1000:  # some element's error comes close to its bound: a looser bound fails here
        assert float((err / bound).max()) > 0.9
    top = torch.tensor([torch.finfo(torch.float32).max, -3.3e38, 3.0e38, 1.0e37, 1.0])  # saturated and not
    err = (fp8_wire.round_trip(top).double() - top.double()).abs()
    assert bool((err <= fp8_wire.coding_error_bound(top)).all())
    assert bool(torch.isfinite(fp8_wire.round_trip(top)).all())


@pytest.mark.parametrize("world", [2, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_reduce_error_against_fp64_is_bounded_and_small(world: int, dtype: torch.dtype) -> None:
    numel = 7168 * 32 + 3
    inputs = [_activations(world, r, numel, dtype) for r in range(world)]
    got = fp8_wire.all_reduce(inputs).double()
    exact = model.fp64_sum(inputs)
    err = (got - exact).abs()
    assert bool((err <= fp8_wire.error_bound(inputs)).all()), float((err - fp8_wire.error_bound(inputs)).max())
    # The figures the docs quote: relative to the exact sum, where it is not tiny against its block.
    big = exact.abs() > 0.05 * exact.abs().max()
    rel = err[big] / exact.abs()[big]
    assert float(rel.max()) < 0.2 and float(rel.mean()) < 0.04, (float(rel.max()), float(rel.mean()))


def _split(n: int, parts: int, idx: int) -> tuple[int, int]:
    """The kernels' split of n items into parts (csrc/partition.cuh)."""
    per = -(-n // parts)
    begin = min(per * idx, n)
    return begin, min(begin + per, n)


@pytest.mark.parametrize("world,cuda_blocks", [(2, 1), (3, 2), (4, 3), (8, 5)])
def test_every_owner_s_shard_alone_gives_that_shard_of_the_whole(world: int, cuda_blocks: int) -> None:
    """What the two-shot computes: each owner sums only its shard's blocks (split among the
    ranks, then among the CUDA blocks), and every rank assembles the owners' shards. Each piece,
    computed alone by the independent model, must be the reference's bits of the whole message
    at that place: no element depends on blocks outside its own, whoever owns them."""
    numel = BLOCK * 37 + 11
    for dtype in (torch.bfloat16, torch.float32):
        inputs = model.large_inputs(world, numel, dtype)[0]
        whole = fp8_wire.all_reduce(inputs)
        blocks = -(-numel // BLOCK)
        pieces = []
        for owner in range(world):
            shard = _split(blocks, world, owner)
            for cb in range(cuda_blocks):
                sub = _split(shard[1] - shard[0], cuda_blocks, cb)
                lo, hi = (shard[0] + sub[0]) * BLOCK, min((shard[0] + sub[1]) * BLOCK, numel)
                if lo < hi:
                    pieces.append(model.all_reduce([x[lo:hi] for x in inputs]))
        assert _same_bits(torch.cat(pieces), whole), (world, cuda_blocks, dtype)


def test_the_error_report_runs_and_every_case_is_within_the_bound(capsys: pytest.CaptureFixture) -> None:
    from bench import fp8_error

    assert fp8_error.main(["--world", "2", "3", "--numel", "4099", "--seed", "5"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [(r[0], r[1]) for r in rows] == [("2", "bfloat16"), ("2", "float16"), ("3", "bfloat16"), ("3", "float16")]
    assert all(r[-1] == "yes" and 0 < float(r[2]) < 0.05 for r in rows), rows


# ---- the edges of fp32: large values, overflow, infinities and NaN


def test_bf16_pairs_of_3_3e38_sum_to_0_and_to_3_3e38_finite_and_within_the_bound() -> None:
    """+-3.3e38 (bf16) on two ranks, the sums 0 (opposite signs) and +-3.3e38 (the other rank 0):
    rounding 3.3e38 to e4m3's precision would reach 2^128, beyond fp32; it saturates instead."""
    numel = 8192
    gen = torch.Generator().manual_seed(3)
    sign = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
    first = (sign * 3.3e38).to(torch.bfloat16)
    second = torch.where(torch.arange(numel) % 2 == 0, -first.float(), torch.zeros(numel)).to(torch.bfloat16)
    inputs = [first, second]
    got = fp8_wire.all_reduce(inputs)
    exact = model.fp64_sum(inputs)
    bound = fp8_wire.error_bound(inputs)
    assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(bound).all())
    assert bool((got[0::2] == 0).all())
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert _same_bits(got, model.all_reduce(inputs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 3, 8])
def test_large_values_stay_finite_within_the_bound_and_overflowing_sums_are_inf(world: int, dtype: torch.dtype) -> None:
    """Inputs at the dtype's top (tests/_fp8_model.large_inputs): where the exact sum is finite
    the result is finite and within the bound of the fp64 sum; where every rank adds +-big it
    overflows to the exact wire's +-Inf; no NaN; the bound finite everywhere."""
    inputs, overflow = model.large_inputs(world, BLOCK * 24 + 5, dtype)
    got = fp8_wire.all_reduce(inputs)
    exact_wire = model.exact_wire(inputs)
    bound = fp8_wire.error_bound(inputs)
    assert bool(torch.isfinite(bound).all())
    assert not bool(torch.isnan(got).any())
    assert bool(torch.isinf(exact_wire[overflow]).all()) and torch.equal(got[overflow], exact_wire[overflow])
    assert bool(torch.isfinite(exact_wire[~overflow]).all()) and bool(torch.isfinite(got[~overflow]).all())
    err = (got.double() - model.fp64_sum(inputs))[~overflow].abs()
    assert bool((err <= bound[~overflow]).all()), float((err - bound[~overflow]).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 4])
def test_nan_only_where_an_input_is_nan_and_inf_arrives_as_on_the_exact_wire(world: int, dtype: torch.dtype) -> None:
    """A NaN, +-Inf on one rank, +Inf meeting -Inf, +Inf beside a huge value: the non-finite
    results are the exact wire's, element for element (NaN from the NaN inputs and from
    Inf - Inf only); the other elements of their blocks are finite and within the bound."""
    numel = BLOCK * 4 + 9
    inputs, where = model.special_inputs(world, numel, dtype)
    got, exact_wire = fp8_wire.all_reduce(inputs), model.exact_wire(inputs)
    nan = torch.zeros(numel, dtype=torch.bool)
    nan[where["nan"] + where["inf-inf"]] = True
    assert torch.equal(torch.isnan(got), nan) and torch.equal(torch.isnan(exact_wire), nan)
    assert got[where["inf"]].tolist() == [float("inf")] and got[where["-inf"]].tolist() == [float("-inf")]
    inf = torch.isinf(exact_wire)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], exact_wire[inf])
    finite_in = torch.stack([torch.isfinite(x) for x in inputs]).all(0)
    assert bool(torch.isfinite(got[finite_in]).all())
    err = (got.double() - model.fp64_sum(inputs))[finite_in].abs()
    bound = fp8_wire.error_bound(inputs)
    assert bool(torch.isfinite(bound[finite_in]).all()) and bool((err <= bound[finite_in]).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bound_is_finite_where_the_fp32_sum_overflows(dtype: torch.dtype) -> None:
    """An fp32 sum that overflows gives +-Inf (as the exact wire does) and a finite bound; the
    other elements of its block keep their own bound."""
    big = model.BIG[dtype]
    inputs = [torch.tensor([big, -big, 1.0e3, 2.0], dtype=dtype), torch.tensor([big, -big, 2.0e3, -1.0], dtype=dtype)]
    got = fp8_wire.all_reduce(inputs)
    bound = fp8_wire.error_bound(inputs)
    assert got[:2].tolist() == [float("inf"), float("-inf")] == model.exact_wire(inputs)[:2].tolist()
    assert bool(torch.isfinite(bound).all())
    assert bool(((got[2:].double() - model.fp64_sum(inputs)[2:]).abs() <= bound[2:]).all())
