"""The vLLM plugin's compile pass on the post-grad graph vLLM's compiler hands it (pinned 0.34.0).

tests/test_vllm_plugin.py runs the pass on a graph traced by hand. Here the graph is the one
``torch.compile`` builds from vLLM's own code and hands vLLM's ``PostGradPassManager``, built the way
vLLM's fusion-pass tests build theirs (a ``TestBackend`` around Inductor, a model of all-reduces and
RMSNorms without attention): Dynamo traces several layers, each a row-parallel linear (the input split
along its last dimension as vLLM's ``RowParallelLinear`` splits it, then this rank's weight shard),
vLLM's ``tensor_model_parallel_all_reduce`` and vLLM's ``RMSNorm`` in its residual form, with the
token count dynamic as vLLM compiles it; vLLM's pre-grad pass turns the norm's ``maybe_inplace``
overload into the functional one; AOTAutograd produces the functional post-grad graph (views, symbolic
sizes, tuple outputs); vLLM's pass manager, configured from a ``VllmConfig`` that names our pass as
vLLM's users do, runs vLLM's passes, ours where ``VllmBackend.configure_post_pass`` puts it, then
vLLM's IR lowering and fix-functionalization; Inductor compiles the rest. Two gloo ranks (at world
size 1 vLLM leaves the all-reduce out of the graph) with vLLM's real tp ``GroupCoordinator`` and
``CudaCommunicator``, our adapter on the stand-in communicator of tests/_standins.py.

Two substitutions make this run on a CPU:

- the tp group records ``torch.ops.vllm.all_reduce`` in the graph (``use_custom_op_call``), as it does
  on CUDA platforms (``Platform.use_custom_op_collectives``); vLLM's platform here is unspecified,
  and its group would call the communicator directly instead;
- ``torch.ops._C.rotary_embedding`` is defined, schema only (vLLM's csrc/torch_bindings.cpp), where
  vLLM's native library is absent, as in a CPU install: vLLM's ``FixFunctionalizationPass`` looks
  it up in every graph. Nothing calls it here.

Checked: the pass rewrites every all-reduce -> residual RMSNorm pair of that graph (its count, none
left); at a token count the adapter declines (above PCIE_AR_VLLM_MAX_BYTES, so the fused op runs
vLLM's own pair inside) the compiled model's output is bitwise the eager model's; at a count the
adapter serves, the compiled model makes one fused call per layer and no other all-reduce, and
agrees with the eager model to bf16 rounding (the stand-in's norm is not vLLM's). The eager
model is the bitwise reference, not the model compiled without the pass: Inductor generates its own
code for vLLM's native norm, whose bits differ from ATen's.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

from pcie_allreduce.tools import ranks
from tests._vllm import cpu_facts, ensure_entry_point, plugin_env, tp_group, vllm_skip_reason

VLLM_SKIP = vllm_skip_reason()
needs_vllm = pytest.mark.skipif(VLLM_SKIP is not None, reason=VLLM_SKIP or "")

PASS_NAME = "vllm_plugin.fuse_allreduce_rmsnorm"
LAYERS, HIDDEN, EPS = 3, 96, 1e-6
MAX_BYTES = 4096
SERVED_TOKENS = 7  # 7 x 96 bf16 = 1344 bytes: the adapter takes the fused call
DECLINED_TOKENS = 45  # 8640 bytes, above MAX_BYTES: the adapter declines, the fused op runs vLLM's pair
MAX_TOKENS = 64  # the compile range vLLM's pass context carries

ALL_REDUCE = "vllm.all_reduce.default"
NORM = "vllm_ir.fused_add_rms_norm.default"
FUSED = "pcie_allreduce_vllm.all_reduce_rmsnorm.default"
VIEWS = ("aten.slice.Tensor", "aten.permute.default")


def _define_absent_native_ops() -> list[torch.library.Library]:
    """``torch.ops._C.rotary_embedding``, with vLLM's schema, where vLLM's native library did not
    define it (see the module docstring); the libraries must stay alive while the op is used."""
    if hasattr(torch.ops._C, "rotary_embedding"):
        return []
    lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901 - kept alive by the caller
    lib.define("rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
               "Tensor cos_sin_cache, bool is_neox) -> ()")
    return [lib]


def _graph_facts(graph: torch.fx.Graph) -> dict:
    """What the graph holds: the count of each call's target, the all-reduce -> norm pairs, the
    views, and whether its sizes are symbolic."""
    calls = [n for n in graph.nodes if n.op == "call_function"]
    targets = collections.Counter(str(n.target) for n in calls)
    pairs = sum(1 for n in calls if str(n.target) == NORM and isinstance(n.args[0], torch.fx.Node)
                and str(n.args[0].target) == ALL_REDUCE)
    symbolic = any(isinstance(n.meta.get("val"), torch.SymInt) for n in graph.nodes if n.op == "placeholder")
    return {"targets": dict(targets), "pairs": pairs, "views": sum(targets[v] for v in VIEWS),
            "symbolic": symbolic}


def _backend(config, graphs: dict):
    """A ``torch.compile`` backend as vLLM's fusion tests build one: Inductor with vLLM's pre-grad IR
    functionalization and vLLM's ``PostGradPassManager`` as the post-grad pass, configured from
    ``config``, our pass (as ``config`` resolved it by name) added as ``VllmBackend.configure_post_pass``
    adds it; the graph just before and after our pass goes into ``graphs``."""
    from torch._inductor.compile_fx import compile_fx
    from vllm.compilation.passes.inductor_pass import InductorPass, pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config.utils import Range

    class Snapshot(InductorPass):
        def __init__(self, label: str) -> None:
            self.label = label

        def __call__(self, graph: torch.fx.Graph) -> None:
            graphs[self.label] = _graph_facts(graph)

    cc = config.compilation_config
    manager = PostGradPassManager()
    manager.configure(config)
    for pass_ in (Snapshot("before"), cc.inductor_compile_config["post_grad_custom_post_pass"], Snapshot("after")):
        manager.add(pass_)
    patches = {**cc.inductor_compile_config, "force_disable_caches": True, "post_grad_custom_post_pass": manager,
               "pre_grad_custom_pass": VllmIRInplaceFunctionalizationPass(config)}

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        with pass_context(Range(1, MAX_TOKENS)):
            return compile_fx(gm, example_inputs, config_patches=patches)

    return compile_graph


class _Layers(torch.nn.Module):
    """``LAYERS`` x (row-parallel linear -> vLLM's all-reduce -> vLLM's RMSNorm with the residual):
    the all-reduce + add + RMSNorm of a decoder layer, as vLLM's models call them."""

    def __init__(self, rank: int, world_size: int, gen: torch.Generator) -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm

        super().__init__()
        self.part, self.rank = HIDDEN // world_size, rank
        self.norms = torch.nn.ModuleList(RMSNorm(HIDDEN, EPS, dtype=torch.bfloat16) for _ in range(LAYERS))
        for norm in self.norms:
            norm.weight.data = (1 + torch.rand(HIDDEN, generator=gen)).to(torch.bfloat16)
        # The same full weights on every rank; each rank keeps its shard of the input dimension.
        self.shards = [(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(torch.bfloat16)
                       .chunk(world_size, dim=1)[rank].contiguous() for _ in range(LAYERS)]

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm.distributed import tensor_model_parallel_all_reduce

        for shard, norm in zip(self.shards, self.norms):
            partial = torch.nn.functional.linear(x.narrow(-1, self.rank * self.part, self.part), shard)
            x, residual = norm(tensor_model_parallel_all_reduce(partial), residual)
        return x, residual


def _compile_rank(ctx: ranks.RankContext, seed: int) -> dict:
    """One rank: the plugin serving vLLM's tp group, the model run eagerly and compiled through vLLM's
    pass manager with our pass, at a declined and a served token count."""
    ensure_entry_point()
    from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.plugins import load_general_plugins

    from tests._standins import GlooCommunicator
    from vllm_plugin import fusion, plugin

    load_general_plugins()
    plugin.STATE.communicator_factory = GlooCommunicator
    plugin.STATE.facts_fn = cpu_facts()
    tp = tp_group(ctx, torch.device("cpu"))
    tp.use_custom_op_call = True  # as on CUDA platforms (module docstring)
    comm = tp.device_communicator.ca_comm.comm
    libs = _define_absent_native_ops()

    rewrites: list[int] = []
    rewrite = fusion.rewrite

    def counting_rewrite(graph, group_name=None):
        rewrites.append(rewrite(graph, group_name))
        return rewrites[-1]

    fusion.rewrite = counting_rewrite  # what FuseAllReduceRMSNorm.__call__ calls
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, inductor_passes={"post_grad_custom_post_pass": PASS_NAME}))
    gen = torch.Generator().manual_seed(seed)
    graphs: dict = {}
    out: dict = {}
    with set_current_vllm_config(config):
        config.kernel_config.ir_op_priority.set_default()  # what vLLM's worker does at start
        model = _Layers(ctx.rank, ctx.world_size, gen)
        compiled = torch.compile(model, backend=_backend(config, graphs), fullgraph=True)
        for label, tokens in (("declined", DECLINED_TOKENS), ("served", SERVED_TOKENS)):
            x = (4 * torch.randn(tokens, HIDDEN, generator=gen)).to(torch.bfloat16)
            residual = (4 * torch.randn(tokens, HIDDEN, generator=gen)).to(torch.bfloat16)
            start = len(comm.calls)
            want = model(x.clone(), residual.clone())
            eager_calls = [c[0] for c in comm.calls[start:] if c[0] != "check"]
            start = len(comm.calls)
            inputs = (x.clone(), residual.clone())
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)  # vLLM compiles one graph for every token count
            got = compiled(*inputs)
            out[label] = {"eager_calls": eager_calls,
                          "compiled_calls": [c[0] for c in comm.calls[start:] if c[0] != "check"],
                          "bitwise": [torch.equal(g, w) for g, w in zip(got, want)],
                          "relative_error": [((g.float() - w.float()).norm() / w.float().norm()).item()
                                             for g, w in zip(got, want)]}
    fusion.rewrite = rewrite
    del libs
    return {"rewrites": rewrites, "graphs": graphs, **out}


