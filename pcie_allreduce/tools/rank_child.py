"""What runs in each rank :func:`pcie_allreduce.tools.ranks.run_ranks` starts: the child's side
of the spawner.

A child detaches into its own process group (so the parent can kill its helpers too) and dies
with the parent, arms faulthandler so a hang or a fatal signal leaves its Python stacks in a file
the parent reads, joins the gloo group through the ``file://`` rendezvous, calls the function and
sends back its result or its traceback as pickled bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import multiprocessing.connection
import os
import pickle
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


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


@dataclasses.dataclass(frozen=True)
class RunSpec:
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


def _init_rank(spec: RunSpec, rank: int) -> RankContext:
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


def rank_main(spec: RunSpec, rank: int, conn: multiprocessing.connection.Connection) -> None:
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
