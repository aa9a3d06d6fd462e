"""The files of ``python -m bench topo --out DIR``, all derived from its JSON document.

- ``topo.txt``: the printed matrices;
- ``topo.csv``: one row per measured (W, sender, receiver): flag round trip and one-way write
  bandwidth, plus the per-rank one-to-one / all-to-all rows (receiver ``*`` for all-to-all);
- ``topo.png``: per W, heat maps of the round trip and of the write bandwidth.

Pure functions over the document, so ``python -m bench plot topo.json`` can redraw a saved run on
any machine and the CPU tests check them with a fake document.
"""

from __future__ import annotations

import csv
import io
from typing import Any

CSV_COLUMNS: tuple[str, ...] = ("world", "placement", "kind", "sender", "receiver", "rtt_us", "write_gbps")


def is_topo_document(data: Any) -> bool:
    """Whether a loaded JSON document is ``topo.json`` (not a bench report)."""
    return isinstance(data, dict) and "peer_access" in data and "gpus" in data


def _measured(data: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    return sorted(((int(w), m) for w, m in (data.get("measured") or {}).items()), key=lambda item: item[0])


def csv_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The CSV's rows (dicts keyed by CSV_COLUMNS), W by W."""
    rows: list[dict[str, Any]] = []
    for world, m in _measured(data):
        base = {"world": world, "placement": m.get("placement", "")}
        rtt, gbps = m.get("rtt_us") or [], m.get("write_gbps") or []
        for i in range(world):
            for j in range(world):
                if i != j:
                    rows.append({**base, "kind": "pair", "sender": i, "receiver": j,
                                 "rtt_us": rtt[i][j] if i < len(rtt) else None,
                                 "write_gbps": gbps[i][j] if i < len(gbps) else None})
        for r, value in enumerate(m.get("one_to_one_gbps") or []):
            rows.append({**base, "kind": "one_to_one", "sender": r, "receiver": (r + 1) % world, "rtt_us": None,
                         "write_gbps": value})
        for r, value in enumerate(m.get("all_to_all_gbps") or []):
            rows.append({**base, "kind": "all_to_all", "sender": r, "receiver": "*", "rtt_us": None,
                         "write_gbps": value})
    return rows


def csv_text(data: dict[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in csv_rows(data):
        writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_COLUMNS})
    return buf.getvalue()


def write_png(data: dict[str, Any], path: str) -> str | None:
    """Heat maps per W; None on success, else why nothing was written (no matplotlib, no data)."""
    from bench.plot import pyplot

    measured = _measured(data)
    if not measured:
        return "no measurements to plot (topo ran with --no-probe, or every W failed)"
    plt, problem = pyplot()
    if plt is None:
        return problem
    fig, axes = plt.subplots(len(measured), 2, figsize=(11, 4.6 * len(measured)), squeeze=False)
    try:
        for row, (world, m) in enumerate(measured):
            for col, (key, what, fmt) in enumerate((("rtt_us", "flag round trip (us)", "{:.2f}"),
                                                    ("write_gbps", "one-way write (GB/s)", "{:.0f}"))):
                ax = axes[row][col]
                grid = [[float("nan") if v is None else float(v) for v in line] for line in m.get(key) or []]
                image = ax.imshow(grid, cmap="viridis")
                fig.colorbar(image, ax=ax, fraction=0.046)
                for i, line in enumerate(grid):
                    for j, v in enumerate(line):
                        if v == v:  # not NaN (the diagonal)
                            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7, color="white")
                ax.set_xticks(range(world), [f"r{j}" for j in range(world)])
                ax.set_yticks(range(world), [f"r{i}" for i in range(world)])
                ax.set_xlabel("receiver")
                ax.set_ylabel("sender")
                ax.set_title(f"W={world} {what}\n{m.get('placement', '')}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return None
