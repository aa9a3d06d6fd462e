"""Stand-ins for the parts of SGLang 0.5.23's DeepSeek-V3 / Kimi-K2 model path that the GPU test
machine cannot import (tests/test_sglang_model_path_gpu.py says why each is needed): the layer loop
and its boundary steps, ``RMSNorm`` where its module does not import, and ``UnreducedOutput``.
Each makes SGLang's calls in SGLang's order, reading the parallel state through SGLang's own
functions, and says which SGLang code it reproduces."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

LAYERS = 3

Outputs = list[tuple[torch.Tensor, torch.Tensor]]  # (normed, new residual) per boundary, in order


# ---------------------------------------------------------------------------- RMSNorm


class RMSNormStandIn(torch.nn.Module):
    """Stand-in for SGLang 0.5.23's ``RMSNorm`` (sglang/srt/layers/layernorm.py) where that module
    does not import (on CUDA it imports ``sgl_kernel``). ``forward`` is its ``forward_native`` at
    the defaults a DeepSeek layer uses; ``forward_with_allreduce_fusion`` is its
    ``_forward_with_allreduce_fusion`` off ROCm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=weight_dtype))
        self.variance_epsilon = eps
        self.hidden_size = hidden_size

    def forward(self, x, residual=None, post_residual_addition=None):
        return self.forward_native(x, residual, post_residual_addition)

    def forward_native(self, x, residual=None, post_residual_addition=None):
        # RMSNorm.forward_native: add in fp32, round the residual once, norm in fp32, scale, round.
        if not x.is_contiguous():
            x = x.contiguous()
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            if post_residual_addition is not None:
                x = x + post_residual_addition.to(torch.float32)
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = (x * self.weight).to(orig_dtype)
        return x if residual is None else (x, residual)

    def forward_with_allreduce_fusion(self, x, residual=None, post_residual_addition=None, use_attn_tp_group=True):
        # layernorm.py _forward_with_allreduce_fusion, its CUDA branch.
        if residual is not None:
            from sglang.srt.distributed import attention_tensor_model_parallel_all_reduce
            from sglang.srt.layers import flashinfer_comm_fusion
            from sglang.srt.layers.moe.utils import deferred_post_experts_all_reduce
            from sglang.srt.runtime_context import get_parallel

            parallel = get_parallel()
            if use_attn_tp_group:
                world_size = parallel.attn_tp_size
            else:
                world_size = parallel.moe_ep_size if parallel.moe_ep_size > 1 else parallel.moe_tp_size
            if world_size > 1:
                if post_residual_addition is not None:
                    residual = residual + post_residual_addition
                fused = flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm(
                    input_tensor=x, residual=residual, weight=self.weight, eps=self.variance_epsilon,
                    max_token_num=max(x.shape[0], 2048), use_attn_tp_group=use_attn_tp_group)
                if fused[0] is not None:
                    return fused
                # Declined: all-reduce over the group the kernel would have, then add and norm.
                x = attention_tensor_model_parallel_all_reduce(x) if use_attn_tp_group \
                    else deferred_post_experts_all_reduce(x)
                if post_residual_addition is None:
                    residual = residual.clone()
                return self.forward(x, residual, None)
        return self.forward(x, residual, post_residual_addition)


def rmsnorm_class() -> tuple[type, str]:
    """SGLang's ``RMSNorm`` where its module imports, else the stand-in; and which it is."""
    try:
        from sglang.srt.layers.layernorm import RMSNorm
    except Exception as exc:  # noqa: BLE001 - on CUDA without sgl_kernel (the GPU test machine), or a missing package
        return RMSNormStandIn, f"stand-in ({type(exc).__name__}: {exc})"
    return RMSNorm, "sglang.srt.layers.layernorm.RMSNorm"


# ---------------------------------------------------------------------------- the layers


@dataclasses.dataclass(frozen=True)
class UnreducedOutputStandIn:
    """Stand-in for ``UnreducedOutput`` (layer_boundary/output.py): a partial output and the group
    that owes its sum; ``complete()`` is its ``group.all_reduce(partial)``."""

    partial: torch.Tensor
    group: Any

    def complete(self) -> torch.Tensor:
        return self.group.all_reduce(self.partial)


def plugin_gate(batch_size: int) -> bool:
    """Stand-in for calling the hooked ``add_norm.flashinfer_ar_fusion_applies``: the plugin's hook
    around SGLang's own answer where FlashInfer's fusion is not configured."""
    from sglang_plugin import hooks

    return hooks.flashinfer_ar_fusion_applies(_sglang_gate_without_flashinfer_fusion, batch_size)


def _sglang_gate_without_flashinfer_fusion(batch_size: int) -> bool:
    return False


def gate_closed(batch_size: int) -> bool:
    """The gate as SGLang leaves it without the plugin's fused path: every boundary runs unfused."""
    return False


