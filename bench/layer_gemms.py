"""``bench verify --gemms``: each layer's own GEMMs between its collectives, at the served model's
per-rank shapes, so the collectives (and the fused all-reduce + RMSNorm) are timed in context:
after a GEMM has filled the GPU's caches and queues with weights, not back to back.

A layer with tensor parallelism W (Megatron-style, as SGLang shards these models) runs, per rank:

- before its first all-reduce, the attention: the column-parallel projections into the heads
  (1/W of the heads each) and the row-parallel output projection (1/W of its input rows);
- before its second, the MLP or MoE: the gate/up projection (1/W of the intermediate size) and the
  down projection (1/W of its rows), once per active expert for MoE models (routed + shared).

Each GEMM is ``[batch] x ([T, k] @ [k, n])`` on that rank's slice (bf16/fp16 as the run's dtype);
experts run as one batched GEMM over distinct weights (their weights, not their FLOPs, set the
time at verify sizes). What is simplified: attention itself (the softmax over the KV cache) and
the router are left out, MoE tokens are taken as evenly routed (each active expert sees all T
tokens), and DeepSeek-V3's three dense layers count as MoE layers. Two weight sets alternate
from layer to layer, so one layer's weights are not still in L2 for the next (H200: 50 MiB).

Pure except :class:`GemmAdapter`, which allocates on the rank's GPU.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping

WEIGHT_SETS = 2


@dataclasses.dataclass(frozen=True)
class Gemm:
    """``batch`` x ([T, k] @ [k, n]) on one rank."""

    name: str
    k: int
    n: int
    batch: int = 1

    def weight_bytes(self, element: int) -> int:
        return self.batch * self.k * self.n * element

    def flops(self, tokens: int) -> int:
        return 2 * self.batch * tokens * self.k * self.n


def _shard(size: int, world: int) -> int:
    return max(1, math.ceil(size / world))


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A model's layer as its GEMMs see it (the published configs)."""

    hidden: int
    attn_in: tuple[tuple[str, int, int], ...]   # (name, k, n before sharding n over W): column-parallel
    attn_out: int                               # the output projection's input width (sharded over W)
    intermediate: int                           # per expert (MoE) or of the MLP
    experts: int = 1                            # active experts per token (routed + shared), 1 for dense

    def stages(self, world: int) -> tuple[tuple[Gemm, ...], tuple[Gemm, ...]]:
        """(attention, MLP/MoE) GEMMs of one rank at tensor parallelism ``world``."""
        attention = tuple(Gemm(name, k, _shard(n, world)) for name, k, n in self.attn_in)
        attention += (Gemm("o_proj", _shard(self.attn_out, world), self.hidden),)
        inter = _shard(self.intermediate, world)
        mlp = (Gemm("gate_up_proj", self.hidden, 2 * inter, self.experts),
               Gemm("down_proj", inter, self.hidden, self.experts))
        return attention, mlp


# The verify presets' layers (bench.verify_options.PRESETS names them).
# DeepSeek-V3 / Kimi-K2.5: MLA with 128 heads (q_lora 1536 -> 128 x 192, kv_lora 512 -> 128 x
# (128 + 128), o_proj 128 x 128 -> 7168), MoE of 8 routed + 1 shared experts of 2048.
# Llama-3-70B: 64 query and 8 KV heads of 128 (qkv 8192 -> 10240), MLP 28672.
# Qwen3-235B-A22B: 64 query and 4 KV heads of 128 (qkv 4096 -> 9216, o_proj 8192 -> 4096), MoE of
# 8 routed experts of 1536, no shared expert.
_DEEPSEEK_V3 = LayerShape(7168, (("q_b_proj", 1536, 128 * 192), ("kv_b_proj", 512, 128 * 256)), 128 * 128, 2048,
                          experts=9)
LAYERS: Mapping[str, LayerShape] = MappingProxyType({
    "kimi-k2.5": _DEEPSEEK_V3,
    "deepseek-v3": _DEEPSEEK_V3,
    "llama-3-70b": LayerShape(8192, (("qkv_proj", 8192, 10240),), 8192, 28672),
    "qwen3-235b-a22b": LayerShape(4096, (("qkv_proj", 4096, 9216),), 8192, 1536, experts=8),
})


