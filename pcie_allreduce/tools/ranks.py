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
on every path, KeyboardInterrupt included. What runs in a child is :mod:`.rank_child`; the
parent's waiting, failure messages and clean-up are :mod:`.rank_supervisor`; when to use MPS and
the daemon itself are :mod:`.mps`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.multiprocessing

from pcie_allreduce.tools import mps as mps_mod
from pcie_allreduce.tools.mps import MpsDaemon, MpsError, MpsUnavailableWarning
from pcie_allreduce.tools.rank_child import RankContext, RunSpec, rank_main
from pcie_allreduce.tools.rank_supervisor import RankFailed, Supervisor, kill_all, sigterm_unwinds

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
            raise AttributeError("pcie_allreduce.tools.ranks.requires_gpu needs pytest") from exc
        reason = skip_reason_no_gpu()
        return pytest.mark.skipif(reason is not None, reason=reason or "")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    mps_env: Mapping[str, str] | None, user_env: Mapping[str, str] | None, ranks_per_gpu: int = 1
) -> dict[str, str]:
    """The variables every rank gets on top of the parent's environment."""
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
    if mps_env:  # ranks sharing a GPU: each its share of the SMs (a smaller one set by the caller stays)
        env.update(mps_mod.thread_share_env(ranks_per_gpu, {**os.environ, **env}))
    return env


def _want_mps(mps: bool | str, gpu: bool, shared_gpu: bool) -> bool:
    if mps == "auto":
        return gpu and shared_gpu
    if isinstance(mps, bool):
        return mps
    raise ValueError(f"mps must be True, False or 'auto', got {mps!r}")


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
    with sigterm_unwinds(), contextlib.ExitStack() as stack:
        # Unwinds in reverse: children are killed first, then MPS stops, then dirs go.
        mps_env, daemon = mps_mod.env_for_run(want, gpu, world_size, n_gpus, stack)
        workdir = tempfile.mkdtemp(prefix="pcie_ar_ranks_")
        stack.callback(shutil.rmtree, workdir, True)
        spec = RunSpec(
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
        stack.callback(kill_all, procs)  # a no-op when every rank has exited
        with patched_environ(_child_env(mps_env, env, -(-world_size // max(n_gpus, 1)))):
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                readers.append(reader)
                proc = ctx.Process(
                    target=rank_main,
                    args=(spec, rank, writer),
                    name=f"pcie_ar_rank{rank}",
                    daemon=False,
                )
                procs.append(proc)
                proc.start()
                # Drop our copy of the write end so a dead child reads as EOF.
                writer.close()
        results = Supervisor(procs, readers, spec, daemon).wait(timeout_s, start)
    return results
