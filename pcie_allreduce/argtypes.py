"""``argparse`` types that convert and check a value, so a bad one is a usage error (exit 2).

Apart from :mod:`pcie_allreduce.tools.cli` so that value parsers (:mod:`pcie_allreduce.sizes`) can offer
an argparse type without importing the console script and what it imports.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable


def typed_arg(convert: Callable[[str], Any], check: Callable[[Any], bool], what: str,
              *, explains: bool = False) -> Callable[[str], Any]:
    """An argparse ``type=`` that converts and checks, so bad values become usage errors (exit 2).

    ``explains``: the converter's ValueError message is meant for users (``parse_size``); int() and
    float() messages are not, so those get "'x' is not <what>".
    """

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) if explains else f"{text!r} is not {what}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse
