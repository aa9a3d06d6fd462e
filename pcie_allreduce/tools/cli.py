"""The ``pcie-allreduce`` console script (also ``python -m pcie_allreduce``).

    pcie-allreduce tune [options]   measure this machine's crossovers between our algorithms and block
                                    counts, and cache the algorithm table every Communicator here adopts
    pcie-allreduce env              print the build and runtime configuration

Subcommands are registered in :data:`COMMANDS`; each names the function that declares its options
and the handler as "module:function" paths, and only the subcommand named on the command line is
imported, so ``--help`` and argument errors stay fast and never touch a GPU. The benchmark
harness is not part of the package: from a checkout, run ``python -m bench --help``.

Exit status: 0 success; 1 the run finished but something it checked failed; 2 usage error; 3 this
machine cannot run the command (the reason is printed as one line on stderr, without a
traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, NamedTuple, Sequence

from pcie_allreduce.argtypes import typed_arg
from pcie_allreduce.errors import one_line

PROG = "pcie-allreduce"
EXIT_FAILURES = 1
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130


class Command(NamedTuple):
    """A subcommand: ``add_arguments`` and ``handler`` are "module:function" paths, imported lazily."""

    name: str
    help: str
    add_arguments: str
    handler: str


COMMANDS: tuple[Command, ...] = (
    Command("tune", "measure the crossovers between our algorithms and block counts here, and cache the algorithm "
                    "table every Communicator on this machine adopts",
            "pcie_allreduce.tools.tune.cli:add_arguments", "pcie_allreduce.tools.tune.cli:run"),
    Command("env", "print the build and runtime configuration: versions, compiled archs, CUDA, GPUs, peer access, "
                   "the PCIe fabric and its islands",
            "pcie_allreduce.tools.environment:add_arguments", "pcie_allreduce.tools.environment:run"),
)


def resolve(path: str) -> Callable[..., Any]:
    """The function a "module:function" path names (imports the module)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


positive_int = typed_arg(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = typed_arg(int, lambda v: v >= 0, "an integer >= 0")
positive_float = typed_arg(float, lambda v: v > 0, "a number > 0")


def _named_command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is one), if any."""
    names = {cmd.name for cmd in COMMANDS}
    return next((word for word in argv if word in names), None)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser, with the options of the subcommand ``argv`` names (only that one is imported).

    Raises ImportError when that subcommand's module is missing from this install.
    """
    parser = argparse.ArgumentParser(prog=PROG, description="P2P all-reduce for PCIe multi-GPU servers.")
    from pcie_allreduce import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = _named_command(argv)
    for cmd in COMMANDS:
        child = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.name == wanted:
            resolve(cmd.add_arguments)(child)
        child.set_defaults(handler=cmd.handler, parser=child)
    return parser


def run_handler(prefix: str, handler: str | Callable[..., Any], args: argparse.Namespace,
                parser: argparse.ArgumentParser) -> int:
    """Run a subcommand's handler; "cannot run here" and Ctrl-C become one line on stderr and a status.

    ``prefix`` starts those lines ("pcie-allreduce tune"); ``handler`` is a function or a
    "module:function" path. Shared with the benchmark harness (``python -m bench``).
    """
    from pcie_allreduce.errors import UnavailableError

    try:
        function = resolve(handler) if isinstance(handler, str) else handler
    except ImportError as exc:  # an install without the module this command lives in
        print(f"{prefix}: error: cannot load the command ({one_line(exc)})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        return int(function(args, parser))
    except UnavailableError as exc:
        print(f"{prefix}: cannot run here: {one_line(exc)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
    except ImportError as exc:
        print(f"{PROG} {_named_command(argv)}: error: cannot load the command ({one_line(exc)})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    args = parser.parse_args(argv)
    return run_handler(f"{PROG} {args.command}", args.handler, args, args.parser)


if __name__ == "__main__":
    raise SystemExit(main())
