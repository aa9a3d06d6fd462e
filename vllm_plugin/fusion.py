"""The compile pass: vLLM's ``all_reduce`` followed by ``fused_add_rms_norm`` -> our fused op.

vLLM (0.34.0) takes a third-party post-grad pass without a fork: ``CompilationConfig.inductor_passes``
maps Inductor's ``post_grad_custom_post_pass`` hook to a qualified name, and
``VllmBackend.configure_post_pass`` (vllm/compilation/backends.py) appends that pass to its
``PostGradPassManager`` (vllm/compilation/passes/pass_manager.py), after vLLM's own fusions and
before it lowers its IR ops. So this pass sees what vLLM's ``AllReduceFusionPass`` (FlashInfer,
NVLink SM90/SM100 only) left unfused, in the IR form vLLM's own patterns match:

    r = torch.ops.vllm.all_reduce.default(x, group_name)       # used only by the norm
    out, residual2 = torch.ops.vllm_ir.fused_add_rms_norm.default(r, residual, weight, eps)

and replaces each such pair (``variance_size`` unset, a weight given, the tp group) with one call
of ``torch.ops.pcie_allreduce_vllm.all_reduce_rmsnorm`` (:mod:`vllm_plugin.ops`), which fuses at
run time where our adapter serves and the shapes fit, and runs the same unfused pair otherwise.
It rewrites nothing unless the plugin is on with ``PCIE_AR_VLLM_FUSED=1`` and serves this
process's tp group. Switch it on with::

    --compilation-config '{"inductor_passes": {"post_grad_custom_post_pass": "vllm_plugin.fuse_allreduce_rmsnorm"}}'

vLLM caches compiled graphs on disk under a key that includes each pass's ``uuid()``
(``CompilationConfig.compile_factors`` and ``PostGradPassManager.uuid``). The pass is therefore an
``InductorPass`` whose uuid covers what its output depends on besides the graph: this module's and
the op's code, and the state it reads (plugin on, fused on, the tp group served). A graph compiled
with the rewrite is never reused where the fused op would not be registered, nor the other way round.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import get_hash_for_files
from vllm.compilation.passes.inductor_pass import InductorPass

logger = logging.getLogger("vllm_plugin")


class FuseAllReduceRMSNorm(InductorPass):
    """The post-grad pass vLLM runs (``vllm_plugin.fuse_allreduce_rmsnorm`` is its instance):
    :func:`rewrite` on the graph, under a cache key that changes with what the rewrite would do."""

    def __call__(self, graph: fx.Graph) -> None:
        rewrite(graph)

    def uuid(self) -> str:
        return InductorPass.hash_dict(cache_key_inputs())


def cache_key_inputs() -> dict[str, Any]:
    """What the rewrite's output depends on besides the graph: the code of this module and of the
    op it emits (its schema), and the state :func:`served_tp_group` reads."""
    from vllm_plugin import ops, plugin

    state = plugin.STATE
    return {"code": get_hash_for_files((__file__, ops.__file__)).hex(),
            "plugin_on": state is not None,
            "fused": state is not None and state.settings.fused,
            "served_tp_group": served_tp_group()}


def rewrite(graph: fx.Graph, group_name: str | None = None) -> int:
    """Rewrite every ``all_reduce`` -> ``fused_add_rms_norm`` pair on the tp group; returns how many.

    Args:
        graph: a post-grad FX graph (vLLM's pass manager hands it over).
        group_name: the group whose all-reduces are rewritten; by default this process's tp group
            when the plugin serves it (else nothing is rewritten).
    """
    if group_name is None:
        group_name = served_tp_group()
        if group_name is None:
            return 0
    import vllm.ir.ops  # noqa: F401 - registers torch.ops.vllm_ir (loaded already wherever vLLM compiles)

    from vllm_plugin import ops

    ops.register()
    all_reduce = torch.ops.vllm.all_reduce.default
    norm = torch.ops.vllm_ir.fused_add_rms_norm.default
    fused = getattr(torch.ops, ops.OP_NAMESPACE).all_reduce_rmsnorm.default
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not norm:
            continue
        args = _arguments(norm, node)
        reduced = args.get("x")
        if args.get("variance_size") is not None or not isinstance(args.get("weight"), fx.Node):
            continue
        if not isinstance(reduced, fx.Node) or reduced.target is not all_reduce or len(reduced.users) != 1:
            continue
        ar_args = _arguments(all_reduce, reduced)
        if ar_args.get("group_name") != group_name:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(fused, (ar_args["tensor"], args["x_residual"], args["weight"],
                                              float(args["epsilon"]), group_name))
        new.meta.update(node.meta)
        # The tracer's record of the norm's eager arguments, by the norm's schema: Inductor would
        # normalize it against ours and fail. Without it Inductor constrains no layout, as for any
        # op a custom pass inserts.
        new.meta.pop("eager_input_vals", None)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        graph.erase_node(reduced)
        count += 1
    if count:
        logger.debug("pcie_allreduce[vllm]: fused %d all-reduce + residual + RMSNorm pairs", count)
    return count


def served_tp_group() -> str | None:
    """The tp group's name when our adapter serves it with the fused path on, else None."""
    from vllm_plugin import plugin
    from vllm_plugin.adapter import VllmAllReduceAdapter

    if plugin.STATE is None or not plugin.STATE.settings.fused:
        return None
    try:
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
    except Exception:  # no model-parallel groups in this process
        return None
    ca_comm = getattr(tp.device_communicator, "ca_comm", None)
    if isinstance(ca_comm, VllmAllReduceAdapter) and not ca_comm.disabled:
        return tp.unique_name
    return None


def _arguments(target: Any, node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (positional and keyword alike)."""
    schema = target._schema
    named = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    for arg, value in zip(schema.arguments, node.args):
        named[arg.name] = value
    named.update(node.kwargs)
    return named


fuse_allreduce_rmsnorm = FuseAllReduceRMSNorm()
"""The instance vLLM's ``CompilationConfig`` resolves by name (re-exported by the package)."""
