"""Creating a Communicator is all or nothing, on CPU ranks with a fake extension.

A rank that fails while creating (a bad argument, no GPU, an allocation or mapping that fails,
probes that do not arrive) makes every rank raise at once, naming that rank and why, and frees
what it allocated; no rank waits in a later rendezvous. Also: argument bounds, agreement across
ranks, and the lifetime rules (never freed by the garbage collector, unusable after fork).
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
import weakref
from typing import Any

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.plan.tables import default_table
from pcie_allreduce import communicator, constants, rendezvous, validation, workspaces
from pcie_allreduce.tools import ranks

WORLD = 2
FAULTS = ("none", "bad_max_bytes", "no_gpu", "alloc", "open", "probe", "layout", "timeout_differs")


class FakeWorkspace:
    """The binding's Workspace as the creation protocol uses it; ``fault`` scripts one failure."""

    instances: list["FakeWorkspace"] = []

    def __init__(self, device: int, rank: int, world: int, max_bytes: int, timeout_s: float, transport: int = 0,
                 segment_name: str = "", *, fault: str) -> None:
        if fault == "alloc":
            raise RuntimeError("CUDA error: out of memory (cudaMalloc)")
        # "open" and "probe" model a platform without usable P2P: the host transport is unaffected.
        if transport != constants.TRANSPORT_IDS["p2p"] and fault in ("open", "probe"):
            fault = "none"
        self.rank, self.world, self.max_bytes, self.fault, self.transport = rank, world, max_bytes, fault, transport
        self.name_released = False
        self.segment_name = segment_name
        self.total_bytes = 4096 + max_bytes * world * 2 + (256 if fault == "layout" else 0)
        self.closed = self.retired = self.captured = False
        FakeWorkspace.instances.append(self)

    def ipc_handle(self) -> bytes:
        return bytes(64)

    def open_peers(self, handles: list[bytes]) -> None:
        if self.fault == "open":
            raise RuntimeError("rank 1 could not map the workspace of rank 0 (cudaIpcOpenMemHandle: invalid handle)")

    def write_probes(self, seed: int) -> None:
        pass

    def probe_failures(self, seed: int) -> list[int]:
        return [0] if self.fault == "probe" else []

    def failed(self) -> int:
        return 0

    def release_name(self) -> None:
        self.name_released = True

    def close(self) -> None:
        self.closed = True

    def retire(self) -> None:
        self.retired = True


class FakeExtension:
    """What Communicator creation asks of pcie_allreduce._C."""

    def __init__(self, fault: str, rank: int = 0, distinct_gpus: bool = False) -> None:
        self.fault, self.rank, self.distinct_gpus = fault, rank, distinct_gpus

    def runtime_status(self) -> str:
        return "no CUDA device is visible" if self.fault == "no_gpu" else ""

    def pci_bus_id(self, device: int) -> str:
        return f"0000:00:{6 + self.rank:02x}.0" if self.distinct_gpus else "0000:00:06.0"

    def device_by_pci_bus_id(self, bus_id: str) -> int:
        return 0 if not self.distinct_gpus or bus_id == self.pci_bus_id(0) else 1

    def can_access_peer(self, device: int, peer: int) -> bool:
        return self.fault != "no_peer_access"

    def Workspace(self, *args: Any) -> FakeWorkspace:  # noqa: N802 - the binding's class name
        return FakeWorkspace(*args, fault=self.fault)


class _Properties:
    """An H100's: its SM count, and the compute capability dependent launch is decided by."""

    multi_processor_count = 132
    major, minor = 9, 0


def _fake_cuda(fault: str, rank: int = 0, distinct_gpus: bool = False) -> None:
    """Inside a CPU rank: the extension and the few torch.cuda calls creation makes (every rank on
    one GPU, or each on its own with ``distinct_gpus``)."""
    from pcie_allreduce import _ext

    _ext.require = lambda: FakeExtension(fault, rank, distinct_gpus)
    torch.cuda.get_device_properties = lambda device: _Properties()
    torch.cuda.device = lambda device: contextlib.nullcontext()
    communicator.current_stream_handle = lambda device: 7


