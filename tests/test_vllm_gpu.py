"""vLLM's real CudaCommunicator on W ranks (one GPU under MPS) with the plugin loaded by vLLM.

Each rank runs vLLM's ``load_general_plugins()`` (which finds the entry point), builds vLLM's
``GroupCoordinator`` for ``tp`` with a gloo device group and vLLM's ``CudaCommunicator`` (vLLM's NCCL
and torch symmetric memory communicators off: tests/_vllm.py's ``plugin_env``), then
checks against the rank-order fp32 reference (tests/_reference.py), every result exact:

- eager ``GroupCoordinator.all_reduce`` (vLLM's ``torch.ops.vllm.all_reduce`` -> CudaCommunicator ->
  ``ca_comm``) for decode sizes and dtypes, out of place; a size above ``max_bytes`` falls back to
  vLLM's next backend (gloo here), on integer-valued inputs so its sum is exact too;
- the fused op ``pcie_allreduce_vllm::all_reduce_rmsnorm``: the new residual bitwise
  ``residual + all_reduce(x)``, the norm within the fp64 reference's ulp bound;
- the same inside ``GroupCoordinator.graph_capture()`` + ``torch.cuda.graph`` (warm-up in the
  capture context, capture, replays with new inputs);
- a replay one rank skips: vLLM's next step (``WorkerWrapperBase.execute_model``) raises the
  recorded failure on every rank, naming rank, peer and stage;
- teardown: the group made and destroyed twice (``GroupCoordinator.destroy``) on each transport
  gives back the GPU memory, mapped host segments and /dev/shm entries.

Skips with a reason without a GPU, without the built extension, or without vLLM.
Run: ``PCIE_AR_TEST_VLLM_WORLDS=2,4 python -m pytest -q -rs tests/test_vllm_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.tools import ranks
from tests import _reference as ref
from tests._vllm import ensure_entry_point, plugin_env, tp_group, vllm_skip_reason

SKIP_REASON = ranks.skip_reason_no_gpu() or pcie_allreduce.unavailable_reason() or vllm_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

WORLDS = [int(w) for w in os.environ.get("PCIE_AR_TEST_VLLM_WORLDS", "2,4").split(",")]
MAX_BYTES = 1 << 20
HIDDEN = 7168
EPS = 1e-6
DECODE_TOKENS = (1, 4, 8, 32)
EAGER_CASES = [(t, HIDDEN, torch.bfloat16) for t in DECODE_TOKENS] + [
    (4, 4096, torch.float16), (3, 1000, torch.float32), (1, 7, torch.bfloat16)]


def _env() -> dict[str, str]:
    return plugin_env(PCIE_AR_VLLM_MODE="always", PCIE_AR_VLLM_MAX_BYTES=str(MAX_BYTES),
                      PCIE_AR_VLLM_TIMEOUT_S="30")


def _inputs(ctx, seed: int, tokens: int, hidden: int, dtype: torch.dtype):
    xs = [ref.rank_input(seed, r, tokens * hidden, dtype) for r in range(ctx.world_size)]
    return xs, xs[ctx.rank].view(tokens, hidden).to(ctx.device)


def _fused_case(ctx, seed: int, tokens: int):
    xs, x = _inputs(ctx, seed, tokens, HIDDEN, torch.bfloat16)
    residual = ref.rank_input(seed, 99, tokens * HIDDEN, torch.bfloat16).view(tokens, HIDDEN)
    weight = (1 + 0.1 * ref.rank_input(seed, 98, HIDDEN, torch.float32)).to(torch.bfloat16)
    want_residual = residual + ref.exact(xs).view(tokens, HIDDEN)
    return x, residual.to(ctx.device), weight.to(ctx.device), want_residual


def _check_fused(normed, new_residual, weight, want_residual, what: str) -> None:
    assert torch.equal(new_residual.cpu(), want_residual), f"{what}: residual is not residual + all_reduce(x)"
    ref.check_rmsnorm(normed, new_residual, weight, EPS, what)


def _rank(ctx: ranks.RankContext) -> dict:
    ensure_entry_point()
    from vllm.plugins import load_general_plugins

    from vllm_plugin.adapter import VllmAllReduceAdapter

    load_general_plugins()
    tp = tp_group(ctx, ctx.device)
    adapter = tp.device_communicator.ca_comm
    assert isinstance(adapter, VllmAllReduceAdapter) and not adapter.disabled, f"ca_comm is {adapter!r}"
    op = torch.ops.pcie_allreduce_vllm.all_reduce_rmsnorm
    report: dict = {"eager": 0, "fused": 0}
    for seed, (tokens, hidden, dtype) in enumerate(EAGER_CASES):
        xs, x = _inputs(ctx, seed, tokens, hidden, dtype)
        before = x.clone()
        assert adapter.should_custom_ar(x)
        y = tp.all_reduce(x)
        ref.check(y, xs, f"eager {tokens}x{hidden} {dtype}")
        assert y.data_ptr() != x.data_ptr() and torch.equal(x, before), "not out of place"
        report["eager"] += 1
    big_xs = [ref.rank_input(100, r, MAX_BYTES // 4 + 4, torch.float32).round() for r in range(ctx.world_size)]
    big = big_xs[ctx.rank].to(ctx.device)
    assert not adapter.should_custom_ar(big)
    ref.check(tp.all_reduce(big.clone()), big_xs, "eager fallback above max_bytes")
    for seed, tokens in enumerate(DECODE_TOKENS, start=200):
        x, residual, weight, want_residual = _fused_case(ctx, seed, tokens)
        assert adapter.can_fuse(x, residual, weight, EPS)
        normed, new_residual = op(x, residual, weight, EPS, tp.unique_name)
        _check_fused(normed, new_residual, weight, want_residual, f"fused T={tokens}")
        assert torch.equal(new_residual, residual + tp.all_reduce(x)), "fused residual differs from the unfused pair"
        report["fused"] += 1
    with torch.inference_mode():
        report["graph"] = _graph(ctx, tp, op)
    adapter.comm.check()
    adapter.close()
    return report


def _graph(ctx: ranks.RankContext, tp, op) -> dict:
    plain = [_inputs(ctx, 300 + i, t, HIDDEN, torch.bfloat16)[1] for i, t in enumerate(DECODE_TOKENS)]
    fused = [_fused_case(ctx, 400 + i, t)[:3] for i, t in enumerate(DECODE_TOKENS)]

    def forward() -> list:
        outs = []
        for _layer in range(3):
            outs += [tp.all_reduce(x) for x in plain]
            outs += [op(x, residual, weight, EPS, tp.unique_name) for x, residual, weight in fused]
        return outs

    with tp.graph_capture() as capture_ctx:  # enters ca_comm.capture() with the capture stream current
        stream = capture_ctx.stream
        for _ in range(2):  # vLLM warms up before capturing
            forward()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = forward()
    torch.cuda.synchronize()
    for rep in range(3):
        wants_plain, wants_fused = [], []
        for i, (x, t) in enumerate(zip(plain, DECODE_TOKENS)):
            xs, fresh = _inputs(ctx, 500 + 10 * rep + i, t, HIDDEN, torch.bfloat16)
            x.copy_(fresh)
            wants_plain.append(xs)
        for i, ((x, residual, weight), t) in enumerate(zip(fused, DECODE_TOKENS)):
            fx, fres, fw, want_residual = _fused_case(ctx, 600 + 10 * rep + i, t)
            x.copy_(fx), residual.copy_(fres), weight.copy_(fw)
            wants_fused.append((weight, want_residual))
        graph.replay()
        torch.cuda.synchronize()
        k = 0
        for layer in range(3):
            for xs in wants_plain:
                ref.check(outs[k], xs, f"graph replay {rep} layer {layer} plain")
                k += 1
            for weight, want_residual in wants_fused:
                _check_fused(*outs[k], weight, want_residual, f"graph replay {rep} layer {layer} fused")
                k += 1
    return {"replays": 3, "collectives_per_replay": len(outs)}


@pytest.mark.parametrize("world", WORLDS)
def test_vllm_cuda_communicator_with_plugin(world: int) -> None:
    results = ranks.run_ranks(_rank, world, timeout_s=900, env=_env())
    assert all(r == results[0] for r in results), results
    assert results[0] == {"eager": len(EAGER_CASES), "fused": len(DECODE_TOKENS),
                          "graph": {"replays": 3, "collectives_per_replay": 3 * 2 * len(DECODE_TOKENS)}}


def _skipped_replay(ctx: ranks.RankContext) -> dict:
    """A decode graph captured as vLLM's runner does, replayed by a stand-in worker's step behind
    vLLM's real ``WorkerWrapperBase.execute_model`` (which the plugin wraps). In one replay the
    last rank does not replay: the others' replay gives up and leaves NaN, and their next step
    raises before running; the late rank's own next collective then finds nobody and gives up, and
    its step after that raises. Every rank: CollectiveTimeout / CollectiveMismatch naming itself,
    a peer and the stage."""
    ensure_entry_point()
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from pcie_allreduce.errors import CollectiveError

    load_general_plugins()
    tp = tp_group(ctx, ctx.device)
    x = _inputs(ctx, 700, 4, HIDDEN, torch.bfloat16)[1]
    with tp.graph_capture() as capture_ctx:
        tp.all_reduce(x)  # warm-up in the capture context, as vLLM's runner does
        capture_ctx.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture_ctx.stream):
            out = tp.all_reduce(x)
    torch.cuda.synchronize()

    class Worker:  # the step vLLM's worker runs: here, one graph replay
        def execute_model(self, scheduler_output):
            graph.replay()
            torch.cuda.synchronize()
            return bool(torch.isnan(out).any())

    wrapper = WorkerWrapperBase(rpc_rank=ctx.rank)
    wrapper.worker, wrapper.mm_receiver_cache = Worker(), None
    result = {"healthy_nan": wrapper.execute_model("step 1")}
    torch.distributed.barrier(group=ctx.group)
    late = ctx.rank == ctx.world_size - 1
    if not late:
        graph.replay()
    torch.cuda.synchronize()
    # The late rank's next replay would otherwise complete the others' (the same call, one step
    # late): it waits until their replay gave up.
    torch.distributed.barrier(group=ctx.group)
    result.update(late=late, all_nan=bool(torch.isnan(out).all()), raised=None)
    for step in range(2, 6):
        try:
            wrapper.execute_model(f"step {step}")
        except CollectiveError as exc:
            result["raised"] = (type(exc).__name__, exc.rank, exc.peer, exc.stage, step)
            break
    torch.distributed.barrier(group=ctx.group)  # the late rank stays until the others gave up
    return result


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_a_skipped_replay_makes_the_next_step_raise_on_every_rank(world: int) -> None:
    env = {**_env(), "PCIE_AR_VLLM_TIMEOUT_S": "2"}
    for rank, r in enumerate(ranks.run_ranks(_skipped_replay, world, timeout_s=300, env=env)):
        assert r["healthy_nan"] is False, f"rank {rank}: a healthy step left NaN: {r}"
        assert r["raised"] is not None, f"rank {rank}: no step raised the recorded failure: {r}"
        kind, who, peer, stage, step = r["raised"]
        assert kind in ("CollectiveTimeout", "CollectiveMismatch") and who == rank and stage, r
        assert peer != rank and 0 <= peer < world, r
        if not r["late"]:
            assert r["all_nan"], f"rank {rank}: the replay that gave up left data in its output: {r}"
            assert step == 2 and peer == world - 1, f"rank {rank}: the next step did not raise naming the late rank: {r}"


def _teardown_twice(ctx: ranks.RankContext) -> dict:
    """vLLM's tp group with our ca_comm (an eager workspace and a graph-captured one) made and
    destroyed twice (``GroupCoordinator.destroy``): GPU memory, mapped host segments and /dev/shm
    entries come back to where they started."""
    ensure_entry_point()
    from vllm.plugins import load_general_plugins

    from pcie_allreduce.transport import SEGMENT_PREFIX

    def segments() -> tuple[int, int]:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            mapped = len({line.split()[-1] for line in maps if SEGMENT_PREFIX in line})
        return mapped, sum(name.startswith(SEGMENT_PREFIX) for name in os.listdir("/dev/shm"))

    def free_bytes() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.distributed.barrier(group=ctx.group)  # every rank at the same point of the round
        free = torch.cuda.mem_get_info(ctx.device)[0]
        torch.distributed.barrier(group=ctx.group)
        return free

    load_general_plugins()
    start = (free_bytes(), segments())
    rounds = []
    for _ in range(2):
        tp = tp_group(ctx, ctx.device)
        adapter = tp.device_communicator.ca_comm
        x = _inputs(ctx, 800, 4, HIDDEN, torch.bfloat16)[1]
        tp.all_reduce(x)
        with tp.graph_capture() as capture_ctx:
            tp.all_reduce(x)
            capture_ctx.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=capture_ctx.stream):
                tp.all_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        per_stream = next(iter(adapter.comm._workspaces.values())).total_bytes
        streams = len(adapter.comm._workspaces)
        del graph
        tp.destroy()
        rounds.append({"streams": streams, "retained": adapter.comm.retained_bytes,
                       "open": len(adapter.comm._workspaces), "free": free_bytes(), "segments": segments()})
    return {"start": start, "rounds": rounds, "per_stream": per_stream, "transport": adapter.comm.transport}


@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_teardown_twice_frees_every_workspace(transport: str) -> None:
    world = 2
    env = {**_env(), "PCIE_AR_TRANSPORT": transport}
    for r in ranks.run_ranks(_teardown_twice, world, timeout_s=600, env=env):
        (_, segments0), per_stream = r["start"], r["per_stream"]
        # The first round also leaves what the process keeps for good (torch's cached blocks, CUDA's
        # and vLLM's first-use buffers: ~240 MiB on an H100), so GPU memory is compared with the end
        # of the first round: a second make-and-destroy must give back all it took.
        free1 = r["rounds"][0]["free"]
        for n, round_ in enumerate(r["rounds"]):
            assert round_["streams"] == 2 and round_["retained"] == 0 and round_["open"] == 0, (n, r)
            assert round_["segments"] == segments0, f"round {n}: host segments left mapped or in /dev/shm: {r}"
            # every rank's workspaces are on this one GPU; less than one of them may be missing
            assert free1 - round_["free"] < per_stream, f"round {n}: GPU memory not returned: {r}"
