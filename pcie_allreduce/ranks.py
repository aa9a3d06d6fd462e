"""The rank spawner: start W ranks, each with a gloo group (used by ``tune``, the tests and the harness).

``run_ranks(fn, W, ...)`` starts W fresh interpreters (spawn, never fork: the parent may have
imported CUDA-using libraries), joins them into one gloo process group through a ``file://``
rendezvous, calls ``fn(ctx, *args, **kwargs)`` in each and returns the per-rank results in rank
order. When several ranks have to share one GPU it first starts a private MPS control daemon so
their kernels run concurrently instead of time-slicing (the spin barriers of an all-reduce need
every rank's kernel resident at once to be fast).

Failure is always loud and never leaves anything behind: a rank that raises, dies or hangs makes
``run_ranks`` raise :class:`RankFailed` with the rank's traceback (or its Python stacks, for a
hang); every child is killed, the MPS daemon is stopped and the temporary directories are removed
on every path, KeyboardInterrupt included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing

from pcie_allreduce.mps import (  # noqa: F401 - re-exported: part of the spawner API
    MPS_CONTROL_BINARY,
    MpsDaemon,
    MpsError,
    MpsUnavailableWarning,
    _external_mps_env,
    _tail,
)

__all__ = [
    "MPS_ENV_VAR",
    "MpsDaemon",
    "MpsError",
    "MpsUnavailableWarning",
    "RankContext",
    "RankFailed",
    "gpu_count",
    "mps_active",
    "patched_environ",
    "placement_label",
    "run_ranks",
    "skip_reason_no_gpu",
]

MPS_ENV_VAR = "PCIE_AR_MPS"
"""Set to "1" in every rank when the ranks run under an MPS daemon, "0" otherwise."""


# How long ranks get to exit after all of them returned (interpreter and CUDA teardown).
_EXIT_GRACE_S = 30.0
# How long SIGTERM gets before SIGKILL.
_TERM_GRACE_S = 3.0
# How long a hung rank gets to write its Python stacks after SIGUSR1.
_STACK_DUMP_WAIT_S = 1.0
# Tracebacks of the other failed ranks are secondary (usually "connection closed by peer");
# keep their last lines only so the first failure stays readable.
_SECONDARY_TAIL_LINES = 3
# MPS log lines worth showing next to a failure.


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




@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a rank function receives as its first argument.

    Attributes:
        rank: this rank, 0..world_size-1.
        world_size: number of ranks.
        group: the gloo (CPU) process group of all ranks (``torch.distributed.group.WORLD``).
        device: ``cuda:{rank % gpu_count}`` with ``gpu=True`` (already made current), else ``cpu``.
        mps: whether the ranks run under an MPS daemon.
        shared_gpu: whether several ranks share one GPU (``gpu=True`` and W > GPUs).
    """

    rank: int
    world_size: int
    group: Any
    device: torch.device
    mps: bool = False
    shared_gpu: bool = False


# --------------------------------------------------------------------------- GPU queries


def gpu_count() -> int:
    """Number of visible CUDA GPUs, without creating a CUDA context in the caller.

    ``torch.cuda.device_count()`` asks NVML first and only falls back to
    ``cudaGetDeviceCount`` (driver init, still no context) when NVML is unusable.
    """
    return int(torch.cuda.device_count())


def skip_reason_no_gpu() -> str | None:
    """Why no CUDA GPU can be used here (see :func:`pcie_allreduce._ext.gpu_unavailable_reason`), or None."""
    from pcie_allreduce import _ext

    return _ext.gpu_unavailable_reason()


def placement_label(world: int, gpu_count: int, mps: bool | None) -> str:
    """How ``world`` ranks sit on ``gpu_count`` GPUs, e.g. "emulation: 4 ranks on one GPU under MPS".

    ``mps`` None: not known (no run got far enough to say).
    """
    if 0 < world <= gpu_count:
        return f"{world} ranks on {world} GPUs"
    where = "one GPU" if gpu_count <= 1 else f"{gpu_count} GPUs"
    if mps is None:
        return f"emulation: {world} ranks on {where}"
    if mps:
        return f"emulation: {world} ranks on {where} under MPS"
    return f"emulation: {world} ranks on {where}, time-sliced without MPS (timings not meaningful)"


def mps_active() -> bool:
    """Inside a rank started by :func:`run_ranks`: whether it runs under an MPS daemon."""
    return os.environ.get(MPS_ENV_VAR) == "1"