def _create(ctx: ranks.RankContext, fault: str, faulty_rank: int, transport: str = "p2p") -> dict[str, Any]:
    _fake_cuda(fault if ctx.rank == faulty_rank else "none", ctx.rank, distinct_gpus=fault == "no_peer_access")
    max_bytes = constants.MAX_MESSAGE_BYTES + 1 if fault == "bad_max_bytes" and ctx.rank == faulty_rank else 1 << 20
    timeout_s = 3.0 if fault == "timeout_differs" and ctx.rank == faulty_rank else 5.0
    if fault == "transport_differs" and ctx.rank == faulty_rank:
        transport = "host"
    # ranks of other groups on the same GPU: 16 on every rank, or a rank that says 15, or nonsense
    sharing = {"sharing_16": 16, "sharing_differs": 15 if ctx.rank == faulty_rank else 16,
               "sharing_bad": 0 if ctx.rank == faulty_rank else None}.get(fault)
    failure = None
    gc.disable()  # a failed creation must leave nothing behind that only a cyclic collection frees
    try:
        # one rank leaving the table to the tuned cache while the others give the built-in one
        table = None if fault == "table_given_differs" and ctx.rank == faulty_rank else default_table()
        comm = pcie_allreduce.Communicator(ctx.group, "cuda:0", max_bytes=max_bytes, timeout_s=timeout_s,
                                           algo_table=table, transport=transport, ranks_per_gpu=sharing)
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        failure = {"error": type(exc).__name__, "message": str(exc),
                   "all_closed": all(w.closed for w in FakeWorkspace.instances), "made": len(FakeWorkspace.instances)}
    if failure is not None:
        failure["left_alive"] = sum(isinstance(o, pcie_allreduce.Communicator) for o in gc.get_objects())
    gc.enable()
    if failure is not None:
        return failure
    made = list(comm._workspaces.values())
    comm._closed = True  # no CUDA here: skip close()'s synchronize
    return {"error": None, "made": len(made), "open": not any(w.closed for w in made),
            "transport": comm.transport, "reason": comm.transport_reason, "repr": repr(comm),
            "workspace_transports": [w.transport for w in made], "names_released": all(w.name_released for w in made),
            "segment_names": [w.segment_name for w in made], "block_cap": comm.block_cap,
            "discarded": [(w.transport, w.closed) for w in FakeWorkspace.instances if w not in made]}


def test_healthy_creation_maps_one_workspace() -> None:
    for result in ranks.run_ranks(_create, WORLD, "none", 1, gpu=False, timeout_s=120):
        assert {k: result[k] for k in ("error", "made", "open", "transport")} == {
            "error": None, "made": 1, "open": True, "transport": "p2p"}
        assert result["names_released"], "a workspace's name stayed in /dev/shm after every rank mapped it"


@pytest.mark.parametrize("fault, tried_p2p, reason", [
    ("none", True, "every pair has peer access and the creation transfer test passed"),
    ("no_peer_access", False, "no peer-to-peer: "),
    ("open", True, "peer-to-peer failed at creation: "),
    ("probe", True, "peer-to-peer failed at creation: "),
])
def test_auto_takes_p2p_where_it_works_and_host_where_it_does_not(fault: str, tried_p2p: bool, reason: str) -> None:
    """Every rank ends on the same transport, says why, and frees what a failed P2P try made."""
    results = ranks.run_ranks(_create, WORLD, fault, 1, "auto", gpu=False, timeout_s=120)
    want = "p2p" if fault == "none" else "host"
    for result in results:
        assert result["error"] is None, result
        assert result["transport"] == want and result["reason"].startswith(reason), result
        assert result["workspace_transports"] == [constants.TRANSPORT_IDS[want]]
        assert f"transport={want!r}" in result["repr"]
        if want == "host" and tried_p2p:
            assert result["discarded"] and all(closed for _, closed in result["discarded"]), result
        else:
            assert result["discarded"] == [], result


def test_p2p_asked_for_without_peer_access_is_refused() -> None:
    for result in ranks.run_ranks(_create, WORLD, "no_peer_access", 1, "p2p", gpu=False, timeout_s=120):
        assert result["error"] == "UnavailableError", result