def _stack_entry_stand_in(norm, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's ``attn_boundary.prepare`` on a fresh stream: prepare.py ``_update_read`` with
    ``enters_stack`` (``init_residual``), then ``NormQuantReadout.read`` ->
    ``_update_and_read_residual_plain(norm, hidden, None, None)``: the input is the residual."""
    return norm(hidden), hidden


def _ffn_input_stand_in(norm, partial: torch.Tensor, residual: torch.Tensor, gate: Callable[[int], bool]):
    """``ffn_boundary.prepare`` with the attention's sum owed (``DeclaredSum`` over attention TP):
    prepare.py ``_reduce_update_read`` tries ``fused_ffn_input`` (fusions/allreduce.py), else runs
    ``attn_tp_all_reduce`` (ops.py: the plain attention-TP all-reduce for decode) and
    ``NORM_READOUT.update_and_read`` -> ``norm(hidden, residual)``."""
    from sglang.srt.distributed import attention_tensor_model_parallel_all_reduce

    # fused_ffn_input: aiter_ar_fusion_applies is False off ROCm, so the FlashInfer gate decides.
    if gate(partial.shape[0]):
        return norm.forward_with_allreduce_fusion(partial, residual, use_attn_tp_group=True)
    return norm(attention_tensor_model_parallel_all_reduce(partial), residual)


def _moe_sum_deferred_stand_in(partial: torch.Tensor) -> bool:
    """The FFN exit's decision for a MoE layer that is not the last (exit.py ``ExitPolicy._decide``
    -> ``_defers_sum``: ``exit_facts``' ``may_defer_sum`` and ``single_sum``, and
    ``_batch_allows_deferred_sum``). The parallel terms are SGLang's functions;
    ``post_experts_sum_is_one_all_reduce``'s others read the server config and hold at a plain
    launch (no all-to-all backend, no quantised communication, no TP1 shared experts, no LoRA)."""
    from sglang.srt.layers.moe.utils import can_merge_post_experts_all_reduce, post_experts_reduction_group
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    may_defer_sum = parallel.tp_size > 1 and not (
        parallel.moe_ep_size > 1 and parallel.moe_tp_size > 1 and not can_merge_post_experts_all_reduce())
    single_sum = (not (parallel.moe_ep_size > 1 and parallel.moe_tp_size > 1)
                  and post_experts_reduction_group() is parallel.tp_group)
    return may_defer_sum and partial.shape[0] > 0 and single_sum


def _ffn_exit_stand_in(partial: torch.Tensor, terminal: bool):
    """``ffn_exit.finish``: the MoE's sum deferred as an ``UnreducedOutput`` over
    ``post_experts_reduction_group()``, or completed now (``sum_output`` over the MoE output's
    group -> ``sum_post_experts_output``), as the last layer does: nothing after it fuses it."""
    from sglang.srt.layers.moe.utils import post_experts_reduction_group, sum_post_experts_output

    if not terminal and _moe_sum_deferred_stand_in(partial):
        return UnreducedOutputStandIn(partial, post_experts_reduction_group())
    return sum_post_experts_output(partial)


def _attn_input_stand_in(norm, hidden, residual: torch.Tensor, gate: Callable[[int], bool]):
    """``attn_boundary.prepare`` after a MoE layer: prepare.py ``_run_entry`` tries
    ``fused_attn_input`` on an un-reduced output, else completes it (``complete_owed``), then
    ``NormQuantReadout.update_and_read`` -> ``norm(hidden, residual, None)``."""
    from sglang.srt.layers.moe.utils import post_experts_reduction_group

    if isinstance(hidden, UnreducedOutputStandIn):
        # fused_attn_input: no post-residual addition here; the kernel reduces over the MoE group.
        if hidden.group is post_experts_reduction_group() and gate(hidden.partial.shape[0]):
            return norm.forward_with_allreduce_fusion(hidden.partial, residual, use_attn_tp_group=False)
        hidden = hidden.complete()
    return norm(hidden, residual, None)


def _final_norm_stand_in(norm, hidden: torch.Tensor, residual: torch.Tensor):
    """``residual_batch.final_norm``: the stream's (complete) output and residual ->
    ``access.final_norm_pair`` -> ``norm(hidden, residual)``."""
    return norm(hidden, residual)


def model_forward(norms: list, embedding: torch.Tensor, partials: list[torch.Tensor],
                   gate: Callable[[int], bool]) -> Outputs:
    """Stand-in for ``DeepseekV2Model.forward``'s layer loop over ``DeepseekV2DecoderLayer.forward``
    (boundary steps only): ``partials[2 l]`` is layer l's attention output (o_proj, un-reduced),
    ``partials[2 l + 1]`` its MoE output (un-reduced). Returns every boundary's (normed, residual),
    copied when made: SGLang's CUDA RMSNorm updates a residual in place at the next boundary."""
    outs = []

    def keep(pair) -> None:
        outs.append((pair[0].clone(), pair[1].clone()))

    normed, residual = _stack_entry_stand_in(norms[0], embedding)
    keep((normed, residual))
    hidden = None
    for layer in range(LAYERS):
        if layer > 0:
            normed, residual = _attn_input_stand_in(norms[2 * layer], hidden, residual, gate)
            keep((normed, residual))
        # (the attention runs on ``normed`` here; its stand-in output is partials[2 * layer])
        normed, residual = _ffn_input_stand_in(norms[2 * layer + 1], partials[2 * layer], residual, gate)
        keep((normed, residual))
        # (the MoE runs on ``normed`` here; its stand-in output is partials[2 * layer + 1])
        hidden = _ffn_exit_stand_in(partials[2 * layer + 1], terminal=layer == LAYERS - 1)
    keep(_final_norm_stand_in(norms[-1], hidden, residual))
    return outs