def layer_of(model: str) -> LayerShape | None:
    """The layer of a verify row's model ("kimi-k2.5/deepseek-v3": the first preset), or None (a
    custom model: no GEMMs are known)."""
    return LAYERS.get(model.split("/")[0])


def describe(model: str, world: int, tokens: int, element: int = 2) -> str:
    """One line: the GEMMs per layer of ``model`` at TP ``world`` (for the report)."""
    layer = layer_of(model)
    if layer is None:
        return f"{model}: no GEMM shapes known"
    attention, mlp = layer.stages(world)
    gemms = attention + mlp
    weights = sum(g.weight_bytes(element) for g in gemms)
    flops = sum(g.flops(tokens) for g in gemms)
    shapes = ", ".join(f"{g.name} {'%dx' % g.batch if g.batch > 1 else ''}[{g.k}, {g.n}]" for g in gemms)
    return (f"{model} at TP {world}, T = {tokens}: per layer and rank {shapes}; "
            f"{weights / 2**20:.1f} MiB of weights, {flops / 1e9:.2f} GFLOP")


class GemmAdapter:
    """A backend (or NormAdapter) whose every call first runs the GEMMs its layer runs before that
    collective: call 2i the attention of layer i, call 2i + 1 its MLP/MoE. Everything else is the
    wrapped backend's. Weights are allocated per (model, T, dtype) in :meth:`buffers`, outside any
    capture; the GEMMs write preallocated outputs, so they capture into the pass's CUDA graph."""

    def __init__(self, inner: Any, ctx: Any, job: Any) -> None:
        self._inner = inner
        self._device = ctx.device
        self._world = ctx.world_size
        self._seed = job.seed
        self._weights: dict[tuple[str, Any], list[list[list[Any]]]] = {}  # (model, dtype) -> stage -> gemm -> sets
        self._stages: dict[tuple[str, int, Any], list[Callable[[int], None]]] = {}
        self._active: list[Callable[[int], None]] = []
        self._calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def resolved_algo(self, size_bytes: int, dtype: Any, algo: str, **shape: Any) -> str:
        shape.pop("model", None)
        return self._inner.resolved_algo(size_bytes, dtype, algo, **shape)

    def buffers(self, count: int, dtype: Any, algo: str, **shape: Any) -> Any:
        model = shape.pop("model", "")
        hidden = shape.get("hidden") or count
        key = (model, max(1, count // hidden), dtype)
        if key not in self._stages:
            self._stages[key] = self._build(*key)
        self._active = self._stages[key]
        self._calls = 0
        return self._inner.buffers(count, dtype, algo, **shape)

    def call(self, bufs: Any, algo: str) -> Any:
        if self._active:
            stages = len(self._active)
            self._active[self._calls % stages](self._calls // stages)
        self._calls += 1
        return self._inner.call(bufs, algo)

    def _build(self, model: str, tokens: int, dtype: Any) -> list[Callable[[int], None]]:
        """The two stages' work for T = ``tokens``: activations and outputs of their own, the
        weights shared by every T of the model."""
        import torch

        layer = layer_of(model)
        if layer is None:
            return []
        gen = torch.Generator(device=self._device).manual_seed(self._seed * 7919 + tokens)
        shapes = layer.stages(self._world)
        weights = self._weights.get((model, dtype))
        if weights is None:
            weights = [[[torch.randn(g.batch, g.k, g.n, device=self._device, dtype=dtype, generator=gen)
                         for _ in range(WEIGHT_SETS)] for g in gemms] for gemms in shapes]
            self._weights[(model, dtype)] = weights
        stages = []
        for gemms, stage_weights in zip(shapes, weights):
            work = [(torch.randn(g.batch, tokens, g.k, device=self._device, dtype=dtype, generator=gen) * (g.k ** -0.5),
                     sets, torch.empty(g.batch, tokens, g.n, device=self._device, dtype=dtype))
                    for g, sets in zip(gemms, stage_weights)]

            def run(layer_index: int, work: list = work) -> None:
                for a, sets, out in work:
                    torch.bmm(a, sets[layer_index % WEIGHT_SETS], out=out)

            stages.append(run)
        return stages
