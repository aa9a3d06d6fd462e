"""CPU tests of the rank spawner (pcie_allreduce.tools.ranks): run with gpu=False, no GPU needed.

Rank functions live at module level because the spawner pickles them into spawned children.
The MPS tests put a fake ``nvidia-cuda-mps-control`` first on PATH; it records every call.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pcie_allreduce
from pcie_allreduce.tools import mps, ranks
from pcie_allreduce.tools.ranks import (
    MpsDaemon,
    MpsError,
    MpsUnavailableWarning,
    RankContext,
    RankFailed,
    run_ranks,
)

# ----------------------------------------------------------------------------- rank functions


def _sum_ranks(ctx: RankContext, offset: int, *, scale: int = 1) -> dict:
    t = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(t, group=ctx.group)
    return {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "sum": t.item() * scale,
        "device": str(ctx.device),
        "mps": ctx.mps,
        "mps_active": ranks.mps_active(),
        "shared_gpu": ctx.shared_gpu,
        "env": os.environ.get("PCIE_AR_TEST_VAR"),
    }


def _raise_on_rank_1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("deliberate failure in rank 1")
    dist.barrier(group=ctx.group)  # rank 0 blocks here until it is killed


def _raise_on_every_rank_in_turn(ctx: RankContext) -> None:
    time.sleep(2.0 * ctx.rank)  # rank 1's error comes 2 s after rank 0's, as a peer's timeout would
    raise ValueError(f"deliberate failure in rank {ctx.rank}")


def _hang_on_rank_1(ctx: RankContext, pid_dir: str) -> int:
    Path(pid_dir, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    if ctx.rank == 1:
        # A helper process of the rank must die with it too.
        helper = subprocess.Popen(["sleep", "1000"])
        Path(pid_dir, "helper.pid").write_text(str(helper.pid))
        time.sleep(1000)
    return ctx.rank


def _exit_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        os._exit(3)
    return ctx.rank


def _abort_at_exit_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        import atexit

        atexit.register(os.abort)
    return ctx.rank


class _NotesTeardown:
    """Writes whether the process group was still up when it was freed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.cycle = self

    def __del__(self) -> None:
        Path(self.path).write_text(str(torch.distributed.is_initialized()))


def _leave_a_cycle(ctx: RankContext, out_dir: str) -> int:
    _NotesTeardown(os.path.join(out_dir, f"{ctx.rank}.txt"))  # only a cyclic collection frees it
    return ctx.rank


def _mps_view(ctx: RankContext) -> tuple[bool, bool, str | None]:
    return ctx.mps, ranks.mps_active(), os.environ.get("CUDA_MPS_PIPE_DIRECTORY")


def _visible_devices(ctx: RankContext) -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


# ----------------------------------------------------------------------------- helpers


def _process_gone(pid: int) -> bool:
    """True when pid no longer runs (reaped, or a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


FAKE_MPS = """#!/bin/sh
# Fake nvidia-cuda-mps-control: log argv, MPS env and stdin; emulate -d / get_server_list / quit.
echo "argv=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
if [ "$1" = "-d" ]; then
  echo "daemon sees CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES-unset}}" >> "$FAKE_MPS_LOG"
  {start}
fi
read cmd
echo "stdin=$cmd" >> "$FAKE_MPS_LOG"
case "$cmd" in
  get_server_list)
    [ -e "$CUDA_MPS_PIPE_DIRECTORY/fake_running" ] && exit 0
    echo "Cannot find MPS control daemon process"; exit 1 ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/fake_running" ;;
