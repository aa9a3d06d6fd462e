"""``python -m pcie_allreduce.bench [options]`` is ``pcie-allreduce bench [options]``."""

from __future__ import annotations

import sys

from pcie_allreduce.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