def __getattr__(name: str) -> Any:
    """Lazy ``requires_gpu``: a ``pytest.mark.skipif`` built on access.

    Lazy so that importing this module neither needs pytest nor queries the GPUs.
    """
    if name == "requires_gpu":
        try:
            import pytest
        except ImportError as exc:
            raise AttributeError("pcie_allreduce.ranks.requires_gpu needs pytest") from exc
        reason = skip_reason_no_gpu()
        return pytest.mark.skipif(reason is not None, reason=reason or "")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- child side


@dataclasses.dataclass(frozen=True)
class _RunSpec:
    """Everything a rank needs; pickled into each child by the spawn machinery."""

    world_size: int
    workdir: str
    payload: bytes  # pickle of (fn, args, kwargs), unpickled inside the child's try block
    gpu: bool
    n_gpus: int
    mps: bool
    shared_gpu: bool
    timeout_s: float
    parent_pid: int

    @property
    def init_file(self) -> str:
        return os.path.join(self.workdir, "rendezvous")

    def stack_file(self, rank: int) -> str:
        return os.path.join(self.workdir, f"rank{rank}.stacks")


def _detach(parent_pid: int) -> None:
    """Own process group (so the parent can kill our helpers too) and die with the parent."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _init_rank(spec: _RunSpec, rank: int) -> RankContext:
    if spec.gpu:
        device = torch.device("cuda", rank % spec.n_gpus)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{spec.init_file}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    group = dist.group.WORLD
    # Every rank enters fn at the same moment (benchmarks time from here).
    dist.barrier(group)
    return RankContext(rank, spec.world_size, group, device, spec.mps, spec.shared_gpu)


def _rank_main(spec: _RunSpec, rank: int, conn: multiprocessing.connection.Connection) -> None:
    """Child entry point: run fn, send ("ok", result) or ("err", traceback) as pickled bytes.

    Plain pickle + send_bytes rather than Connection.send: torch registers shared-memory
    reductions with multiprocessing's pickler, and those need this process alive while the
    parent unpickles, which it is not once it exits.
    """
    _detach(spec.parent_pid)
    # Fatal signals and the parent's SIGUSR1 (on timeout) dump all Python stacks to a file the
    # parent puts into the RankFailed message.
    stacks = open(spec.stack_file(rank), "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    ok = False
    try:
        fn, args, kwargs = pickle.loads(spec.payload)
        ctx = _init_rank(spec, rank)
        result = fn(ctx, *args, **kwargs)
        reply = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
        ok = True
    except BaseException:  # noqa: BLE001 - SystemExit too: the caller must hear about it
        reply = pickle.dumps(("err", traceback.format_exc().rstrip()))
    conn.send_bytes(reply)
    conn.close()
    if ok:
        # Only on success: after an error peers may still be blocked in a collective with us. What
        # fn left in reference cycles (a communicator holding the group) is freed first, while the
        # group and the interpreter are whole: freed at interpreter exit, after the group was
        # destroyed, gloo's teardown can abort the process.
        del fn, args, kwargs, result, ctx
        gc.collect()
        dist.destroy_process_group()


# --------------------------------------------------------------------------- parent side


@contextlib.contextmanager
def patched_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Temporarily set env vars; spawned children copy os.environ at start.

    The children need them from their very first instruction (CUDA reads the MPS pipe
    directory when it initialises, some libraries read env at import), which passing them
    as arguments could not guarantee.
    """
    saved = {key: os.environ.get(key) for key in updates}
    try:
        os.environ.update(updates)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _child_env(
    mps_env: Mapping[str, str] | None, user_env: Mapping[str, str] | None
) -> dict[str, str]:
    env: dict[str, str] = {}
    # W interpreters each spinning up one OpenMP thread per core oversubscribe the host; torchrun
    # makes the same choice. The caller's setting wins.
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    # All ranks are local: bind gloo to loopback so a host without a resolvable hostname works.
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(mps_env or {})
    env[MPS_ENV_VAR] = "1" if mps_env else "0"
    env.update({str(k): str(v) for k, v in (user_env or {}).items()})
    return env


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


def _kill_all(procs: Sequence[Any]) -> None:
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


class _Run:
    """Book-keeping of one run_ranks call in the parent: the waiting loop and failure messages."""

    def __init__(self, procs: list[Any], readers: list[Any], spec: _RunSpec, mps_daemon) -> None:
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
            lines += ["", f"--- rank {r} (tail) ---", _tail(failures[r], _SECONDARY_TAIL_LINES)]
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
        """Errors other ranks have already sent (shown as context after the first)."""
        errors = {}
        for rank, reader in enumerate(self.readers):
            if rank == skip or rank in self.results:
                continue
            with contextlib.suppress(Exception):
                if reader.poll(0):
                    kind, value = pickle.loads(reader.recv_bytes())
                    if kind == "err":
                        errors[rank] = value
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
def _sigterm_unwinds() -> Iterator[None]:
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


