"""What a Communicator leaves behind, on CPU (the fake extension of tests/_creation_fakes.py).

The lifetime rules: a communicator dropped without close() warns and is never freed by the garbage
collector, a forked child cannot use it, and close() keeps the memory a captured graph may replay.
And the host transport's /dev/shm housekeeping: segment names that record their creator, and the
stale segments (of dead processes of this namespace and boot) removed, while names anyone can
write, another user's segments and symlinks are left alone.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

import pytest
import torch

from pcie_allreduce import communicator, workspaces
from pcie_allreduce.tools import ranks

from tests._creation_fakes import WORLD, FakeWorkspace, _create


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
