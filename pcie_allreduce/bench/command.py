"""``pcie-allreduce bench``: check this machine can run it, sweep, print, write files."""

from __future__ import annotations

import argparse
import sys

from pcie_allreduce.bench import options, report, runner
from pcie_allreduce.bench.errors import EXIT_FAILURES, EXIT_INTERRUPTED, Unavailable
from pcie_allreduce.bench.results import OK, WRONG, Report


def echo(line: str) -> None:
    """Progress and notes go to stderr, so stdout carries only the report."""
    print(line, file=sys.stderr, flush=True)


def unavailable_reason(cfg: options.BenchConfig) -> str | None:
    """Why no benchmark can run here: no GPU, or our kernels are asked for but not usable."""
    from pcie_allreduce import testing

    reason = testing.skip_reason_no_gpu()
    if reason is not None:
        return reason
    if "ours" in cfg.backends:
        import pcie_allreduce

        reason = pcie_allreduce.unavailable_reason()
        if reason is not None:
            return f"pcie_allreduce kernels unavailable: {reason} (or pass --backends without 'ours')"
    return None


def exit_status(rep: Report) -> int:
    """0, or EXIT_FAILURES when any of our cases is not ok or any backend returned a wrong sum.

    Other backends failing (torch symmetric memory hanging at W=8, say) is reported but is not
    our failure.
    """
    bad = [r for r in rep.results if r.status == WRONG or (r.backend == "ours" and r.status != OK)]
    return EXIT_FAILURES if bad else 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of the ``bench`` subcommand."""
    import torch

    from pcie_allreduce import testing
    from pcie_allreduce.bench.environment import host_environment

    gpu_count = testing.gpu_count() if torch.version.cuda is not None else 0
    cfg = options.config_from_args(args, parser, gpu_count)
    reason = unavailable_reason(cfg)
    if reason is not None:
        raise Unavailable(reason)
    rep = runner.run_sweep(cfg, gpu_count, host_environment(), echo)
    if not rep.results and not rep.environment.get("interrupted"):
        reasons = dict.fromkeys(f"{n.backend}: {n.reason}" for n in rep.notes if n.kind == "skipped")
        raise Unavailable("no requested backend can run here (" + "; ".join(reasons) + ")")
    sys.stdout.write(report.format_report(rep))
    sys.stdout.flush()
    if cfg.out:
        for path in report.write_outputs(rep, cfg.out):
            echo(f"wrote {path}")
    if rep.environment.get("interrupted"):
        return EXIT_INTERRUPTED
    return exit_status(rep)
