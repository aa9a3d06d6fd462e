"""The JSON-lines log rank 0 appends to while a backend run goes on, and the parent reads back.

It is what survives when a rank hangs or dies: run_ranks then raises without any return value,
but every case that finished is already on disk. Events::

    {"event": "setup", ...facts about the ranks...}
    {"event": "start", "index": 3}
    {"event": "done", "index": 3, "status": "ok", "p50_us": ..., ...}
"""

from __future__ import annotations

import json
import os
from typing import Any

LOG_NAME = "progress.jsonl"


class ProgressLog:
    """Append-only event writer; every line is flushed at once (the process may be killed next)."""

    def __init__(self, directory: str) -> None:
        self._fh = open(os.path.join(directory, LOG_NAME), "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def write(self, event: str, **fields: Any) -> None:
        self._fh.write(json.dumps({"event": event, **fields}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_events(directory: str) -> list[dict[str, Any]]:
    """Every complete event in ``directory``'s log (a half-written last line is ignored)."""
    path = os.path.join(directory, LOG_NAME)
    events = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return events