def test_host_asked_for_is_used_where_p2p_works() -> None:
    for result in ranks.run_ranks(_create, WORLD, "none", 1, "host", gpu=False, timeout_s=120):
        assert result["transport"] == "host" and result["reason"] == "asked for"
        assert result["workspace_transports"] == [constants.TRANSPORT_IDS["host"]] and result["names_released"]


def test_transport_is_agreed() -> None:
    for result in ranks.run_ranks(_create, WORLD, "transport_differs", 1, "auto", gpu=False, timeout_s=120):
        assert result["error"] == "ValueError" and "ranks disagree on transport" in result["message"]


@pytest.mark.parametrize("fault, faulty_error, peer_error, needle", [
    ("bad_max_bytes", "ValueError", "UnavailableError", "max_bytes must be an int in [1, 268435456]"),
    ("no_gpu", "UnavailableError", "UnavailableError", "no usable CUDA GPU"),
    ("alloc", "RuntimeError", "UnavailableError", "out of memory"),
    ("open", "RuntimeError", "UnavailableError", "could not map the workspace"),
])
def test_one_rank_failing_makes_every_rank_raise(fault: str, faulty_error: str, peer_error: str, needle: str) -> None:
    results = ranks.run_ranks(_create, WORLD, fault, 1, gpu=False, timeout_s=120)
    faulty, peer = results[1], results[0]
    assert faulty["error"] == faulty_error and needle in faulty["message"]
    assert peer["error"] == peer_error
    assert "rank 1" in peer["message"] and needle in peer["message"]
    for result in results:
        assert result["all_closed"], f"a failed creation kept its workspace: {result}"
        assert result["left_alive"] == 0, f"a failed creation left its communicator in a reference cycle: {result}"


def test_probes_that_do_not_arrive_refuse_the_group() -> None:
    for result in ranks.run_ranks(_create, WORLD, "probe", 1, gpu=False, timeout_s=120):
        assert result["error"] == "UnavailableError"
        assert "P2P writes between the ranks' GPUs do not arrive (rank -> rank: 0 -> 1)" in result["message"]
        assert result["all_closed"] and result["made"] == 1


def test_differing_layouts_are_refused() -> None:
    for result in ranks.run_ranks(_create, WORLD, "layout", 1, gpu=False, timeout_s=120):
        assert result["error"] == "UnavailableError" and "the same pcie_allreduce build" in result["message"]
        assert result["all_closed"]


def test_a_p2p_peer_workspace_of_another_size_is_never_mapped() -> None:
    """A p2p export carries its workspace's size; open_peers refuses one that is not exactly this
    rank's (a smaller one would let the kernels write past its end), and an export of another
    format (a bare 64-byte handle, as earlier builds made). No GPU: pure byte handling."""
    from pcie_allreduce import _ext

    ext = _ext.load()
    if ext is None:
        pytest.skip(f"extension not built: {_ext.unavailable_reason()}")
    handle = bytes(range(64))
    blob = ext.p2p_export(handle, 3 << 20)
    assert len(blob) == 72 and ext.p2p_import(blob, 3 << 20, 1, 0) == handle
    with pytest.raises(RuntimeError, match=r"rank 1 refuses the workspace of rank 0: it is 3145728 bytes, this "
                                           r"rank's layout needs 3145729"):
        ext.p2p_import(blob, (3 << 20) + 1, 1, 0)
    with pytest.raises(RuntimeError, match=r"rank 2 refuses the workspace of rank 3: it is 3145728 bytes, this "
                                           r"rank's layout needs 3145727"):
        ext.p2p_import(blob, (3 << 20) - 1, 2, 3)
    for wrong in (handle, blob + b"\0", b""):
        with pytest.raises(RuntimeError, match=rf"rank 1 refuses the workspace of rank 0: its export is {len(wrong)} "
                                               r"bytes, this build's are 72"):
            ext.p2p_import(wrong, 3 << 20, 1, 0)
    with pytest.raises(RuntimeError, match="an IPC handle is 64 bytes, got 63"):
        ext.p2p_export(handle[:63], 1)


