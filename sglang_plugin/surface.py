"""The parts of SGLang the plugin relies on, with the signatures it expects.

Checked at registration (a moved hook target turns the plugin off with a clear log line instead
of silently serving nothing) and by tests/test_sglang_plugin_settings_and_surface.py (an SGLang
upgrade that moves any of them fails CI). Where a module cannot be imported on a machine
(SGLang's model layers need transformers/torchvision), the tests read the signature from SGLang's
installed source file instead, without importing it
(:func:`pcie_allreduce.plugin_surface.source_parameters`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from sglang_plugin import patching

SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.23",)

# ---- the two interfaces the plugin serves ----------------------------------------------------
#
# "0.5.23": SGLang 0.5.23's, checked against the installed package (EXPECTED below).
# "V2": the JIT custom all-reduce's, as SGLang's newer sources spell it
# (python/sglang/srt/distributed/device_communicators/custom_all_reduce_v2.py,
# CustomAllReduceV2; python/sglang/srt/layers/flashinfer_comm_fusion.py): ``ca_comm`` is asked
# ``custom_all_reduce(input, override_algo=None)`` and read for its per-direction message
# ceilings ``max_push_size`` / ``max_pull_size`` (0: that direction absent; the larger of the two
# is the largest message it takes), and the fused entry is called with ``use_attn_tp_group=``.
# Everything else the plugin hooks or serves is the same in both.
INTERFACES: tuple[str, ...] = ("0.5.23", "V2")

#: ``CustomAllReduceV2.custom_all_reduce``'s parameters in the V2 interface; the adapter takes
#: them (0.5.23's ``(self, input)`` is their prefix, so a 0.5.23 call binds the same).
V2_CUSTOM_ALL_REDUCE: tuple[str, ...] = ("self", "input", "override_algo")
#: The names of SGLang's ``AllReduceAlgo`` (sglang/jit_kernel/all_reduce.py, later
#: sglang/kernels/ops/communication/all_reduce.py) that callers pass as ``override_algo``.
V2_OVERRIDE_ALGOS: tuple[str, ...] = ("ONE_SHOT_PUSH", "TWO_SHOT_PUSH", "ONE_SHOT_PULL", "TWO_SHOT_PULL")
#: Attributes of ``CustomAllReduceV2`` that call sites read off any ``ca_comm``; the adapter has
#: each (SGLang 0.5.23's own V2 class assigns them too: tests/test_sglang_v2_interface.py).
V2_ATTRIBUTES: tuple[str, ...] = ("max_push_size", "max_pull_size", "max_size", "override_algo", "disabled")
#: The fused entry ``flashinfer_allreduce_residual_rmsnorm`` has the same parameters in both
#: interfaces; these defaults differ from 0.5.23's (the V2 one is a registered custom op whose
#: ``fp32_acc`` defaults to False). hooks.py has one hook per interface, checked against this.
FUSED_ENTRY_DEFAULTS: dict[str, dict[str, Any]] = {"0.5.23": {}, "V2": {"fp32_acc": False}}


@dataclasses.dataclass(frozen=True)
class Expectation:
    """An SGLang callable the plugin (or its tests) uses.

    Attributes:
        path: dotted path, e.g. ``pkg.module.Class.method``.
        params: parameter names in order (``self`` included for methods).
        why: what depends on it.
    """

    path: str
    params: tuple[str, ...]
    why: str


PS = "sglang.srt.distributed.parallel_state"
GC = PS + ".GroupCoordinator"
CA = "sglang.srt.distributed.device_communicators.custom_all_reduce.CustomAllreduce"

EXPECTED: tuple[Expectation, ...] = (
    Expectation(GC + ".__init__", ("self", "group_ranks", "local_rank", "torch_distributed_backend", "use_pynccl",
                                   "use_mscclpp", "use_custom_allreduce", "use_torch_symm_mem_all_reduce",
                                   "use_hpu_communicator", "use_xpu_communicator", "use_message_queue_broadcaster",
                                   "group_name", "gloo_timeout", "recovered_rank", "rank_offset", "max_world_size"),
                "builds ca_comm through dispatch_custom_allreduce(group=cpu_group, device=...)"),
    Expectation(GC + ".all_reduce", ("self", "input_"), "dispatches to ca_comm.should_custom_ar / outplace op"),
    Expectation(GC + "._resolve_outplace_all_reduce_method", ("self", "input_", "should_use_pymscclpp_allreduce"),
                "returns 'ca' when ca_comm.should_custom_ar(input_)"),
    Expectation(GC + "._all_reduce_out_place", ("self", "input_", "outplace_all_reduce_method"),
                "calls ca_comm.custom_all_reduce(input_)"),
    Expectation(GC + ".graph_capture", ("self", "graph_capture_context", "stream"),
                "enters ca_comm.capture() with the capture stream current"),
    Expectation(GC + ".fused_allreduce_rmsnorm", ("self", "input_", "residual_inp_", "weight_", "eps"),
                "probes hasattr(ca_comm, 'fused_allreduce_rmsnorm')"),
    Expectation(PS + ".outplace_all_reduce", ("tensor", "group_name", "outplace_all_reduce_method"),
                "custom op that runs ca_comm.custom_all_reduce"),
    Expectation(PS + ".inplace_all_reduce", ("tensor", "group_name"), "custom op for what ca_comm declines"),
    Expectation(CA + ".should_custom_ar", ("self", "inp"), "the ca_comm surface the adapter mirrors"),
    Expectation(CA + ".custom_all_reduce", ("self", "input"), "the ca_comm surface the adapter mirrors"),
    Expectation(CA + ".capture", ("self",), "the ca_comm surface the adapter mirrors"),
    Expectation(CA + ".close", ("self",), "the ca_comm surface the adapter mirrors"),
    Expectation("sglang.srt.distributed.device_communicators.custom_all_reduce_utils.is_full_nvlink",
                ("physical_device_ids", "world_size"), "mode=pcie asks SGLang's own NVLink check"),
    Expectation("sglang.srt.layers.flashinfer_comm_fusion.resolve_fusion_group", ("use_attn_tp_group",),
                "finds the group the fused op reduces over"),
    Expectation("sglang.srt.layers.dp_attention.is_dp_attention_enabled", (),
                "the fused gate stays closed under DP attention"),
    Expectation("sglang.srt.layers.layernorm._forward_with_allreduce_fusion",
                ("norm_module", "x", "residual", "post_residual_addition", "weight", "use_attn_tp_group"),
                "RMSNorm.forward_with_allreduce_fusion -> flashinfer_allreduce_residual_rmsnorm"),
    Expectation("sglang.srt.layers.layernorm.RMSNorm.forward_with_allreduce_fusion",
                ("self", "x", "residual", "post_residual_addition", "use_attn_tp_group"),
                "the fused call site of DeepSeek-V3 / Kimi-K2 layers"),
    Expectation("sglang.srt.plugins.load_plugins", (), "runs our entry point in every SGLang process"),
    Expectation("sglang.srt.plugins.hook_registry.HookRegistry.register",
                ("target", "hook", "hook_type", "source"), "registers our AROUND hooks (a classmethod)"),
)


def parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Parameter names of ``fn`` in order (follows ``__wrapped__`` like inspect does)."""
    return tuple(inspect.signature(fn).parameters)


