"""Communicator adopts the table `pcie-allreduce tune` cached for its GPU model, W and topology.

Runs on a CPU: a one-rank gloo group carries the (real) agreement step, a fake extension
answers the peer-access questions, and the GPU name is patched.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from pcie_allreduce import rendezvous
from pcie_allreduce.fabric import topology
from pcie_allreduce.plan import cache as plan_cache
from pcie_allreduce.plan import rules, tables
from pcie_allreduce.tools.tune.cache import write_table

BUS = "0000:01:00.0"


class _FakeExt:
    def device_by_pci_bus_id(self, bus_id: str) -> int:
        return 0

    def can_access_peer(self, a: int, b: int) -> bool:
        return True


class _Creation:
    """What the tuned-table step of creation reads (a one-rank group, this GPU, its placement, the
    islands, the transport), and what it decided: ``table`` and ``table_source``."""

    def __init__(self) -> None:
        self.collective = rendezvous.Collective(dist.group.WORLD, 0, 1)
        self.ext, self.world_size = _FakeExt(), 1
        self.device = torch.device("cuda", 0)  # the constructor needs a GPU; this step does not
        self.placements = [topology.RankPlacement(0, "host", BUS)]
        self.table, self.table_source = tables.default_table(), "built-in default"
        self.islands: tuple[tuple[int, ...], ...] = ((0,),)
        self.transport = "p2p"

    def adopt_tuned_table(self) -> None:
        self.table, self.table_source = rendezvous.tuned_table(
            self.collective, self.ext, self.device, self.placements, self.islands,
            topology.island_ranks(self.islands), self.transport)


@pytest.fixture
def comm(tmp_path, monkeypatch):
    tmp_path.chmod(0o700)  # the user's own cache directory, whatever the umask
    monkeypatch.setenv(plan_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    yield _Creation()
    dist.destroy_process_group()


def _cache_path(comm: _Creation) -> str:
    fp = plan_cache.fingerprint_of(comm.ext, [BUS])
    return plan_cache.table_path("NVIDIA Test GPU", comm.world_size, fp)


def test_no_cached_table_keeps_the_default(comm) -> None:
    comm.adopt_tuned_table()
    assert comm.table == tables.default_table() and comm.table_source == "built-in default"


@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_a_group_across_islands_takes_the_island_table_on_p2p(comm, transport: str) -> None:
    comm.transport, comm.islands = transport, ((0, 1, 2, 3), (4, 5, 6, 7))
    comm.adopt_tuned_table()
    if transport == "p2p":
        assert comm.table == tables.island_fabric_table()
        assert comm.table_source == "built-in default for 2 islands (an estimate)"
    else:  # host memory: every rank's bytes cross its own link, islands or not
        assert comm.table == tables.default_table("host") and comm.table_source == "built-in default"


def test_cached_table_is_adopted(comm) -> None:
    tuned = tables.AlgoTable((rules.Rule("twoshot", bytes_per_block=1024, max_blocks=3),))
    write_table(_cache_path(comm), tuned.to_json(), {"by": "test"})
    comm.adopt_tuned_table()
    assert comm.table == tuned
    assert comm.table_source == f"tune cache {_cache_path(comm)}"
    assert comm.table.select(56 << 10, 2, "bfloat16") == rules.Choice("twoshot", 3)


def test_a_table_tuned_on_islands_serves_only_groups_with_those_islands(comm) -> None:
    """The cache key includes the islands: a table tuned where the ranks formed 0-3 / 4-7 (whose
    picks fit that fabric) is not loaded by a flat group on the same GPUs, nor by other islands."""
    halves = ((0, 1, 2, 3), (4, 5, 6, 7))
    tuned = tables.AlgoTable((rules.Rule("twoshot_pull", bytes_per_block=1024, max_blocks=3),))
    path = plan_cache.table_path("NVIDIA Test GPU", comm.world_size, plan_cache.fingerprint_of(comm.ext, [BUS], halves))
    write_table(path, tuned.to_json(), {"by": "test"})
    comm.adopt_tuned_table()  # flat (one island)
    assert comm.table == tables.default_table() and comm.table_source == "built-in default"
    comm.islands = ((0, 1), (2, 3), (4, 5), (6, 7))
    comm.adopt_tuned_table()
    assert comm.table == tables.island_fabric_table()
    comm.islands = halves
    comm.adopt_tuned_table()
    assert comm.table == tuned and comm.table_source == f"tune cache {path}"


def test_corrupt_cached_table_warns_and_keeps_the_default(comm) -> None:
    path = _cache_path(comm)
    write_table(path, json.dumps({"rules": [{"algo": "oneshot"}]}), {})
    with open(path, "w", encoding="utf-8") as fh:
        fh.write('{"rules": [{"algo": "ring"}]}')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.adopt_tuned_table()
    assert comm.table == tables.default_table()
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
    write_table(path, json.dumps({"rules": [{"algo": "oneshot"}]}), {})
    with open(path, "wb") as fh:
        fh.write(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.adopt_tuned_table()
    assert comm.table == tables.default_table() and comm.table_source == "built-in default"
    assert any(path in str(w.message) for w in caught), [str(w.message) for w in caught]


def _warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught]


def test_a_planted_link_never_makes_the_writer_overwrite_another_file(tmp_path, monkeypatch) -> None:
    """Links another user could plant in a shared cache directory, to a file of the victim's: at the
    table's name, and at the very name the writer's temporary file draws first (the random names
    made predictable here, as if guessed). The table is written beside them through a file of its
    own, and the file the links point to keeps its bytes."""
    import tempfile

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    path = str(cache / "nvidia-test-gpu-w2-0123456789ab.json")
    names = iter(["guessed", "fresh"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    guessed = str(cache / f".{os.path.basename(path)}.guessed.tmp")  # mkstemp's name for "guessed"
    for planted in (guessed, path):
        os.symlink(victim, planted)
    write_table(path, tables.default_table().to_json(), {"by": "test"})
    assert victim.read_text() == "precious\n"
    assert os.path.islink(guessed), "the planted link was replaced or followed"
    assert not os.path.islink(path) and json.loads(open(path, encoding="utf-8").read())["meta"] == {"by": "test"}
    assert (os.stat(path).st_mode & 0o077) == 0
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(path), os.path.basename(guessed)])  # no temp left


def test_a_cache_directory_others_can_write_is_refused(tmp_path) -> None:
    """Read: a warning and no table. Write: PermissionError naming the problem."""
    shared = tmp_path / "shared"
    shared.mkdir()
    path = str(shared / "t.json")
    write_table(path, tables.default_table().to_json(), {})
    for mode, who in ((0o777, "others"), (0o1777, "others"), (0o770, "its group")):
        shared.chmod(mode)
        found: list = []
        messages = _warnings_of(lambda: found.append(plan_cache.read_table(path)))
        assert found == [None]
        assert any(f"ignoring tuned table {path}: its directory is writable by {who}" in m for m in messages), messages
        with pytest.raises(PermissionError, match=f"refusing to write the tuned table .*writable by {who}"):
            write_table(path, tables.default_table().to_json(), {})
    shared.chmod(0o755)
    assert json.loads(plan_cache.read_table(path))["rules"]


def test_a_cached_table_that_is_a_link_or_writable_by_others_is_refused(tmp_path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    real = str(tmp_path / "elsewhere.json")
    write_table(real, tables.default_table().to_json(), {})
    link = str(cache / "link.json")
    os.symlink(real, link)
    loose = str(cache / "loose.json")
    write_table(loose, tables.default_table().to_json(), {})
    os.chmod(loose, 0o666)
    fifo = str(cache / "fifo.json")
    os.mkfifo(fifo)
    for path, why in ((link, "it is a symbolic link"), (loose, "the file is writable by others (mode 666)"),
                      (fifo, "the file is not a regular file")):
        found: list = []
        messages = _warnings_of(lambda: found.append(plan_cache.read_table(path)))
        assert found == [None] and any(f"ignoring tuned table {path}: {why}" in m for m in messages), messages
    assert plan_cache.read_table(str(cache / "missing.json")) is None
    assert _warnings_of(lambda: plan_cache.read_table(str(cache / "missing.json"))) == []


def test_a_communicator_keeps_the_default_where_the_cache_is_not_the_users_own(comm, tmp_path) -> None:
    tuned = tables.AlgoTable((rules.Rule("twoshot", bytes_per_block=1024, max_blocks=3),))
    write_table(_cache_path(comm), tuned.to_json(), {"by": "test"})
    tmp_path.chmod(0o777)
    try:
        messages = _warnings_of(comm.adopt_tuned_table)
    finally:
        tmp_path.chmod(0o700)
    assert comm.table == tables.default_table() and comm.table_source == "built-in default"
    assert any("its directory is writable by others" in m for m in messages), messages
    comm.adopt_tuned_table()
    assert comm.table == tuned


def test_a_cache_of_another_user_is_refused(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    path = str(cache / "t.json")
    write_table(path, tables.default_table().to_json(), {})
    monkeypatch.setattr(plan_cache, "_owners", lambda: (4242,))  # as if another user owned it all
    found: list = []
    messages = _warnings_of(lambda: found.append(plan_cache.read_table(path)))
    assert found == [None] and any(f"its directory belongs to user id {os.stat(cache).st_uid}" in m for m in messages)
    with pytest.raises(PermissionError, match="its directory belongs to user id"):
        write_table(path, tables.default_table().to_json(), {})
