"""The AROUND hooks the plugin puts on SGLang functions, and the table of their targets.

Each hook is ``hook(original, <SGLang's own parameters>)``; the parameter names after
``original`` repeat SGLang's (tests/test_sglang_plugin_settings_and_surface.py checks them with
inspect.signature, so an SGLang upgrade that changes one fails loudly instead of silently serving
nothing).

- ``dispatch_custom_allreduce``: ``GroupCoordinator.__init__`` asks it which class to build as
  ``ca_comm``; for the ``tp`` group we hand back a factory that decides collectively and builds
  :class:`~sglang_plugin.adapter.PcieAllReduceAdapter`, or SGLang's own class when declining.
- ``flashinfer_ar_fusion_applies``: the layer-boundary gate for the fused all-reduce + residual
  + RMSNorm. SGLang opens it only on SM90/SM100 with FlashInfer; we also open it where our
  adapter serves (a pure function of the batch size, the same on all ranks).
- ``flashinfer_allreduce_residual_rmsnorm``: the fused op behind
  ``RMSNorm.forward_with_allreduce_fusion``; SGLang's FlashInfer kernel when configured, else
  ``Communicator.all_reduce_rmsnorm`` on the group its ``use_attn_tp_group=`` names, where that
  is the group our adapter serves; ``(None, None)`` makes SGLang run its unfused fallback. One
  hook per interface (surface.INTERFACES): the V2 entry's ``fp32_acc`` defaults differently.
- ``model_runner_forward``: every forward step first raises a failure an earlier step recorded
  (a collective in a replayed CUDA graph that timed out left NaN and an error record; without
  this a server whose every collective runs in graphs would go on decoding from NaN). A host
  read of pinned memory per workspace, no CUDA call. Attached lazily: its module loads SGLang's
  model code, which the plugin never imports itself.
- ``group_coordinator_destroy``: SGLang's group teardown drops its ``ca_comm`` only after it
  destroyed the group's process groups, and never closes it; this closes our adapter first, while
  its group can still meet, so the workspaces are freed (collectively, bounded) on every teardown.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from pcie_allreduce import plugin_logline
from pcie_allreduce.plugin_adapter import check_serving, close_before_teardown
from sglang_plugin import eligibility
from sglang_plugin.adapter import PcieAllReduceAdapter, hierarchical_factory
from sglang_plugin.registry import REGISTRY
from sglang_plugin.settings import FUSED, MAX_BYTES

logger = logging.getLogger("sglang_plugin")

DISPATCH = "sglang.srt.distributed.device_communicators.custom_all_reduce.dispatch_custom_allreduce"
FUSION_GATE = "sglang.srt.layers.layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies"
FUSED_OP = "sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm"
FORWARD_STEP = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
GROUP_DESTROY = "sglang.srt.distributed.parallel_state.GroupCoordinator.destroy"
MAX_FUSED_BATCH = 2048  # add_norm.FUSE_ALLREDUCE_MAX_BATCH_SIZE in 0.5.23 (checked by the tests)


def dispatch_custom_allreduce(original: Callable[..., Any], group: Any, device: Any) -> Any:
    """AROUND ``dispatch_custom_allreduce(group, device)``: our factory for the served groups."""
    state = REGISTRY.state
    if state is None or eligibility.group_name(group) not in eligibility.SERVED_GROUPS:
        return original(group=group, device=device)
    return _AdapterFactory(original)


class _AdapterFactory:
    """What ``dispatch_custom_allreduce`` returns for a served group: SGLang calls it as
    ``CAClass(group=cpu_group, device=device)``. The decision is collective, so every rank ends
    up with our adapter or every rank with SGLang's own communicator."""

    def __init__(self, original_dispatch: Callable[..., Any]) -> None:
        self._original_dispatch = original_dispatch

    def __call__(self, group: Any, device: Any) -> Any:
        state = REGISTRY.state
        assert state is not None, "sglang_plugin hook ran after unregister()"
        device = torch.device(device) if not isinstance(device, torch.device) else device
        facts_fn = state.facts_fn or eligibility.local_facts
        decision = eligibility.decide(group, device, state.settings, facts_fn=facts_fn)
        name = eligibility.group_name(group)
        if not decision.serve:
            logger.info(plugin_logline.declined(plugin_logline.where("sglang", group, device, name or "?"),
                                                "SGLang", decision.reason))
            sglang_class = self._original_dispatch(group=group, device=device)
            return sglang_class(group=group, device=device)
        try:
            factory = state.communicator_factory
            if decision.layout is not None and factory is None:  # a group across nodes
                factory = hierarchical_factory(decision.layout)
            adapter = PcieAllReduceAdapter(group, device, state.settings, communicator_factory=factory)
        except Exception as exc:
            # SGLang catches this, warns and leaves ca_comm None (NCCL serves); say why first.
            logger.error("pcie_allreduce[sglang] %s: could not create the communicator (%s: %s); "
                         "SGLang's other backends serve this group", name, type(exc).__name__, exc)
            raise
        state.adapters.add(adapter)
        logger.info(serving_line(adapter, name, decision))
        return adapter


