"""The plugins' per-step failure check and teardown, on CPU ranks with the engines' real classes.

- vLLM: a failure a collective recorded (as a replayed CUDA graph's would be) raises from vLLM's
  own ``WorkerWrapperBase.execute_model``, the call every executor makes once per step, before the
  worker's step runs; a healthy step runs.
- Teardown: vLLM's ``GroupCoordinator.destroy`` (-> ``CudaCommunicator.destroy``) and SGLang's
  ``GroupCoordinator.destroy`` close our communicator, so creating and destroying a group twice in
  one process leaves no workspace allocated, graph-captured ones included; a second close does
  nothing; and a rank whose peer never tears down does not hang (it keeps its memory instead).

The communicator is pcie_allreduce's own, on the fake extension of tests/_creation_fakes.py
(its workspaces record whether they were freed or retired); the engines' classes are never stood in for.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.plan.tables import default_table
from pcie_allreduce import communicator, workspaces
from pcie_allreduce.tools import ranks
from pcie_allreduce.errors import CollectiveTimeout
from tests._sglang import ensure_entry_point as ensure_sglang_entry_point, sglang_skip_reason
from tests._standins import GlooCommunicator
from tests._vllm import ensure_entry_point as ensure_vllm_entry_point, plugin_env, tp_group, vllm_skip_reason
from tests._creation_fakes import FakeWorkspace, _fake_cuda

VLLM_SKIP = vllm_skip_reason()
SGLANG_SKIP = sglang_skip_reason()
needs_vllm = pytest.mark.skipif(VLLM_SKIP is not None, reason=VLLM_SKIP or "")
needs_sglang = pytest.mark.skipif(SGLANG_SKIP is not None, reason=SGLANG_SKIP or "")


def _vllm_facts(device: Any) -> Any:
    from pcie_allreduce.plugin_eligibility import RankFacts

    rank = torch.distributed.get_rank()
    return RankFacts(host="testhost", unavailable=None, physical_gpu=rank, sm="SM120")


def _sglang_facts(device: Any) -> Any:
    from pcie_allreduce.plugin_eligibility import RankFacts

    rank = torch.distributed.get_rank()
    return RankFacts(host="testhost", unavailable=None, physical_gpu=rank, sm="SM120")


class _FailingGloo(GlooCommunicator):
    """The stand-in communicator, whose check() raises what a kernel recorded once ``failure`` is set."""

    failure: Exception | None = None

    def check(self) -> None:
        super().check()
        if self.failure is not None:
            raise self.failure


def _real_communicator(transport: str):
    """pcie_allreduce's Communicator on the fake extension (every rank on "cuda:0")."""

    def make(group: Any, device: Any, *, max_bytes: int, timeout_s: float) -> Any:
        return pcie_allreduce.Communicator(group, "cuda:0", max_bytes=max_bytes, timeout_s=timeout_s,
                                           algo_table=default_table(), transport=transport)

    return make


def _fake_gpu(rank: int) -> None:
    _fake_cuda("none", rank)
    torch.cuda.synchronize = lambda device=None: None


def _live() -> int:
    return sum(not (w.closed or w.retired) for w in FakeWorkspace.instances)


# ---------------------------------------------------------------------------- vLLM: the per-step check


def _vllm_step(ctx: ranks.RankContext) -> dict:
    ensure_vllm_entry_point()
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm_plugin import lifecycle, plugin

    load_general_plugins()
    plugin.STATE.communicator_factory, plugin.STATE.facts_fn = _FailingGloo, _vllm_facts
    tp = tp_group(ctx, torch.device("cpu"))
    adapter = tp.device_communicator.ca_comm
    ran: list[Any] = []

    class Worker:  # what WorkerWrapperBase.init_worker would have built: the step it forwards to
        def execute_model(self, scheduler_output: Any) -> Any:
            ran.append(scheduler_output)
            return f"output of {scheduler_output}"

    wrapper = WorkerWrapperBase(rpc_rank=ctx.rank)
    wrapper.worker, wrapper.mm_receiver_cache = Worker(), None
    out: dict = {"attached": sorted(lifecycle.attached()), "healthy": wrapper.execute_model("step 1")}
    adapter.comm.failure = CollectiveTimeout(f"rank {ctx.rank} waited more than 2 s for rank 1", rank=ctx.rank,
                                             peer=1, stage="flag wait")
    try:
        wrapper.execute_model("step 2")
        out["raised"] = None
    except CollectiveTimeout as exc:
        out["raised"] = (type(exc).__name__, exc.rank, exc.peer, exc.stage)
    out["ran"] = list(ran)
    adapter.comm.failure = None
    plugin.unregister()
    out["detached"] = (lifecycle.attached(), getattr(WorkerWrapperBase.execute_model, "__wrapped__", None))
    adapter.close()
    return out