def hook_parameters(hook: Callable[..., Any]) -> tuple[str, ...]:
    """A hook's parameters after its leading ``original``: the target's, as the hook expects them."""
    names = parameters(hook)
    assert names and names[0] == "original", f"{hook.__qualname__} must take `original` first"
    return names[1:]


def hook_problem(target: str, hook: Callable[..., Any]) -> str | None:
    """Why ``hook`` cannot wrap ``target`` in this SGLang (import failure or other parameters)."""
    try:
        _, _, current = patching.resolve(target)
    except Exception as exc:  # ImportError, AttributeError: the target moved or cannot load here
        return f"cannot resolve {target} ({type(exc).__name__}: {exc})"
    have, want = parameters(current), hook_parameters(hook)
    if have != want:
        return f"{target} has parameters {have}, the plugin was written for {want}"
    defaults = _defaults(current)
    if defaults != _defaults(hook, skip_first=True):
        return f"{target} has defaults {defaults}, the plugin was written for {_defaults(hook, skip_first=True)}"
    return None


def fitting_hook(target: str, hooks: tuple[Callable[..., Any], ...]) -> tuple[Callable[..., Any] | None, str | None]:
    """The first of ``hooks`` (one per interface, 0.5.23's first) that fits ``target`` in the
    installed SGLang, and None; or None and why the first does not fit."""
    first_problem = None
    for hook in hooks:
        problem = hook_problem(target, hook)
        if problem is None:
            return hook, None
        first_problem = first_problem or problem
    return None, first_problem


def _defaults(fn: Callable[..., Any], skip_first: bool = False) -> dict[str, Any]:
    params = list(inspect.signature(fn).parameters.values())[1 if skip_first else 0:]
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def resolve_parameters(path: str) -> tuple[str, ...]:
    """Parameters of the callable at ``path``, importing its module."""
    _, _, current = patching.resolve(path)
    return parameters(current)
