"""Combining the ranks' outcomes of one case into the one event rank 0 logs (pure)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Sequence

from pcie_allreduce.tools.timing import summarize

from bench.results import FAILED, OK, SKIPPED, WRONG

_SEVERITY = MappingProxyType({OK: 0, SKIPPED: 1, WRONG: 2, FAILED: 3})  # worst status of the ranks wins
MAX_ERROR_CHARS = 500


class CaseSkipped(Exception):
    """Raised by a backend inside a case it cannot run here (a forced kernel that cannot take the
    shape, a baseline that does not import): the case is "skipped" with this message, not failed."""


def rank_outcome(rank: int, status: str, *, error: str = "", times: Sequence[float] = (),
                 resolved: str = "") -> dict[str, Any]:
    """What one rank reports about one case (gathered over gloo, so plain data)."""
    return {"rank": rank, "status": status, "error": error[:MAX_ERROR_CHARS], "times": list(times),
            "resolved": resolved}


def worst_status(outcomes: Sequence[dict[str, Any]]) -> str:
    return max((o["status"] for o in outcomes), key=lambda s: _SEVERITY[s])


def merge(outcomes: Sequence[dict[str, Any]], calls_per_block: int) -> dict[str, Any]:
    """The case's status (worst over ranks), first error (prefixed with its rank) and timing stats."""
    status = worst_status(outcomes)
    event: dict[str, Any] = {"status": status, "resolved_algo": outcomes[0]["resolved"], "error": ""}
    for o in outcomes:
        if o["status"] == status and o["error"]:
            event["error"] = f"rank {o['rank']}: {o['error']}"
            break
    if status == OK:
        timing = summarize([o["times"] for o in outcomes], calls_per_block)
        event.update(p50_us=timing.p50_us, p99_us=timing.p99_us, rank0_p50_us=timing.rank0_p50_us,
                     min_us=timing.min_us, mean_us=timing.mean_us, replays=timing.replays)
    return event


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (CUDA and torch errors can span many)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:MAX_ERROR_CHARS]
