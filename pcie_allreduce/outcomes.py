"""Meetings of every rank through the group's key-value store, bounded: never a collective.

A step that can fail on some ranks only (creating a communicator across nodes, whose ranks wait on
each other in sends and process groups) must end the same way everywhere: every rank raises, or
none does. A gather on the group cannot decide it: a rank still waiting on a peer that failed
never joins it, and the group's collectives are bounded only by its timeout (30 minutes by
default). The store is: each rank posts its outcome under the step's keys, and one that succeeded
polls every rank's until all succeeded, one failed (it raises at once, naming that rank and why),
or the bound passed. :func:`meet` is the plain form: every rank's value once all have posted,
within a bound (a rank that gives up marks its key, so one that comes later raises too).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import time

import torch.distributed as dist

from pcie_allreduce.errors import CollectiveTimeout, UnavailableError

OK = "ok"
# What a rank that gave up on a meeting leaves in its key.
ABANDONED = "abandoned"
_POLL_S = 0.01
# Steps agreed per process group (by name) in this process: numbers every rank's step alike (ranks
# run a group's steps in the same order), so each step's keys are its own.
_STEPS: collections.Counter[str] = collections.Counter()


def next_step(group: dist.ProcessGroup, kind: str) -> str:
    """The key prefix of this rank's next step of ``kind`` on ``group``: call it on every rank at
    the same point, before anything that may fail on one rank only."""
    name = f"{dist.distributed_c10d._get_process_group_name(group)}/{kind}"
    _STEPS[name] += 1
    return f"pcie_allreduce/{kind}/{_STEPS[name]}"


def agree(group: dist.ProcessGroup, step: str, failure: str | None, *, bound_s: float, what: str) -> None:
    """Post this rank's outcome of ``step`` (``failure``: why it failed, or None) and, where it
    succeeded, wait for every rank's: UnavailableError naming the ranks that failed and why as
    soon as one has, or naming those that did not report within ``bound_s``. A rank that failed
    only posts (best effort: its own exception is the one to raise) and returns."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    keys = [f"{step}/{r}" for r in range(world)]
    if failure is not None:
        with contextlib.suppress(Exception):
            dist.distributed_c10d._get_process_group_store(group).set(keys[rank], failure)
        return
    store = dist.distributed_c10d._get_process_group_store(group)
    store.set(keys[rank], OK)
    deadline = time.monotonic() + bound_s
    while True:
        posted = {r: store.get(k).decode() for r, k in enumerate(keys) if store.check([k])}
        failed = {r: why for r, why in posted.items() if why != OK}
        if failed:
            reasons = "; ".join(f"rank {r}: {why}" for r, why in failed.items())
            raise UnavailableError(f"rank {rank}: {what} failed on another rank ({reasons})")
        if len(posted) == world:
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if r not in posted]
            raise UnavailableError(f"rank {rank}: ranks {missing} did not finish {what} within {bound_s:g} s of "
                                   "this rank: stuck, or gone")
        time.sleep(_POLL_S)


def meet(group: dist.ProcessGroup, prefix: str, number: int, what: str, mine: str, *, wait_s: float,
         stage: str) -> list[str]:
    """Every rank's ``mine`` for meeting ``number`` under ``prefix``, once all have posted it,
    within ``wait_s``; CollectiveTimeout (with ``stage``) naming the missing ranks past it, or at
    once when one of them already gave up on this meeting. Each rank removes its key of the
    previous meeting once every rank has posted this one (so every rank has read the previous)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    store = dist.distributed_c10d._get_process_group_store(group)  # the group's own key prefix
    keys = [f"{prefix}/{number}/{r}" for r in range(world)]
    store.set(keys[rank], mine)
    try:
        store.wait(keys, datetime.timedelta(seconds=wait_s))
    except Exception as exc:  # noqa: BLE001 - the store's timeout (RuntimeError / DistStoreError)
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        store.set(keys[rank], ABANDONED)
        raise CollectiveTimeout(f"rank {rank}: ranks {missing} did not reach {what} within {wait_s:g} s: a rank is "
                                "stuck or gone, or the ranks' calls differ", rank=rank,
                                peer=missing[0] if missing else -1, stage=stage) from exc
    values = [store.get(k).decode() for k in keys]
    gave_up = [r for r, v in enumerate(values) if v == ABANDONED]
    if gave_up:
        store.set(keys[rank], ABANDONED)
        raise CollectiveTimeout(f"rank {rank}: ranks {gave_up} gave up waiting for the others at {what} before this "
                                f"rank reached it (after {wait_s:g} s)", rank=rank, peer=gave_up[0], stage=stage)
    if number:
        store.delete_key(f"{prefix}/{number - 1}/{rank}")
    return values
