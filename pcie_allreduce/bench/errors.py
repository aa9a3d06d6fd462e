"""Errors the CLI turns into one line on stderr and a non-zero exit status (no traceback)."""

from __future__ import annotations

EXIT_FAILURES = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130


class Unavailable(Exception):
    """The command cannot run on this machine; ``str(exc)`` is the one-line reason."""

    exit_code = EXIT_UNAVAILABLE