esac
exit 0
"""
START_OK = 'touch "$CUDA_MPS_PIPE_DIRECTORY/fake_running"; exit 0'
START_FAIL = 'echo "fake failure: no MPS here" >&2; exit 1'


@pytest.fixture
def fake_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a fake nvidia-cuda-mps-control first on PATH; returns (install(start), log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "mps.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)

    def install(start: str) -> Path:
        script = bin_dir / "nvidia-cuda-mps-control"
        script.write_text(FAKE_MPS.format(start=start))
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return script

    return install, log


# ----------------------------------------------------------------------------- multi-rank runs


@pytest.mark.parametrize("world", [2, 3])
def test_results_in_rank_order_and_gloo_all_reduce(world: int) -> None:
    before = dict(os.environ)
    out = run_ranks(
        _sum_ranks, world, 10, scale=2, gpu=False, env={"PCIE_AR_TEST_VAR": "hello"}
    )
    assert [r["rank"] for r in out] == list(range(world))
    expected = 2.0 * sum(r + 10 for r in range(world))
    for r in out:
        assert r["world"] == world
        assert r["sum"] == expected
        assert r["device"] == "cpu"
        assert (r["mps"], r["mps_active"], r["shared_gpu"]) == (False, False, False)
        assert r["env"] == "hello"
    assert dict(os.environ) == before, "the caller's environment must be restored"


def test_raising_rank_reports_rank_and_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_raise_on_rank_1, 2, gpu=False, timeout_s=60)
    msg = str(info.value)
    assert "rank 1" in msg
    assert "Traceback" in msg
    assert "_raise_on_rank_1" in msg
    assert "ValueError: deliberate failure in rank 1" in msg
    # rank 0 was blocked in a barrier: it fails there once rank 1 is gone (a secondary failure,
    # after the first), or is killed at the end of the grace
    assert list(info.value.failures)[0] == 1
    assert set(info.value.failures) | set(info.value.unfinished) == {0, 1}
    assert time.monotonic() - start < 30
    assert isinstance(info.value, RuntimeError)


def test_a_failure_waits_briefly_for_the_other_ranks_errors() -> None:
    """The other ranks' errors that come moments after the first are reported with it (each
    names whom it waited for), rather than those ranks being killed mid-call."""
    with pytest.raises(RankFailed) as info:
        run_ranks(_raise_on_every_rank_in_turn, 2, gpu=False, timeout_s=60)
    assert list(info.value.failures) == [0, 1]
    assert "deliberate failure in rank 1" in info.value.failures[1]
    assert info.value.unfinished == []


def test_hanging_rank_times_out_and_leaves_nothing(tmp_path: Path) -> None:
    # timeout_s counts the ranks' start-up too (spawn, torch's import, the gloo group), which on a
    # loaded 2-core machine can take more than 5 s; so the bound is 15 s, and the run must end
    # within 10 s of it, as before (rank 1 sleeps 1000 s).
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_hang_on_rank_1, 2, str(tmp_path), gpu=False, timeout_s=15)
    elapsed = time.monotonic() - start
    assert elapsed < 15 + 10
    msg = str(info.value)
    assert "timed out" in msg
    assert "ranks [1] had not finished" in msg
    assert "_hang_on_rank_1" in msg  # its Python stack, dumped by faulthandler
    assert info.value.unfinished == [1]
    pids = [int((tmp_path / name).read_text()) for name in ("rank0.pid", "rank1.pid", "helper.pid")]
    for pid in pids:
        assert _process_gone(pid), f"process {pid} survived the spawner"
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)


_CALLER_THAT_CATCHES_SYSTEM_EXIT = """
import sys
from pcie_allreduce.tools.ranks import run_ranks
from tests.test_ranks import _hang_on_rank_1

if __name__ == "__main__":
    try:
        run_ranks(_hang_on_rank_1, 2, sys.argv[1], gpu=False, timeout_s=300)
    except BaseException as exc:  # as pytest does with a test's SystemExit: record it, go on
        print("caught", type(exc).__name__, flush=True)
    print("went on to the next test", flush=True)
