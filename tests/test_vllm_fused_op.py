"""The vLLM plugin's fused op ``pcie_allreduce_vllm::all_reduce_rmsnorm``: its fallback and which
results are the same bits whatever the batch.

Where the adapter does not take the call, the op runs the engine's own pair: vLLM's all-reduce,
then vLLM's ``fused_add_rms_norm`` (its CUDA kernel ``torch.ops._C.fused_add_rms_norm`` where vLLM's
kernels are built, its reference implementation on a CPU). The CPU tests check that dispatch with
vLLM's real IR op and its real ``vllm_c`` implementation, the CUDA kernel played by a CPU stand-in
registered under vLLM's op name. The GPU test checks the claim of vllm_plugin/README.md: a token's
all-reduce, new residual and norm are bitwise the same in every batch the plugin serves.
"""

from __future__ import annotations

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from tests import _reference as ref
from tests._vllm import ensure_entry_point, plugin_env, tp_group, vllm_skip_reason

VLLM_SKIP = vllm_skip_reason()
needs_vllm = pytest.mark.skipif(VLLM_SKIP is not None, reason=VLLM_SKIP or "")
EPS = 1e-6


def _args(tokens: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    reduced = (4 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    residual = (4 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    weight = (1 + torch.rand(hidden, generator=gen)).to(weight_dtype or dtype)
    return reduced, residual, weight


class CudaKernelStandIn:
    """``torch.ops._C.fused_add_rms_norm`` as vLLM's CUDA kernel is called (in place on its first two
    arguments), for a CPU: registered under vLLM's name while the test runs, counting its calls. Its
    output is marked (+1 on the normed values) so a result that did not come from it is told apart."""

    def __init__(self) -> None:
        self.calls = 0
        self.lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901 - destroyed in close()
        self.lib.define("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()")
        self.lib.impl("fused_add_rms_norm", self._kernel, "CPU")

    @staticmethod
    def result(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """What the stand-in writes into (x, residual): the norm of the rounded sum, marked."""
        total = (x.float() + residual.float()).to(x.dtype)
        var = total.float().pow(2).mean(-1, keepdim=True)
        return (total.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight + 1, total

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        self.calls += 1
        normed, total = self.result(x, residual, weight, eps)
        x.copy_(normed)
        residual.copy_(total)

    def close(self) -> None:
        self.lib._destroy()


@pytest.fixture
def vllm_c(monkeypatch):
    """vLLM's ``vllm_c`` implementation of its IR op made available as on a CUDA box, its kernel the
    stand-in (vLLM marks it unsupported on a platform without CUDA)."""
    from vllm import ir
    from vllm.platforms import current_platform

    current_platform.import_ir_kernels()
    monkeypatch.setattr(ir.ops.fused_add_rms_norm.impls["vllm_c"], "supported", True)
    kernel = CudaKernelStandIn()
    yield kernel
    kernel.close()


def _native(reduced, residual, weight):
    from vllm import ir

    return ir.ops.fused_add_rms_norm.impls["native"].impl_fn(reduced.clone(), residual.clone(), weight, EPS)


@needs_vllm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_a_cpu_the_fallback_norm_is_vllms_reference(dtype: torch.dtype) -> None:
    from vllm_plugin import ops

    assert not hasattr(torch.ops._C, "fused_add_rms_norm")  # a CPU: vLLM's kernels are not built
    reduced, residual, weight = _args(5, 96, dtype, seed=1)
    inputs = (reduced.clone(), residual.clone())
    normed, new_residual = ops.engine_add_rms_norm(reduced, residual, weight, EPS)
    want_normed, want_residual = _native(reduced, residual, weight)
    assert torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
    assert torch.equal(new_residual, (reduced.float() + residual.float()).to(dtype))
    assert torch.equal(reduced, inputs[0]) and torch.equal(residual, inputs[1])  # functional


@needs_vllm
def test_where_vllms_kernels_are_built_the_fallback_norm_is_its_cuda_kernel_on_copies(vllm_c) -> None:
    from vllm_plugin import ops

    reduced, residual, weight = _args(3, 64, torch.bfloat16, seed=2)
    inputs = (reduced.clone(), residual.clone())
    normed, new_residual = ops.engine_add_rms_norm(reduced, residual, weight, EPS)
    assert vllm_c.calls == 1
    want_normed, want_residual = vllm_c.result(reduced, residual, weight, EPS)
    assert torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
    assert torch.equal(reduced, inputs[0]) and torch.equal(residual, inputs[1])  # run on copies

    # vLLM's kernel wants the weight in the input's dtype; otherwise vLLM's reference serves.
    reduced, residual, weight = _args(3, 64, torch.bfloat16, torch.float32, seed=3)
    normed, new_residual = ops.engine_add_rms_norm(reduced, residual, weight, EPS)
    assert vllm_c.calls == 1
    want_normed, want_residual = _native(reduced, residual, weight)
    assert torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)


@needs_vllm
def test_a_declined_call_runs_the_groups_all_reduce_then_vllms_kernel(vllm_c, monkeypatch) -> None:
    """The op's fallback: the group's out-of-place all-reduce (what torch.ops.vllm.all_reduce runs),
    then vLLM's norm kernel on its result; nothing else."""
    from vllm_plugin import ops

    reduced, residual, weight = _args(2, 32, torch.float16, seed=4)
    x = torch.randn(2, 32).to(torch.float16)

    class Group:  # a vLLM GroupCoordinator whose ca_comm is not ours
        device_communicator = type("Comm", (), {"ca_comm": None})()

        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def _all_reduce_out_place(self, inp: torch.Tensor) -> torch.Tensor:
            self.seen.append(inp)
            return reduced.clone()

    group = Group()
    monkeypatch.setattr(ops, "_group", lambda name: group if name == "tp:7" else None)
    normed, new_residual = ops.all_reduce_rmsnorm(x, residual, weight, EPS, "tp:7")
    assert len(group.seen) == 1 and group.seen[0] is x and vllm_c.calls == 1
    want = ops.engine_add_rms_norm(reduced, residual, weight, EPS)
    assert torch.equal(normed, want[0]) and torch.equal(new_residual, want[1])


# ---------------------------------------------------------------------------- one GPU, W ranks

GPU_SKIP = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason() or VLLM_SKIP
MAX_BYTES = 1 << 20
HIDDEN = 4096
SERVED_TOKENS = (1, 3, 16, 57, MAX_BYTES // (HIDDEN * 2))  # bf16: the last is the largest batch served


def _batch(ctx, tokens: int):
    """A batch whose row 0 is the same token in every batch (x per rank, residual, weight)."""
    x = ref.rank_input(1000 + tokens, ctx.rank, tokens * HIDDEN, torch.bfloat16).view(tokens, HIDDEN)
    residual = ref.rank_input(2000 + tokens, 99, tokens * HIDDEN, torch.bfloat16).view(tokens, HIDDEN)
    x[0] = ref.rank_input(7, ctx.rank, HIDDEN, torch.bfloat16)
    residual[0] = ref.rank_input(7, 99, HIDDEN, torch.bfloat16)
    weight = (1 + 0.1 * ref.rank_input(7, 98, HIDDEN, torch.float32)).to(torch.bfloat16)
    return x.to(ctx.device), residual.to(ctx.device), weight.to(ctx.device)


def _batch_rank(ctx: ranks.RankContext) -> dict:
    ensure_entry_point()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    tp = tp_group(ctx, ctx.device)
    adapter = tp.device_communicator.ca_comm
    op = torch.ops.pcie_allreduce_vllm.all_reduce_rmsnorm
    rows = []
    for tokens in SERVED_TOKENS:
        x, residual, weight = _batch(ctx, tokens)
        assert adapter.should_custom_ar(x) and adapter.can_fuse(x, residual, weight, EPS), tokens
        reduced = tp.all_reduce(x)
        normed, new_residual = op(x, residual, weight, EPS, tp.unique_name)
        rows.append([t[0].cpu() for t in (reduced, normed, new_residual)])
    x, residual, weight = _batch(ctx, SERVED_TOKENS[-1] + 1)
    declined = not adapter.should_custom_ar(x) and not adapter.can_fuse(x, residual, weight, EPS)
    adapter.comm.check()
    adapter.close()
    names = ("all_reduce", "normed", "new_residual")
    return {"declined_above": declined,
            "same_bits": {name: all(torch.equal(r[i], rows[0][i]) for r in rows) for i, name in enumerate(names)}}


@pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")
@pytest.mark.parametrize("world", [2, 4])
def test_a_token_gets_the_same_bits_in_every_batch_the_plugin_serves(world: int) -> None:
    env = plugin_env(PCIE_AR_VLLM_MODE="always", PCIE_AR_VLLM_MAX_BYTES=str(MAX_BYTES), PCIE_AR_VLLM_TIMEOUT_S="30",
                     VLLM_DISABLE_PYNCCL="1", VLLM_ALLREDUCE_USE_SYMM_MEM="0")
    for result in ranks.run_ranks(_batch_rank, world, timeout_s=900, env=env):
        assert result == {"declined_above": True,
                          "same_bits": {"all_reduce": True, "normed": True, "new_residual": True}}, result
