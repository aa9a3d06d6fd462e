"""Sizes on the command line ("4096", "14K", "56KiB", "64M": binary units, as nccl-tests), and dtype sizes."""

from __future__ import annotations

import re
from types import MappingProxyType

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