"""


def test_sigterm_of_the_caller_cleans_up_then_ends_it_even_when_it_catches_system_exit(tmp_path: Path) -> None:
    """A CI time-out's SIGTERM stops the whole run: the ranks, their helpers and the temp dirs
    are cleaned up, then the caller dies of the signal, even one that catches SystemExit (pytest
    would otherwise record one failed test and run the next)."""
    script = tmp_path / "caller.py"
    script.write_text(_CALLER_THAT_CATCHES_SYSTEM_EXIT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # The script imports this module's _hang_on_rank_1: the checkout goes first on its path.
    path = [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    caller = subprocess.Popen([sys.executable, str(script), str(pid_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    names = ("rank0.pid", "rank1.pid", "helper.pid")
    deadline = time.monotonic() + 120
    while not all((pid_dir / n).exists() and (pid_dir / n).read_text() for n in names):
        assert caller.poll() is None, "the caller ended before its ranks started"
        assert time.monotonic() < deadline, "the ranks did not start within 120 s"
        time.sleep(0.1)
    pids = [int((pid_dir / n).read_text()) for n in names]
    caller.send_signal(signal.SIGTERM)
    out, _ = caller.communicate(timeout=60)
    assert caller.returncode == -signal.SIGTERM, (caller.returncode, out)
    assert "went on" not in out, out
    for pid in pids:
        assert _process_gone(pid), f"process {pid} survived the caller's SIGTERM"


def test_rank_that_exits_without_reporting() -> None:
    with pytest.raises(RankFailed) as info:
        run_ranks(_exit_on_rank_1, 2, gpu=False, timeout_s=60)
    msg = str(info.value)
    assert "rank 1 exited with code 3 without reporting a result" in msg
    assert list(info.value.failures) == [1]


def test_rank_that_dies_after_returning_fails_the_run_with_its_stacks() -> None:
    with pytest.raises(RankFailed) as info:
        run_ranks(_abort_at_exit_on_rank_1, 2, gpu=False, timeout_s=60)
    msg = str(info.value)
    assert "rank 1 returned, then was killed by SIGABRT" in msg
    assert "its last Python stacks:" in msg and "Fatal Python error: Aborted" in msg


def test_what_a_rank_left_in_reference_cycles_is_freed_before_its_group_is_destroyed(tmp_path: Path) -> None:
    assert run_ranks(_leave_a_cycle, 2, str(tmp_path), gpu=False, timeout_s=60) == [0, 1]
    assert [(tmp_path / f"{r}.txt").read_text() for r in range(2)] == ["True", "True"]


# ----------------------------------------------------------------------------- MPS


def test_private_mps_daemon_started_with_env_and_stopped(fake_mps) -> None:
    install, log = fake_mps
    install(START_OK)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MpsUnavailableWarning)
        out = run_ranks(_mps_view, 2, gpu=False, mps=True)
    pipe_dirs = {pipe for _, _, pipe in out}
    assert [(m, a) for m, a, _ in out] == [(True, True)] * 2
    assert len(pipe_dirs) == 1
    (pipe_dir,) = pipe_dirs
    calls = log.read_text().splitlines()
    root = os.path.dirname(pipe_dir)
    env_part = f"pipe={pipe_dir} log={os.path.join(root, 'log')}"
    assert calls[0] == f"argv=-d {env_part}"
    assert "stdin=get_server_list" in calls
    assert calls[-2:] == [f"argv= {env_part}", "stdin=quit"]
    assert all(env_part in c for c in calls if c.startswith("argv="))
    assert not os.path.exists(root), "the MPS temp dir must be removed"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_mps_clients_count_gpus_from_zero_within_the_daemons_devices(fake_mps, monkeypatch) -> None:
    # An MPS server started with CUDA_VISIBLE_DEVICES=1 refuses clients that say 1 ("Invalid
    # CUDA_VISIBLE_DEVICES"): its clients count from 0 within the GPUs it serves.
    install, log = fake_mps
    install(START_OK)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert run_ranks(_visible_devices, 2, gpu=False, mps=True) == ["0", "0"]
    assert "daemon sees CUDA_VISIBLE_DEVICES=1" in log.read_text().splitlines()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5, 3")
    assert run_ranks(_visible_devices, 2, gpu=False, mps=True) == ["0,1", "0,1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert run_ranks(_visible_devices, 2, gpu=False, mps=True) == [None, None]


def test_mps_start_failure_warns_and_runs_anyway(fake_mps) -> None:
    install, log = fake_mps
    install(START_FAIL)
    with pytest.warns(MpsUnavailableWarning, match="fake failure: no MPS here") as record:
        out = run_ranks(_mps_view, 2, gpu=False, mps=True)
    assert len(record) == 1
    assert "\n" not in str(record[0].message)
    assert out == [(False, False, None)] * 2
    assert log.read_text().splitlines()[0].startswith("argv=-d ")


def test_mps_daemon_unit_start_stop(fake_mps) -> None:
    install, log = fake_mps
    install(START_OK)
    with MpsDaemon.start() as daemon:
        pipe = daemon.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.exists(os.path.join(pipe, "fake_running"))
        assert daemon.env["CUDA_MPS_LOG_DIRECTORY"].startswith(daemon.root)
        assert daemon.log_problems() == ""
        Path(daemon.env["CUDA_MPS_LOG_DIRECTORY"], "server.log").write_text(
            "[1] Accepting connection\n[2] ERROR: out of memory\n[3] client done\n"
        )
        assert daemon.log_problems() == "--- server.log ---\n[2] ERROR: out of memory"
    assert not os.path.exists(daemon.root)
    assert log.read_text().splitlines()[-1] == "stdin=quit"
    daemon.stop()  # idempotent


def test_mps_daemon_missing_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsError, match="not found on PATH"):
        MpsDaemon.start()


def test_mps_daemon_that_never_answers(fake_mps) -> None:
    install, _ = fake_mps
    install("exit 0")  # -d "succeeds" but nothing ever listens
    with pytest.raises(MpsError, match="did not answer"):
        MpsDaemon.start(ready_timeout_s=0.3)


def test_existing_mps_daemon_is_reused(fake_mps, tmp_path: Path, monkeypatch) -> None:
    install, _ = fake_mps
    install(START_OK)
    pipe = tmp_path / "their_pipe"
    pipe.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    assert mps._external_mps_env() is None  # a directory nobody answers in
    (pipe / "fake_running").touch()
    assert mps._external_mps_env() == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}


@pytest.mark.parametrize(
    ("mps", "gpu", "shared", "want"),
    [
        ("auto", True, True, True),
        ("auto", True, False, False),
        ("auto", False, False, False),
        (True, False, False, True),
        (False, True, True, False),
    ],
)
def test_when_mps_is_wanted(mps, gpu: bool, shared: bool, want: bool) -> None:
    assert ranks._want_mps(mps, gpu, shared) is want


# ----------------------------------------------------------------------------- argument checks


def test_argument_errors_before_spawning() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_sum_ranks, 0, gpu=False)
    with pytest.raises(ValueError, match="mps must be"):
        run_ranks(_sum_ranks, 2, 0, gpu=False, mps="sometimes")
    with pytest.raises(TypeError, match="picklable"):
        run_ranks(lambda ctx: None, 2, gpu=False)


def test_gpu_helpers_without_creating_a_context() -> None:
    reason = ranks.skip_reason_no_gpu()
    assert (reason is None) == (ranks.gpu_count() > 0)
    assert ranks.requires_gpu.name == "skipif"
    if reason is not None:
        assert reason == pcie_allreduce.unavailable_reason() or not pcie_allreduce.is_available()
        with pytest.raises(RuntimeError, match=re.escape(reason)):
            run_ranks(_sum_ranks, 2, 0, gpu=True)
    assert not torch.cuda.is_initialized()


def test_rank_failed_pickles() -> None:
    import pickle

    err = RankFailed("msg", {1: "tb"}, [0])
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.failures, back.unfinished) == ("msg", {1: "tb"}, [0])


if __name__ == "__main__":  # pragma: no cover - convenience
    sys.exit(pytest.main([__file__, "-v"]))
