"""The parts of vLLM the plugin relies on, with the signatures it expects: the one place that
names vLLM's version surface.

tests/test_vllm_plugin.py checks each against the installed vLLM (imported, or read from its
source with ``ast`` where a module needs vLLM's compiled kernels), so a vLLM upgrade that moves
one fails the conformance tests instead of silently serving nothing.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from typing import Any

from pcie_allreduce.plugin_surface import source_parameters

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.34.0",)

DC = "vllm.distributed.device_communicators"
CA = DC + ".custom_all_reduce.CustomAllreduce"
CC = DC + ".cuda_communicator.CudaCommunicator"
PS = "vllm.distributed.parallel_state"


@dataclasses.dataclass(frozen=True)
class Expectation:
    """A vLLM callable the plugin (or its tests) uses: dotted path, parameter names in order
    (``self`` included for methods), and what depends on it."""

    path: str
    params: tuple[str, ...]
    why: str


EXPECTED: tuple[Expectation, ...] = (
    Expectation("vllm.plugins.load_general_plugins", (), "runs our entry point in every vLLM process"),
    Expectation(CC + ".__init__", ("self", "cpu_group", "device", "device_group", "unique_name", "global_ranks",
                                   "global_world_size", "tcp_store_group", "use_all2all"),
                "imports CustomAllreduce lazily and builds ca_comm for the tp group"),
    Expectation(CC + ".all_reduce", ("self", "input_"), "ca_comm.should_custom_ar, then ca_comm.custom_all_reduce"),
    Expectation(CC + ".custom_all_gather", ("self", "input_"), "asks ca_comm.custom_all_gather"),
    Expectation(CC + ".custom_reduce_scatter", ("self", "input_"), "asks ca_comm.custom_reduce_scatter"),
    Expectation(CA + ".__init__", ("self", "group", "device", "max_size", "max_all_gather_size",
                                   "max_mnnvl_all_gather_size", "max_reduce_scatter_size",
                                   "max_mnnvl_reduce_scatter_size", "max_mnnvl_multimem_reduce_scatter_size",
                                   "symm_mem_enabled", "register_graph_buffers"),
                "the class the plugin subclasses; CudaCommunicator passes group=, device=, symm_mem_enabled=, "
                "register_graph_buffers="),
    Expectation(CA + ".should_custom_ar", ("self", "inp"), "the ca_comm interface the adapter answers"),
    Expectation(CA + ".custom_all_reduce", ("self", "input"), "the ca_comm interface the adapter answers"),
    Expectation(CA + ".capture", ("self",), "the ca_comm interface the adapter answers"),
    Expectation(CA + ".close", ("self",), "the ca_comm interface the adapter answers"),
    Expectation(CA + ".should_custom_all_gather", ("self", "inp"), "answered no"),
    Expectation(CA + ".custom_all_gather", ("self", "inp"), "answered None"),
    Expectation(CA + ".should_custom_reduce_scatter", ("self", "inp"), "answered no"),
    Expectation(CA + ".custom_reduce_scatter", ("self", "inp"), "answered None"),
    Expectation(PS + ".GroupCoordinator.graph_capture", ("self", "graph_capture_context"),
                "enters ca_comm.capture() with the capture stream current"),
    Expectation(PS + ".GroupCoordinator._all_reduce_out_place", ("self", "input_"),
                "the fused op's unfused fallback"),
    Expectation(PS + ".all_reduce", ("tensor", "group_name"), "torch.ops.vllm.all_reduce, which the pass matches"),
    Expectation("torch.ops.vllm_ir.fused_add_rms_norm.default",
                ("x", "x_residual", "weight", "epsilon", "variance_size"),
                "torch.ops.vllm_ir.fused_add_rms_norm, which the pass matches"),
    Expectation("vllm.kernels.vllm_c.fused_add_rms_norm", ("x", "x_residual", "weight", "epsilon", "variance_size"),
                "vLLM's CUDA norm kernel (its IR op's vllm_c implementation): the fused op's fallback"),
    Expectation("vllm.ir.op.IrOpImpl.supports_args", ("self", "args", "kwargs"),
                "whether vLLM's kernel takes the fallback's arguments"),
    Expectation("vllm.ir.op.IrOpImpl.func_impl_fn", ("self", "args", "kwargs"),
                "runs vLLM's in-place kernel on copies in the fused op's fallback"),
    Expectation("vllm.compilation.passes.pass_manager.PostGradPassManager.add", ("self", "pass_"),
                "appends the inductor_passes post-grad pass after vLLM's own"),
    Expectation("vllm.compilation.backends.VllmBackend.configure_post_pass", ("self",),
                "adds CompilationConfig.inductor_passes['post_grad_custom_post_pass'] to the pass manager"),
    Expectation("vllm.compilation.passes.inductor_pass.InductorPass.uuid", ("self",),
                "the pass's cache key, folded into CompilationConfig.compile_factors and PostGradPassManager.uuid"),
    Expectation("vllm.compilation.passes.inductor_pass.InductorPass.hash_dict", ("dict_",),
                "hashes what the pass's output depends on into its uuid"),
    Expectation("vllm.compilation.caching.compute_env_and_config_hashes", ("vllm_config",),
                "vLLM's compile cache key (AOT and JIT), which the tests check follows the pass's settings and code"),
)


def resolve(path: str) -> Any:
    """The object at dotted ``path`` (imports the longest module prefix)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj: Any = importlib.import_module(name)
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module in {path!r}", name=parts[0])


def parameters(path: str) -> tuple[str, ...]:
    """Parameter names of the callable at ``path``: imported where its module imports here, else read
    from vLLM's installed source (vLLM IR ops are read from their wrapped function)."""
    if path.startswith("torch.ops."):  # a registered op: its schema (vllm.ir.ops registers vllm_ir's)
        importlib.import_module("vllm.ir.ops")
        import torch

        op = torch.ops
        for attr in path.split(".")[2:]:
            op = getattr(op, attr)
        return tuple(a.name for a in op._schema.arguments)
    try:
        obj = resolve(path)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "vllm":
            raise
        return source_parameters(path)
    try:
        return tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return source_parameters(path)
