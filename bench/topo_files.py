"""The files of ``python -m bench topo --out DIR``, all derived from its JSON document.

- ``topo.txt``: the printed matrices;
- ``topo.csv``: one row per measured (W, sender, receiver): flag round trip and one-way write
  bandwidth, plus the per-rank one-to-one / all-to-all rows (receiver ``*`` for all-to-all);
- ``topo.png``: per W, heat maps of the round trip and of the write bandwidth
  (:func:`bench.plot.write_topo_png`).

Pure functions over the document, so ``python -m bench plot topo.json`` can redraw a saved run on
any machine and the CPU tests check them with a fake document.
"""

from __future__ import annotations

import csv
import io
from typing import Any

CSV_COLUMNS: tuple[str, ...] = ("world", "placement", "kind", "sender", "receiver", "rtt_us", "write_gbps",
                                 "read_gbps")


def is_topo_document(data: Any) -> bool:
    """Whether a loaded JSON document is ``topo.json`` (not a bench report)."""
    return isinstance(data, dict) and "peer_access" in data and "gpus" in data


def measured_worlds(data: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(W, its measurements) of every world size measured, in W order."""
    return sorted(((int(w), m) for w, m in (data.get("measured") or {}).items()), key=lambda item: item[0])


def csv_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The CSV's rows (dicts keyed by CSV_COLUMNS), W by W."""
    rows: list[dict[str, Any]] = []
    for world, m in measured_worlds(data):
        base = {"world": world, "placement": m.get("placement", "")}
        rtt, gbps, reads = m.get("rtt_us") or [], m.get("write_gbps") or [], m.get("read_gbps") or []
        for i in range(world):
            for j in range(world):
                if i != j:  # read_gbps: rank i (the sender's column) reading rank j's memory
                    rows.append({**base, "kind": "pair", "sender": i, "receiver": j,
                                 "rtt_us": rtt[i][j] if i < len(rtt) else None,
                                 "write_gbps": gbps[i][j] if i < len(gbps) else None,
                                 "read_gbps": reads[i][j] if i < len(reads) else None})
        for r, value in enumerate(m.get("one_to_one_gbps") or []):
            rows.append({**base, "kind": "one_to_one", "sender": r, "receiver": (r + 1) % world, "rtt_us": None,
                         "write_gbps": value, "read_gbps": None})
        many_read = m.get("all_to_all_read_gbps") or []
        for r, value in enumerate(m.get("all_to_all_gbps") or []):
            rows.append({**base, "kind": "all_to_all", "sender": r, "receiver": "*", "rtt_us": None,
                         "write_gbps": value, "read_gbps": many_read[r] if r < len(many_read) else None})
    return rows


def csv_text(data: dict[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in csv_rows(data):
        writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_COLUMNS})
    return buf.getvalue()
