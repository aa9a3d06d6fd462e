"""The sends and receives between the nodes of a hierarchical all-reduce, each one bounded.

Point-to-point on one process group of the hierarchy's ranks: NCCL where that group is NCCL (GPU
tensors; the current stream waits, never the host, so a CUDA graph can capture them), any other
backend through host memory (the host waits, eager only). A send or receive that fails or outlasts
the timeout raises :class:`~pcie_allreduce.errors.InterNodeError` naming the step, the rank and the
peer: through host memory at once; on NCCL at the next call or check after it failed, or after
the timeout passed with it pending (:meth:`InterNodeLink.check_pending`). The link records the
first failure; the communicator that owns it is unusable afterwards
(:mod:`pcie_allreduce.hierarchy` says what a graph's replay can and cannot bound)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from pcie_allreduce.errors import InterNodeError, one_line

MAX_PENDING = 256  # NCCL works of eager calls not yet complete; at this many the host waits for the oldest
_POLL_S = 0.0005


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never, without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def make_group(global_ranks: list[int], backend: str, timeout_s: float) -> dist.ProcessGroup:
    """A group of ``global_ranks`` of ``backend`` for the sends between nodes, made by those ranks
    alone (local synchronization). NCCL's watchdog bounds an eager work by its group's timeout,
    so an NCCL group gets ``timeout_s`` (:mod:`pcie_allreduce.hierarchy` says what that bounds in a
    CUDA graph). Through host memory each wait passes its own, and a gloo group's timeout would
    also bound its connections at creation, which a rank that comes late there must not fail."""
    bound = timedelta(seconds=timeout_s) if "nccl" in backend else None
    return dist.new_group(global_ranks, backend=backend, timeout=bound, use_local_synchronization=True)


class InterNodeLink:
    """One rank's sends and receives to the other nodes over ``group``, bounded by ``timeout_s``.

    ``global_ranks`` maps the group's ranks to the world's (what ``dist.isend`` takes);
    ``backend`` is the group's ("nccl", "gloo", or e.g. "cpu:gloo,cuda:nccl"). Eager NCCL works
    are kept until read (:attr:`pending`); :attr:`captured` says whether a graph captured one
    (the group must then outlive the communicator); :attr:`failed` names the first failure."""

    def __init__(self, group: dist.ProcessGroup | None, global_ranks: list[int], rank: int, timeout_s: float,
                 backend: str) -> None:
        self.group = group
        self.global_ranks = global_ranks
        self.rank = rank
        self.timeout_s = timeout_s
        self.backend = backend
        self.through_host = "nccl" not in backend
        self.captured = False  # a send or receive was captured in a CUDA graph
        self.failed: str | None = None
        self.pending: list[tuple[float, Any, int, str]] = []  # NCCL works of eager calls, until read

    def receive_all(self, parts: list[tuple[torch.Tensor, int]], step: str) -> None:
        """Receive each ``(view, peer)`` pair, all posted at once (empty views skipped)."""
        parts = [(into, peer) for into, peer in parts if into.numel()]
        staged = [torch.empty(into.shape, dtype=into.dtype) if self.through_host else into for into, _ in parts]
        works = []
        for (_, peer), buf in zip(parts, staged):
            source = self.global_ranks[peer]
            start = lambda buf=buf, source=source: dist.irecv(buf, src=source, group=self.group)  # noqa: E731
            works.append((self._start(start, peer, step), peer))
        for work, peer in works:
            self._wait(work, peer, step)
        for (into, _), buf in zip(parts, staged):
            if buf is not into:
                into.copy_(buf)

    def send(self, tensor: torch.Tensor, peer: int, step: str) -> None:
        """Send ``tensor`` to ``peer`` (a rank of the group); nothing where it is empty."""
        if not tensor.numel():
            return
        staged = tensor.cpu() if self.through_host else tensor.contiguous()
        work = self._start(lambda: dist.isend(staged, dst=self.global_ranks[peer], group=self.group), peer, step)
        self._wait(work, peer, step)

    def check_pending(self) -> None:
        """Raise for an NCCL send or receive of an eager call that failed, or is still not
        complete ``timeout_s`` after it was issued (no host wait); forget the ones that completed."""
        now, still = time.monotonic(), []
        for started, work, peer, step in self.pending:
            if not self._completed(work, peer, step):
                if now - started > self.timeout_s:
                    self._fail(peer, step, f"not complete {now - started:.1f} s after it was issued")
                still.append((started, work, peer, step))
        self.pending = still

    def drain(self) -> None:
        """Wait until every pending NCCL work completed, each at most ``timeout_s`` after it was
        issued (InterNodeError past it): the host does wait here, at creation."""
        while self.pending:
            self.check_pending()
            time.sleep(_POLL_S if self.pending else 0)

    def _start(self, start: Callable[[], Any], peer: int, step: str) -> Any:
        try:
            return start()
        except Exception as exc:  # noqa: BLE001 - any backend's failure becomes the library's error
            self._fail(peer, step, one_line(exc))

    def _wait(self, work: Any, peer: int, step: str) -> None:
        """Wait for one send or receive, bounded: InterNodeError naming ``step``.

        Through host memory the host waits (it must, to copy the data). On NCCL the current
        stream waits instead, so the call never blocks the host and a graph capture records the
        dependency; eager works are kept until read (:meth:`_track`)."""
        try:
            if self.through_host:
                done = work.wait(timeout=timedelta(seconds=self.timeout_s))
            else:
                done = work.wait()
        except Exception as exc:  # noqa: BLE001 - any backend's failure becomes the library's error
            self._fail(peer, step, one_line(exc))
        if done is False:
            self._fail(peer, step, f"not complete after {self.timeout_s:g} s")
        if not self.through_host:
            if capturing():
                self.captured = True
            else:
                self._track(work, peer, step)

    def _track(self, work: Any, peer: int, step: str) -> None:
        """Keep an eager NCCL work until it is read (:meth:`check_pending`), never dropping one
        unread: at ``MAX_PENDING`` still pending, the host waits for the oldest, at most until
        ``timeout_s`` after it was issued."""
        while len(self.pending) >= MAX_PENDING:
            started, oldest, old_peer, old_step = self.pending[0]
            while not self._completed(oldest, old_peer, old_step):
                waited = time.monotonic() - started
                if waited > self.timeout_s:
                    self._fail(old_peer, old_step, f"not complete {waited:.1f} s after it was issued")
                time.sleep(_POLL_S)
            self.pending.pop(0)
        self.pending.append((time.monotonic(), work, peer, step))

    def _completed(self, work: Any, peer: int, step: str) -> bool:
        """Whether ``work`` is complete; InterNodeError where it failed (torch reports a failed
        work complete: its exception says it failed, or reading it raises)."""
        try:
            if not work.is_completed():
                return False
            failure = work.exception()
        except Exception as exc:  # noqa: BLE001 - the backend's failure becomes the library's error
            self._fail(peer, step, one_line(exc))
        if failure is not None:
            self._fail(peer, step, one_line(failure))
        return True

    def _fail(self, peer: int, step: str, why: str) -> NoReturn:
        self.failed = f"rank {self.rank}: {step} (rank {peer}) failed"
        raise InterNodeError(f"rank {self.rank}: the inter-node step '{step}' with rank {peer} failed over "
                             f"{self.backend}: {why}", rank=self.rank, peer=peer, stage=step)
