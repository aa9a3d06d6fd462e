"""Host-side cost of one eager all-reduce call (pytest-benchmark); the goal is under 10 us.

- ``test_host_cost_python_path`` (runs anywhere): ``Communicator.all_reduce`` on
  a CPU tensor with a fake workspace, so it times exactly the Python part (validation, algorithm
  choice, the call into the binding) with a no-op binding.
- ``test_host_cost_reference_torch_launch`` (GPU): one eager torch kernel launch on the same
  tensor, the floor this host puts under any eager GPU call.
- ``test_host_cost_eager_call[full|raw]`` (GPU): a real 2-rank communicator; ``full`` times
  ``comm.all_reduce`` (Python + binding + kernel launch), ``raw`` the binding + launch alone
  (``Workspace.all_reduce``). The peer rank is a subprocess that queues the matching calls 32
  at a time: before every 32nd call (untimed ``setup``) rank 0 synchronizes (so its launch queue
  never fills up: a full queue would make the launch block and time the GPU instead of the
  host), then has the peer queue the next 32 and waits until it has. So rank 0's calls run
  back to back like the reference's, neither each behind a gloo round trip (cold caches) nor
  next to the peer's launches (which queue in a shared MPS server), and the two ranks always
  agree, whatever pytest-benchmark decides to run (``--benchmark-disable`` included): rank 0
  makes up the rest of the last batch untimed. With one GPU both ranks share it as clients of a
  private MPS daemon (no context time-slicing inside the measurement).

An ordinary test run calls each benchmarked function once (tests/conftest.py); to time them:
    pytest tests/test_host_overhead.py --benchmark-enable --benchmark-columns=min,median,mean,max
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from typing import Any

import pytest
import torch

pytest.importorskip("pytest_benchmark")

import pcie_allreduce  # noqa: E402
from pcie_allreduce import communicator, constants  # noqa: E402
from pcie_allreduce.tools import ranks  # noqa: E402
from pcie_allreduce.plan import algorithms, tables  # noqa: E402
from pcie_allreduce.communicator import Communicator  # noqa: E402
from tests import _reference as ref  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN = 7168  # one decode token of DeepSeek-V3 / Kimi-K2.5, bf16: 14 KiB
ROUNDS, WARMUP_ROUNDS, SYNC_EVERY = 300, 30, 32
# The goal, recorded in each benchmark's extra_info next to the timings; informational only, never
# asserted: a time limit in a test would fail on a busy host, and speed claims come from bench/.
GOAL_US = 10.0
# Each rank's input: random integers (tests/_reference.py, integer_input), so the sum is exact.
INPUT_SEED = 41


# ---------------------------------------------------------------------------- CPU: the Python path


class _FakeWorkspace:
    """Stands in for ``_C.Workspace``: the launch is a no-op that reports success."""

    calls = 0

    def all_reduce(self, algo: int, inp: int, out: int, nbytes: int, dtype: int, blocks: int, stream: int) -> int:
        self.calls += 1
        return 0

    def failed(self) -> int:
        return 0

    def close(self) -> None:
        pass


class _FakeStream:
    cuda_stream = 0


def _cpu_communicator(world: int = 4) -> tuple[Communicator, _FakeWorkspace]:
    """A Communicator whose device is the CPU and whose only workspace is fake (no rendezvous)."""
    comm = Communicator.__new__(Communicator)
    workspace = _FakeWorkspace()
    comm._closed = False
    comm.device = torch.device("cpu")
    comm.max_bytes = 8 << 20
    comm.ll_capacity = 512 << 10
    comm.world_size = world
    comm.rank = 0
    comm.table = tables.default_table()
    comm._choices, comm._input_areas = {}, {}
    comm.block_cap = constants.MAX_LAUNCH_BLOCKS
    comm._workspaces = {_FakeStream.cuda_stream: workspace}
    return comm, workspace


def test_host_cost_python_path(benchmark, monkeypatch) -> None:
    monkeypatch.setattr(communicator, "current_stream_handle", lambda device: _FakeStream.cuda_stream)
    comm, workspace = _cpu_communicator()
    x = torch.ones(HIDDEN, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    assert comm.all_reduce(x, out=out) is out and workspace.calls == 1
    benchmark.extra_info.update(what="Communicator.all_reduce, fake binding (validation + algo choice + call)",
                                bytes=x.numel() * 2, goal_us=GOAL_US)
    result = benchmark(comm.all_reduce, x, out)
    assert result is out and workspace.calls > 1


# ---------------------------------------------------------------------------- GPU: the whole call

_PEER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import pcie_allreduce
    from tests import _reference
    init_file, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=1, world_size=2,
                            timeout=timedelta(seconds=120))
    device = torch.device("cuda", 1 % torch.cuda.device_count())
    torch.cuda.set_device(device)
    comm = pcie_allreduce.Communicator(dist.group.WORLD, device, max_bytes=count * 2)
    bound = _reference.integer_bound(2, torch.bfloat16)
    x = _reference.integer_input(seed, 1, count, torch.bfloat16, bound).to(device)
    out = torch.empty_like(x)
    n = torch.zeros(1, dtype=torch.int64)
    while True:
        dist.broadcast(n, src=0)  # how many calls rank 0 will make next
        if int(n) == 0:
            break
        for _ in range(int(n)):
            comm.all_reduce(x, out=out)
        dist.broadcast(n, src=1)  # all queued: rank 0 may start
    torch.cuda.synchronize(device)
    comm.check()
    comm.close()
    dist.destroy_process_group()
""")