def serving_line(adapter: PcieAllReduceAdapter, name: str, decision: eligibility.Decision) -> str:
    """The INFO line of a rank whose group the plugin serves (:func:`pcie_allreduce.plugin_logline.serving`)."""
    fused = ("fused all-reduce+residual+RMSNorm -> pcie_allreduce where SGLang's FlashInfer fusion is off "
             "(it runs only on SM90/SM100)" if adapter.fused_enabled else f"fused path off ({FUSED}=0)")
    return plugin_logline.serving(plugin_logline.where("sglang", adapter.group, adapter.device, name or "?"), adapter,
                                  decision.reason, engine_name="SGLang", max_bytes_variable=MAX_BYTES, fused=fused)


def flashinfer_ar_fusion_applies(original: Callable[..., Any], batch_size: int) -> bool:
    """AROUND the fused-path gate: SGLang's answer, or ours where our adapter serves."""
    if original(batch_size):
        return True
    return _our_fusion_open(batch_size)


def flashinfer_allreduce_residual_rmsnorm(
    original: Callable[..., Any],
    input_tensor: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    max_token_num: int = 2048,
    use_oneshot: bool | None = None,
    trigger_completion_at_end: bool = False,
    fp32_acc: bool = True,
    use_attn_tp_group: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """AROUND the fused op (SGLang 0.5.23's defaults): SGLang's FlashInfer kernel where
    configured, else ours on the group ``use_attn_tp_group`` names, else ``(None, None)`` (SGLang
    then all-reduces and norms unfused, with the same result)."""
    return _fused_op(original, input_tensor, residual, weight, eps, max_token_num, use_oneshot,
                     trigger_completion_at_end, fp32_acc, use_attn_tp_group)


def flashinfer_allreduce_residual_rmsnorm_v2(
    original: Callable[..., Any],
    input_tensor: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    max_token_num: int = 2048,
    use_oneshot: bool | None = None,
    trigger_completion_at_end: bool = False,
    fp32_acc: bool = False,
    use_attn_tp_group: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The same hook for the V2 interface, whose fused entry defaults ``fp32_acc`` to False
    (surface.FUSED_ENTRY_DEFAULTS): a call that leaves it out reaches SGLang's kernel as SGLang
    would have run it."""
    return _fused_op(original, input_tensor, residual, weight, eps, max_token_num, use_oneshot,
                     trigger_completion_at_end, fp32_acc, use_attn_tp_group)


def _fused_op(original: Callable[..., Any], input_tensor: torch.Tensor, residual: torch.Tensor,
              weight: torch.Tensor, eps: float, max_token_num: int, use_oneshot: bool | None,
              trigger_completion_at_end: bool, fp32_acc: bool,
              use_attn_tp_group: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if _sglang_fusion_configured():
        result = original(input_tensor, residual, weight, eps, max_token_num, use_oneshot,
                          trigger_completion_at_end, fp32_acc, use_attn_tp_group)
        if result[0] is not None:
            return result
    adapter = _adapter_of_fusion_group(use_attn_tp_group)
    if adapter is None:
        return None, None
    fused = adapter.fused_allreduce_rmsnorm(input_tensor, residual, weight, eps)
    return (None, None) if fused is None else fused


def model_runner_forward(
    original: Callable[..., Any],
    self: Any,
    forward_batch: Any,
    skip_attn_backend_init: bool | None = None,
    pp_proxy_tensors: Any = None,
    reinit_attn_backend: bool = False,
    split_forward_count: int = 1,
) -> Any:
    """AROUND ``ModelRunner.forward``: raise what an earlier step's collectives recorded, then run
    the step. The failure surfaces as CollectiveTimeout / CollectiveMismatch in the scheduler,
    which ends the server's model process instead of serving tokens sampled from NaN."""
    check_serving_adapters()
    return original(self, forward_batch, skip_attn_backend_init, pp_proxy_tensors, reinit_attn_backend,
                    split_forward_count)


def check_serving_adapters() -> None:
    """``Communicator.check()`` on every adapter serving in this process (no CUDA call)."""
    state = REGISTRY.state
    if state is not None:
        check_serving(state.adapters)


def group_coordinator_destroy(original: Callable[..., Any], self: Any) -> None:
    """AROUND ``GroupCoordinator.destroy``: close our ``ca_comm`` (collective over the group's CPU
    group, which SGLang destroys next), then SGLang's teardown."""
    close_before_teardown(getattr(self, "ca_comm", None), logger,
                          f"pcie_allreduce[sglang] group {getattr(self, 'unique_name', '?')}")
    return original(self)


@dataclasses.dataclass(frozen=True)
class HookTarget:
    """One SGLang function the plugin wraps.

    Attributes:
        target: dotted path (HookRegistry's format).
        hook: the AROUND hook.
        fused: belongs to the fused path (skipped when ``PCIE_AR_SGLANG_FUSED=0``).
        lazy: attached by the plugin itself once its module has been imported (now, if it
            already is; else by the import hook's finder), never by importing it: its module
            loads SGLang's model code. Optional: where it does not fit, a warning says what is
            lost and serving goes on.
        owner_depth: how many trailing components of ``target`` are attributes rather than the
            module (1 for a module function, 2 for a class's method).
        variants: the hooks for the target's signature in SGLang's other interfaces.
    """

    target: str
    hook: Callable[..., Any]
    fused: bool
    lazy: bool = False
    owner_depth: int = 1
    variants: tuple[Callable[..., Any], ...] = ()

    @property
    def hooks(self) -> tuple[Callable[..., Any], ...]:
        """``hook`` (SGLang 0.5.23's signature), then the hooks for the other interfaces'
        signatures of the same target (surface.INTERFACES); registration takes the one that fits."""
        return (self.hook, *self.variants)

    @property
    def module(self) -> str:
        """The dotted name of the module that defines the target."""
        return self.target.rsplit(".", self.owner_depth)[0]


TARGETS: tuple[HookTarget, ...] = (
    HookTarget(DISPATCH, dispatch_custom_allreduce, fused=False),
    HookTarget(FUSION_GATE, flashinfer_ar_fusion_applies, fused=True),
    HookTarget(FUSED_OP, flashinfer_allreduce_residual_rmsnorm, fused=True,
               variants=(flashinfer_allreduce_residual_rmsnorm_v2,)),
    HookTarget(FORWARD_STEP, model_runner_forward, fused=False, lazy=True, owner_depth=2),
    HookTarget(GROUP_DESTROY, group_coordinator_destroy, fused=False, owner_depth=2),
)


# ---- helpers (cheap: they run once per layer boundary) ------------------------------------


def _our_fusion_open(batch_size: int) -> bool:
    state = REGISTRY.state
    if state is None or not state.settings.fused or not REGISTRY.serving():
        return False
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled

    if is_dp_attention_enabled():  # attention TP is then a subgroup we do not serve
        return False
    # Size checks last: under Dynamo they guard on the symbolic token count.
    return 0 < batch_size <= MAX_FUSED_BATCH


def _sglang_fusion_configured() -> bool:
    """Whether SGLang's own FlashInfer fusion is on (``--flashinfer-allreduce-fusion-backend``;
    SGLang only allows it on SM90/SM100)."""
    try:
        from sglang.srt.runtime_context import get_exec

        return get_exec().comm.flashinfer_allreduce_fusion_backend is not None
    except (AttributeError, RuntimeError, ValueError):  # no server config published (tests)
        return False


def _adapter_of_fusion_group(use_attn_tp_group: bool) -> PcieAllReduceAdapter | None:
    """Our adapter on the group SGLang's fused kernel would reduce over, if it serves that group;
    None (SGLang's own path) otherwise, and wherever the group cannot be found, never raising
    inside a forward.

    ``use_attn_tp_group=True`` names the attention-TP group (``get_parallel().attn_tp_group``,
    what SGLang's ``resolve_fusion_group(use_attn_tp_group=True)`` returns, read without
    importing the MoE package that function pulls in for its other case): ours only when it is
    the ``tp`` group our communicator serves (not under DP attention, whose attention-TP group is
    a subgroup). False names the post-experts reduction group SGLang's
    ``resolve_fusion_group(use_attn_tp_group=False)`` returns: ours only when that is the ``tp``
    group; an SGLang without that function declines.
    """
    try:
        if use_attn_tp_group:
            from sglang.srt.runtime_context import get_parallel

            coordinator = get_parallel().attn_tp_group
        else:
            from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

            _, _, coordinator = resolve_fusion_group(use_attn_tp_group=False)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        _log_unresolved(use_attn_tp_group, exc)
        return None
    comm = getattr(coordinator, "ca_comm", None)
    if isinstance(comm, PcieAllReduceAdapter) and not comm.disabled:
        return comm
    return None


_UNRESOLVED_LOGGED: set[bool] = set()


def _log_unresolved(use_attn_tp_group: bool, exc: Exception) -> None:
    """One warning per group kind: the fused calls on it stay on SGLang's unfused path."""
    if use_attn_tp_group in _UNRESOLVED_LOGGED:
        return
    _UNRESOLVED_LOGGED.add(use_attn_tp_group)
    logger.warning("pcie_allreduce[sglang]: cannot find the group of fused calls with use_attn_tp_group=%s "
                   "(%s: %s); they stay on SGLang's unfused path", use_attn_tp_group, type(exc).__name__, exc)
