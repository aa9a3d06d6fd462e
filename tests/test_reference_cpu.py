"""The GPU tests' checking helpers (tests/_reference.py) on the CPU: each accepts what a correct
kernel returns and rejects what a wrong one would (a doctored output), so a GPU test built on
them can fail."""

from __future__ import annotations

import random

import pytest
import torch

from tests import _reference as ref

EPS = 1e-6
HALF_DTYPES = (torch.bfloat16, torch.float16)


# ---- ulp and the RMSNorm check


def test_ulp_of_each_dtype() -> None:
    v = torch.tensor([1.0, 1.5, 2.0, 3.0, -0.75, 0.0, 1e-45])
    assert ref.ulp(v, torch.bfloat16).tolist() == [2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -6, 2.0 ** -8,
                                                   2.0 ** -133, 2.0 ** -133]
    assert ref.ulp(v, torch.float16).tolist()[:5] == [2.0 ** -10, 2.0 ** -10, 2.0 ** -9, 2.0 ** -9, 2.0 ** -11]
    assert ref.ulp(torch.tensor([0.0, 1e-6]), torch.float16).tolist() == [2.0 ** -24, 2.0 ** -24]  # subnormals
    assert ref.ulp(torch.tensor([1.0]), torch.float32).tolist() == [2.0 ** -23]
    # the spacing is the dtype's: the next representable number is value + ulp
    for dtype in HALF_DTYPES:
        x = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype).abs()
        up = (ref.bits(x) + 1).view(dtype)  # the next representable number above x
        assert torch.equal((up.double() - x.double()), ref.ulp(x.double(), dtype))


def _row_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    new_residual = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype)
    new_residual[:, ::97] = 0  # exact zeros and tiny values: the subnormal range of the norm
    new_residual[:, 1::89] = 1e-5
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    return new_residual, weight


def _kernel_norm(new_residual: torch.Tensor, weight: torch.Tensor, eps: float, factor: float = 1.0,
                 tree_sum: bool = False) -> torch.Tensor:
    """The kernels' formula on the CPU (add_rmsnorm.finish_row): fp32 v * rstd * w, rounded once;
    the statistic exact (the fixed-point sum) or an fp32 sum (oneshot_ll's partials); ``factor``
    doctors rstd."""
    v = new_residual.float()
    sumsq = (v * v).sum(-1, keepdim=True) if tree_sum else (v.double() ** 2).sum(-1, keepdim=True).float()
    rstd = 1.0 / torch.sqrt(sumsq / v.shape[-1] + eps)
    return (v * (rstd * factor) * weight.float()).to(new_residual.dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 7168), (4, 2050), (3, 77), (2, 8192)])
@pytest.mark.parametrize("tree_sum", [False, True])
def test_check_rmsnorm_accepts_the_kernels_formula(dtype, tokens, hidden, tree_sum) -> None:
    new_residual, weight = _row_inputs(tokens, hidden, dtype, tokens * hidden)
    normed = _kernel_norm(new_residual, weight, EPS, tree_sum=tree_sum)
    ref.check_rmsnorm(normed, new_residual, weight, EPS, "the kernels' formula")
    ref.check_rmsnorm(normed, new_residual, weight.float(), EPS, "fp32 weight")


@pytest.mark.parametrize("dtype, factor", [(torch.bfloat16, 1.01), (torch.bfloat16, 0.99), (torch.float16, 1.001)])
def test_check_rmsnorm_rejects_a_norm_factor_error(dtype, factor) -> None:
    new_residual, weight = _row_inputs(4, 7168, dtype, 3)
    doctored = _kernel_norm(new_residual, weight, EPS, factor=factor)
    with pytest.raises(AssertionError, match="more than 1.0 ulp"):
        ref.check_rmsnorm(doctored, new_residual, weight, EPS, "doctored")
    if factor == 1.01:  # the tolerance it replaces (rtol 2^-6, atol 2e-2) took a 1% error
        want = ref.rmsnorm_fp64(new_residual, weight, EPS)
        torch.testing.assert_close(doctored.double(), want, rtol=2 * ref.TOLERANCE[dtype], atol=2e-2)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_check_rmsnorm_rejects_one_bad_element(dtype) -> None:
    new_residual, weight = _row_inputs(2, 2050, dtype, 5)
    normed = _kernel_norm(new_residual, weight, EPS)
    for doctor in ("two ulp", "nan", "unwritten row", "other row's rstd"):
        bad = normed.clone()
        if doctor == "two ulp":
            v = bad[1, 1000].double()
            bad[1, 1000] = (v + 2 * ref.ulp(v, dtype)).to(dtype)
        elif doctor == "nan":
            bad[0, 7] = float("nan")
        elif doctor == "unwritten row":
            bad[1] = float("nan")
        else:
            bad[1] = _kernel_norm(new_residual, weight, EPS)[0]
        with pytest.raises(AssertionError, match="normed elements"):
            ref.check_rmsnorm(bad, new_residual, weight, EPS, doctor)


# ---- integer inputs with exact sums