def test_the_block_cap_shares_the_gpu_with_the_ranks_of_other_groups_on_it() -> None:
    alone = ranks.run_ranks(_create, WORLD, "none", 1, gpu=False, timeout_s=120)
    beside = ranks.run_ranks(_create, WORLD, "sharing_16", 1, gpu=False, timeout_s=120)
    cap = min(constants.MAX_LAUNCH_BLOCKS, _Properties.multi_processor_count // WORLD)
    assert [r["block_cap"] for r in alone] == [cap] * WORLD
    assert [r["block_cap"] for r in beside] == [_Properties.multi_processor_count // 16] * WORLD


def test_ranks_per_gpu_is_agreed_and_checked() -> None:
    for result in ranks.run_ranks(_create, WORLD, "sharing_differs", 1, gpu=False, timeout_s=120):
        assert result["error"] == "ValueError" and "ranks disagree on ranks_per_gpu" in result["message"], result
    bad = ranks.run_ranks(_create, WORLD, "sharing_bad", 1, gpu=False, timeout_s=120)
    assert "ranks_per_gpu must be a positive int or None, got 0" in bad[1]["message"], bad


def test_timeout_is_agreed() -> None:
    for result in ranks.run_ranks(_create, WORLD, "timeout_differs", 1, gpu=False, timeout_s=120):
        assert result["error"] == "ValueError" and "ranks disagree on timeout_s" in result["message"]


def test_whether_a_table_was_given_is_agreed(monkeypatch) -> None:
    """A rank that leaves the table to the tuned cache would meet the others' next step with the
    cache's gather: every rank raises at once instead, naming the setting, even where the given
    table is the same as the one the cache would pick."""
    monkeypatch.delenv("PCIE_AR_ALGO_TABLE", raising=False)
    for result in ranks.run_ranks(_create, WORLD, "table_given_differs", 1, gpu=False, timeout_s=120):
        assert result["error"] == "ValueError", result
        assert "ranks disagree on whether a table was given (algo_table= or $PCIE_AR_ALGO_TABLE)" in result["message"]


# ---- bounds ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, constants.MAX_MESSAGE_BYTES + 1, 2**64 - 1, 1.5, True, "8M"])
def test_max_bytes_out_of_bounds(value: object) -> None:
    with pytest.raises(ValueError, match=r"max_bytes must be an int in \[1, "):
        validation.validate_max_bytes(value)


def test_max_bytes_in_bounds() -> None:
    assert validation.validate_max_bytes(1) == 1
    assert validation.validate_max_bytes(constants.MAX_MESSAGE_BYTES) == constants.MAX_MESSAGE_BYTES


@pytest.mark.parametrize("value", [0, -2, float("nan"), float("inf"), 1e30, constants.MAX_TIMEOUT_S + 1, "soon"])
def test_timeout_out_of_bounds(value: object) -> None:
    with pytest.raises(ValueError, match="PCIE_AR_TIMEOUT_S"):
        validation.validate_timeout(value, source="PCIE_AR_TIMEOUT_S")


def test_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rendezvous.TIMEOUT_ENV, "2.5")
    assert rendezvous.default_timeout() == 2.5
    monkeypatch.setenv(rendezvous.TIMEOUT_ENV, "1e300")
    with pytest.raises(ValueError, match=rendezvous.TIMEOUT_ENV):
        rendezvous.default_timeout()


# ---- lifetime ----------------------------------------------------------------------------


def _bare_communicator() -> communicator.Communicator:
    """A created communicator's state, without a process group or a GPU."""
    comm = communicator.Communicator.__new__(communicator.Communicator)
    comm._workspaces = {7: FakeWorkspace(0, 0, 2, 1 << 20, 5.0, fault="none")}
    comm._input_areas = {}
    comm._closed, comm._closed_reason, comm._pid, comm.rank = False, "Communicator is closed", 12345, 0
    comm._group, comm._meeting_id = None, "0" * 16  # no process group: close() has no rank to wait for
    comm.device, comm.max_bytes = torch.device("cpu"), 1 << 20
    return comm


def test_dropping_without_close_warns_and_never_frees() -> None:
    comm = _bare_communicator()
    workspace = comm._workspaces[7]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del comm
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) and "without close()" in str(w.message) for w in caught)
    assert not workspace.closed and workspace in workspaces.NEVER_FREED
    workspaces.NEVER_FREED.remove(workspace)


