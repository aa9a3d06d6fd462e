"""One parser for every environment setting: booleans, byte sizes, integers, seconds, choices.

The library (``PCIE_AR_*``) and both engine plugins (``PCIE_AR_SGLANG_*``, ``PCIE_AR_VLLM_*``) read
their settings through these functions, so the same spelling means the same thing everywhere and a
value that cannot be used is a :class:`SettingsError` naming the variable, never a silent default
or a bare ``int()`` traceback. Pure functions of their arguments; nothing here keeps state.

setup.py loads this file by path (the package's ``__init__`` imports torch, which a build need not
have), so it imports nothing of the package at module level.
"""

from __future__ import annotations

import os
from typing import Mapping

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class SettingsError(ValueError):
    """An environment variable has a value that cannot be used; the message names the variable."""


def parse_bool(name: str, raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (case-insensitive; empty is off)."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}={raw!r}: expected 1 or 0 (also true/false, yes/no, on/off)")


def parse_size(name: str, raw: str, *, max_bytes: int | None = None) -> int:
    """A positive byte count: ``8388608``, ``8MiB``, ``64KiB``, ``1M`` (binary units), at most ``max_bytes``
    (default: the largest message a communicator takes, ``MAX_MESSAGE_BYTES``)."""
    from pcie_allreduce.constants import MAX_MESSAGE_BYTES
    from pcie_allreduce.sizes import parse_size as _parse_size_text

    max_bytes = MAX_MESSAGE_BYTES if max_bytes is None else max_bytes
    try:
        value = _parse_size_text(raw)
    except ValueError as exc:
        if "positive" not in str(exc):
            raise SettingsError(f"{name}={raw!r}: expected a byte count such as 8388608, 8MiB or 512KiB") from None
        value = 0
    if not 0 < value <= max_bytes:
        raise SettingsError(f"{name}={raw!r}: must be between 1 byte and {format_bytes(max_bytes)}")
    return value


def parse_int(name: str, raw: str, *, lo: int, hi: int | None = None) -> int:
    """A decimal integer in ``[lo, hi]`` (ASCII digits only: ``"²"`` is refused, not crashed on)."""
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not digits.isascii() or not digits.isdigit():
        raise SettingsError(f"{name}={raw!r}: expected a whole number")
    value = int(text)
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise SettingsError(f"{name}={raw!r}: must be {bound}")
    return value


def parse_seconds(name: str, raw: str, *, max_s: float | None = None) -> float:
    """A positive, finite number of seconds, at most ``max_s`` (default: the longest kernel wait,
    ``MAX_TIMEOUT_S``)."""
    from pcie_allreduce.constants import MAX_TIMEOUT_S

    max_s = MAX_TIMEOUT_S if max_s is None else max_s
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a number of seconds") from None
    if not 0 < value <= max_s:  # also refuses nan and inf
        raise SettingsError(f"{name}={raw!r}: must be a number of seconds in (0, {max_s:g}]")
    return value


def parse_choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive, surrounding blanks ignored)."""
    value = raw.strip().lower()
    if value not in choices:
        raise SettingsError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return value


def env_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """``$name`` as a boolean; ``default`` when unset."""
    raw = (os.environ if environ is None else environ).get(name)
    return default if raw is None else parse_bool(name, raw)


def env_int(name: str, *, lo: int, hi: int | None = None,
            environ: Mapping[str, str] | None = None) -> int | None:
    """``$name`` as an integer in ``[lo, hi]``; None when unset or blank."""
    raw = (os.environ if environ is None else environ).get(name, "")
    return parse_int(name, raw, lo=lo, hi=hi) if raw.strip() else None


def format_bytes(n: int) -> str:
    """``8388608`` -> ``8MiB``: exact binary units only, else plain bytes (how settings are written)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
