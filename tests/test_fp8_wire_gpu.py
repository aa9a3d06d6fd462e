"""The FP8 wire on GPUs (``all_reduce(x, wire="fp8")``, the kernel twoshot_fp8): on every rank
the bits of the reference (pcie_allreduce/fp8_wire.py), so bitwise identical across ranks, and
within its error bound of the fp64 sum; both transports, every dtype, odd sizes and partial
blocks, activations with outliers and zeros, Inf and NaN, in place, unaligned, captured in a
CUDA graph and replayed with fresh inputs, and the fused all-reduce + RMSNorm; at the dtypes'
top, values that saturate, sums that cancel or overflow to +-Inf, NaN only from NaN inputs.
Skipped with a reason on a machine without a GPU or without the built extension.
"""

from __future__ import annotations

import pytest
import torch

import pcie_allreduce
from bench.fp8_error import activations  # the inputs RESULTS.md's error figures use
from pcie_allreduce import fp8_wire
from pcie_allreduce.tools import ranks
from tests import _fp8_model as model
from tests import _reference as ref
from tests._allreduce_gpu import SKIP_REASON, TRANSPORTS, WORLDS

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
MAX_BYTES = 4 << 20
SIZES = (1, 127, 128, 129, 4099, 4 * 7168, 32 * 7168 + 3, (1 << 20) // 2 + 77)


def _check(got: torch.Tensor, inputs: list[torch.Tensor], what: str) -> None:
    want = fp8_wire.all_reduce(inputs)
    bad = ref.bitwise_mismatches(got.cpu().reshape(-1), want.reshape(-1))
    assert not bad.any(), f"{what}: {int(bad.sum())} elements are not the FP8 wire's bits (first at {int(bad.nonzero()[0])})"
    finite = torch.isfinite(want.reshape(-1))
    err = (got.cpu().reshape(-1).double() - ref.fp64(inputs).reshape(-1))[finite].abs()
    bound = fp8_wire.error_bound(inputs)[finite]
    assert (err <= bound).all(), f"{what}: error {float((err - bound).max())} beyond the bound"


def _fp8_rank(ctx: ranks.RankContext, transport: str) -> dict:
    comm = pcie_allreduce.Communicator(ctx.group, ctx.device, max_bytes=MAX_BYTES, timeout_s=30, transport=transport)
    checks = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for seed, numel in enumerate(SIZES):
            inputs = [activations(seed, r, numel, dtype) for r in range(ctx.world_size)]
            if seed == 4:  # a NaN and an infinity on one rank each: their blocks' other values survive
                inputs[0][5] = float("nan")
                inputs[-1][300] = float("inf")
            x = inputs[ctx.rank].to(ctx.device)
            out = torch.full_like(x, float("nan"))
            comm.all_reduce(x, out=out, wire="fp8")
            inplace = x.clone()
            comm.all_reduce(inplace, out=inplace, wire="fp8")
            unaligned = torch.empty(numel + 1, dtype=dtype, device=ctx.device)[1:]  # one element off
            unaligned.copy_(x)
            got_unaligned = comm.all_reduce(unaligned, wire="fp8")
            torch.cuda.synchronize()
            what = f"W={ctx.world_size} {transport} rank {ctx.rank} {dtype} numel={numel}"
            for name, got in (("out", out), ("in place", inplace), ("unaligned", got_unaligned)):
                _check(got, inputs, f"{what} {name}")
                checks += 1
    checks += _edges(ctx, comm)
    with pytest.raises(ValueError, match="wire"):
        comm.all_reduce(torch.zeros(8, device=ctx.device), wire="int4")
    with pytest.raises(ValueError, match="cannot be combined"):
        comm.all_reduce(torch.zeros(8, device=ctx.device), algo="twoshot", wire="fp8")
    # captured: fresh inputs before every replay, every output poisoned and checked
    numel, dtype = 7168 * 4 + 5, torch.bfloat16
    static = torch.empty(numel, dtype=dtype, device=ctx.device)
    outs = [torch.empty_like(static) for _ in range(3)]
    stream = torch.cuda.Stream(ctx.device)
    comm.prepare_stream(stream.cuda_stream)  # collective: outside the capture, on every rank
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for o in outs:
            comm.all_reduce(static, out=o, wire="fp8")
    for rep in range(5):
        inputs = [activations(100 + rep, r, numel, dtype) for r in range(ctx.world_size)]
        static.copy_(inputs[ctx.rank])
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, o in enumerate(outs):
            _check(o, inputs, f"W={ctx.world_size} {transport} graph replay {rep} call {i}")
            checks += 1
    # the fused all-reduce + RMSNorm on the FP8 wire
    tokens, hidden = 4, 7168
    xs = [activations(200, r, tokens * hidden, torch.bfloat16) for r in range(ctx.world_size)]
    x = xs[ctx.rank].view(tokens, hidden).to(ctx.device)
    residual = activations(201, 0, tokens * hidden, torch.bfloat16).view(tokens, hidden).to(ctx.device)
    weight = (1 + activations(202, 0, hidden, torch.float32) / 8).to(torch.bfloat16).to(ctx.device)
    poisoned = [torch.full_like(x, float("nan")) for _ in range(2)]
    normed, new_residual = comm.all_reduce_rmsnorm(x, residual, weight, 1e-6, out=poisoned[0],
                                                   residual_out=poisoned[1], wire="fp8")
    reduced = fp8_wire.all_reduce(xs).view(tokens, hidden)
    assert torch.equal(ref.bits(new_residual.cpu()), ref.bits(residual.cpu() + reduced)), "fused: residual + FP8 sum"
    ref.check_rmsnorm(normed.cpu(), new_residual.cpu(), weight.cpu(), 1e-6, f"W={ctx.world_size} fused fp8")
    checks += 1
    # the torch.library op (what torch.compile graphs hold) takes the wire too
    op_normed, op_residual = torch.ops.pcie_allreduce.all_reduce_rmsnorm(x, residual, weight, 1e-6, comm.handle,
                                                                         "auto", "fp8")
    assert torch.equal(ref.bits(op_residual.cpu()), ref.bits(new_residual.cpu())), "op: residual"
    assert torch.equal(ref.bits(op_normed.cpu()), ref.bits(normed.cpu())), "op: normed"
    checks += _plugin_wire(ctx, comm)
    comm.check()
    comm.close()
    return {"checks": checks}


def _edges(ctx: ranks.RankContext, comm: pcie_allreduce.Communicator) -> int:
    """The edges of the format (tests/_fp8_model.py's inputs, which the CPU tests hold the
    reference to): values at each dtype's top that saturate, sums that cancel to 0 or overflow
    to the exact wire's +-Inf, NaN and +-Inf inputs; the reference's bits on every rank, and
    the non-finite elements exactly the exact wire's."""
    checks = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for numel in (4099, 32 * 7168 + 3):
            large, _ = model.large_inputs(ctx.world_size, numel, dtype)
            special, _ = model.special_inputs(ctx.world_size, numel, dtype)
            for name, inputs in (("large", large), ("special", special)):
                got = comm.all_reduce(inputs[ctx.rank].to(ctx.device), wire="fp8").cpu()
                what = f"W={ctx.world_size} rank {ctx.rank} {dtype} numel={numel} {name} values"
                _check(got, inputs, what)
                exact_wire = model.exact_wire(inputs)
                assert torch.equal(torch.isnan(got), torch.isnan(exact_wire)), f"{what}: NaN not the exact wire's"
                inf = torch.isinf(exact_wire)
                assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], exact_wire[inf]), \
                    f"{what}: +-Inf not the exact wire's"
                checks += 1
    return checks