@needs_vllm
def test_the_pass_fuses_every_pair_of_vllms_post_grad_graph_and_keeps_its_output() -> None:
    seed = random.randrange(1 << 31)
    env = plugin_env(PCIE_AR_VLLM_MODE="always", PCIE_AR_VLLM_MAX_BYTES=str(MAX_BYTES))
    for r in ranks.run_ranks(_compile_rank, 2, seed, gpu=False, timeout_s=600, env=env):
        before, after = r["graphs"]["before"], r["graphs"]["after"]
        assert before["pairs"] == LAYERS and before["views"] > 0 and before["symbolic"], (seed, before)
        assert r["rewrites"] == [LAYERS], (seed, r["rewrites"])  # one graph, every pair rewritten
        assert after["pairs"] == 0 and after["targets"].get(FUSED) == LAYERS, (seed, after)
        assert ALL_REDUCE not in after["targets"] and NORM not in after["targets"], (seed, after)
        declined, served = r["declined"], r["served"]
        assert declined["eager_calls"] == declined["compiled_calls"] == [], (seed, declined)
        assert declined["bitwise"] == [True, True], (seed, declined)
        assert served["eager_calls"] == ["all_reduce"] * LAYERS, (seed, served)
        assert served["compiled_calls"] == ["all_reduce_rmsnorm"] * LAYERS, (seed, served)
        # The stand-in's norm rounds differently from vLLM's (a few bf16 ulps, carried through the
        # layers: about 2**-8 of the output's norm); a swapped or dropped output would be of order 1.
        assert max(served["relative_error"]) < 2 ** -5, (seed, served)
