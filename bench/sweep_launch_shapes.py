"""Superseded by ``pcie-allreduce tune``; kept so the commands recorded in bench/RESULTS.md still run.

    python bench/sweep_launch_shapes.py --world 2 4 8 --sizes 14K 56K 448K 2M [--blocks 1 2 4 8 16 32]

runs ``pcie-allreduce tune --dry-run`` with the same options: the same (algorithm, blocks) matrix
per world size, now checked for exact sums first, timed as the bench times (slowest rank, graph
replay) and followed by the table those crossovers give; no table is written.
"""

from __future__ import annotations

import sys

from pcie_allreduce.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["tune", "--dry-run", *sys.argv[1:]]))
