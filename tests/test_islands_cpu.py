"""Communicator.islands on CPU ranks with a fake extension: every rank reads its own sysfs (here
a recorded tree per rank), the placements carry it to every rank, and all compute the same
islands; ``PCIE_AR_ISLANDS`` overrides them and must be the same on every rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pcie_allreduce
from pcie_allreduce.plan.tables import default_table
from pcie_allreduce.tools import ranks
from pcie_allreduce.fabric import sysfs as fabric_sysfs, topology
from tests import _sysfs
from tests._creation_fakes import _fake_cuda

WORLD = 4
# Where FakeExtension(distinct_gpus=True) puts rank r's GPU: on the host bridge, at 0000:00:0<6+r>.0.
# Ranks 0-1 on NUMA node 0, ranks 2-3 on node 1.
SCENARIOS: list[tuple[str, dict[int, str], set[int]]] = [
    # (name, PCIE_AR_ISLANDS per rank, ranks whose container shows no /sys)
    ("detected", {}, set()),
    ("override", {r: "0,2;1,3" for r in range(WORLD)}, set()),
    ("override on one rank", {1: "0,2;1,3"}, set()),
    ("bad override", {r: "0-4" for r in range(WORLD)}, set()),
    ("one rank without sysfs", {}, {3}),
]


def _tree(root: str) -> None:
    sysfs = _sysfs.Sysfs(Path(root))
    for r in range(WORLD):
        sysfs.device(f"pci0000:00/0000:00:{6 + r:02x}.0", numa=str(r // 2))


def _create_each(ctx: ranks.RankContext, root: str) -> list[dict[str, Any]]:
    _fake_cuda("none", ctx.rank, distinct_gpus=True)
    read_gpu = fabric_sysfs.read_gpu
    results = []
    for name, env, blind in SCENARIOS:
        here = os.path.join(root, "none") if ctx.rank in blind else root
        fabric_sysfs.read_gpu = lambda bus_id, _root="/", here=here: read_gpu(bus_id, here)  # type: ignore[misc]
        os.environ.pop(topology.ISLANDS_ENV, None)
        if ctx.rank in env:
            os.environ[topology.ISLANDS_ENV] = env[ctx.rank]
        try:
            comm = pcie_allreduce.Communicator(ctx.group, "cuda:0", max_bytes=1 << 20, timeout_s=5.0,
                                               algo_table=default_table(), transport="p2p")
        except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
            results.append({"scenario": name, "error": type(exc).__name__, "message": str(exc)})
            continue
        comm._closed = True  # no CUDA here: skip close()'s synchronize
        results.append({"scenario": name, "error": None, "islands": comm.islands, "source": comm.islands_source,
                        "numa": [p.fabric.numa_node if p.fabric else "none" for p in comm.placements]})
    return results


def test_islands_are_gathered_agreed_and_overridden(tmp_path) -> None:
    _tree(str(tmp_path))
    per_rank = ranks.run_ranks(_create_each, WORLD, str(tmp_path), gpu=False, timeout_s=300)
    for results in per_rank:
        got = {r["scenario"]: r for r in results}
        assert got["detected"]["error"] is None, got["detected"]
        assert got["detected"]["islands"] == ((0, 1), (2, 3)) and got["detected"]["source"] == "by NUMA node"
        assert got["detected"]["numa"] == [0, 0, 1, 1]  # every rank sees every rank's reading
        assert got["override"]["islands"] == ((0, 2), (1, 3)) and got["override"]["source"] == "$PCIE_AR_ISLANDS"
        mismatch = got["override on one rank"]
        assert mismatch["error"] == "ValueError", mismatch
        assert "ranks disagree on islands ($PCIE_AR_ISLANDS): rank 0 has None, ranks [1] differ" in mismatch["message"]
        bad = got["bad override"]
        assert bad["error"] == "ValueError" and "PCIE_AR_ISLANDS='0-4': rank 4 is out of range" in bad["message"]
        blind = got["one rank without sysfs"]
        assert blind["numa"] == [0, 0, 1, None]
        assert blind["islands"] == ((0, 1, 2, 3),) and blind["source"].startswith("flat")
