"""Communicator adopts the table `pcie-allreduce tune` cached for its GPU model, W and topology.

Runs on a CPU: a one-rank gloo group carries the (real) agreement step, a fake extension
answers the peer-access questions, and the GPU name is patched.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist

from pcie_allreduce import algo, topology, tune_cache
from pcie_allreduce.communicator import Communicator

BUS = "0000:01:00.0"


class _FakeExt:
    def device_by_pci_bus_id(self, bus_id: str) -> int:
        return 0

    def can_access_peer(self, a: int, b: int) -> bool:
        return True


@pytest.fixture
def comm(tmp_path, monkeypatch):
    monkeypatch.setenv(tune_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    c = Communicator.__new__(Communicator)  # the constructor needs a GPU; this step does not
    c._ext, c._group, c.rank, c.world_size = _FakeExt(), dist.group.WORLD, 0, 1
    c.device = torch.device("cuda", 0)
    c.placements = [topology.RankPlacement(0, "host", BUS)]
    c.table, c.table_source = algo.default_table(), "built-in default"
    c.islands = ((0,),)
    yield c
    dist.destroy_process_group()


def _cache_path(comm: Communicator) -> str:
    fp = tune_cache.fingerprint_of(comm._ext, [BUS])
    return tune_cache.table_path("NVIDIA Test GPU", comm.world_size, fp)


def test_no_cached_table_keeps_the_default(comm) -> None:
    comm._adopt_tuned_table()
    assert comm.table == algo.default_table() and comm.table_source == "built-in default"


@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_a_group_across_islands_takes_the_island_table_on_p2p(comm, transport: str) -> None:
    comm.transport, comm.islands = transport, ((0, 1, 2, 3), (4, 5, 6, 7))
    comm._adopt_tuned_table()
    if transport == "p2p":
        assert comm.table == algo.island_fabric_table()
        assert comm.table_source == "built-in default for 2 islands (an estimate)"
    else:  # host memory: every rank's bytes cross its own link, islands or not
        assert comm.table == algo.default_table("host") and comm.table_source == "built-in default"


def test_cached_table_is_adopted(comm) -> None:
    tuned = algo.AlgoTable((algo.Rule("twoshot", bytes_per_block=1024, max_blocks=3),))
    tune_cache.write_table(_cache_path(comm), tuned.to_json(), {"by": "test"})
    comm._adopt_tuned_table()
    assert comm.table == tuned
    assert comm.table_source == f"tune cache {_cache_path(comm)}"
    assert comm.table.select(56 << 10, 2, "bfloat16") == algo.Choice("twoshot", 3)


def test_a_table_tuned_on_islands_serves_only_groups_with_those_islands(comm) -> None:
    """The cache key includes the islands: a table tuned where the ranks formed 0-3 / 4-7 (whose
    picks fit that fabric) is not loaded by a flat group on the same GPUs, nor by other islands."""
    halves = ((0, 1, 2, 3), (4, 5, 6, 7))
    tuned = algo.AlgoTable((algo.Rule("twoshot_pull", bytes_per_block=1024, max_blocks=3),))
    path = tune_cache.table_path("NVIDIA Test GPU", comm.world_size, tune_cache.fingerprint_of(comm._ext, [BUS], halves))
    tune_cache.write_table(path, tuned.to_json(), {"by": "test"})
    comm._adopt_tuned_table()  # flat (one island)
    assert comm.table == algo.default_table() and comm.table_source == "built-in default"
    comm.islands = ((0, 1), (2, 3), (4, 5), (6, 7))
    comm._adopt_tuned_table()
    assert comm.table == algo.island_fabric_table()
    comm.islands = halves
    comm._adopt_tuned_table()
    assert comm.table == tuned and comm.table_source == f"tune cache {path}"


def test_corrupt_cached_table_warns_and_keeps_the_default(comm) -> None:
    path = _cache_path(comm)
    tune_cache.write_table(path, json.dumps({"rules": [{"algo": "oneshot"}]}), {})
    with open(path, "w", encoding="utf-8") as fh:
        fh.write('{"rules": [{"algo": "ring"}]}')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm._adopt_tuned_table()
    assert comm.table == algo.default_table()
    assert any("ignoring tuned table" in str(w.message) for w in caught)


@pytest.mark.parametrize("content", [
    b'{"rules": [{"algo": "twoshot", "max_bytes": "64K"}]}',
    b'{"rules": [{"algo": "twoshot", "world": 8.0}]}',
    b'{"rules": [{"algo": "twoshot", "bytes_per_block": Infinity}]}',
    b'{"rules": [{"algo": "twoshot", "dtypes": "bfloat16"}]}',
    b'{"rules": [{"algo": "oneshot", "max_bytes": 65536}]}',
    b'{"rules": [{"algo": "twoshot"}]}\xff',
    b"[" * 100_000,
])
def test_any_corrupt_cached_table_warns_and_keeps_the_default(comm, content: bytes) -> None:
    path = _cache_path(comm)
    tune_cache.write_table(path, json.dumps({"rules": [{"algo": "oneshot"}]}), {})
    with open(path, "wb") as fh:
        fh.write(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm._adopt_tuned_table()
    assert comm.table == algo.default_table() and comm.table_source == "built-in default"
    assert any(path in str(w.message) for w in caught), [str(w.message) for w in caught]
