"""``python -m bench`` (also ``--fused``) and ``python -m bench verify``: check this machine can run
it, sweep, print, write files and the plot."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from pcie_allreduce.tools.cli import EXIT_FAILURES, EXIT_INTERRUPTED
from pcie_allreduce.errors import UnavailableError

from bench import options, report, runner
from bench.results import OK, SKIPPED, WRONG, Report

Echo = Callable[[str], None]


def echo(line: str) -> None:
    """Progress and notes go to stderr, so stdout carries only the report."""
    print(line, file=sys.stderr, flush=True)


def unavailable_reason(cfg: options.BenchConfig) -> str | None:
    """Why no benchmark can run here: no GPU, or our kernels are asked for but not usable."""
    from pcie_allreduce.tools import ranks

    reason = ranks.skip_reason_no_gpu()
    if reason is not None:
        return reason
    if any(b.startswith("ours") for b in cfg.backends):
        import pcie_allreduce

        reason = pcie_allreduce.unavailable_reason()
        if reason is not None:
            return f"pcie_allreduce kernels unavailable: {reason} (or pass --backends without 'ours')"
    return None


def exit_status(rep: Report) -> int:
    """0, or EXIT_FAILURES when any of our cases is not ok or any backend returned a wrong sum.

    Other backends failing (torch symmetric memory hanging at W=8, say) is reported but is not
    our failure; a case skipped by design (over a backend's capacity) is not a failure.
    """
    bad = [r for r in rep.results
           if r.status == WRONG or (r.backend.startswith("ours") and r.status not in (OK, SKIPPED))]
    return EXIT_FAILURES if bad else 0


def write_plot(rep: Report, out_dir: str, say: Echo) -> None:
    """<stem>.png next to the other files, or one line saying why not."""
    import os

    from bench import plot

    path = os.path.join(out_dir, f"{report.file_stem(rep)}.png")
    problem = plot.write_plot(rep, path)
    say(f"wrote {path}" if problem is None else f"plot skipped: {problem}")


def sweep(cfg: options.BenchConfig, gpu_count: int, desc: str) -> Report:
    """Run every (world, backend) of ``cfg`` under a progress bar (tqdm, when it imports and stderr is a tty)."""
    from bench.environment import host_environment
    from bench.progress_bar import Bar

    reason = unavailable_reason(cfg)
    if reason is not None:
        raise UnavailableError(reason)
    with Bar(runner.total_cases(cfg), desc) as bar:
        rep = runner.run_sweep(cfg, gpu_count, host_environment(), bar.write, bar)
    if not rep.results and not rep.environment.get("interrupted"):
        reasons = dict.fromkeys(f"{n.backend}: {n.reason}" for n in rep.notes if n.kind == "skipped")
        raise UnavailableError("no requested backend can run here (" + "; ".join(reasons) + ")")
    return rep


def finish(rep: Report, cfg: options.BenchConfig, text: str | None = None) -> int:
    """Print the report (``text``, default the formatted report), write the files, the exit status."""
    body = report.format_report(rep) if text is None else text
    sys.stdout.write(body)
    sys.stdout.flush()
    if cfg.out:
        for path in report.write_outputs(rep, cfg.out, body):
            echo(f"wrote {path}")
        write_plot(rep, cfg.out, echo)
    if rep.environment.get("interrupted"):
        return EXIT_INTERRUPTED
    return exit_status(rep)


def _gpu_count() -> int:
    import torch

    from pcie_allreduce.tools import ranks

    return ranks.gpu_count() if torch.version.cuda is not None else 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``python -m bench`` (``--fused`` included)."""
    gpu_count = _gpu_count()
    cfg = options.config_from_args(args, parser, gpu_count)
    return finish(sweep(cfg, gpu_count, "bench --fused" if args.fused else "bench"), cfg)


def run_verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``python -m bench verify``."""
    from bench import verify_options

    gpu_count = _gpu_count()
    cfg = verify_options.config_from_args(args, parser, gpu_count)
    return finish(sweep(cfg, gpu_count, "bench verify"), cfg)
