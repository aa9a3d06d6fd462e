"""Statistics over timed replays (pure)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pcie_allreduce.tune import percentile


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call times in microseconds over ``replays`` timed replays."""

    p50_us: float
    p99_us: float
    min_us: float
    mean_us: float
    rank0_p50_us: float
    replays: int


def summarize(per_rank_block_us: Sequence[Sequence[float]], calls_per_block: int) -> Timing:
    """Per-call statistics from every rank's per-replay block times.

    A collective is done when its slowest rank is, so each replay counts as the maximum over
    ranks of that replay's time; dividing by ``calls_per_block`` gives the time per call.
    """
    if not per_rank_block_us or not per_rank_block_us[0]:
        raise ValueError("no timings")
    lengths = {len(t) for t in per_rank_block_us}
    if len(lengths) != 1:
        raise ValueError(f"ranks timed different numbers of replays: {sorted(lengths)}")
    if calls_per_block < 1:
        raise ValueError(f"calls_per_block must be >= 1, got {calls_per_block}")
    slowest = [max(replay) / calls_per_block for replay in zip(*per_rank_block_us)]
    rank0 = [t / calls_per_block for t in per_rank_block_us[0]]
    return Timing(
        p50_us=percentile(slowest, 50),
        p99_us=percentile(slowest, 99),
        min_us=min(slowest),
        mean_us=sum(slowest) / len(slowest),
        rank0_p50_us=percentile(rank0, 50),
        replays=len(slowest),
    )
