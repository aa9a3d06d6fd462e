"""``python -m bench``: the benchmark harness, run from a checkout's root.

    python -m bench [options]           time all-reduce backends side by side (the default sweep)
    python -m bench --fused [options]   all-reduce + residual add + RMSNorm on [tokens, hidden]
    python -m bench verify [options]    the collectives of one speculative-decoding verify pass
    python -m bench topo [options]      peer access, PCI bus ids, NUMA nodes; latency and bandwidth
    python -m bench soak [options]      a long run of random collectives, every result checked exactly
    python -m bench plot JSON           redraw the PNG of a saved run

Exit status as ``pcie-allreduce`` (:mod:`pcie_allreduce.tools.cli`): 0 success; 1 some of our cases
failed or a backend returned a wrong sum; 2 usage error; 3 this machine cannot run it (one line on
stderr); 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from pcie_allreduce.tools.cli import Command, resolve, run_handler

PROG = "python -m bench"
DESCRIPTION = ("Time all-reduce backends side by side (ours, torch symmetric memory, NCCL, and FlashInfer, vLLM, "
               "sgl-kernel where installed). Without a mode: the all-reduce sweep (or --fused).")

MODES: tuple[Command, ...] = (
    Command("verify", "time the 2 x L all-reduces of one speculative-decoding verify pass, in one CUDA graph per "
                      "backend", "bench.verify_options:add_arguments", "bench.command:run_verify"),
    Command("topo", "show which GPUs have CUDA peer access to which (PCI bus ids, NUMA nodes), and measure flag "
                    "round-trip latency and write bandwidth between the ranks",
            "bench.topo:add_arguments", "bench.topo:run"),
    Command("soak", "run random collectives (plain and fused, every size class, dtype and algorithm, CUDA graphs, "
                    "stragglers) for a number of calls and minutes, checking every result exactly",
            "bench.soak:add_arguments", "bench.soak:run"),
    Command("plot", "draw the PNG of a saved bench / fused / verify / topo JSON (needs matplotlib)",
            "bench.plot:add_arguments", "bench.plot:run"),
)


def build_parser() -> argparse.ArgumentParser:
    """The default benchmark's options, and one subparser per mode (their options go after its name)."""
    from bench import options

    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    options.add_arguments(parser)
    parser.set_defaults(handler="bench.command:run", parser=parser)
    modes = parser.add_subparsers(dest="bench_mode", metavar="[MODE]",
                                  title="modes (their options go after the mode's name)")
    for mode in MODES:
        child = modes.add_parser(mode.name, help=mode.help, description=mode.help)
        resolve(mode.add_arguments)(child)
        child.set_defaults(handler=mode.handler, parser=child)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the benchmark or the mode; the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    prefix = PROG + (f" {args.bench_mode}" if args.bench_mode else "")
    return run_handler(prefix, args.handler, args, args.parser)


if __name__ == "__main__":
    raise SystemExit(main())
