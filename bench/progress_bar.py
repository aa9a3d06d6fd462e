"""A progress bar over a sweep's cases: tqdm when it imports and stderr is a terminal, else nothing.

Lines printed while the bar is up must go through :meth:`Bar.write` so they do not tear the bar.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TextIO


class Bar:
    """``advance(n)`` cases done; ``write(line)`` a message line; ``close()``. Also a context manager."""

    def __init__(self, total: int, desc: str, *, stream: TextIO | None = None,
                 factory: Callable[..., Any] | None = None) -> None:
        self._stream = stream or sys.stderr
        self._bar: Any = None
        if factory is None:
            factory = _tqdm_factory()
        if factory is not None and total > 0 and _is_tty(self._stream):
            self._bar = factory(total=total, desc=desc, unit="case", file=self._stream, leave=True,
                                dynamic_ncols=True)

    @property
    def active(self) -> bool:
        return self._bar is not None

    def advance(self, cases: int) -> None:
        if self._bar is not None and cases > 0:
            self._bar.update(cases)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        else:
            print(line, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _tqdm_factory() -> Callable[..., Any] | None:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm
