"""CPU tests of the all-reduce across nodes: node discovery and its emulation ($PCIE_AR_NODES),
the layouts the hierarchy takes, and the hierarchy itself over gloo, each node's own all-reduce
stood in for by the rank-order fp32 sum the kernels compute (the GPU suite runs the kernels)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from pcie_allreduce.tools import ranks
from pcie_allreduce.fabric import nodes
from pcie_allreduce.errors import InterNodeError
from pcie_allreduce import inter_node
from pcie_allreduce.hierarchy import HierarchicalCommunicator
from pcie_allreduce.inter_node import InterNodeLink
from pcie_allreduce.fabric.nodes import NodeLayout, layout_of, off_node_bytes, shard_bounds
from pcie_allreduce.settings import SettingsError
from tests import _reference as ref


def test_host_identity_is_the_host_name_and_the_boot_id(tmp_path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("1234-abcd\n")
    import socket

    assert nodes.host_identity(str(boot)) == f"{socket.gethostname()}/1234-abcd"
    assert nodes.host_identity(str(tmp_path / "missing")) == socket.gethostname()


def test_emulated_nodes_parse_and_name_the_variable() -> None:
    assert nodes.emulated_nodes({}) is None and nodes.emulated_nodes({"PCIE_AR_NODES": " "}) is None
    assert nodes.emulated_nodes({"PCIE_AR_NODES": "4"}) == 4 and nodes.emulated_nodes({"PCIE_AR_NODES": " 2 "}) == 2
    for bad, why in (("0", "must be at least 1"), ("-2", "must be at least 1"), ("two", "expected a whole number"),
                     ("1.5", "expected a whole number"), ("\u00b2", "expected a whole number"),
                     ("\u0664", "expected a whole number")):
        with pytest.raises(SettingsError, match=f"PCIE_AR_NODES={bad!r}: {why}"):
            nodes.emulated_nodes({"PCIE_AR_NODES": bad})


def test_layouts_from_identities_and_emulation() -> None:
    two = layout_of(["a", "a", "b", "b"])
    assert two.nodes == ((0, 1), (2, 3)) and two.source == "host identity" and two.hierarchy_problem() is None
    assert [two.node_of(r) for r in range(4)] == [0, 0, 1, 1] and [two.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert two.describe() == "0-1;2-3" and two.count == 2 and two.world == 4
    assert "one node" in layout_of(["a"] * 4).hierarchy_problem()
    interleaved = layout_of(["a", "b", "a", "b"])
    assert interleaved.nodes == ((0, 2), (1, 3))
    assert "not a run of consecutive ranks (0,2;1,3)" in interleaved.hierarchy_problem()
    assert "different numbers of ranks (0-2;3)" in layout_of(["a", "a", "a", "b"]).hierarchy_problem()
    emulated = layout_of(["a"] * 8, [4] * 8)
    assert emulated == nodes.equal_nodes(8, 4)
    assert emulated.nodes == ((0, 1), (2, 3), (4, 5), (6, 7)) and emulated.source == "$PCIE_AR_NODES"
    assert layout_of(["a"] * 4, [4] * 4).nodes == ((0,), (1,), (2,), (3,))
    with pytest.raises(ValueError, match="does not divide the group's 6 ranks"):
        layout_of(["a"] * 6, [4] * 6)
    with pytest.raises(ValueError, match="set \\$PCIE_AR_NODES differently"):
        layout_of(["a"] * 2, [2, None])


def test_off_node_bytes_per_rank() -> None:
    """1/L of the message per rank: its shard of the fp32 partial, or (last node) of the result to
    each other node."""
    layout = nodes.equal_nodes(8, 2)  # 0-3;4-7
    assert [off_node_bytes(1000, 2, layout, r) for r in range(8)] == [1000] * 4 + [500] * 4
    assert [off_node_bytes(10, 2, layout, r) for r in range(8)] == [8, 12, 8, 12, 4, 6, 4, 6]
    four = nodes.equal_nodes(4, 4)
    assert [off_node_bytes(10, 2, four, r) for r in range(4)] == [40, 40, 40, 60]
    assert shard_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)] and shard_bounds(1, 2) == [(0, 0), (0, 1)]


CPU_CASES = [(1, torch.bfloat16), (3, torch.float32), (7, torch.float16), (4099, torch.bfloat16),
             (7168 * 3 + 5, torch.float16), (1000, torch.float32)]


class _RankOrderSum:
    """A node's all-reduce as the kernels compute it: the fp32 sum in rank order (gloo, CPU)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x, group=self.group)
        acc = parts[0].clone()
        for part in parts[1:]:
            acc += part
        return acc


def _hierarchy_rank(ctx: ranks.RankContext, node_counts: list[int]) -> dict:
    gathered = nodes.gather_layout(ctx.group)  # $PCIE_AR_NODES=2 in every rank
    checked = 0
    for count in node_counts:
        layout = nodes.equal_nodes(ctx.world_size, count)
        comm = HierarchicalCommunicator(ctx.group, "cpu", layout=layout, intra_node=_RankOrderSum,
                                        inter_node_timeout_s=30)
        for seed, (numel, dtype) in enumerate(CPU_CASES):
            inputs = ref.all_inputs(seed + 100 * count, ctx.world_size, numel, dtype)
            out = torch.full_like(inputs[ctx.rank], float("nan"))
            got = comm.all_reduce(inputs[ctx.rank].view(1, -1) if numel > 1000 else inputs[ctx.rank],
                                  out=out.view(1, -1) if numel > 1000 else out)
            want = ref.exact(inputs)  # the single-node result: the fp32 sum in rank order, rounded once
            assert torch.equal(ref.bits(got.reshape(-1)), ref.bits(want)), f"{count} nodes, {numel} {dtype}"
            checked += 1
        # -0.0 on every rank stays -0.0, NaN (any payload) and infinities pass, as in the flat sum
        edge = [torch.tensor([-0.0, float("nan"), float("inf"), -1.5, 0.0], dtype=torch.bfloat16)
                for _ in range(ctx.world_size)]
        got = comm.all_reduce(edge[ctx.rank])
        assert not ref.bitwise_mismatches(got, ref.exact(edge)).any(), f"{count} nodes: edge values {got}"
        checked += 1
    return {"nodes": gathered.nodes, "source": gathered.source, "checked": checked}


@pytest.mark.parametrize("world, node_counts", [(4, [2, 4]), (8, [2, 4])])
def test_hierarchical_sum_is_bitwise_the_single_node_sum(world: int, node_counts: list[int]) -> None:
    """Two and four nodes of 1, 2 and 4 ranks: the chain of fp32 partials gives the flat result
    bit for bit on every rank, bf16 / fp16 / fp32, odd sizes."""
    results = ranks.run_ranks(_hierarchy_rank, world, node_counts, gpu=False, timeout_s=240,
                              env={"PCIE_AR_NODES": "2"})
    half = world // 2
    for r in results:
        assert r["nodes"] == (tuple(range(half)), tuple(range(half, world))) and r["source"] == "$PCIE_AR_NODES"
        assert r["checked"] == (len(CPU_CASES) + 1) * len(node_counts)


def _silent_last_node_rank(ctx: ranks.RankContext) -> dict:
    layout = nodes.equal_nodes(4, 2)
    comm = HierarchicalCommunicator(ctx.group, "cpu", layout=layout, intra_node=_RankOrderSum,
                                    inter_node_timeout_s=2)
    if ctx.rank == 2:  # the last node's first rank never sends the result back
        comm._link.send = lambda tensor, peer, step: None  # type: ignore[method-assign]
    x = torch.randn(64)
    started = time.monotonic()
    raised = None
    try:
        comm.all_reduce(x)
    except InterNodeError as exc:
        raised = {"peer": exc.peer, "stage": exc.stage, "rank": exc.rank, "message": str(exc)}
    except RuntimeError as exc:  # the node's own all-reduce, its peer gone (on GPUs: the kernel's timeout)
        raised = {"node": " ".join(str(exc).split())[:200]}
    elapsed = time.monotonic() - started
    again = None
    if raised:
        try:
            comm.all_reduce(x)
        except RuntimeError as exc:
            again = str(exc)
    # no collective after this: a receive that timed out leaves gloo's connection to that peer closed
    return {"raised": raised, "elapsed": elapsed, "again": again}


def test_a_silent_inter_node_peer_raises_naming_the_step_never_hangs() -> None:
    """The last node's first rank never sends node 0's first rank its shard of the result: that
    rank raises InterNodeError naming the step and the peer after the timeout, and refuses later
    calls; its node peer's gather fails in turn; nothing hangs."""
    results = ranks.run_ranks(_silent_last_node_rank, 4, gpu=False, timeout_s=120)
    r0 = results[0]
    assert r0["raised"] == {"peer": 2, "stage": "the result from node 1", "rank": 0,
                            "message": r0["raised"]["message"]}, r0
    assert "rank 0: the inter-node step 'the result from node 1' with rank 2 failed over gloo" in r0["raised"]["message"]
    assert r0["elapsed"] < 20 and "failed earlier" in r0["again"]
    # rank 1 got its shard but then lost rank 0 in the node's gather; node 1 finished
    assert results[1]["raised"] is not None and "node" in results[1]["raised"], results[1]
    assert results[2]["raised"] is None and results[3]["raised"] is None, results


def test_layout_the_hierarchy_refuses_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None),
                                                                                             [obj] * len(out)))
    group = object()
    with pytest.raises(ValueError, match="cannot serve this group: the group runs on one node"):
        HierarchicalCommunicator(group, "cpu", layout=NodeLayout(((0, 1, 2, 3),)))
    with pytest.raises(ValueError, match="node 0 holds ranks \\[0, 2\\], not a run of consecutive ranks"):
        HierarchicalCommunicator(group, "cpu", layout=layout_of(["a", "b", "a", "b"]))
    with pytest.raises(ValueError, match="the node layout covers 2 ranks, the group has 4"):
        HierarchicalCommunicator(group, "cpu", layout=NodeLayout(((0,), (1,))))
    for bad in (0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="inter_node_timeout_s must be a number of seconds"):
            HierarchicalCommunicator(group, "cpu", layout=NodeLayout(((0, 1), (2, 3))), inter_node_timeout_s=bad)
    with pytest.raises(ValueError, match="max_bytes=134217729 is above 128 MiB, the most a group across nodes takes"):
        HierarchicalCommunicator(group, "cpu", layout=NodeLayout(((0, 1), (2, 3))), max_bytes=(128 << 20) + 1)


class _FakeWork:
    """An NCCL work as torch reports it: complete once it ran or failed; ``exception()`` says which.
    ``polls``: complete after that many ``is_completed()`` calls."""

    def __init__(self, completed: bool, failure: BaseException | None = None, polls: int | None = None) -> None:
        self.completed, self.failure, self.polls = completed, failure, polls

    def is_completed(self) -> bool:
        if self.polls is not None:
            self.polls -= 1
            self.completed = self.polls <= 0
        return self.completed

    def exception(self) -> BaseException | None:
        if isinstance(self.failure, _Unreadable):
            raise RuntimeError("NCCL communicator was aborted on rank 0")
        return self.failure

    def wait(self, timeout=None) -> bool:  # on NCCL: the current stream waits, the host does not
        return True


class _Unreadable(Exception):
    """A failure whose work raises when its exception is read."""


def _nccl_comm(timeout_s: float = 5.0) -> HierarchicalCommunicator:
    """Rank 0 of two nodes of two ranks, sends on NCCL, no node all-reduce (the host side only)."""
    comm = object.__new__(HierarchicalCommunicator)
    comm.rank, comm.inter_node_timeout_s, comm._closed, comm.intra = 0, timeout_s, False, None
    comm._link = InterNodeLink(None, [0, 1, 2, 3], 0, timeout_s, "nccl")
    comm.device, comm.max_bytes, comm.layout = torch.device("cpu"), 1 << 20, nodes.equal_nodes(4, 2)
    comm.node, comm.local_rank, comm.node_size, comm._global = 0, 0, 2, [0, 1, 2, 3]
    return comm


def test_nccl_works_are_checked_without_waiting_on_the_host() -> None:
    """On NCCL the stream waits, not the host; check() raises InterNodeError for a work that
    failed, or is still pending past the timeout, and forgets the completed ones."""
    comm = object.__new__(HierarchicalCommunicator)
    comm.rank, comm.inter_node_timeout_s, comm.intra = 0, 5.0, None
    comm._link = InterNodeLink(None, [0, 1, 2, 3], 0, 5.0, "nccl")
    now = time.monotonic()
    comm._link.pending = [(now, _FakeWork(True), 1, "a"), (now, _FakeWork(False), 2, "the result from node 1")]
    comm.check()
    assert [p[2] for p in comm._link.pending] == [2]
    comm._link.pending = [(now - 10, _FakeWork(False), 2, "the result from node 1")]
    with pytest.raises(InterNodeError, match="'the result from node 1' with rank 2 failed over nccl: not complete"):
        comm.check()
    with pytest.raises(RuntimeError, match="failed earlier"):
        comm.check()
    comm._link.failed = None
    comm._link.pending = [(now, _FakeWork(True, RuntimeError("NCCL error: remote process exited")), 3, "x")]
    with pytest.raises(InterNodeError, match="with rank 3 failed over nccl: NCCL error: remote process exited"):
        comm.check()


@pytest.mark.parametrize("failure", [RuntimeError("NCCL error: remote process exited"), _Unreadable()])
def test_a_failed_nccl_work_is_never_forgotten_unread(monkeypatch, failure: BaseException) -> None:
    """torch reports a failed NCCL work complete: the sends of the calls after it must not drop it
    unread; check() raises for it, and so does the next call, before it posts anything."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # eager, on a CPU
    comm = _nccl_comm()
    work = _FakeWork(False)
    comm._link._wait(work, 2, "the fp32 partial to node 1")
    work.completed, work.failure = True, failure
    comm._link._wait(_FakeWork(True), 3, "the result from node 1")  # a later send of the same call
    why = "NCCL error: remote process exited" if isinstance(failure, RuntimeError) else "communicator was aborted"
    with pytest.raises(InterNodeError, match=f"'the fp32 partial to node 1' with rank 2 failed over nccl: .*{why}"):
        comm.check()
    comm = _nccl_comm()
    comm._link._wait(work, 2, "the fp32 partial to node 1")
    posted: list = []
    comm._link._start = lambda start, peer, step: posted.append(step)  # type: ignore[method-assign]
    with pytest.raises(InterNodeError, match="with rank 2 failed over nccl"):
        comm.all_reduce(torch.ones(64, dtype=torch.bfloat16))
    assert posted == []


def test_the_pending_nccl_works_are_bounded_without_dropping_one(monkeypatch) -> None:
    """At MAX_PENDING works still pending the host waits for the oldest, at most until its
    timeout: a work that completes meanwhile is read and forgotten, one that does not raises."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # eager, on a CPU
    comm = _nccl_comm(timeout_s=0.5)
    oldest = _FakeWork(False, polls=3)
    comm._link._wait(oldest, 2, "oldest")
    for _ in range(inter_node.MAX_PENDING - 1):
        comm._link._wait(_FakeWork(False), 3, "newer")
    comm._link._wait(_FakeWork(False), 3, "one more")  # waits for the oldest, which completes
    assert len(comm._link.pending) == inter_node.MAX_PENDING and all(p[3] != "oldest" for p in comm._link.pending)
    comm._link.pending[0] = (time.monotonic(), _FakeWork(False), 2, "stuck")
    started = time.monotonic()
    with pytest.raises(InterNodeError, match=r"'stuck' with rank 2 failed over nccl: not complete 0\.[5-9] s after"):
        comm._link._wait(_FakeWork(False), 3, "one too many")
    assert 0.4 < time.monotonic() - started < 5
    comm = _nccl_comm()
    comm._link._wait(_FakeWork(False), 2, "fails later")
    comm._link.pending[0][1].completed, comm._link.pending[0][1].failure = True, RuntimeError("NCCL timeout")
    with pytest.raises(InterNodeError, match="'fails later' with rank 2 failed over nccl: NCCL timeout"):
        for _ in range(inter_node.MAX_PENDING):
            comm._link._wait(_FakeWork(False), 3, "newer")


