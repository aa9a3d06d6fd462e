"""SGLang's real GroupCoordinator on W ranks (one GPU under MPS) with the plugin loaded by SGLang.

Each rank runs SGLang's ``load_plugins()`` (which finds the entry point), builds the ``tp``
``GroupCoordinator`` with NCCL off (NCCL refuses ranks that share a GPU; the device group is
gloo, which also serves what the plugin declines), then checks against the rank-order fp32
reference (tests/_reference.py):

- eager ``all_reduce`` through SGLang's ``outplace_all_reduce`` custom op, for decode sizes and
  dtypes, out of place, input untouched; a size above ``max_bytes`` falls back to SGLang;
- the same inside ``graph_capture()`` + ``torch.cuda.graph`` as SGLang's CUDA-graph runner does
  (warm-up in the capture context, capture, several replays with new inputs);
- the fused all-reduce + residual + RMSNorm through SGLang's ``fused_allreduce_rmsnorm`` and
  through the hooked ``flashinfer_allreduce_residual_rmsnorm`` (what ``RMSNorm.forward_with_
  allreduce_fusion`` calls), eagerly and captured; its new residual must be bitwise
  ``residual + all_reduce(x)`` (the unfused path) and its norm match SGLang's ``RMSNorm``.

Skips with a reason without a GPU, without the built extension, or without SGLang.
Run: ``PCIE_AR_TEST_SGLANG_WORLDS=2,4 python -m pytest -q tests/test_sglang_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from tests._sglang import fake_model_runner_module, plugin_tp_coordinator, serving_env, sglang_skip_reason
from tests import _reference as ref

SKIP_REASON = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason() or sglang_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

WORLDS = [int(w) for w in os.environ.get("PCIE_AR_TEST_SGLANG_WORLDS", "2,4").split(",")]
MAX_BYTES = 1 << 20
HIDDEN = 7168
EPS = 1e-6
DECODE_TOKENS = (1, 4, 8, 32)  # 14 KiB .. 448 KiB of bf16 at hidden 7168
EAGER_CASES = [(t, HIDDEN, torch.bfloat16) for t in DECODE_TOKENS] + [
    (4, 4096, torch.float16), (3, 1000, torch.float32), (1, 7, torch.bfloat16)]


def _inputs(ctx, seed: int, tokens: int, hidden: int, dtype: torch.dtype):
    xs = [ref.rank_input(seed, r, tokens * hidden, dtype) for r in range(ctx.world_size)]
    return xs, xs[ctx.rank].view(tokens, hidden).to(ctx.device)


def _fused_case(ctx, seed: int, tokens: int):
    xs, x = _inputs(ctx, seed, tokens, HIDDEN, torch.bfloat16)
    residual = ref.rank_input(seed, 99, tokens * HIDDEN, torch.bfloat16).view(tokens, HIDDEN)
    weight = (1 + 0.1 * ref.rank_input(seed, 98, HIDDEN, torch.float32)).to(torch.bfloat16)
    want_residual = residual + ref.exact(xs).view(tokens, HIDDEN)
    v = want_residual.double()
    want_norm = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return x, residual.to(ctx.device), weight.to(ctx.device), want_residual, want_norm


def _check_fused(normed, new_residual, want_residual, want_norm, what: str) -> None:
    assert torch.equal(new_residual.cpu(), want_residual), f"{what}: residual is not residual + all_reduce(x)"
    torch.testing.assert_close(normed.cpu().double(), want_norm, rtol=2 * ref.TOLERANCE[torch.bfloat16], atol=2e-2,
                               msg=lambda m: f"{what}: {m}")


def _sglang_rmsnorm(hidden: int):
    """SGLang's own RMSNorm module (its unfused path), or the reason it is unavailable here."""
    try:
        from sglang.srt.layers.layernorm import RMSNorm

        return RMSNorm(hidden, eps=EPS)
    except Exception as exc:  # its module needs packages (transformers, torchvision) the machine may lack
        return f"{type(exc).__name__}: {exc}"


def _fusion_gate_open() -> bool | str:
    """SGLang's layer-boundary gate for the fused path, hooked: open (no FlashInfer here)."""
    try:
        from sglang.srt.layers.layer_boundary.residual import add_norm
    except Exception as exc:  # the layer stack needs packages the machine may lack
        return f"not importable: {type(exc).__name__}: {exc}"
    assert hasattr(add_norm.flashinfer_ar_fusion_applies, "__wrapped__"), "fused-path gate not hooked"
    return bool(add_norm.flashinfer_ar_fusion_applies(4)) and not add_norm.flashinfer_ar_fusion_applies(4096)