def test_a_forked_child_cannot_use_the_communicator() -> None:
    comm = _bare_communicator()
    workspace = comm._workspaces[7]
    communicator._LIVE.add(comm)
    try:
        communicator._disown_after_fork()  # what os.register_at_fork runs in the child
        with pytest.raises(RuntimeError, match="created in process 12345; this process is a child forked"):
            comm.all_reduce(torch.ones(4))
        assert not workspace.closed and workspace in workspaces.NEVER_FREED
    finally:
        communicator._LIVE.discard(comm)
        workspaces.NEVER_FREED.remove(workspace)


def test_close_keeps_the_memory_a_captured_graph_may_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() frees a workspace no graph captured; one a capture recorded is retired instead
    (abort raised, peers unmapped, own memory kept alive here) and counted in retained_bytes."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    comm = _bare_communicator()
    captured = FakeWorkspace(0, 0, 2, 1 << 20, 5.0, fault="none")
    captured.captured = True
    eager = comm._workspaces[7]
    comm._workspaces[8] = captured
    try:
        comm.close()
        assert eager.closed and not eager.retired
        assert captured.retired and not captured.closed and captured in workspaces.NEVER_FREED
        assert comm.retained_bytes == captured.total_bytes
        with pytest.raises(RuntimeError, match="closed"):
            comm.all_reduce(torch.ones(4))
    finally:
        if captured in workspaces.NEVER_FREED:
            workspaces.NEVER_FREED.remove(captured)


# ---- the first fused call of a shape: compiled on every rank before any rank launches it ------


def _first_fused_call(ctx: ranks.RankContext, case: str) -> dict[str, Any]:
    import time

    from pcie_allreduce.fused import path as fused_path

    _fake_cuda("none", ctx.rank)
    comm = pcie_allreduce.Communicator(ctx.group, "cuda:0", max_bytes=1 << 20, timeout_s=5.0,
                                       algo_table=default_table())
    comm._closed = True  # no CUDA here: skip close()'s synchronize
    last = ctx.rank == ctx.world_size - 1
    call = ("oneshot_ll", (4, 7168 if case != "shape_differs" or not last else 4096), torch.bfloat16, torch.bfloat16)

    def compile_call() -> None:
        if case == "slow_compiler" and last:
            time.sleep(3.0)
        if case == "compile_fails" and last:
            raise RuntimeError("ptxas: out of resources")

    if case in ("never_comes", "comes_late"):
        fused_path.FIRST_FUSED_CALL_WAIT_S = 2
        if last:  # this rank's calls went another way: it reaches no meeting within the bound
            time.sleep(4.0)
    started = time.perf_counter()
    error, message = None, ""
    if not (case == "never_comes" and last):
        try:
            comm._fused._compile_everywhere(comm, call, compile_call)
        except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
            error, message = type(exc).__name__, str(exc)
    waited = time.perf_counter() - started
    # The group must be as the caller left it: a collective the meeting left posted would pair with
    # this one (and give another sum, or hang until the group's timeout).
    total = torch.tensor([float(10 ** ctx.rank)])
    torch.distributed.all_reduce(total, group=ctx.group)
    compiled = sorted(map(str, comm._fused._compiled))
    # A failed call must not leave the communicator in a reference cycle (its exception's traceback
    # holding a frame that holds the exception): it would then outlive the caller's references,
    # and be torn down with its group at interpreter exit, which can abort the process.
    gc.disable()
    try:
        alive = weakref.ref(comm)
        del comm
        freed = alive() is None
    finally:
        gc.enable()
    return {"error": error, "message": message, "waited": waited, "group_sum": float(total),
            "compiled": compiled, "freed": freed}


def test_first_fused_call_waits_for_every_rank_to_compile() -> None:
    """The first call of a shape waits until the slowest rank has compiled it: no rank's kernel
    starts its bounded waits while a peer is still compiling."""
    results = ranks.run_ranks(_first_fused_call, 3, "slow_compiler", gpu=False, timeout_s=120)
    assert [r["error"] for r in results] == [None] * 3
    assert all(r["waited"] >= 2.5 for r in results), [r["waited"] for r in results]
    assert all(len(r["compiled"]) == 1 for r in results)
    assert all(r["freed"] for r in results)


