"""The spawner's parent side while its ranks run: waiting for results, failure messages, clean-up.

:class:`Supervisor` polls every rank's result pipe and process sentinel until all returned and
exited, and turns a rank that raised, died, hung or failed to exit into one :class:`RankFailed`
whose message leads with the first failure (its traceback, or its Python stacks for a hang).
:func:`kill_all` ends every child on the way out, and :func:`sigterm_unwinds` lets SIGTERM run the
spawner's clean-up before it ends the process.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle
import signal
import time
from typing import Any, Iterator, Mapping, Sequence

from pcie_allreduce.tools.mps import MpsDaemon, last_lines
from pcie_allreduce.tools.rank_child import RunSpec

# How long ranks get to exit after all of them returned (interpreter and CUDA teardown).
_EXIT_GRACE_S = 30.0
# How long SIGTERM gets before SIGKILL.
_TERM_GRACE_S = 3.0
# How long a hung rank gets to write its Python stacks after SIGUSR1.
_STACK_DUMP_WAIT_S = 1.0
# How long the other ranks get to report after one rank raised: a collective that fails on one
# rank usually fails on its peers moments later, each naming whom it waited for, and a rank killed
# while its kernel still runs can fault a GPU shared under MPS for every later client.
_FAILURE_GRACE_S = 10.0
# Tracebacks of the other failed ranks are secondary (usually "connection closed by peer");
# keep their last lines only so the first failure stays readable.
_SECONDARY_TAIL_LINES = 3


class RankFailed(RuntimeError):
    """A rank raised, died without reporting, hung past the timeout, or failed to exit.

    Attributes:
        failures: rank -> what happened to it (formatted traceback, exit status or stacks).
        unfinished: ranks that had neither returned nor failed when the run was stopped.
    """

    def __init__(
        self,
        message: str,
        failures: Mapping[int, str] | None = None,
        unfinished: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.unfinished: list[int] = list(unfinished)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the exception picklable (a benchmark may run the spawner inside a worker).
        return (type(self), (str(self), self.failures, self.unfinished))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _read_text(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read().strip()
    return ""


def _signal_tree(proc: Any, sig: signal.Signals) -> None:
    """Signal a rank and its process group, but only while its pid is still ours (unreaped)."""
    if proc.pid is None or proc.exitcode is not None:
        return
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(OSError):
        os.kill(proc.pid, sig)  # in case it had not yet made its own group


def kill_all(procs: Sequence[Any]) -> None:
    """SIGTERM every live rank (and its helpers), then SIGKILL what is left, then reap."""
    live = [p for p in procs if p.pid is not None and p.exitcode is None]
    for p in live:
        _signal_tree(p, signal.SIGTERM)
    deadline = time.monotonic() + _TERM_GRACE_S
    while any(p.is_alive() for p in live) and time.monotonic() < deadline:
        multiprocessing.connection.wait([p.sentinel for p in live if p.is_alive()], timeout=0.1)
    for p in live:
        _signal_tree(p, signal.SIGKILL)
    for p in live:
        p.join(timeout=5.0)


class Supervisor:
    """Book-keeping of one run_ranks call in the parent: the waiting loop and failure messages."""

    def __init__(self, procs: list[Any], readers: list[Any], spec: RunSpec, mps_daemon: MpsDaemon | None) -> None:
        self.procs = procs
        self.readers = readers
        self.spec = spec
        self.mps_daemon: MpsDaemon | None = mps_daemon
        self.results: dict[int, Any] = {}
        self.exited: set[int] = set()

    def _fail(self, failures: dict[int, str], headline: str) -> RankFailed:
        unfinished = [r for r in range(self.spec.world_size) if r not in self.results]
        unfinished = [r for r in unfinished if r not in failures]
        first, *others = list(failures)  # the failure that stopped the run comes first
        lines = [headline, "", f"--- rank {first} ---", failures[first]]
        for r in others:
            lines += ["", f"--- rank {r} (tail) ---", last_lines(failures[r], _SECONDARY_TAIL_LINES)]
        if unfinished:
            lines += ["", f"ranks {unfinished} had not finished; they were terminated"]
        if self.mps_daemon is not None:
            log = self.mps_daemon.log_problems()
            if log:
                lines += ["", "MPS daemon log, error lines:", log]
        return RankFailed("\n".join(lines), failures, unfinished)

    def _died(self, rank: int) -> RankFailed:
        proc = self.procs[rank]
        proc.join(timeout=5.0)
        text = f"rank {rank} {_describe_exit(proc.exitcode)} without reporting a result"
        stack_file = self.spec.stack_file(rank)
        if not os.path.exists(stack_file):
            text += (
                " while starting up, before it could run fn (unpickling the spawn arguments "
                "or importing the caller's __main__ failed?): its stderr has the cause"
            )
        return self._fail({rank: self._with_stacks(rank, text)}, f"rank {rank} {_describe_exit(proc.exitcode)}")

    def _with_stacks(self, rank: int, text: str) -> str:
        """``text``, then the Python stacks faulthandler last wrote for ``rank``, if any."""
        stacks = _read_text(self.spec.stack_file(rank))
        return f"{text}\nits last Python stacks:\n{stacks}" if stacks else text

    def _receive(self, rank: int) -> None:
        """Read rank's reply; raise RankFailed if it is an error or never came."""
        try:
            kind, value = pickle.loads(self.readers[rank].recv_bytes())
        except (EOFError, OSError):
            raise self._died(rank) from None
        except Exception as exc:  # noqa: BLE001 - a result the parent cannot unpickle
            raise self._fail(
                {rank: f"its result could not be unpickled in the parent: {exc!r}"},
                f"rank {rank} returned a result the caller cannot load",
            ) from exc
        if kind == "err":
            failures = {rank: value}
            failures.update(self._drain_other_errors(rank))
            raise self._fail(failures, f"rank {rank} raised an exception")
        self.results[rank] = value

    def _drain_other_errors(self, skip: int) -> dict[int, str]:
        """Errors the other ranks send within ``_FAILURE_GRACE_S`` of the first (shown as context
        after it); the wait ends as soon as every other rank has replied or exited."""
        errors: dict[int, str] = {}
        pending = {r for r in range(self.spec.world_size) if r != skip and r not in self.results}
        deadline = time.monotonic() + _FAILURE_GRACE_S
        while pending and (now := time.monotonic()) < deadline:
            watch = {self.readers[r]: r for r in pending}
            watch.update({self.procs[r].sentinel: r for r in pending})
            for obj in multiprocessing.connection.wait(list(watch), timeout=deadline - now):
                rank = watch[obj]
                if rank not in pending:
                    continue
                pending.discard(rank)
                with contextlib.suppress(Exception):  # died without a reply: nothing to show
                    if self.readers[rank].poll(0):
                        kind, value = pickle.loads(self.readers[rank].recv_bytes())
                        if kind == "err":
                            errors[rank] = value
                        else:
                            self.results[rank] = value
        return errors

    def _handle_exit(self, rank: int) -> None:
        proc = self.procs[rank]
        proc.join(timeout=5.0)
        self.exited.add(rank)
        if rank not in self.results:
            # It may have sent its reply just before exiting: the pipe still holds it.
            if self.readers[rank].poll(0):
                self._receive(rank)
            else:
                raise self._died(rank)
        if proc.exitcode != 0:
            text = self._with_stacks(rank, f"rank {rank} returned, then {_describe_exit(proc.exitcode)}")
            raise self._fail({rank: text}, f"rank {rank} {_describe_exit(proc.exitcode)} after returning")

    def _timeout(self, elapsed: float) -> RankFailed:
        results_done = len(self.results) == self.spec.world_size
        waiting = [
            r
            for r in range(self.spec.world_size)
            if (r not in self.exited if results_done else r not in self.results)
        ]
        for r in waiting:  # ask for Python stacks: where is it stuck?
            with contextlib.suppress(OSError):
                if self.procs[r].exitcode is None:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(_STACK_DUMP_WAIT_S)
        failures = {}
        for r in waiting:
            stacks = _read_text(self.spec.stack_file(r)) or "(no Python stacks were written)"
            failures[r] = f"Python stacks of rank {r}:\n{stacks}"
        if results_done:
            headline = f"ranks {waiting} had returned but not exited"
        else:
            headline = f"ranks {waiting} had not finished"
            if self.results:
                headline += f" (ranks {sorted(self.results)} returned)"
        headline = f"run_ranks timed out after {elapsed:.1f} s: {headline}"
        if not any(os.path.exists(self.spec.stack_file(r)) for r in waiting):
            headline += "; none of them had got past start-up, which counts toward timeout_s"
        err = self._fail(failures, headline)
        err.unfinished = waiting
        return err

    def wait(self, timeout_s: float, start: float) -> list[Any]:
        """Poll result pipes and process sentinels until every rank returned and exited."""
        world = self.spec.world_size
        deadline = start + timeout_s
        exit_deadline: float | None = None
        while len(self.exited) < world:
            now = time.monotonic()
            if len(self.results) == world and exit_deadline is None:
                exit_deadline = max(deadline, now + _EXIT_GRACE_S)
            limit = deadline if exit_deadline is None else exit_deadline
            if now >= limit:
                raise self._timeout(now - start)
            watch: dict[Any, int] = {}
            for rank in range(world):
                if rank in self.exited:
                    continue
                watch[self.procs[rank].sentinel] = rank
                if rank not in self.results:
                    watch[self.readers[rank]] = rank
            ready = multiprocessing.connection.wait(list(watch), timeout=limit - now)
            ready_ranks = sorted({watch[obj] for obj in ready})
            for rank in ready_ranks:
                if rank not in self.results and self.readers[rank].poll(0):
                    self._receive(rank)
                if self.procs[rank].sentinel in ready:
                    self._handle_exit(rank)
        return [self.results[r] for r in range(world)]


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the spawner runs, so its cleanup still happens, then
    let the signal end the process as it would have.

    Without this a CI time-out or ``kill`` of the caller skips every ``finally``: the ranks die
    with it (parent-death signal) but their helper processes, the MPS daemon and the temp dirs
    stay behind. The SystemExit alone is not enough: a caller that catches it (pytest records it
    as the failure of the test that was running, then runs the next one) would go on as if the
    signal had never come, and a ``timeout`` would stop one test instead of the run. So once the
    cleanup is done the signal is delivered again with its default action. Only done from the
    main thread over the default handler; restored afterwards.
    """
    import threading

    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    received = False

    def on_sigterm(signum: int, frame: Any) -> None:
        nonlocal received
        received = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the process at once
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if received:  # everything above has unwound: now end as the signal meant
            os.kill(os.getpid(), signal.SIGTERM)
