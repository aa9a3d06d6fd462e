"""Fixed-width, right-aligned text tables (nccl-tests style) and number formats (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Column:
    """A table column: header, width, and the cell text of a row."""

    header: str
    width: int
    cell: Callable[[Any], str]


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def line(columns: Sequence[Column], cells: Sequence[str]) -> str:
    return " ".join(cell.rjust(col.width) for cell, col in zip(cells, columns))


def header(columns: Sequence[Column]) -> str:
    """The header line, starting with '#' (which takes the first column's leading space)."""
    return "#" + line(columns, [c.header for c in columns])[1:]


def render(columns: Sequence[Column], rows: Sequence[Any]) -> list[str]:
    """Header and one line per row (trailing spaces stripped)."""
    return [header(columns)] + [line(columns, [c.cell(r) for c in columns]).rstrip() for r in rows]


# Our rows' bytes on one rank's link per call (out/in) and the link rate they imply
# (Result.wire, Result.wire_gbps): the same two columns in the sweep's and --fused's tables.
WIRE_COLUMNS: tuple[Column, ...] = (
    Column("wire(B)", 21, lambda r: "-" if r.wire is None else f"{r.wire.out}/{r.wire.into}"),
    Column("wire(GB/s)", 11, lambda r: num(r.wire_gbps)),
)


#: The fused summaries' "(which)" column: the backend and variant of a summary entry's best
#: all-reduce + one-kernel add + RMSNorm ("-" when there is none).
BEST_ONE_KERNEL_WHICH = Column("(which)", 36, lambda e: "-" if e["best_one_kernel"] is None
                               else f"{e['best_one_kernel'].backend}/{e['best_one_kernel'].label}")