@pytest.mark.parametrize("case, first, last", [
    ("shape_differs", "CollectiveMismatch", "CollectiveMismatch"),
    ("compile_fails", "RuntimeError", "RuntimeError"),
    ("never_comes", "CollectiveTimeout", None),
    ("comes_late", "CollectiveTimeout", "CollectiveTimeout"),
])
def test_first_fused_call_problems_raise_on_every_rank_that_meets(case: str, first: str, last: str | None) -> None:
    """Every rank that reaches the meeting raises the same kind of error; and the meeting leaves
    nothing behind on the caller's group: its next collective still sums what it should."""
    results = ranks.run_ranks(_first_fused_call, 2, case, gpu=False, timeout_s=120)
    assert [r["error"] for r in results] == [first, last]
    assert [r["freed"] for r in results] == [True, True]
    assert not any(r["compiled"] for r in results)
    assert [r["group_sum"] for r in results] == [11.0, 11.0]
    if case == "shape_differs":
        assert "oneshot_ll [4, 7168] torch.bfloat16" in results[0]["message"] and "ranks [1]" in results[0]["message"]
    if case == "compile_fails":
        assert "ptxas: out of resources" in results[1]["message"] and "rank(s) [1]" in results[0]["message"]
    if case in ("never_comes", "comes_late"):
        assert "within 2 s" in results[0]["message"] and "rank 0: ranks [1] did not reach" in results[0]["message"]
    if case == "comes_late":  # it raises at once: rank 0 gave up on this meeting before it came
        assert "ranks [0] gave up" in results[1]["message"] and results[1]["waited"] < 1.0


# ---- the host transport's /dev/shm housekeeping -------------------------------------------


def _dead_pid() -> int:
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def _segment(creator: Any, counter: int = 0) -> str:
    """The name a segment of ``creator`` has in /dev/shm."""
    return (f"pcie_ar-{creator.boot_id}-{creator.pid_namespace}-{creator.pid}-{creator.start_time}-{counter}-"
            "0123456789ab")


def _us() -> Any:
    from pcie_allreduce import transport

    us = transport.current_creator()
    if us is None:
        pytest.skip("/proc cannot say who this process is here")
    return us


def test_a_new_segment_name_records_this_process() -> None:
    from pcie_allreduce import transport

    us = _us()
    first, second = transport.new_segment_name(), transport.new_segment_name()
    assert first != second
    assert transport.creator_of(first) == transport.creator_of(second) == us
    assert us.pid == os.getpid() and us.pid_namespace == os.stat("/proc/self/ns/pid").st_ino


def test_stale_segments_are_those_of_dead_processes_of_this_namespace_and_boot(tmp_path: Any) -> None:
    import dataclasses

    from pcie_allreduce import transport

    us = _us()
    dead = _dead_pid()
    stale = {
        "dead": dataclasses.replace(us, pid=dead),
        "pid reused": dataclasses.replace(us, start_time=us.start_time + 1),
        "an earlier boot": dataclasses.replace(us, boot_id="0" * 32, pid=dead),
    }
    kept = {
        "alive": us,
        # Another container's pid namespace sharing /dev/shm: its pids name other processes here.
        "another namespace, a pid dead here": dataclasses.replace(us, pid_namespace=us.pid_namespace + 1, pid=dead),
        "another namespace, a pid alive here": dataclasses.replace(us, pid_namespace=us.pid_namespace + 1,
                                                                   start_time=us.start_time + 1),
    }
    names = {what: _segment(creator, i) for i, (what, creator) in enumerate({**stale, **kept}.items())}
    names["unparseable"] = f"pcie_ar-{dead}-0-1f2e3d"
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    expected = sorted(str(tmp_path / names[what]) for what in stale)
    assert transport.stale_segments(str(tmp_path)) == expected
    assert transport.remove_stale_segments(str(tmp_path)) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[what] for what in [*kept, "unparseable"])
    assert transport.stale_segments(str(tmp_path / "missing")) == []