@needs_vllm
def test_vllm_step_raises_a_recorded_failure_before_running() -> None:
    """The failure surfaces at vLLM's per-step entry (WorkerWrapperBase.execute_model) on every
    rank, naming rank, peer and stage, and the worker's step does not run; unregister() unwraps."""
    from vllm_plugin import lifecycle

    results = ranks.run_ranks(_vllm_step, 2, gpu=False, timeout_s=300, env=plugin_env(PCIE_AR_VLLM_MODE="always"))
    for rank, r in enumerate(results):
        assert r["attached"] == sorted([lifecycle.STEP, lifecycle.DESTROY]), r
        assert r["healthy"] == "output of step 1", r
        assert r["raised"] == ("CollectiveTimeout", rank, 1, "flag wait"), r
        assert r["ran"] == ["step 1"], r
        assert r["detached"] == ((), None), r


# ---------------------------------------------------------------------------- teardown


def _vllm_teardown(ctx: ranks.RankContext, transport: str) -> dict:
    _fake_gpu(ctx.rank)
    ensure_vllm_entry_point()
    from vllm.plugins import load_general_plugins

    from vllm_plugin import plugin

    load_general_plugins()
    plugin.STATE.communicator_factory, plugin.STATE.facts_fn = _real_communicator(transport), _vllm_facts
    start = _live()
    out: dict = {"start": start, "after": []}
    for _ in range(2):
        tp = tp_group(ctx, torch.device("cpu"))
        adapter = tp.device_communicator.ca_comm
        adapter.comm._workspace(8).captured = True  # a second stream's workspace, as a graph capture records it
        out["made"] = _live() - start
        tp.destroy()  # vLLM's teardown: CudaCommunicator.destroy drops ca_comm
        out["after"].append(_live())
        adapter.close()  # idempotent
    out["retained"] = sum(w.retired for w in FakeWorkspace.instances)
    return out


@needs_vllm
@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_vllm_teardown_frees_every_workspace(transport: str) -> None:
    results = ranks.run_ranks(_vllm_teardown, 2, transport, gpu=False, timeout_s=300,
                              env=plugin_env(PCIE_AR_VLLM_MODE="always"))
    for r in results:
        assert r["made"] == 2 and r["after"] == [r["start"]] * 2 and r["retained"] == 0, r


def _sglang_teardown(ctx: ranks.RankContext) -> dict:
    _fake_gpu(ctx.rank)
    ensure_sglang_entry_point()
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.plugins import load_plugins

    from sglang_plugin.adapter import PcieAllReduceAdapter
    from sglang_plugin.registry import REGISTRY

    load_plugins()
    REGISTRY.state.communicator_factory, REGISTRY.state.facts_fn = _real_communicator("host"), _sglang_facts
    start = _live()
    out: dict = {"start": start, "after": []}
    for _ in range(2):
        tp = GroupCoordinator(group_ranks=[list(range(ctx.world_size))], local_rank=ctx.rank,
                              torch_distributed_backend="gloo", use_pynccl=False, use_mscclpp=False,
                              use_custom_allreduce=True, use_torch_symm_mem_all_reduce=False,
                              use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
        adapter = tp.ca_comm
        assert isinstance(adapter, PcieAllReduceAdapter), adapter
        adapter.comm._workspace(8).captured = True
        out["made"] = _live() - start
        tp.destroy()  # SGLang's teardown: destroys the process groups, then drops ca_comm
        out["after"].append(_live())
        adapter.close()
    out["retained"] = sum(w.retired for w in FakeWorkspace.instances)
    return out


@needs_sglang
def test_sglang_teardown_frees_every_workspace() -> None:
    from tests._sglang import serving_env

    env = {**serving_env(1 << 20), "PCIE_AR_SGLANG_TIMEOUT_S": "5"}
    for r in ranks.run_ranks(_sglang_teardown, 2, gpu=False, timeout_s=300, env=env):
        assert r["made"] == 2 and r["after"] == [r["start"]] * 2 and r["retained"] == 0, r


def _peer_never_tears_down(ctx: ranks.RankContext) -> dict:
    _fake_gpu(ctx.rank)
    workspaces.CLOSE_WAIT_S = 2.0
    ensure_vllm_entry_point()
    from vllm.plugins import load_general_plugins

    from vllm_plugin import plugin

    load_general_plugins()
    plugin.STATE.communicator_factory, plugin.STATE.facts_fn = _real_communicator("p2p"), _vllm_facts
    tp = tp_group(ctx, torch.device("cpu"))
    if ctx.rank == 1:  # gone as far as the others can tell: never reaches the teardown
        time.sleep(8)
        return {}
    started = time.monotonic()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp.destroy()
    return {"elapsed": time.monotonic() - started, "live": _live(),
            "retired": sum(w.retired for w in FakeWorkspace.instances),
            "warned": [str(w.message) for w in caught if "keeps this communicator's workspaces" in str(w.message)]}


@needs_vllm
def test_teardown_never_hangs_on_a_peer_that_is_gone() -> None:
    """Rank 0 tears down alone: it returns within the close bound, keeps its workspace (a peer
    still running may write into it) and says so."""
    r = ranks.run_ranks(_peer_never_tears_down, 2, gpu=False, timeout_s=120,
                        env=plugin_env(PCIE_AR_VLLM_MODE="always"))[0]
    assert r["elapsed"] < 7 and r["live"] == 0 and r["retired"] == 1 and len(r["warned"]) == 1, r