def _rank(ctx: ranks.RankContext) -> dict:
    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang.srt.runtime_context import get_parallel

    tp = plugin_tp_coordinator(ctx)
    adapter = tp.ca_comm
    report: dict = {"served": [], "fallback": None}

    # ---- eager, through GroupCoordinator.all_reduce -> outplace_all_reduce -> the adapter
    for seed, (tokens, hidden, dtype) in enumerate(EAGER_CASES):
        xs, x = _inputs(ctx, seed, tokens, hidden, dtype)
        before = x.clone()
        assert tp._resolve_outplace_all_reduce_method(x) == "ca"
        y = tp.all_reduce(x)
        ref.check(y, xs, f"eager {tokens}x{hidden} {dtype}")
        assert y.data_ptr() != x.data_ptr() and torch.equal(x, before), "not out of place"
        report["served"].append(f"{tokens}x{hidden}:{dtype}")
    # Above max_bytes SGLang's own fallback (here gloo) serves; small integers make its sum exact
    # in any order, so it still equals the rank-order reference.
    big_xs = [ref.rank_input(100, r, MAX_BYTES // 4 + 4, torch.float32).round() for r in range(ctx.world_size)]
    big = big_xs[ctx.rank].to(ctx.device)
    assert tp._resolve_outplace_all_reduce_method(big) is None
    ref.check(tp.all_reduce(big.clone()), big_xs, "eager fallback above max_bytes")
    report["fallback"] = "sglang"
    report["fusion_gate"] = _fusion_gate_open()

    norm = _sglang_rmsnorm(HIDDEN)
    report["sglang_rmsnorm"] = norm if isinstance(norm, str) else "compared"
    norm = None if isinstance(norm, str) else norm.to(ctx.device)
    with get_parallel().override(attn_tp_group=tp, attn_tp_size=ctx.world_size, attn_tp_rank=ctx.rank):
        # ---- fused, eager: SGLang's coordinator method and the hooked FlashInfer entry point
        for seed, tokens in enumerate(DECODE_TOKENS, start=200):
            x, residual, weight, want_residual, want_norm = _fused_case(ctx, seed, tokens)
            # The hooked entry point first: it lets exceptions through (SGLang's method below
            # swallows them and returns None).
            b = flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm(
                input_tensor=x, residual=residual, weight=weight, eps=EPS, max_token_num=2048, use_attn_tp_group=True)
            assert b[0] is not None, "hooked flashinfer_allreduce_residual_rmsnorm declined"
            _check_fused(*b, want_residual, want_norm, f"flashinfer_allreduce_residual_rmsnorm T={tokens}")
            a = tp.fused_allreduce_rmsnorm(x, residual, weight, EPS)
            assert a is not None, "GroupCoordinator.fused_allreduce_rmsnorm declined"
            _check_fused(*a, want_residual, want_norm, f"GroupCoordinator.fused_allreduce_rmsnorm T={tokens}")
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            unfused_residual = residual + tp.all_reduce(x)  # SGLang's unfused path: all-reduce, then add
            assert torch.equal(unfused_residual, b[1]), "fused residual differs from the unfused path"
            if norm is not None:
                norm.weight.data.copy_(weight)
                normed_native, residual_native = norm.forward_native(tp.all_reduce(x), residual.clone())
                assert torch.equal(residual_native, b[1]), "SGLang RMSNorm residual differs"
                torch.testing.assert_close(normed_native.float(), b[0].float(), rtol=2 ** -7, atol=2 ** -6)

        # ---- CUDA graph, the way SGLang's graph runner captures (inference mode, capture context)
        with torch.inference_mode():
            report["graph"] = _graph(ctx, tp)
    adapter.comm.check()
    adapter.close()
    return report


def _graph(ctx: ranks.RankContext, tp) -> dict:
    from sglang.srt.layers import flashinfer_comm_fusion

    plain = [_inputs(ctx, 300 + i, t, HIDDEN, torch.bfloat16)[1] for i, t in enumerate(DECODE_TOKENS)]
    fused = [_fused_case(ctx, 400 + i, t)[:3] for i, t in enumerate(DECODE_TOKENS)]

    def forward() -> list:
        outs = []
        for _layer in range(3):  # a few layers: per layer one plain and one fused collective per size
            for x in plain:
                outs.append(tp.all_reduce(x))
            for x, residual, weight in fused:
                outs.append(flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm(
                    input_tensor=x, residual=residual, weight=weight, eps=EPS, use_attn_tp_group=True))
        return outs

    with tp.graph_capture() as capture_ctx:
        stream = capture_ctx.stream
        for _ in range(2):  # SGLang's runner warms up inside the capture context, then captures
            forward()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = forward()
    torch.cuda.synchronize()
    replays = 0
    for rep in range(3):
        wants_plain, wants_fused = [], []
        for i, (x, t) in enumerate(zip(plain, DECODE_TOKENS)):
            xs, fresh = _inputs(ctx, 500 + 10 * rep + i, t, HIDDEN, torch.bfloat16)
            x.copy_(fresh)
            wants_plain.append(xs)
        for i, ((x, residual, weight), t) in enumerate(zip(fused, DECODE_TOKENS)):
            fx, fres, fw, want_residual, want_norm = _fused_case(ctx, 600 + 10 * rep + i, t)
            x.copy_(fx), residual.copy_(fres), weight.copy_(fw)
            wants_fused.append((want_residual, want_norm))
        graph.replay()
        torch.cuda.synchronize()
        k = 0
        for layer in range(3):
            for xs in wants_plain:
                ref.check(outs[k], xs, f"graph replay {rep} layer {layer} plain")
                k += 1
            for want_residual, want_norm in wants_fused:
                _check_fused(*outs[k], want_residual, want_norm, f"graph replay {rep} layer {layer} fused")
                k += 1
        replays += 1
    return {"replays": replays, "collectives_per_replay": len(outs)}


@pytest.mark.parametrize("world", WORLDS)
def test_sglang_group_coordinator_with_plugin(world: int) -> None:
    results = ranks.run_ranks(_rank, world, timeout_s=900, env=serving_env(MAX_BYTES))
    assert all(r == results[0] for r in results), results
    assert results[0]["graph"] == {"replays": 3, "collectives_per_replay": 3 * 2 * len(DECODE_TOKENS)}
    gate = results[0]["fusion_gate"]
    assert gate is True or str(gate).startswith("not importable"), gate


def _default_mode_decision(ctx: ranks.RankContext) -> dict:
    from pcie_allreduce import plugin_eligibility
    from sglang_plugin import eligibility
    from sglang_plugin.settings import Settings

    decision = eligibility.decide(ctx.group, ctx.device, Settings(enabled=True))
    physical = [plugin_eligibility.physical_gpu_index(ctx.device)]
    gathered: list = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, physical[0], group=ctx.group)
    return {"serve": decision.serve, "reason": decision.reason,
            "full_nvlink": eligibility.sglang_full_nvlink(gathered)}


@pytest.mark.parametrize("world", [w for w in WORLDS if w == 2])
def test_default_mode_serves_pcie_and_leaves_nvlink_to_sglang(world: int) -> None:
    """mode=pcie (the default): a group whose GPUs are all NVLinked is SGLang's, with the reason;
    anything else (ranks sharing a GPU here, PCIe GPUs on a real box) is served."""
    for r in ranks.run_ranks(_default_mode_decision, world, timeout_s=300):
        if r["full_nvlink"]:
            assert not r["serve"] and "NVLinked" in r["reason"], r
        else:
            assert r["serve"], r


# Graphs SGLang 0.5.23 captures on its one capture stream: decode, target-verify and (breakable)
# prefill graphs; tokens per graph here (64 x 7168 bf16 stays within MAX_BYTES).
GRAPH_TOKENS = {"decode": 1, "verify": 4, "prefill": 64}
INTERLEAVED_STEPS = 300


def _interleaved_graphs(ctx: ranks.RankContext) -> dict:
    """Several graphs captured on SGLang's capture stream, replayed in an order every rank draws
    from the same seed, with eager collectives between replays; results checked against the
    unfused path (the new residual bitwise, the norm against the fp64 reference)."""
    import random

    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang.srt.runtime_context import get_parallel

    tp = plugin_tp_coordinator(ctx)
    graphs = {}
    checked = 0
    with get_parallel().override(attn_tp_group=tp, attn_tp_size=ctx.world_size, attn_tp_rank=ctx.rank), \
            torch.inference_mode():
        with tp.graph_capture() as capture_ctx:
            stream = capture_ctx.stream
            for i, (name, tokens) in enumerate(GRAPH_TOKENS.items()):
                plain = _inputs(ctx, 700 + i, tokens, HIDDEN, torch.bfloat16)[1]
                x, residual, weight = _fused_case(ctx, 800 + i, tokens)[:3]

                def step(plain=plain, x=x, residual=residual, weight=weight) -> tuple:
                    reduced = tp.all_reduce(plain)
                    normed, new_residual = flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm(
                        input_tensor=x, residual=residual, weight=weight, eps=EPS, use_attn_tp_group=True)
                    return reduced, normed, new_residual

                for _ in range(2):  # warm-up inside the capture context, as SGLang's runner does
                    step()
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    outs = step()
                graphs[name] = (graph, plain, x, residual, weight, outs)
        torch.cuda.synchronize()
        rng = random.Random(7)  # the same order on every rank
        order = [rng.choice(list(GRAPH_TOKENS)) for _ in range(INTERLEAVED_STEPS)]
        for s, name in enumerate(order):
            graph, plain, x, residual, weight, outs = graphs[name]
            tokens = GRAPH_TOKENS[name]
            plain_xs, fresh = _inputs(ctx, 1000 + s, tokens, HIDDEN, torch.bfloat16)
            plain.copy_(fresh)
            fx, fres, fw, want_residual, want_norm = _fused_case(ctx, 5000 + s, tokens)
            x.copy_(fx), residual.copy_(fres), weight.copy_(fw)
            graph.replay()
            if s % 3 == 0:  # an eager step between replays (its own stream's workspace)
                eager_xs, eager = _inputs(ctx, 9000 + s, 2, HIDDEN, torch.bfloat16)
                ref.check(tp.all_reduce(eager), eager_xs, f"eager call after replay {s}")
            torch.cuda.synchronize()
            ref.check(outs[0], plain_xs, f"replay {s} ({name}) plain")
            _check_fused(outs[1], outs[2], want_residual, want_norm, f"replay {s} ({name}) fused")
            checked += 1
    tp.ca_comm.comm.check()
    tp.ca_comm.close()
    return {"checked": checked, "graphs": sorted(graphs)}


@pytest.mark.parametrize("world", WORLDS)
def test_graphs_of_every_kind_replayed_interleaved_with_eager_calls(world: int) -> None:
    for r in ranks.run_ranks(_interleaved_graphs, world, timeout_s=900, env=serving_env(MAX_BYTES)):
        assert r["checked"] == INTERLEAVED_STEPS and r["graphs"] == sorted(GRAPH_TOKENS), r


def _late_peer_during_a_replay(ctx: ranks.RankContext) -> dict:
    """A decode graph captured as SGLang's runner does; in one replay the last rank does not
    replay (a peer stuck past the timeout). The other ranks' replay gives up, leaves NaN, and their
    next forward step raises CollectiveTimeout naming that rank, before running anything."""
    import sys

    from pcie_allreduce.errors import CollectiveTimeout
    from sglang_plugin import import_hook

    tp = plugin_tp_coordinator(ctx)
    module = fake_model_runner_module()
    sys.modules[module.__name__] = module
    import_hook.on_module_loaded(module.__name__)  # what the import hook's loader does after the import
    runner = module.ModelRunner()
    x = _inputs(ctx, 700, 4, HIDDEN, torch.bfloat16)[1]
    with tp.graph_capture() as capture_ctx:
        tp.all_reduce(x)  # warm-up in the capture context, as SGLang's runner does
        capture_ctx.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture_ctx.stream):
            out = tp.all_reduce(x)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    healthy_step = runner.forward("step 1")
    torch.distributed.barrier(group=ctx.group)
    late = ctx.rank == ctx.world_size - 1
    if not late:
        graph.replay()
    torch.cuda.synchronize()
    result = {"late": late, "healthy_step": list(healthy_step), "all_nan": bool(torch.isnan(out).all())}
    try:
        runner.forward("step 2")
        result["raised"] = None
    except CollectiveTimeout as exc:
        result["raised"], result["peer"] = "CollectiveTimeout", exc.peer
    torch.distributed.barrier(group=ctx.group)  # the late rank stays until the others gave up
    return result


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_a_peer_late_during_a_replay_makes_the_next_forward_step_raise(world: int) -> None:
    env = {**serving_env(MAX_BYTES), "PCIE_AR_SGLANG_TIMEOUT_S": "2"}
    for rank, r in enumerate(ranks.run_ranks(_late_peer_during_a_replay, world, timeout_s=300, env=env)):
        assert r["healthy_step"] == ["ran", "step 1", 1], f"rank {rank}: a healthy step did not run: {r}"
        if r["late"]:
            continue
        assert r["all_nan"], f"rank {rank}: the replay that gave up left data in its output: {r}"
        assert r["raised"] == "CollectiveTimeout" and r["peer"] == world - 1, \
            f"rank {rank}: the next forward step did not raise the recorded timeout naming rank {world - 1}: {r}"