def test_nothing_is_stale_when_this_process_cannot_tell_who_it_is(tmp_path: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from pcie_allreduce import transport

    name = _segment(dataclasses.replace(_us(), pid=_dead_pid()))
    (tmp_path / name).write_bytes(b"x")
    monkeypatch.setattr(transport, "current_creator", lambda: None)
    assert transport.remove_stale_segments(str(tmp_path)) == []
    assert transport.creator_of(transport.new_segment_name()) is None
    assert [p.name for p in tmp_path.iterdir()] == [name]


def _host_segment_names(ctx: ranks.RankContext) -> dict[str, Any]:
    from pcie_allreduce import transport

    result = _create(ctx, "none", 0, transport="host")
    result["creators_are_this_rank"] = [transport.creator_of(n) == transport.current_creator()
                                        for n in result["segment_names"]]
    return result


def test_a_host_communicator_names_its_segment_after_its_creator() -> None:
    for result in ranks.run_ranks(_host_segment_names, WORLD, gpu=False, timeout_s=120):
        assert result["error"] is None, result
        assert result["creators_are_this_rank"] == [True], result["segment_names"]


@pytest.mark.parametrize("name", ["pcie_ar-4294967296-0-a", "pcie_ar-18446744073709551616-0-a",
                                  "pcie_ar-" + "9" * 200 + "-0-a", "pcie_ar-0-0-a", "pcie_ar--1-0-a",
                                  "pcie_ar-١٢-0-a", "pcie_ar-12-0-a\n", "pcie_ar-12-0-" + "a" * 200,
                                  "pcie_ar-{boot}-{ns}-4294967296-0-0-0123456789ab",
                                  "pcie_ar-{boot}-18446744073709551616-1-0-0-0123456789ab",
                                  "pcie_ar-{boot}-{ns}-1-99999999999999999999-0-0123456789ab",
                                  "pcie_ar-{boot}-{ns}-1-0-0-0123456789ab\n", "pcie_ar-{boot}-{ns}-1-0-0-0123456789abc",
                                  "pcie_ar-{boot}-{ns}-01-0-0-0123456789ab"])
def test_segment_names_anyone_can_write_are_ignored(name: str, tmp_path: Any) -> None:
    from pcie_allreduce import transport

    us = _us()
    name = name.format(boot=us.boot_id, ns=us.pid_namespace)
    (tmp_path / name).write_bytes(b"x")
    assert transport.stale_segments(str(tmp_path)) == []
    assert transport.remove_stale_segments(str(tmp_path)) == []
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_another_users_segment_and_symlinks_are_left_alone(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from pcie_allreduce import transport

    dead = dataclasses.replace(_us(), pid=_dead_pid())
    link, directory, plain = (_segment(dead, i) for i in range(3))
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / link).symlink_to(target)
    (tmp_path / directory).mkdir()
    (tmp_path / plain).write_bytes(b"x")
    monkeypatch.setattr(os, "getuid", lambda: os.stat(target).st_uid + 1)  # every file is another user's
    assert transport.stale_segments(str(tmp_path)) == []
    monkeypatch.undo()
    assert transport.remove_stale_segments(str(tmp_path)) == [str(tmp_path / plain)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["target", link, directory])
    assert target.read_bytes() == b"keep"


def test_a_host_communicator_is_created_beside_a_segment_name_with_an_absurd_pid() -> None:
    import secrets

    from pcie_allreduce import transport

    if not os.path.isdir(transport.SHM_DIR):
        pytest.skip(f"no {transport.SHM_DIR} here")
    # What any local user can write into the world-writable directory the housekeeping sweeps.
    planted = os.path.join(transport.SHM_DIR, f"pcie_ar-4294967296-0-{secrets.token_hex(6)}")
    with open(planted, "wb") as fh:
        fh.write(b"x")
    try:
        for result in ranks.run_ranks(_create, WORLD, "none", 0, "host", gpu=False, timeout_s=120):
            assert result["error"] is None, result
            assert result["transport"] == "host"
        assert os.path.exists(planted)
    finally:
        os.unlink(planted)


@pytest.mark.parametrize("value", ["nvlink", "", None, 1, "P2P"])
def test_transport_values(value: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pcie_allreduce import transport

    with pytest.raises(ValueError, match="expected one of"):
        transport.validate_transport(value)
    monkeypatch.setenv(transport.ENV, "Host")
    assert transport.requested(None) == "host" and transport.requested("p2p") == "p2p"
    monkeypatch.setenv(transport.ENV, "shm")
    with pytest.raises(ValueError, match=transport.ENV):
        transport.requested(None)
    monkeypatch.delenv(transport.ENV)
    assert transport.requested(None) == "auto"