def _want_mps(mps: bool | str, gpu: bool, shared_gpu: bool) -> bool:
    if mps == "auto":
        return gpu and shared_gpu
    if isinstance(mps, bool):
        return mps
    raise ValueError(f"mps must be True, False or 'auto', got {mps!r}")


def _mps_env_for_run(
    want: bool, gpu: bool, world_size: int, n_gpus: int, stack: contextlib.ExitStack
) -> tuple[dict[str, str] | None, MpsDaemon | None]:
    """MPS env for the children (None: no MPS) and the private daemon, if one was started."""
    external = _external_mps_env() if (gpu or want) else None
    if external is not None:
        return external, None
    if not want:
        return None, None
    try:
        daemon = MpsDaemon.start()
    except MpsError as exc:
        where = (
            f"{world_size} ranks on {n_gpus} GPU(s) will time-slice (correct but slow)"
            if gpu
            else "ranks run without MPS"
        )
        warnings.warn(
            f"pcie_allreduce.ranks: could not start an MPS daemon ({exc}); {where}",
            MpsUnavailableWarning,
            stacklevel=3,
        )
        return None, None
    stack.callback(daemon.stop)
    return daemon.env, daemon


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    gpu: bool = True,
    mps: bool | str = "auto",
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` in ``world_size`` spawned ranks; results in rank order.

    Args:
        fn: a module-level (picklable) function taking a :class:`RankContext` first.
        world_size: number of ranks (>= 1).
        *args, **kwargs: passed to ``fn``; must be picklable. (``timeout_s``, ``gpu``, ``mps``
            and ``env`` are the spawner's own and never reach ``fn``.)
        timeout_s: wall-clock limit for the whole run, process start-up included.
        gpu: put rank r on ``cuda:{r % gpu_count()}``; False: CPU only.
        mps: "auto" starts a private MPS daemon when ranks share a GPU; True always; False never.
            A daemon already running (``$CUDA_MPS_PIPE_DIRECTORY`` or /tmp/nvidia-mps) is reused.
            If one cannot be started, :class:`MpsUnavailableWarning` is issued and the run goes on.
        env: extra environment variables for the ranks (present from their interpreter start).

    Returns:
        The ranks' return values (which must be picklable; return CPU values, since unpickling a
        CUDA tensor would create a CUDA context in the caller).

    Raises:
        RankFailed: a rank raised (its traceback is in the message), died without returning
            (exit code / signal and stacks), exited non-zero after returning, or the run
            exceeded ``timeout_s`` (the stuck ranks' Python stacks are in the message).
        RuntimeError: ``gpu=True`` but no GPU is visible.
        TypeError: ``fn`` or its arguments cannot be pickled.

    Not thread-safe: it briefly sets the children's variables in ``os.environ`` while spawning.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"run_ranks: fn and its arguments must be picklable (fn must be a module-level "
            f"function): {exc}"
        ) from exc
    n_gpus = 0
    if gpu:
        reason = skip_reason_no_gpu()
        if reason is not None:
            raise RuntimeError(f"run_ranks(gpu=True): {reason}")
        n_gpus = gpu_count()
    shared_gpu = gpu and world_size > n_gpus
    want = _want_mps(mps, gpu, shared_gpu)

    start = time.monotonic()
    procs: list[Any] = []
    with _sigterm_unwinds(), contextlib.ExitStack() as stack:
        # Unwinds in reverse: children are killed first, then MPS stops, then dirs go.
        mps_env, daemon = _mps_env_for_run(want, gpu, world_size, n_gpus, stack)
        workdir = tempfile.mkdtemp(prefix="pcie_ar_ranks_")
        stack.callback(shutil.rmtree, workdir, True)
        spec = _RunSpec(
            world_size=world_size,
            workdir=workdir,
            payload=payload,
            gpu=gpu,
            n_gpus=n_gpus,
            mps=mps_env is not None,
            shared_gpu=shared_gpu,
            timeout_s=timeout_s,
            parent_pid=os.getpid(),
        )
        ctx = torch.multiprocessing.get_context("spawn")
        readers = []
        stack.callback(lambda: [r.close() for r in readers])
        stack.callback(_kill_all, procs)  # a no-op when every rank has exited
        with patched_environ(_child_env(mps_env, env)):
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                readers.append(reader)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(spec, rank, writer),
                    name=f"pcie_ar_rank{rank}",
                    daemon=False,
                )
                procs.append(proc)
                proc.start()
                # Drop our copy of the write end so a dead child reads as EOF.
                writer.close()
        results = _Run(procs, readers, spec, daemon).wait(timeout_s, start)
    return results