def _plugin_wire(ctx: ranks.RankContext, comm: pcie_allreduce.Communicator) -> int:
    """The SGLang plugin's PCIE_AR_SGLANG_WIRE=fp8 on this communicator: calls from the
    threshold up carry the FP8 wire's bits, smaller ones the exact rank-order sum."""
    from sglang_plugin.adapter import PcieAllReduceAdapter
    from sglang_plugin.settings import Settings

    settings = Settings(enabled=True, wire="fp8", wire_min_bytes=64 << 10)
    adapter = PcieAllReduceAdapter(ctx.group, ctx.device, settings, communicator_factory=lambda *a, **k: comm)
    checks = 0
    for seed, numel in enumerate(((64 << 10) // 2 - 1, (64 << 10) // 2, 3 * 7168 * 8 + 1)):
        inputs = [activations(300 + seed, r, numel, torch.bfloat16) for r in range(ctx.world_size)]
        got = adapter.custom_all_reduce(inputs[ctx.rank].to(ctx.device))
        torch.cuda.synchronize()
        if numel * 2 >= settings.wire_min_bytes:
            _check(got, inputs, f"plugin wire=fp8 numel={numel}")
        else:
            exact = ref.bits(ref.exact(inputs))
            assert torch.equal(ref.bits(got.cpu()), exact), f"plugin below the threshold numel={numel}: not exact"
        checks += 1
    return checks


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", WORLDS)
def test_fp8_wire_is_the_reference_bits_on_every_rank(world: int, transport: str) -> None:
    results = ranks.run_ranks(_fp8_rank, world, transport, timeout_s=600)
    assert all(r["checks"] == results[0]["checks"] > 0 for r in results)
