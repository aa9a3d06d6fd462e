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


# ---- exact integer inputs: every call's sum known exactly, whatever the order of the additions

# Explicit mantissa bits and the exponent of the smallest normal number of each dtype.
_FORMATS = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126)}


def integer_bound(world: int, dtype: torch.dtype) -> int:
    """The largest |x| a rank's integer-valued input may hold so that every partial and final sum
    of ``world`` of them is an integer ``dtype`` holds exactly (|sum| <= 2^(mantissa bits + 1)):
    any algorithm, any order of additions, gives that exact sum."""
    return (1 << (_FORMATS[dtype][0] + 1)) // world


def integer_input(seed: int, rank: int, numel: int, dtype: torch.dtype, bound: int) -> torch.Tensor:
    """Rank ``rank``'s random integers in [-bound, bound] for test ``seed`` (CPU, as ``dtype``)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank * 7919 + numel)
    return torch.randint(-bound, bound + 1, (numel,), generator=gen, dtype=torch.int32).to(dtype)


class AffinePools:
    """Fresh integer inputs for many calls without generating W tensors per call.

    Each rank holds a pool of random integers twice the message long (``integer_input``); call
    ``i``'s input on rank r is ``scale_i * pool_r[shift_i : shift_i + numel] + offset_i``, with
    (shift, scale, offset) drawn per call from an RNG every rank seeds alike. The expected sum is
    ``scale_i * S[shift_i : ...] + W * offset_i`` with S the sum of the W pools: exact (every value
    stays within ``integer_bound``), so it is compared for equality, and one tensor op per call on
    the rank gives it. A window of ``pool_r`` at another shift, scale or offset differs from this
    call's in nearly every element, so a result of an earlier call, a missing or doubled rank or a
    misplaced element shows up in that call's comparison."""

    SCALES = (-3, -2, -1, 1, 2, 3)

    def __init__(self, seed: int, world: int, numel: int, dtype: torch.dtype) -> None:
        limit = integer_bound(world, dtype)
        self.numel, self.world, self.dtype = numel, world, dtype
        self.value_bound = max(1, limit // 4)  # pool values: |scale * v + offset| <= 3/4 + 1/4 of limit
        self.offset_bound = max(0, limit // 4)
        self.pools = [integer_input(seed, r, 2 * numel, dtype, self.value_bound) for r in range(world)]
        self.total = exact(self.pools)  # exact: integers within the bound

    def draw(self, rng) -> tuple[int, int, int]:
        """(shift, scale, offset) of one call, from a ``random.Random`` every rank seeds alike."""
        return (rng.randrange(self.numel), rng.choice(self.SCALES),
                rng.randint(-self.offset_bound, self.offset_bound))

    @staticmethod
    def apply(values: torch.Tensor, numel: int, params: tuple[int, int, int], world: int = 1,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """``scale * values[shift : shift + numel] + world * offset`` (into ``out`` if given): a
        rank's input from its pool (world 1), or the expected sum from the pools' sum (world W)."""
        shift, scale, offset = params
        window = values[shift:shift + numel]
        out = torch.mul(window, scale, out=out)
        return out.add_(world * offset)

    def inputs(self, params: tuple[int, int, int]) -> list[torch.Tensor]:
        """Every rank's input of the call ``params`` (CPU), for references built the long way."""
        return [self.apply(p, self.numel, params) for p in self.pools]

    def expected(self, params: tuple[int, int, int]) -> torch.Tensor:
        return self.apply(self.total, self.numel, params, self.world)


def value_mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many elements of ``got`` differ in value from ``want`` (a 0-dim int64 tensor on their
    device, so a batch of checks needs no synchronization); NaN (the poison) always differs."""
    return (got != want).sum()


# ---- bitwise comparison and the full-payload wire format

_INT_VIEW = {2: torch.int16, 4: torch.int32}
# The fp32 word of two 16-bit poison lanes (0x80008000), a negative subnormal, and fp32 -0.0.
POISON_WORD_FP32 = -0x7FFF8000  # 0x80008000 as int32
NEG_ZERO_FP32 = -0x80000000     # 0x80000000 as int32
NEG_ZERO_16 = -0x8000           # 0x8000 as int16: -0.0 of bf16/fp16, the poison lane
# The algorithms whose data is its own arrival flag at full payload (docs/guide.md, "Algorithms": the sign of a zero).
FULL_PAYLOAD_ALGORITHMS = ("oneshot_full", "twoshot_full", "host_oneshot", "host_twoshot")


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as a signed integer tensor of the same element size."""
    return t.view(_INT_VIEW[t.element_size()])


def as_sent_full_payload(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the full-payload algorithms put it on the wire (csrc/host_wire.cuh, H1): a
    bf16/fp16 -0.0 (0x8000, the poison lane) as +0.0, the fp32 word 0x80008000 as -0.0."""
    b = bits(t).clone()
    if t.element_size() == 2:
        b[b == NEG_ZERO_16] = 0
    else:
        b[b == POISON_WORD_FP32] = NEG_ZERO_FP32
    return b.view(t.dtype)


def expected_sum(inputs: list[torch.Tensor], algo: str) -> torch.Tensor:
    """What ``algo`` returns for ``inputs``: the rank-order fp32 sum of what it sends (``exact``
    of the inputs, or of them as the full-payload format sends them)."""
    if algo in FULL_PAYLOAD_ALGORITHMS:
        inputs = [as_sent_full_payload(x) for x in inputs]
    return exact(inputs)


def edge_inputs(seed: int, world: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input of the edge-value tests (CPU, ``numel`` >= 112): random normals, about a
    quarter of them replaced per rank by -0.0, +0.0, NaN, +Inf, -Inf (and, in fp32, the poison
    word 0x80008000), after seven leading blocks of 16: every rank -0.0 (where the full-payload
    algorithms give +0.0 in bf16/fp16), every rank the poison word (-0.0 in bf16/fp16), every
    rank +0.0, NaN, +Inf; -0.0 on every rank but the last, which has +0.0; the poison word on
    rank 0 and -0.0 on the others (a sum that is the poison word itself)."""
    specials = [-0.0, 0.0, float("nan"), float("inf"), float("-inf")]
    kinds = len(specials) + 1  # the last: the poison word
    inputs = []
    for r in range(world):
        gen = torch.Generator().manual_seed(seed * 1009 + r * 7919 + numel)
        x = torch.randn(numel, generator=gen, dtype=torch.float32) * (1 + r)
        pick = torch.randint(0, 4 * kinds, (numel,), generator=gen)
        pick[:112] = kinds  # the leading blocks: set below
        for k, v in enumerate(specials):
            x[pick == k] = v
        x[pick == len(specials)] = -0.0
        last = 0.0 if r == world - 1 else -0.0
        for block, v in enumerate((-0.0, -0.0, 0.0, float("nan"), float("inf"), last, -0.0)):
            x[16 * block:16 * (block + 1)] = v
        x = x.to(dtype)
        if dtype == torch.float32:  # the poison word as data: a negative subnormal
            b = bits(x)
            b[pick == len(specials)] = POISON_WORD_FP32
            b[16:32] = POISON_WORD_FP32
            if r == 0:
                b[96:112] = POISON_WORD_FP32
        inputs.append(x)
    return inputs


def bitwise_mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Mask of the elements whose bits differ (any NaN equals any NaN: payloads may differ)."""
    both_nan = torch.isnan(got) & torch.isnan(want)
    return (bits(got) != bits(want)) & ~both_nan


# ---- the RMSNorm of the fused kernels, at the precision they promise

#: How far the fused kernels' normed output may be from the fp64 RMSNorm of their own new
#: residual, in units in the last place of the output dtype. The kernels compute fp32
#: ``v * rstd * w`` and round once to the dtype (add_rmsnorm.finish_row; rstd = 1 / sqrt_rn(sum /
#: H + eps) from an exact or fp32-summed statistic): the fp32 value is within a few fp32 ulps
#: (~1e-6 relative) of the exact one, far below half a bf16/fp16 ulp (2^-9 / 2^-12 relative at
#: least), so the stored value is within half an ulp and a little more. One ulp holds with margin;
#: a norm factor off by 1% (bf16) or 0.1% (fp16) fails.
NORM_ULPS = 1.0


def ulp(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s numbers at |value| (fp64, on value's device): 2^(e - mantissa
    bits) for |value| in [2^e, 2^(e+1)), the subnormal spacing below the smallest normal and at 0."""
    mantissa, emin = _FORMATS[dtype]
    # the binary exponent from the fp64 bits (exact; 0 and fp64 subnormals give -1023, below emin)
    e = ((value.double().view(torch.int64) >> 52) & 0x7FF) - 1023
    return torch.exp2((e.clamp_min(emin) - mantissa).double())


def rmsnorm_fp64(new_residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    v = new_residual.double()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double().to(v.device)


def check_rmsnorm(normed: torch.Tensor, new_residual: torch.Tensor, weight: torch.Tensor, eps: float, what: str,
                  ulps: float = NORM_ULPS) -> None:
    """``normed`` within ``ulps`` units in the last place of its dtype of the fp64 RMSNorm of
    ``new_residual`` (the kernel's own output, checked bitwise elsewhere) times ``weight``; every
    element (a NaN only where the reference is NaN). Runs on the tensors' device; raises
    AssertionError naming ``what``."""
    got = normed.detach().double()
    want = rmsnorm_fp64(new_residual.detach(), weight.detach(), eps)
    err = (got - want).abs()
    ok = (err <= ulps * ulp(want, normed.dtype)) | (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(ok.all()):
        bad = (~ok).reshape(-1).nonzero()
        first = int(bad[0])
        g, w = got.reshape(-1)[first].item(), want.reshape(-1)[first].item()
        off = err.reshape(-1)[first].item() / ulp(want.reshape(-1)[first], normed.dtype).item()
        raise AssertionError(f"{what}: {len(bad)} of {want.numel()} normed elements are more than {ulps} ulp of "
                             f"{normed.dtype} from the fp64 RMSNorm of the new residual (first at flat index {first}: "
                             f"got {g!r}, want {w!r}, {off:.3g} ulp)")
