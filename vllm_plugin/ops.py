"""The fused all-reduce + residual add + RMSNorm as a registered torch op for vLLM graphs.

``torch.ops.pcie_allreduce_vllm.all_reduce_rmsnorm(x, residual, weight, eps, group_name)`` returns
``(rmsnorm(residual + all_reduce(x)) * weight, residual + all_reduce(x))`` as new tensors: what
vLLM's ``all_reduce`` followed by its IR op ``fused_add_rms_norm`` computes, in one kernel where the
group's ``ca_comm`` is our adapter and takes the shapes (``VllmAllReduceAdapter.can_fuse``: a pure
function of dtype and shape, so every rank takes the same branch, in graphs too). Otherwise it runs
the engine's own unfused pair: the group's all-reduce (what ``torch.ops.vllm.all_reduce`` runs),
then vLLM's ``fused_add_rms_norm`` kernel (:func:`engine_add_rms_norm`). Either way the new
residual is bitwise ``residual + all_reduce(x)`` rounded to the input's dtype. The op is
functional (no input is written) and has a fake implementation, so Dynamo and Inductor treat it
as one opaque call; :mod:`vllm_plugin.fusion` puts it in compiled graphs.
"""

from __future__ import annotations

import torch

OP_NAMESPACE = "pcie_allreduce_vllm"
OP_NAME = "all_reduce_rmsnorm"
_registered = False


def register() -> None:
    """Define the op once per process (idempotent)."""
    global _registered
    if _registered or hasattr(getattr(torch.ops, OP_NAMESPACE), OP_NAME):
        _registered = True
        return
    lib = torch.library.Library(OP_NAMESPACE, "FRAGMENT")  # noqa: TOR901 - kept alive below
    lib.define(f"{OP_NAME}(Tensor x, Tensor residual, Tensor weight, float eps, str group_name) -> (Tensor, Tensor)")
    lib.impl(OP_NAME, all_reduce_rmsnorm, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{OP_NAMESPACE}::{OP_NAME}", _fake, lib=lib)
    _LIBS.append(lib)
    _registered = True


_LIBS: list[torch.library.Library] = []


def all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's implementation (see the module docstring); ``group_name`` is the vLLM group's
    ``unique_name`` (``"tp:0"``), as vLLM's own ``torch.ops.vllm.all_reduce`` takes it."""
    from vllm_plugin.adapter import VllmAllReduceAdapter

    group = _group(group_name)
    ca_comm = getattr(group.device_communicator, "ca_comm", None)
    if isinstance(ca_comm, VllmAllReduceAdapter):
        fused = ca_comm.fused_allreduce_rmsnorm(x, residual, weight, eps)
        if fused is not None:
            return fused
    return engine_add_rms_norm(group._all_reduce_out_place(x), residual, weight, eps)


def engine_add_rms_norm(reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own ``fused_add_rms_norm`` (vllm/ir/ops/layernorm.py) on ``reduced``, functional:
    ``(normed, new_residual)``, no input written.

    Its CUDA kernel ``torch.ops._C.fused_add_rms_norm`` (the IR op's ``vllm_c`` implementation, run
    on copies as vLLM's functional overload does) where vLLM's kernels are built for this platform
    and take the arguments (no variance size, the weight in the input's dtype); else its reference
    implementation (``native``: what ``RMSNorm.forward_native`` computes; a CPU has no ``_C``). The
    choice is a pure function of the platform and the dtypes, the same on every rank.
    """
    from vllm import ir
    from vllm.platforms import current_platform

    current_platform.import_ir_kernels()  # registers vllm_c where vLLM's kernels exist
    op = ir.ops.fused_add_rms_norm
    kernel = op.impls.get("vllm_c")
    if (kernel is None or not kernel.supported or not hasattr(torch.ops._C, "fused_add_rms_norm")
            or not kernel.supports_args(reduced, residual, weight, eps)):
        kernel = op.impls["native"]
    return kernel.func_impl_fn(reduced, residual, weight, eps)


def _fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
          group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _group(group_name: str):  # -> vllm GroupCoordinator
    from vllm.distributed import parallel_state

    ref = parallel_state._groups.get(group_name)
    group = ref() if ref is not None else None
    if group is None:
        raise ValueError(f"pcie_allreduce vllm plugin: no live vLLM group named {group_name!r}")
    return group
