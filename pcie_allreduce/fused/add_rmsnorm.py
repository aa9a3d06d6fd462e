"""Residual add + RMSNorm in one Triton kernel, and the row statistic every fused kernel shares.

    new_residual = residual + y                                   (rounded once, as torch adds)
    normed       = new_residual * rsqrt(mean(new_residual^2) + eps) * weight   (fp32 math)

This is the library's own unfused epilogue (launched by
:func:`pcie_allreduce.fused.path.add_rmsnorm`): where no fused all-reduce + RMSNorm kernel beats
the plain all-reduce followed by it, ``Communicator.all_reduce_rmsnorm`` runs those two kernels
instead (``algo="unfused"``). One program per row, the whole row in registers.
With ``$PCIE_AR_PDL=1`` on Hopper and later the pair overlaps: this kernel is launched as the
all-reduce's programmatic dependent (the all-reduce allows it at its end, csrc/protocol.cuh's
``allow_dependent_launch``), loads the residual and the weight, and waits for the all-reduce
(``griddepcontrol.wait``) only before it reads the sum; past that wait it allows its own
dependent (the next collective) to launch.

The row statistic (:func:`sum_of_squares`) is exact fixed-point arithmetic, not an fp32 tree: the
square of a bf16 or fp16 value is exact in fp32 (8 or 11 mantissa bits, squared, fit in 24), and
each square is scaled onto a common 64-bit fixed-point grid set by the row's largest square
(which lands in [2^48, 2^49), so 16384 of them stay below 2^63), where integer addition is
associative.
So the sum, and with it ``normed``, does not depend on the order of the additions: not on
Triton's register layout (which follows the tensors' alignment: a vectorised and a scalar
variant give the same bits), not on how many threads or programs a row is spread over. Ranks
whose tensors differ in alignment still agree bitwise, and a 16-byte aligned variant is safe.
Each square keeps its bits down to 2^-48 of the row's largest (far below fp32's own rounding of
the sum); a row holding inf or NaN gets the fp32 sum of its squares (inf or NaN, whatever the order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcie_allreduce.fused.protocol import allow_dependent_launch, round_to

# The row's largest square lands at 2^48 <= term < 2^49 on the fixed-point grid, so
# MAX_RMSNORM_HIDDEN (2^14) terms sum below 2^63.
_GRID_TOP: tl.constexpr = tl.constexpr(48)


@triton.jit
def _pow2(n):
    """2^n as fp32 for an int32 n in [-126, 127]."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def sum_of_squares(v, mask):
    """Sum of ``v * v`` over the masked elements of fp32 ``v`` (values of a bf16/fp16 tensor), the
    same bits whatever the order of the additions (module docstring): a scalar.

    Each square is scaled by a power of two chosen from the row's largest (exact, a per-row
    scalar) and truncated to an int64, a function of that element alone; the int64 sum is then
    exact, whatever the order. Per element: the square, an unsigned max of its bits, one multiply
    and one conversion. One multiply suffices because the scale 2^k is a normal fp32 for every
    k <= 127 (k >= -79 for a finite row): where the scaled square is >= 1 the product is exact,
    where it is < 1 it truncates to 0 whatever the rounding. Only a row whose largest square is
    below 2^-79 (k > 127) takes a second multiply, in a branch the whole row takes."""
    q = tl.where(mask, v * v, 0.0)
    # A square is >= +0 (a NaN may carry a sign bit): its bits order as unsigned integers with the
    # sign left in, and every inf or NaN, signed or not, lands at or above 0x7F800000.
    top = tl.max(q.to(tl.uint32, bitcast=True))
    if top >= 0x7F800000:  # inf or NaN in the row (or a square that overflowed): fp32's own answer
        result = tl.sum(q)
    else:
        exponent = tl.maximum(top.to(tl.int32) >> 23, 1)  # biased; a subnormal counts as exponent 1
        # term = q * 2^(GRID_TOP + 127 - exponent): the largest square in [2^48, 2^49).
        k = _GRID_TOP + 127 - exponent
        scaled = q * _pow2(tl.minimum(k, 127))
        if k > 127:  # 2^k is past fp32's range: the rest of the scale, again >= 1, so again exact
            scaled = scaled * _pow2(k - 127)
        total = tl.sum(scaled.to(tl.int64))
        k1 = k >> 1  # the scale back, in two factors within fp32's range
        result = total.to(tl.float32) * _pow2(-k1) * _pow2(k1 - k)
    return result


@triton.jit
def rstd_of(sumsq, H, eps):
    """1 / sqrt(mean + eps) with a correctly rounded square root: the same in every kernel."""
    return 1.0 / tl.sqrt_rn(sumsq / H + eps)


@triton.jit
def finish_row(nr, w, cols_ok, H, eps, normed_ptrs, res_out_ptrs, mask, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """Store a row's new residual ``nr`` (of DT) and its RMSNorm times ``w`` (fp32), the statistic
    over ``cols_ok``: the epilogue of this module's kernel and of every fused kernel, so the exact
    statistic (and its independence of the register layout) is the same everywhere."""
    tl.store(res_out_ptrs, nr, mask=mask)
    v = nr.to(tl.float32)
    rstd = rstd_of(sum_of_squares(v, cols_ok), H, eps)
    tl.store(normed_ptrs, round_to(v * rstd * w, DT, INTERPRET), mask=mask)


@triton.jit
def typed_pointer(addr, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """An address (int64) as a pointer to DT; with ALIGNED, known to be 16-byte aligned."""
    ptr = addr.to(tl.pointer_type(DT))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit(do_not_specialize=["y_addr", "res_addr", "w_addr", "normed_addr", "res_out_addr"])
def _add_rmsnorm_kernel(y_addr, res_addr, w_addr, normed_addr, res_out_addr, eps,
                        H: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, WT: tl.constexpr,
                        ALIGNED: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    y = typed_pointer(y_addr, DT, ALIGNED)
    res = typed_pointer(res_addr, DT, ALIGNED)
    w = typed_pointer(w_addr, WT, ALIGNED)
    normed = typed_pointer(normed_addr, DT, ALIGNED)
    res_out = typed_pointer(res_out_addr, DT, ALIGNED)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    off = row.to(tl.int64) * H + cols
    # the whole row is read before any of it is written: y may be normed, residual res_out
    r = tl.load(res + off, mask=ok, other=0.0).to(tl.float32)
    wv = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32)
    if PDL:
        # Launched as the dependent of the all-reduce (module docstring): the residual and the
        # weight were written before that kernel started, y by it, so only y waits for it.
        tl.extra.cuda.gdc_wait()
        # Past our only wait: a dependent launched after us (the next collective) may start its
        # launch now; it waits for our completion before it reads anything.
        allow_dependent_launch(PDL)
    nr = round_to(tl.load(y + off, mask=ok, other=0.0).to(tl.float32) + r, DT, INTERPRET)
    finish_row(nr, wv, ok, H, eps, normed + off, res_out + off, ok, DT, INTERPRET)


#: torch dtype -> Triton dtype, for kernels that take addresses and a DT constexpr.
TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
