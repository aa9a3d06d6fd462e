"""``python -m pcie_allreduce COMMAND ...`` is the ``pcie-allreduce`` console script."""

from __future__ import annotations

from pcie_allreduce.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
