"""Helpers for the SGLang plugin's tests (CPU conformance and the multi-rank GPU test); not part of the plugin."""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import Any

from sglang_plugin.plugin import ENTRY_POINT, ENTRY_POINT_GROUP, PLUGIN_NAME
from tests import _standins

SKIP_NO_SGLANG = "sglang is not importable here (docs/guide.md's '# sglang.' line installs what these tests need)"


def sglang_skip_reason() -> str | None:
    """Why the SGLang-dependent tests cannot run here, or None."""
    try:
        import sglang.srt.distributed.parallel_state  # noqa: F401
        import sglang.srt.plugins  # noqa: F401
    except Exception as exc:  # ImportError, or a dependency failing at import
        return f"{SKIP_NO_SGLANG}: {type(exc).__name__}: {exc}"
    return None


def entry_point_installed() -> bool:
    """Whether the installed package metadata declares our entry point."""
    return any(ep.name == PLUGIN_NAME and ep.value == ENTRY_POINT for ep in entry_points(group=ENTRY_POINT_GROUP))


def ensure_entry_point() -> str | None:
    """Make ``load_plugins()`` find the plugin in this process, installed or not (tests/_standins.py)."""
    return _standins.ensure_entry_point(ENTRY_POINT_GROUP, PLUGIN_NAME, ENTRY_POINT, "sglang_plugin")


def plugin_tp_coordinator(ctx: Any, *, served: bool = True) -> Any:
    """In a GPU rank: the plugin loaded as SGLang loads it (``load_plugins()`` finds the entry
    point), then SGLang's real ``tp`` GroupCoordinator with NCCL off (NCCL refuses ranks that
    share a GPU; the device group is gloo, which also serves what the plugin declines). With
    ``served``, checks that our adapter is its ``ca_comm`` and that the fused op is hooked."""
    ensure_entry_point()
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang.srt.plugins import load_plugins

    from sglang_plugin.adapter import PcieAllReduceAdapter
    from sglang_plugin.registry import REGISTRY

    load_plugins()
    assert REGISTRY.state is not None, "load_plugins() did not load the plugin"
    tp = GroupCoordinator(group_ranks=[list(range(ctx.world_size))], local_rank=ctx.device.index,
                          torch_distributed_backend="gloo", use_pynccl=False, use_mscclpp=False,
                          use_custom_allreduce=True, use_torch_symm_mem_all_reduce=False,
                          use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
    if served:
        adapter = tp.ca_comm
        assert isinstance(adapter, PcieAllReduceAdapter) and not adapter.disabled, f"ca_comm is {adapter!r}"
        assert hasattr(flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm, "__wrapped__"), \
            "fused op not hooked"
    return tp


def serving_env(max_bytes: int) -> dict[str, str]:
    """The ranks' environment for the SGLang GPU tests that serve: the plugin on, mode=always (on
    NVLinked GPUs the default mode leaves the group to SGLang; these tests are about serving,
    wherever they run), this checkout importable in every rank."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"PCIE_AR_SGLANG_ENABLE": "1", "PCIE_AR_SGLANG_MAX_BYTES": str(max_bytes), "PCIE_AR_SGLANG_MODE": "always",
            "PCIE_AR_SGLANG_TIMEOUT_S": "30", "SGLANG_PLUGINS": "pcie_allreduce",
            "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}


def fake_model_runner_module() -> Any:
    """A stand-in for ``sglang.srt.model_executor.model_runner`` (whose real import needs SGLang's
    GPU dependencies): ``ModelRunner.forward`` with SGLang 0.5.23's signature (the conformance
    tests check the real one), returning ``("ran", forward_batch, split_forward_count)``."""
    import importlib.machinery
    import types

    from sglang_plugin import hooks

    name = hooks.FORWARD_STEP.rsplit(".", 2)[0]
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    class ModelRunner:
        def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None,
                    reinit_attn_backend=False, split_forward_count=1):
            return ("ran", forward_batch, split_forward_count)

    module.ModelRunner = ModelRunner
    return module
