"""Per-rank hang guard: a rank stuck longer than the current phase allows dumps its stacks and exits.

Built on ``faulthandler.dump_traceback_later(exit=True)``, whose timer runs in a C thread that
needs no GIL, so it fires even when the main thread is blocked inside a CUDA call (a spin that
never ends in some backend's kernel). The rank's death makes ``run_ranks`` stop the whole run at
once instead of waiting for its overall timeout; the parent then reads which phase hung from
the files written here.
"""

from __future__ import annotations

import faulthandler
import json
import os
from typing import Any


def dump_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"watchdog.rank{rank}.txt")


def phase_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"phase.rank{rank}.json")


class Watchdog:
    """``arm(seconds, phase)`` before each phase; ``close()`` at the end (also a context manager)."""

    def __init__(self, directory: str, rank: int) -> None:
        self._directory = directory
        self._rank = rank
        self._dump = open(dump_path(directory, rank), "w", encoding="utf-8")  # noqa: SIM115 - faulthandler writes it

    def arm(self, seconds: float, phase: str, **facts: Any) -> None:
        """Exit this process (after dumping all Python stacks) unless re-armed or closed within ``seconds``."""
        with open(phase_path(self._directory, self._rank), "w", encoding="utf-8") as fh:
            json.dump({"phase": phase, "seconds": seconds, **facts}, fh)
        faulthandler.dump_traceback_later(seconds, repeat=False, file=self._dump, exit=True)

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._dump.close()

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_hang(directory: str, world: int) -> tuple[list[int], dict[str, Any], str] | None:
    """(ranks whose watchdog fired, the first one's phase facts, its stacks), or None if none fired."""
    fired: list[int] = []
    stacks = ""
    for rank in range(world):
        try:
            with open(dump_path(directory, rank), encoding="utf-8", errors="replace") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text:
            fired.append(rank)
            stacks = stacks or text
    if not fired:
        return None
    phase: dict[str, Any] = {}
    try:
        with open(phase_path(directory, fired[0]), encoding="utf-8") as fh:
            phase = json.load(fh)
    except (OSError, json.JSONDecodeError):
        pass
    return fired, phase, stacks
