"""Writing a tuned table into the tune cache (:mod:`pcie_allreduce.plan.cache` names, keys and
reads it; only ``tune`` writes).

A cached table decides what every Communicator here runs, so :func:`write_table` refuses a
directory the reader would not trust (not the user's or root's, or writable by group or others),
and writes through a new file of its own (``mkstemp``: created exclusively, never through a link)
renamed over the table, so nobody can make it write anywhere else and readers never see half a
table.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

from pcie_allreduce.plan.cache import untrusted


def write_table(path: str, table_json: str, meta: dict[str, Any]) -> None:
    """Write an AlgoTable's JSON with a ``meta`` object beside its ``rules`` (the loader ignores it).

    Raises PermissionError where the directory is one :func:`pcie_allreduce.plan.cache.read_table`
    would not trust."""
    data = json.loads(table_json)
    data["meta"] = meta
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    problem = untrusted(os.stat(directory), "directory")
    if problem is not None:
        raise PermissionError(f"refusing to write the tuned table {path}: its {problem}")
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)  # readers never see a half-written table; a link at ``path`` is replaced, not followed
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