class _ClosableSum(_RankOrderSum):
    """A node's all-reduce that says whether it was closed; ``fail``: its every call raises."""

    made: list["_ClosableSum"] = []

    def __init__(self, group: dist.ProcessGroup, fail: bool = False) -> None:
        super().__init__(group)
        self.fail, self.closed = fail, False
        _ClosableSum.made.append(self)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the node's all-reduce failed")
        return super().all_reduce(x)

    def close(self) -> None:
        self.closed = True


def _lifetime_rank(ctx: ranks.RankContext) -> dict:
    out: dict = {}
    # Different layouts: every rank raises at once, before any process group is made.
    started = time.monotonic()
    try:
        HierarchicalCommunicator(ctx.group, "cpu", layout=nodes.equal_nodes(4, 4 if ctx.rank == 3 else 2),
                                 intra_node=_ClosableSum, inter_node_timeout_s=30)
    except ValueError as exc:
        out["layouts"] = (str(exc), time.monotonic() - started)
    # One rank gathers the layout ($PCIE_AR_NODES=2), the others pass the same one: agreed.
    comm = HierarchicalCommunicator(ctx.group, "cpu", layout=None if ctx.rank == 0 else nodes.equal_nodes(4, 2),
                                    intra_node=_ClosableSum, inter_node_backend="gloo", inter_node_timeout_s=7)
    between = comm._link.group
    out["made"] = between is not ctx.group and comm.layout.nodes == ((0, 1), (2, 3))
    x = torch.ones(64)
    out["sum"] = comm.all_reduce(x).tolist() == [4.0] * 64
    comm.close()
    comm.close()  # a second close does nothing
    out["closed"] = (_ClosableSum.made[-1].closed, comm._owned_groups == [])
    posted: list = []
    comm._link._start = lambda start, peer, step: posted.append(step)  # type: ignore[method-assign]
    for call in (lambda: comm.all_reduce(x), lambda: comm.all_reduce_rmsnorm(x.view(1, 64), x.view(1, 64),
                                                                             torch.ones(64), 1e-6)):
        try:
            call()
        except RuntimeError as exc:
            out.setdefault("after_close", []).append(str(exc))
    out["posted"] = posted
    # A new communicator over the same ranks after close() (whose groups torch names alike).
    again = HierarchicalCommunicator(ctx.group, "cpu", layout=nodes.equal_nodes(4, 2), intra_node=_ClosableSum,
                                     inter_node_backend="gloo", inter_node_timeout_s=7)
    out["again"] = again.all_reduce(x).tolist() == [4.0] * 64
    again.close()
    # A warm-up that fails closes the node's all-reduce (and shuts down the groups made for it).
    try:
        HierarchicalCommunicator(ctx.group, "cpu", layout=nodes.equal_nodes(4, 2), inter_node_backend="gloo",
                                 intra_node=lambda group: _ClosableSum(group, fail=True), inter_node_timeout_s=2)
    except (RuntimeError, InterNodeError) as exc:
        made = _ClosableSum.made[-1]
        out["warm_up"] = (type(exc).__name__, made.fail, made.closed)
    # no collective on ctx.group's peers after this: rank 2's receive timed out on the group made for it
    return out


