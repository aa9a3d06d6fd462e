"""Sizes on the command line ("4096", "14K", "56KiB", "64M": binary units, as nccl-tests), and dtype sizes."""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Sequence

from pcie_allreduce.argtypes import typed_arg

if TYPE_CHECKING:
    import argparse

# Read-only: suffix (lower case) -> bytes. "KB" is accepted as binary too, like nccl-tests' "K".
_UNITS = MappingProxyType({
    "": 1, "b": 1,
    **{suffix: 1 << (10 * power)
       for power, letter in enumerate("kmg", start=1)
       for suffix in (letter, letter + "b", letter + "ib")},
})

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: an integer with an optional K/M/G (or KiB/MiB/GiB, KB/MB/GB) suffix.

    All units are binary (1K = 1024), as in nccl-tests. Raises ValueError naming the problem.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 14K, 56KiB, 64M)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"{text!r}: unknown unit {unit!r} (use K, M, G or KiB, MiB, GiB; all binary)")
    value = int(number) * factor
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return value


def format_size(nbytes: int) -> str:
    """Shortest exact form: 1024 -> "1K", 14336 -> "14K", 1000 -> "1000"."""
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


def doubling_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """min_bytes, 2*min_bytes, 4*min_bytes, ... up to and including max_bytes (as nccl-tests -f 2)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min ({min_bytes}) <= max ({max_bytes})")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


# Element bytes of the dtypes the kernels take, by name (what the command lines and tables say).
DTYPE_SIZES = MappingProxyType({"bfloat16": 2, "float16": 2, "float32": 4})


def requested_sizes(explicit: Sequence[int] | None, min_bytes: int | None, max_bytes: int | None, *,
                    default_min: str, default_max: str, dtype: str, error: Callable[[str], object]) -> tuple[int, ...]:
    """The message sizes a command line asks for, sorted and unique: ``explicit`` (``--sizes``), else
    the doubling sweep ``min_bytes .. max_bytes`` (each defaulting to the given text). ``error``
    (``parser.error``) is called for both forms at once, an empty range, or a size that is not a
    whole number of ``dtype`` elements."""
    if explicit and (min_bytes is not None or max_bytes is not None):
        error("give either --sizes or --min-bytes/--max-bytes, not both")
    if explicit:
        chosen = set(explicit)
    else:
        low = min_bytes if min_bytes is not None else parse_size(default_min)
        high = max_bytes if max_bytes is not None else parse_size(default_max)
        if high < low:
            error(f"--max-bytes ({high}) is smaller than --min-bytes ({low})")
        chosen = set(doubling_sizes(low, high))
    element = DTYPE_SIZES[dtype]
    ragged = sorted(s for s in chosen if s % element)
    if ragged:
        error(f"sizes {ragged} are not a multiple of the {dtype} element size ({element} bytes)")
    return tuple(sorted(chosen))


def add_size_arguments(group: "argparse._ArgumentGroup", *, default_min: str, default_max: str) -> None:
    """``--sizes`` or the doubling sweep ``--min-bytes .. --max-bytes`` (read back with
    :func:`requested_sizes`), for the benchmark and ``pcie-allreduce tune``."""
    group.add_argument("--sizes", type=size_arg, nargs="+", metavar="SIZE",
                       help="message sizes in bytes, K/M/G suffixes (= KiB/MiB/GiB), e.g. 14K 56K 448K; "
                            "default a doubling sweep")
    group.add_argument("--min-bytes", type=size_arg, metavar="SIZE",
                       help=f"smallest size of the doubling sweep (default {default_min})")
    group.add_argument("--max-bytes", type=size_arg, metavar="SIZE",
                       help=f"largest size of the doubling sweep (default {default_max})")


#: argparse ``type=`` for a size option ("14K"); a bad value is a usage error naming the problem.
size_arg = typed_arg(parse_size, lambda v: v > 0, "a positive size", explains=True)
