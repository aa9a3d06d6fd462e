"""Creating a Communicator is all or nothing, on CPU ranks with a fake extension.

A rank that fails while creating (a bad argument, no GPU, an allocation or mapping that fails,
probes that do not arrive) makes every rank raise at once, naming that rank and why, and frees
what it allocated; no rank waits in a later rendezvous. Also: the transport each group ends on,
agreement across ranks, argument bounds, and the first fused call of a shape, compiled on every
rank before any rank launches it (a problem there raises on every rank that meets). The fake
extension is tests/_creation_fakes.py.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

import pcie_allreduce
from pcie_allreduce.plan.tables import default_table
from pcie_allreduce import constants, rendezvous, validation
from pcie_allreduce.tools import ranks

from tests._creation_fakes import WORLD, _create, _fake_cuda, _Properties


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