def _gpu_problem() -> str | None:
    reason = ranks.skip_reason_no_gpu()
    if reason is not None:
        return reason
    reason = pcie_allreduce.unavailable_reason()
    if reason is not None:
        return reason
    import torch.distributed as dist

    if dist.is_initialized():
        return "this process already has a default process group"
    return None


@pytest.fixture(scope="module")
def shared_gpu_mps() -> Any:
    """With one GPU both ranks run on it: start a private MPS daemon first, so the two processes'
    kernels run side by side instead of time-slicing contexts (which would put GPU context
    switches into a host-side measurement). Must happen before this process touches CUDA."""
    if _gpu_problem() is not None or ranks.gpu_count() >= 2:
        yield None
        return
    from pcie_allreduce.tools.mps import MpsDaemon, MpsError

    try:
        daemon = MpsDaemon.start()
    except MpsError as exc:
        yield f"no MPS ({exc})"
        return
    try:
        with ranks.patched_environ(daemon.env):  # the peer subprocess inherits it too
            yield "MPS"
    finally:
        daemon.stop()


@pytest.mark.parametrize("path", ["full", "raw"])
def test_host_cost_eager_call(benchmark, tmp_path, path: str, shared_gpu_mps: Any) -> None:
    problem = _gpu_problem()
    if problem is not None:
        pytest.skip(problem)
    import torch.distributed as dist

    benchmark.extra_info.update(sharing=shared_gpu_mps or "distinct GPUs")
    init_file = str(tmp_path / "rendezvous")
    peer = subprocess.Popen([sys.executable, "-c", _PEER, init_file, str(HIDDEN), str(INPUT_SEED)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=0, world_size=2,
                                timeout=timedelta(seconds=120))
        try:
            _measure(benchmark, path, dist)
        finally:
            dist.destroy_process_group()
        output, _ = peer.communicate(timeout=120)
        assert peer.returncode == 0, output
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


def test_host_cost_reference_torch_launch(benchmark, shared_gpu_mps: Any) -> None:
    """The floor this host puts under any eager GPU call: one torch elementwise kernel on the same
    7168 bf16 tensor (dispatcher + launch, no communication). Recorded next to ours so the 10 us
    goal can be read against what a launch costs on this machine."""
    problem = _gpu_problem()
    if problem is not None:
        pytest.skip(problem)
    device = torch.device("cuda", 0)
    x = ref.integer_input(INPUT_SEED, 0, HIDDEN, torch.bfloat16, 100).to(device)
    out = torch.full_like(x, float("nan"))
    rounds = [0]

    def setup() -> None:
        if rounds[0] % SYNC_EVERY == 0:
            torch.cuda.synchronize(device)  # keep the launch queue from filling up
        rounds[0] += 1

    benchmark.extra_info.update(what="torch.add(x, x, out=out): one eager torch kernel launch",
                                bytes=x.numel() * 2, sharing=shared_gpu_mps or "own GPU")
    benchmark.pedantic(lambda: torch.add(x, x, out=out), setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    torch.cuda.synchronize(device)
    assert torch.equal(out, x + x)


def _peer_queues(dist, calls: int) -> None:
    """Have the peer queue ``calls`` all-reduces; returns once it has."""
    count = torch.tensor([calls], dtype=torch.int64)
    dist.broadcast(count, src=0)
    dist.broadcast(count, src=1)


def _measure(benchmark, path: str, dist) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    comm = Communicator(dist.group.WORLD, device, max_bytes=HIDDEN * 2)
    bound = ref.integer_bound(2, torch.bfloat16)
    inputs = [ref.integer_input(INPUT_SEED, r, HIDDEN, torch.bfloat16, bound) for r in range(2)]
    x = inputs[0].to(device)
    out = torch.full_like(x, float("nan"))
    made, queued_by_peer = [0], [0]

    def setup() -> None:  # called once before every call pytest-benchmark makes
        if made[0] == queued_by_peer[0]:
            torch.cuda.synchronize(device)
            _peer_queues(dist, SYNC_EVERY)
            queued_by_peer[0] += SYNC_EVERY
        made[0] += 1

    if path == "full":
        target = lambda: comm.all_reduce(x, out=out)  # noqa: E731
        what = "Communicator.all_reduce: validation + algo choice + binding + kernel launch"
    else:
        choice = comm.table.select(x.numel() * 2, comm.world_size, "bfloat16")
        algo_id, blocks = algorithms.ALGO_IDS[choice.algo], min(choice.blocks, comm.block_cap)
        stream = torch.cuda.current_stream(device).cuda_stream
        workspace = comm._workspace(stream)
        args = (algo_id, x.data_ptr(), out.data_ptr(), x.numel() * 2, 2, blocks, stream)
        target = lambda: workspace.all_reduce(*args)  # noqa: E731
        what = "Workspace.all_reduce: binding + kernel launch only"
    benchmark.extra_info.update(what=what, bytes=x.numel() * 2, goal_us=GOAL_US, world=2,
                                shared_gpu=torch.cuda.device_count() < 2)
    try:
        benchmark.pedantic(target, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    finally:
        for _ in range(queued_by_peer[0] - made[0]):  # the rest of the peer's last batch, untimed
            target()
        dist.broadcast(torch.zeros(1, dtype=torch.int64), src=0)  # the peer stops
        torch.cuda.synchronize(device)
    comm.check()
    # the last call's result: the exact sum of two different random integer inputs (a kernel that
    # returned twice its own input, or its input, would fail; all-ones inputs could not tell)
    assert torch.equal(out.cpu(), inputs[0] + inputs[1])
    comm.close()