@pytest.mark.parametrize("dtype", (*HALF_DTYPES, torch.float32))
@pytest.mark.parametrize("world", [2, 3, 8])
def test_affine_pools_give_exact_sums(world: int, dtype: torch.dtype) -> None:
    rng = random.Random(world)
    for numel in (1, 7, 1001):
        pools = ref.AffinePools(3, world, numel, dtype)
        limit = ref.integer_bound(world, dtype)
        for _ in range(20):
            params = pools.draw(rng)
            inputs = pools.inputs(params)
            for x in inputs:
                assert x.numel() == numel and bool((x.double().abs() <= limit).all())
                assert torch.equal(x.double(), x.double().round())
            want = pools.expected(params)
            assert torch.equal(want, ref.exact(inputs)), "the pools' sum must be the rank-order sum"
            assert torch.equal(want.double(), ref.fp64(inputs)), "and exact"
            for order in (inputs[::-1], inputs[1:] + inputs[:1]):
                assert torch.equal(ref.exact(order), want), "in any order"


@pytest.mark.parametrize("world", [2, 8])
def test_value_mismatches_catch_stale_missing_and_doubled_data(world: int) -> None:
    rng = random.Random(0)
    numel = 21509
    pools = ref.AffinePools(7, world, numel, torch.bfloat16)
    earlier, now = pools.draw(rng), pools.draw(rng)
    inputs, want = pools.inputs(now), pools.expected(now)
    assert int(ref.value_mismatches(ref.exact(inputs), want)) == 0
    wrong = {
        "the previous call's result": pools.expected(earlier),
        "a rank missing": ref.exact(inputs[:-1]),
        "rank 0 counted twice": ref.exact([inputs[0]] + inputs[1:-1] + [inputs[0]]),
        "W times rank 0's input": (inputs[0].float() * world).to(torch.bfloat16),
        "elements shifted by one": want.roll(1),
        "unwritten (the poison)": torch.full_like(want, float("nan")),
    }
    for what, got in wrong.items():
        assert int(ref.value_mismatches(got, want)) > numel // 2, what
    one = want.clone()
    one[12345] = float("nan")
    assert int(ref.value_mismatches(one, want)) == 1


# ---- edge values and the full-payload wire format


def test_full_payload_wire_format() -> None:
    x = torch.tensor([-0.0, 0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    sent = ref.as_sent_full_payload(x)
    assert ref.bits(sent).tolist() == [0, 0, ref.bits(x)[2].item(), ref.bits(x)[3].item()]
    assert ref.bits(x)[0].item() == ref.NEG_ZERO_16, "the input itself is untouched"
    w = torch.tensor([ref.POISON_WORD_FP32, ref.NEG_ZERO_FP32, 0], dtype=torch.int32).view(torch.float32)
    assert ref.bits(ref.as_sent_full_payload(w)).tolist() == [ref.NEG_ZERO_FP32, ref.NEG_ZERO_FP32, 0]


def test_bitwise_mismatches_see_the_sign_of_zero_and_nan_positions() -> None:
    want = torch.tensor([-0.0, 1.0, float("nan"), float("inf")])
    assert not bool(ref.bitwise_mismatches(want.clone(), want).any())
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    got = want.clone()
    got[2] = other_nan[0]
    assert not bool(ref.bitwise_mismatches(got, want).any()), "any NaN equals any NaN"
    for i, v in ((0, 0.0), (1, float("nan")), (2, 1.0), (3, float("-inf"))):
        got = want.clone()
        got[i] = v
        assert ref.bitwise_mismatches(got, want).nonzero().view(-1).tolist() == [i]


@pytest.mark.parametrize("dtype", (*HALF_DTYPES, torch.float32))
@pytest.mark.parametrize("world", [2, 4])
def test_edge_inputs_tell_the_two_families_apart(world: int, dtype: torch.dtype) -> None:
    inputs = ref.edge_inputs(1, world, 283, dtype)
    exact = ref.expected_sum(inputs, "oneshot")
    full = ref.expected_sum(inputs, "oneshot_full")
    assert not bool(ref.bitwise_mismatches(exact, ref.expected_sum(inputs, "twoshot")).any())
    assert not bool(ref.bitwise_mismatches(full, ref.expected_sum(inputs, "host_twoshot")).any())
    differ = ref.bitwise_mismatches(full, exact)
    neg_zero = ref.bits(torch.tensor(-0.0, dtype=dtype)).item()
    # -0.0 on every rank: -0.0 by the exact algorithms, +0.0 by the full-payload ones in bf16/fp16
    assert ref.bits(exact[:16]).tolist() == [neg_zero] * 16
    assert ref.bits(full[:16]).tolist() == [0 if dtype != torch.float32 else neg_zero] * 16
    if dtype == torch.float32:  # the poison word on every rank: W of it, or -0.0
        assert bool((exact[16:32] == -world * 2.0 ** -134).all())
        assert ref.bits(full[16:32]).tolist() == [ref.NEG_ZERO_FP32] * 16
        # the poison word on rank 0, -0.0 elsewhere: the poison word itself, or -0.0
        assert ref.bits(exact[96:112]).tolist() == [ref.POISON_WORD_FP32] * 16
        assert ref.bits(full[96:112]).tolist() == [ref.NEG_ZERO_FP32] * 16
    assert ref.bits(exact[32:48]).tolist() == [0] * 16 and ref.bits(exact[80:96]).tolist() == [0] * 16
    assert bool(torch.isnan(exact[48:64]).all()) and bool((exact[64:80] == float("inf")).all())
    # elsewhere the families differ only in the sign of a zero (or by a poison word's 2^-134)
    assert bool(((exact[differ] == 0) | (exact[differ].abs() <= world * 2.0 ** -134)).all())
    assert bool(differ.any()), "the test must tell the families apart"
    # every kind of value occurs in the random part too
    body = exact[112:]
    assert bool(torch.isnan(body).any()) and bool(torch.isinf(body).any())
    assert bool((torch.isfinite(body) & (body != 0)).sum() > 20)
