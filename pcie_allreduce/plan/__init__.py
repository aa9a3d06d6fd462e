"""The plan: what a call runs, as pure choices from data.

:mod:`~pcie_allreduce.plan.algorithms` holds one record per algorithm and everything derived from
them; :mod:`~pcie_allreduce.plan.rules` the rows of a table, :mod:`~pcie_allreduce.plan.defaults`
the built-in rows, :mod:`~pcie_allreduce.plan.tables` the tables (select, JSON, loading);
:mod:`~pcie_allreduce.plan.dispatch` turns a call's shape and a table into a kernel and launch
shape, the fused kernels' shapes and signatures from :mod:`~pcie_allreduce.plan.fused_shapes`.
"""

from __future__ import annotations

from pcie_allreduce.plan.tables import AlgoTable, default_table, load_table

__all__ = ["AlgoTable", "default_table", "load_table"]
