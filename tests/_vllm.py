"""Helpers for the vLLM plugin's tests (CPU conformance and the multi-rank GPU test); not part of the plugin."""

from __future__ import annotations

import os
from typing import Any

import torch

from pcie_allreduce.plugin_eligibility import RankFacts
from vllm_plugin.plugin import ENTRY_POINT, ENTRY_POINT_GROUP, PLUGIN_NAME
from tests import _standins

SKIP_NO_VLLM = "vllm is not importable here (docs/guide.md's '# vllm.' line installs what these tests need)"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vllm_skip_reason() -> str | None:
    """Why the vLLM-dependent tests cannot run here, or None."""
    try:
        import vllm.distributed.device_communicators.cuda_communicator  # noqa: F401
        import vllm.plugins  # noqa: F401
    except Exception as exc:  # ImportError, or a dependency failing at import
        return f"{SKIP_NO_VLLM}: {type(exc).__name__}: {exc}"
    return None


def ensure_entry_point() -> str | None:
    """Make ``load_general_plugins()`` find the plugin in this process, installed or not (tests/_standins.py)."""
    return _standins.ensure_entry_point(ENTRY_POINT_GROUP, PLUGIN_NAME, ENTRY_POINT, "vllm_plugin")


def plugin_env(**extra: str) -> dict[str, str]:
    """The ranks' environment: the plugin on and allow-listed, this checkout importable, and vLLM's
    NCCL and torch symmetric memory communicators off, so that ``tp_group`` builds a communicator
    of gloo and ours alone. NCCL refuses ranks that share a GPU, and with a CUDA build of torch on
    a machine without a GPU it fails its own start ("unhandled cuda error"), where a CPU build of
    torch has no NCCL for vLLM to find."""
    return {"PCIE_AR_VLLM_ENABLE": "1", "VLLM_PLUGINS": PLUGIN_NAME, "VLLM_DISABLE_PYNCCL": "1",
            "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
            "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **extra}


def tp_group(ctx: Any, device: torch.device) -> Any:
    """vLLM's real ``GroupCoordinator`` named ``tp`` over the ranks, with NCCL off (gloo device
    group; ``plugin_env`` turns vLLM's own NCCL communicator off), its device communicator vLLM's real
    ``CudaCommunicator`` (the one vLLM builds on CUDA platforms), registered as vLLM's tp group.
    The plugin must have been loaded (``load_general_plugins()``) first."""
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    local_rank = device.index if device.type == "cuda" else ctx.rank
    tp = parallel_state.GroupCoordinator(group_ranks=[list(range(ctx.world_size))], local_rank=local_rank,
                                         torch_distributed_backend="gloo", use_device_communicator=False,
                                         group_name="tp")
    tp.device = device
    tp.device_communicator = CudaCommunicator(cpu_group=tp.cpu_group, device=device, device_group=tp.device_group,
                                              unique_name=tp.unique_name)
    parallel_state._TP = tp
    return tp




def cpu_facts(unavailable_on: int | None = None):
    """The per-rank GPU facts the plugin's eligibility reads, for gloo ranks on a CPU (one GPU per
    rank, SM120, one host); rank ``unavailable_on`` cannot run the kernels."""
    def facts(device) -> RankFacts:
        rank = torch.distributed.get_rank()
        return RankFacts(host="testhost", unavailable="no GPU (test)" if rank == unavailable_on else None,
                         physical_gpu=rank, sm="SM120")
    return facts
