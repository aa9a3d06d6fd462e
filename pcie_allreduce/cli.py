"""The ``pcie-allreduce`` console script (also ``python -m pcie_allreduce``).

Subcommands are registered in :data:`COMMANDS`; each names the function that declares its options
and the handler, both imported only when that subcommand runs, so ``--help`` and argument errors
stay fast and never touch a GPU. Implemented: ``bench`` and ``topo`` (peer-access matrix). Planned
(issue 5): ``bench verify``, ``tune``, and latency/bandwidth per pair in ``topo``.

Exit status: 0 success; 1 the run finished but some of our cases failed or a backend returned a
wrong sum (``topo``: a measurement failed); 2 usage error; 3 this machine cannot run the command
(the reason is printed as one line on stderr, without a traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, NamedTuple, Sequence

PROG = "pcie-allreduce"
EXIT_INTERRUPTED = 130
EXIT_UNAVAILABLE = 3


class Command(NamedTuple):
    """A subcommand: ``add_arguments`` and ``handler`` are "module:function" paths, imported lazily."""

    name: str
    help: str
    add_arguments: str
    handler: str


COMMANDS: tuple[Command, ...] = (
    Command("bench", "time all-reduce backends side by side (ours, torch symmetric memory, NCCL)",
            "pcie_allreduce.bench.options:add_arguments", "pcie_allreduce.bench.command:run"),
    Command("tune", "measure the crossovers between our algorithms and block counts here, and cache an "
                    "algorithm table for PCIE_AR_ALGO_TABLE",
            "pcie_allreduce.bench.tune:add_arguments", "pcie_allreduce.bench.tune:run"),
    Command("plot", "draw the PNG of a saved bench / fused / verify / tune JSON (needs matplotlib)",
            "pcie_allreduce.bench.plot:add_arguments", "pcie_allreduce.bench.plot:run"),
    Command("env", "print the build and runtime configuration: versions, compiled archs, CUDA, GPUs and peer access",
            "pcie_allreduce.environment:add_arguments", "pcie_allreduce.environment:run"),
    Command("topo", "show which GPUs have CUDA peer access to which (PCI bus ids, NUMA nodes), and measure flag "
                    "round-trip latency and write bandwidth between the ranks",
            "pcie_allreduce.bench.topo:add_arguments", "pcie_allreduce.bench.topo:run"),
)


def _resolve(path: str) -> Callable[..., object]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_parser() -> argparse.ArgumentParser:
    """The full parser (imports only the option modules of the subcommands, which are pure)."""
    parser = argparse.ArgumentParser(prog=PROG, description="P2P all-reduce for PCIe multi-GPU servers.")
    from pcie_allreduce import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        child = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        _resolve(cmd.add_arguments)(child)
        child.set_defaults(handler=cmd.handler, parser=child)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    mode = getattr(args, "bench_mode", None)  # "bench verify"
    prefix = f"{PROG} {args.command}" + (f" {mode}" if mode else "")
    try:
        handler = _resolve(args.handler)
    except ImportError as exc:  # e.g. an install whose package list lacks pcie_allreduce.bench
        print(f"{prefix}: error: cannot load the command ({_one_line(exc)})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    from pcie_allreduce.bench.errors import Unavailable

    try:
        return int(handler(args, args.parser))  # type: ignore[call-overload]
    except Unavailable as exc:
        print(f"{prefix}: cannot run here: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
