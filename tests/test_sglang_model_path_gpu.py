"""SGLang 0.5.23's model path with the plugin: the all-reduce + residual + RMSNorm boundaries of
consecutive DeepSeek-V3 / Kimi-K2 decoder layers on W ranks (one GPU under MPS), eagerly and in
CUDA graphs.

What SGLang 0.5.23 runs at those boundaries (``DeepseekV2DecoderLayer.forward`` and
``DeepseekV2Model.forward`` in sglang/srt/models/deepseek_v2.py, through the stage boundaries of
sglang/srt/layers/layer_boundary/), for a TP launch without DP attention or EP, on decode and
verify batches:

1. ``attn_boundary.prepare``, the input norm. At the first layer the embedding becomes the
   residual (prepare.py ``_update_read`` with ``enters_stack``). At a later layer the previous
   layer's MoE output arrives un-reduced (``UnreducedOutput`` over ``post_experts_reduction_
   group()``) and ``fused_attn_input`` (fusions/allreduce.py) completes it together with the
   residual add and the norm: ``input_layernorm.forward_with_allreduce_fusion(partial, residual,
   use_attn_tp_group=False)``.
2. The attention's o_proj leaves its sum (``reduce_results=False``); ``attn_boundary.finish``
   records it as owed over attention TP.
3. ``ffn_boundary.prepare``: ``fused_ffn_input`` runs ``post_attention_layernorm.
   forward_with_allreduce_fusion(partial, residual, use_attn_tp_group=True)``.
4. The MoE leaves its sum too; ``ffn_exit.finish`` (exit.py ``ExitPolicy._decide``) defers it to
   the next layer's step 1, except at the last layer, which completes it there
   (``sum_post_experts_output``); ``residual_batch.final_norm`` then adds it into the residual and
   applies the final norm, unfused.

Both fused calls reach ``flashinfer_allreduce_residual_rmsnorm`` (hooked by the plugin) through
``RMSNorm.forward_with_allreduce_fusion``, behind the gate ``flashinfer_ar_fusion_applies`` (hooked:
open where the plugin serves). With the gate closed SGLang runs the same steps unfused: the
all-reduce, then ``norm(x, residual)``.

Real SGLang code here: ``load_plugins()``; the ``tp`` ``GroupCoordinator`` (NCCL off: NCCL refuses
ranks that share a GPU), which is also the attention-TP and MoE-TP group, as
``initialize_model_parallel`` makes them for TP only (published with ``get_parallel().override``);
its ``all_reduce`` and ``graph_capture()``; the hooked ``flashinfer_allreduce_residual_rmsnorm``
and, inside the plugin, ``resolve_fusion_group``; ``post_experts_reduction_group``,
``can_merge_post_experts_all_reduce``, ``sum_post_experts_output``,
``deferred_post_experts_all_reduce`` and ``attention_tensor_model_parallel_all_reduce``; SGLang's
``RMSNorm`` where its module imports (a full SGLang install).

Stand-ins (each says what it reproduces):

- the layer loop and the boundary steps (``model_forward`` and the ``_..._stand_in`` functions
  beside it, tests/_sglang_model.py): ``DeepseekV2DecoderLayer`` needs a model config; the ``layer_boundary`` package
  imports ``sglang.srt.layers.layernorm`` (``sgl_kernel`` on CUDA) and the quantization package
  (``compressed_tensors``), and binding its stages reads the published server config. The GPU
  test machine has none of these. The stand-ins make SGLang's calls in SGLang's order, reading
  the parallel state through SGLang's own functions.
- ``RMSNormStandIn`` (tests/_sglang_model.py) where SGLang's ``RMSNorm`` does not import: ``forward`` is its
  ``forward_native``, ``forward_with_allreduce_fusion`` its ``_forward_with_allreduce_fusion``.
- the attention and MoE compute: fixed per-rank partial outputs (tests/_reference.py inputs), so
  every boundary has an exact reference.
- the gate: the plugin's hook function around SGLang's own answer where FlashInfer's fusion is
  not configured (False). Its module, ``add_norm``, is in ``layer_boundary``: where that does not
  import, the plugin logs that it leaves the gate unhooked, so the test calls what the hook does.
- ``dill``: SGLang's model configs, and so ``sglang.srt.layers.moe``, import
  ``custom_logit_processor``, which imports dill to serialise custom logit processors (nothing on
  this path does). Where dill is missing that one import gets a pickle-backed stand-in.

Checks, for W ranks, three layers at hidden 7168 in bf16, 1, 4 and 32 tokens (decode and
target-verify sizes):

- each boundary's new residual is bitwise ``residual + all_reduce(x)`` with the rank-order fp32
  sum of tests/_reference.py, its norm within bf16 rounding of the fp64 reference, and the fused
  forward equals SGLang's unfused path (gate closed) bitwise in every residual;
- the plugin served every fused call (each boundary but the first input norm and the final norm)
  and every plain all-reduce;
- the same in CUDA graphs captured under ``graph_capture()`` and replayed with new inputs, and a
  replay with an eager forward's inputs reproduces that forward bitwise;
- every rank's digests of all outputs are identical.

Skips with a reason without a GPU, without the built extension, or without SGLang.
Run: ``PCIE_AR_TEST_SGLANG_WORLDS=2,4 python -m pytest -q tests/test_sglang_model_path_gpu.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib
import importlib.util
import os
import pickle
import sys
import types
from typing import Any

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from tests import _reference as ref
from tests._sglang import plugin_tp_coordinator, serving_env, sglang_skip_reason
from tests._sglang_model import LAYERS, Outputs, gate_closed, model_forward, plugin_gate, rmsnorm_class

SKIP_REASON = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason() or sglang_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

WORLDS = [int(w) for w in os.environ.get("PCIE_AR_TEST_SGLANG_WORLDS", "2,4").split(",")]
MAX_BYTES = 1 << 20  # 32 x 7168 bf16 is 448 KiB: every call here is within it
HIDDEN = 7168  # DeepSeek-V3 / Kimi-K2
EPS = 1e-6
DTYPE = torch.bfloat16
TOKENS = (1, 4, 32)  # decode batches and a target-verify batch
NORMS = 2 * LAYERS + 1  # per layer the input and post-attention norms, then the final norm
FUSED_PER_FORWARD = 2 * LAYERS - 1  # every boundary but the stack entry and the final norm
PLAIN_PER_FORWARD = 1  # the last layer's MoE sum
PLAIN_PER_UNFUSED_FORWARD = 2 * LAYERS  # every sum, unfused
EAGER_SEEDS = (1, 2)
REPLAYS = 3
WARMUPS = 2  # SGLang's graph runner runs each batch size twice in the capture context first
MAX_FUSED_BATCH = 2048  # add_norm.FUSE_ALLREDUCE_MAX_BATCH_SIZE


# ---------------------------------------------------------------------------- SGLang set-up


def _import_custom_logit_processor() -> str:
    """Make SGLang's model configs importable where ``dill`` is missing; says what served as dill.

    ``sglang.srt.configs`` imports ``sampling/custom_logit_processor.py``, whose ``import dill``
    serves ``CustomLogitProcessor.to_str``/``from_str`` only (DeepSeek-OCR's config serialises
    its processor class at import, by reference). Without dill that one module is imported with
    a pickle-backed stand-in, which is removed again at once: torch probes for dill lazily and
    must go on finding none.
    """
    if importlib.util.find_spec("dill") is not None:
        return "dill"
    stand_in = types.ModuleType("dill")
    stand_in.dumps, stand_in.loads = pickle.dumps, pickle.loads
    sys.modules["dill"] = stand_in
    try:
        importlib.import_module("sglang.srt.sampling.custom_logit_processor")
    finally:
        del sys.modules["dill"]
    return "pickle stand-in"


def _tp_only_parallel(ctx: ranks.RankContext, tp) -> dict[str, Any]:
    """The parallel state of a TP-only launch: ``initialize_model_parallel`` makes the attention-TP
    and MoE-TP groups the TP group itself when their sizes are the TP size."""
    w = ctx.world_size
    return {"tp_group": tp, "tp_size": w, "tp_rank": ctx.rank,
            "attn_tp_group": tp, "attn_tp_size": w, "attn_tp_rank": ctx.rank,
            "attn_dp_size": 1, "attn_dp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "moe_tp_group": tp, "moe_tp_size": w, "moe_ep_size": 1, "moe_dp_size": 1, "dwdp_size": 1}


def _count_served(adapter) -> collections.Counter:
    """Count what the plugin's adapter serves: wraps its two entry points on this instance (what
    ``GroupCoordinator`` and the fused-op hook call), counting the calls it did not decline."""
    served: collections.Counter = collections.Counter()

    def count(name: str, key: str) -> None:
        method = getattr(adapter, name)

        def counted(*args, **kwargs):
            out = method(*args, **kwargs)
            served[key if out is not None else f"{key} declined"] += 1
            return out

        setattr(adapter, name, counted)

    count("fused_allreduce_rmsnorm", "fused")
    count("custom_all_reduce", "plain")
    return served


def _weights() -> list[torch.Tensor]:
    """The norms' weights (bf16, as a bf16 checkpoint loads them), the same on every rank."""
    return [(1 + 0.1 * ref.rank_input(700 + j, 0, HIDDEN, torch.float32)).to(DTYPE) for j in range(NORMS)]


def _norms(device: torch.device, weights: list[torch.Tensor]) -> tuple[list[torch.nn.Module], str]:
    """Per layer ``input_layernorm`` and ``post_attention_layernorm``, then the model's final norm."""
    cls, kind = rmsnorm_class()
    norms = []
    for weight in weights:
        norm = cls(HIDDEN, eps=EPS, weight_dtype=DTYPE)
        norm.weight.data.copy_(weight)
        norm.weight.requires_grad_(False)
        norms.append(norm.to(device))
    return norms, kind


# ---------------------------------------------------------------------------- references


@dataclasses.dataclass(frozen=True)
class _Case:
    """One forward's inputs on every rank and its NCCL-free references."""

    embedding: torch.Tensor  # (T, H), the same on every rank
    partials: list  # [2 * LAYERS][world] -> (T, H): attention and MoE partial outputs per rank
    want_residuals: list  # per boundary: residual + the rank-order fp32 sum, bf16 (bitwise reference)
    want_norms: list  # per boundary: the fp64 RMSNorm of that residual

    def rank_inputs(self, rank: int, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.embedding.to(device), [p[rank].to(device) for p in self.partials]


def _case(seed: int, tokens: int, world: int, weights: list[torch.Tensor]) -> _Case:
    n = tokens * HIDDEN
    embedding = ref.rank_input(seed * 100 + 50, 0, n, DTYPE).view(tokens, HIDDEN)
    partials = [[ref.rank_input(seed * 100 + k, r, n, DTYPE).view(tokens, HIDDEN) for r in range(world)]
                for k in range(2 * LAYERS)]
    residual = embedding
    want_residuals, want_norms = [], []
    for j, weight in enumerate(weights):
        if j > 0:
            residual = residual + ref.exact(partials[j - 1])
        want_residuals.append(residual)
        v = residual.double()
        want_norms.append(v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * weight.double())
    return _Case(embedding, partials, want_residuals, want_norms)


def _check(outs: Outputs, case: _Case, what: str) -> None:
    assert len(outs) == NORMS, f"{what}: {len(outs)} boundaries, want {NORMS}"
    for j, ((normed, residual), want_residual, want_norm) in enumerate(zip(outs, case.want_residuals, case.want_norms)):
        where = f"{what}, boundary {j}"
        assert torch.equal(residual.cpu(), want_residual), f"{where}: residual is not residual + all_reduce(x)"
        torch.testing.assert_close(normed.cpu().double(), want_norm, rtol=2 * ref.TOLERANCE[DTYPE], atol=2e-2,
                                   msg=lambda m, where=where: f"{where}: {m}")


def _digest(outs: Outputs) -> str:
    h = hashlib.sha256()
    for pair in outs:
        for t in pair:
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _expect_served(served: collections.Counter, before: collections.Counter, fused: int, plain: int,
                   what: str) -> None:
    got = {k: served[k] - before[k] for k in ("fused", "plain", "fused declined", "plain declined")}
    want = {"fused": fused, "plain": plain, "fused declined": 0, "plain declined": 0}
    assert got == want, f"{what}: the plugin served {got}, want {want}"


# ---------------------------------------------------------------------------- per rank


def _eager(ctx: ranks.RankContext, norms: list, weights: list, served: collections.Counter) -> dict[str, str]:
    """Fused and unfused forwards per batch size; returns the fused forwards' digests."""
    digests = {}
    for tokens in TOKENS:
        for seed in EAGER_SEEDS:
            case = _case(seed, tokens, ctx.world_size, weights)
            what = f"eager T={tokens} seed={seed}"
            before = served.copy()
            fused = model_forward(norms, *case.rank_inputs(ctx.rank, ctx.device), plugin_gate)
            _expect_served(served, before, FUSED_PER_FORWARD, PLAIN_PER_FORWARD, f"{what} fused")
            _check(fused, case, f"{what} fused")
            before = served.copy()
            unfused = model_forward(norms, *case.rank_inputs(ctx.rank, ctx.device), gate_closed)
            _expect_served(served, before, 0, PLAIN_PER_UNFUSED_FORWARD, f"{what} unfused")
            _check(unfused, case, f"{what} unfused")
            for j, ((fn, fr), (un, ur)) in enumerate(zip(fused, unfused)):
                where = f"{what}, boundary {j}"
                assert torch.equal(fr, ur), f"{where}: fused and unfused residuals differ"
                torch.testing.assert_close(fn.float(), un.float(), rtol=2 ** -7, atol=2 ** -6,
                                           msg=lambda m, where=where: f"{where}, fused vs unfused norm: {m}")
            digests[f"{tokens}:{seed}"] = _digest(fused)
    return digests


def _graphs(ctx: ranks.RankContext, tp, norms: list, weights: list, served: collections.Counter,
            eager: dict[str, str]) -> dict[str, str]:
    """One graph per batch size, captured the way SGLang's graph runner does (largest first, in
    ``graph_capture()``, warm-ups in the capture context), replayed with new inputs."""
    graphs = {}
    with tp.graph_capture() as capture_ctx:
        stream = capture_ctx.stream
        for tokens in sorted(TOKENS, reverse=True):
            embedding, partials = _case(0, tokens, ctx.world_size, weights).rank_inputs(ctx.rank, ctx.device)

            def step(embedding=embedding, partials=partials) -> Outputs:
                return model_forward(norms, embedding, partials, plugin_gate)

            before = served.copy()
            for _ in range(WARMUPS):
                step()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = step()
            _expect_served(served, before, (WARMUPS + 1) * FUSED_PER_FORWARD, (WARMUPS + 1) * PLAIN_PER_FORWARD,
                           f"capture T={tokens}")
            graphs[tokens] = (graph, embedding, partials, outs)
    torch.cuda.synchronize()
    digests = {}
    for rep in range(REPLAYS):
        for tokens in TOKENS:
            graph, embedding, partials, outs = graphs[tokens]
            seed = EAGER_SEEDS[0] if rep == 0 else 100 + rep  # the first replay repeats an eager forward
            case = _case(seed, tokens, ctx.world_size, weights)
            fresh_embedding, fresh_partials = case.rank_inputs(ctx.rank, ctx.device)
            embedding.copy_(fresh_embedding)
            for static, fresh in zip(partials, fresh_partials):
                static.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            _check(outs, case, f"graph T={tokens} replay {rep}")
            digests[f"{tokens}:{rep}"] = _digest(outs)
            if rep == 0:
                assert digests[f"{tokens}:{rep}"] == eager[f"{tokens}:{seed}"], \
                    f"graph T={tokens}: the replay differs from the eager forward with the same inputs"
    return digests


def _rank(ctx: ranks.RankContext) -> dict:
    report: dict = {"dill": _import_custom_logit_processor()}  # first: before anything imports SGLang's configs
    from sglang.srt.runtime_context import get_parallel

    tp = plugin_tp_coordinator(ctx)
    adapter = tp.ca_comm
    served = _count_served(adapter)
    weights = _weights()
    norms, report["rmsnorm"] = _norms(ctx.device, weights)

    with get_parallel().override(**_tp_only_parallel(ctx, tp)), torch.inference_mode():
        report["gate"] = {t: plugin_gate(t) for t in (*TOKENS, MAX_FUSED_BATCH, MAX_FUSED_BATCH + 1)}
        report["eager"] = _eager(ctx, norms, weights, served)
        report["graph"] = _graphs(ctx, tp, norms, weights, served, report["eager"])
    report["served"] = dict(served)
    adapter.comm.check()
    adapter.close()
    return report


@pytest.mark.parametrize("world", WORLDS)
def test_deepseek_layer_boundaries_through_the_plugin(world: int) -> None:
    results = ranks.run_ranks(_rank, world, timeout_s=900, env=serving_env(MAX_BYTES))
    for rank, r in enumerate(results[1:], start=1):
        assert r == results[0], f"rank {rank} differs from rank 0 (digests of the outputs included):\n{r}\n{results[0]}"
    report = results[0]
    assert report["gate"] == {**{t: True for t in TOKENS}, MAX_FUSED_BATCH: True, MAX_FUSED_BATCH + 1: False}
    assert sorted(report["eager"]) == sorted(f"{t}:{s}" for t in TOKENS for s in EAGER_SEEDS)
    assert sorted(report["graph"]) == sorted(f"{t}:{r}" for t in TOKENS for r in range(REPLAYS))
    forwards = len(TOKENS) * len(EAGER_SEEDS)
    captured = len(TOKENS) * (WARMUPS + 1)
    assert report["served"] == {
        "fused": (forwards + captured) * FUSED_PER_FORWARD,
        "plain": (forwards + captured) * PLAIN_PER_FORWARD + forwards * PLAIN_PER_UNFUSED_FORWARD,
    }, report["served"]