def test_layouts_lifetime_and_the_group_between_nodes() -> None:
    """Ranks given different layouts raise together, at once; close() closes the node's all-reduce
    and shuts down both groups made for it (the node's, and the one between nodes); a call after
    it raises without posting a send; a new communicator over the same ranks works; a failed
    warm-up closes the node's all-reduce."""
    results = ranks.run_ranks(_lifetime_rank, 4, gpu=False, timeout_s=240, env={"PCIE_AR_NODES": "2"})
    for rank, r in enumerate(results):
        message, elapsed = r["layouts"]
        assert "the ranks were given different node layouts (rank 0: 0-1;2-3; rank 1: 0-1;2-3; rank 2: 0-1;2-3; " \
               "rank 3: 0;1;2;3)" in message and elapsed < 30, r
        assert r["made"] and r["sum"] and r["again"], r
        assert r["closed"] == (True, True), r
        assert r["after_close"] == ["this hierarchical communicator is closed"] * 2 and r["posted"] == [], r
        # rank 2 waits for node 0's partial, which never comes: InterNodeError; the others' node all-reduce raised
        want = "InterNodeError" if rank == 2 else "RuntimeError"
        assert r["warm_up"] == (want, True, True), (rank, r)


def test_an_nccl_group_between_nodes_gets_the_timeout_and_a_failed_warm_up_releases_everything(monkeypatch) -> None:
    """inter_node_backend="nccl": the group is made with inter_node_timeout_s as its timeout (what
    NCCL's watchdog bounds its works by); a warm-up that fails closes the node's all-reduce and
    shuts down both groups made for it, and the error that failed it is the one raised."""
    made, shut = [], []

    class Group:
        def __init__(self, backend: str) -> None:
            self.backend = backend

        def shutdown(self) -> None:
            shut.append(self)

    def new_group(ranks, backend=None, timeout=None, use_local_synchronization=False):
        made.append((tuple(ranks), backend, timeout))
        return Group(backend)

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: getattr(group, "backend", "gloo"))
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None),
                                                                                             [obj] * len(out)))
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    intra: list[_ClosableSum] = []
    with pytest.raises(RuntimeError, match="the node's all-reduce failed"):
        HierarchicalCommunicator(Group("gloo"), "cpu", layout=nodes.equal_nodes(4, 2), inter_node_backend="nccl",
                                 inter_node_timeout_s=42,
                                 intra_node=lambda group: intra.append(_ClosableSum(group, fail=True)) or intra[-1])
    from datetime import timedelta

    assert made == [((0, 1, 2, 3), "nccl", timedelta(seconds=42)), ((0, 1), "gloo", None)]
    assert intra[0].closed and [g.backend for g in shut] == ["nccl", "gloo"]


def _one_rank_skips_its_exchange(ctx: ranks.RankContext) -> dict:
    """2x2 emulated nodes; rank 2 (node 1's first rank) never sends during creation's warm-up, so
    rank 0 never gets its shard of the result: creation must fail on every rank alike."""
    if ctx.rank == 2:
        InterNodeLink.send = lambda self, tensor, peer, step: None  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        comm = HierarchicalCommunicator(ctx.group, "cpu", layout=nodes.equal_nodes(4, 2),
                                        intra_node=_ClosableSum, inter_node_timeout_s=2)
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        made = _ClosableSum.made[-1] if _ClosableSum.made else None
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - started,
                "node_closed": made is not None and made.closed}
    comm.close()
    return {"error": None, "elapsed": time.monotonic() - started}


def test_creation_is_all_or_nothing_when_one_rank_skips_its_exchange() -> None:
    """Every rank raises (none returns a communicator), within the creation bound: rank 0 the
    timeout of the receive that never came, naming rank 2 and the step; node 1's ranks, whose own
    part went well, an error naming rank 0 and why; rank 1 (whose node gather lost rank 0) its own
    or that one; each rank's node all-reduce is closed."""
    results = ranks.run_ranks(_one_rank_skips_its_exchange, 4, gpu=False, timeout_s=120, env={"PCIE_AR_NODES": "2"})
    assert all(r["error"] is not None for r in results), results
    assert all(r["elapsed"] < 3 * 2 + 10 for r in results), [r["elapsed"] for r in results]
    assert results[0]["error"] == "InterNodeError" and "'the result from node 1' with rank 2" in results[0]["message"]
    for r in results[2:]:
        assert r["error"] == "UnavailableError" and "creating the hierarchical communicator failed on another rank" \
            in r["message"] and "rank 0: InterNodeError" in r["message"], r
    assert all(r["node_closed"] for r in results), results
