"""The PCIe fabric as sysfs describes it, and the islands it forms, on recorded sysfs trees (CPU).

Each tree is built in tmp_path as Linux lays it out (tests/_sysfs.py); then the override
``PCIE_AR_ISLANDS``: its syntax and every error message.
"""

from __future__ import annotations

import os

import pytest

from pcie_allreduce.fabric import sysfs as fabric_sysfs, topology
from pcie_allreduce.fabric.sysfs import GpuFabric
from tests import _sysfs


def _read(root, bus_ids: list[str]) -> list[GpuFabric]:
    return [fabric_sysfs.read_gpu(b, str(root)) for b in bus_ids]


# ---- (a) two sockets, no switches -----------------------------------------------------------


def test_two_sockets_without_switches(tmp_path) -> None:
    gpus = _sysfs.two_sockets_no_switch(tmp_path)
    found = _read(tmp_path, gpus)
    first = found[0]
    assert first == GpuFabric(bus_id="0000:01:00.0", known=True, numa_node=0, domain="0000", host_bridge="pci0000:00",
                              root_port="0000:00:01.1", bridges=("0000:00:01.1",), switches=(),
                              link_speed="32.0 GT/s PCIe", link_width=16, max_link_speed="32.0 GT/s PCIe",
                              max_link_width=16)
    assert first.switch is None and first.switch_label() == "root port"
    assert first.link_label() == "32.0 GT/s x16 (max 32.0 GT/s x16)"
    assert [f.numa_node for f in found] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [f.host_bridge for f in found] == ["pci0000:00", "pci0000:00", "pci0000:20", "pci0000:20",
                                              "pci0000:80", "pci0000:80", "pci0000:a0", "pci0000:a0"]
    # several host bridges per socket (as on EPYC): the NUMA node groups, not the host bridge
    assert topology.islands(found) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topology.islands_basis(found) == "by NUMA node"


def test_ranks_in_another_order_than_the_gpus(tmp_path) -> None:
    gpus = _sysfs.two_sockets_no_switch(tmp_path)
    order = [0, 4, 1, 5, 2, 6, 3, 7]  # rank r runs on GPU order[r]
    assert topology.islands(_read(tmp_path, [gpus[g] for g in order])) == ((0, 2, 4, 6), (1, 3, 5, 7))


# ---- (b) two switches on one socket ---------------------------------------------------------


def test_two_switches_on_one_socket(tmp_path) -> None:
    found = _read(tmp_path, _sysfs.two_switches_one_socket(tmp_path))
    assert found[0].bridges == ("0000:00:01.0", "0000:10:00.0", "0000:11:00.0")
    assert found[0].switches == ("0000:10:00.0",) and found[0].switch == "0000:10:00.0"
    assert found[5].switch_label() == "0000:30:00.0" and found[5].root_port == "0000:00:03.0"
    assert {f.numa_node for f in found} == {0}
    assert topology.islands(found) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topology.islands_basis(found) == "by PCIe switch"


def test_switches_on_two_sockets_split_by_both(tmp_path) -> None:
    sysfs = _sysfs.Sysfs(tmp_path)
    gpus = [sysfs.device(_sysfs.switch_path(host, f"0000:{host:02x}:01.0", host + 0x10 + 0x8 * s, port), numa=str(n))
            for n, host in enumerate((0x00, 0x80)) for s in range(2) for port in range(2)]
    found = _read(tmp_path, gpus)
    assert len({f.switch for f in found}) == 4
    assert topology.islands(found) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topology.islands_basis(found) == "by NUMA node and PCIe switch"


def test_gpus_under_a_switch_and_on_root_ports(tmp_path) -> None:
    sysfs = _sysfs.Sysfs(tmp_path)
    gpus = [sysfs.device(_sysfs.switch_path(0, "0000:00:01.0", 0x10, port)) for port in range(3)]
    gpus += [sysfs.device(f"pci0000:00/0000:00:0{p}.0/0000:{p:02x}:00.0") for p in (5, 6)]
    assert topology.islands(_read(tmp_path, gpus)) == ((0, 1, 2), (3, 4))


# ---- (c) sixteen GPUs under one switch ------------------------------------------------------


def test_sixteen_gpus_under_one_switch(tmp_path) -> None:
    found = _read(tmp_path, _sysfs.one_switch_sixteen(tmp_path))
    assert {f.switch for f in found} == {"0000:10:00.0"}
    assert topology.islands(found) == (tuple(range(16)),)
    assert topology.islands_basis(found) == "flat: one NUMA node, one PCIe switch"


def test_two_level_switches_count_the_top_one(tmp_path) -> None:
    """A switch below a switch: GPUs under the same top switch never cross the root complex."""
    sysfs = _sysfs.Sysfs(tmp_path)
    top = "pci0000:00/0000:00:01.0/0000:10:00.0"
    gpus = [sysfs.device(f"{top}/0000:11:0{s}.0/0000:{0x20 + 0x10 * s:02x}:00.0/0000:{0x21 + 0x10 * s:02x}:0{p}.0/"
                         f"0000:{0x22 + 0x10 * s + p:02x}:00.0") for s in range(2) for p in range(4)]
    found = _read(tmp_path, gpus)
    assert found[0].switches == ("0000:10:00.0", "0000:20:00.0") and found[0].switch == "0000:10:00.0"
    assert found[0].switch_label() == "0000:10:00.0 > 0000:20:00.0"
    assert topology.islands(found) == (tuple(range(8)),)


def test_a_switch_on_the_card_above_one_gpu_is_no_island(tmp_path) -> None:
    """A bridge chip on each card (one GPU below it) does not make every GPU its own island."""
    sysfs = _sysfs.Sysfs(tmp_path)
    gpus = [sysfs.device(_sysfs.switch_path(host, f"0000:{host:02x}:01.0", host + 0x10, 0), numa=str(i // 2))
            for i, host in enumerate((0x00, 0x20, 0x80, 0xa0))]
    found = _read(tmp_path, gpus)
    assert all(f.switch is not None for f in found)
    assert topology.islands(found) == ((0, 1), (2, 3)) and topology.islands_basis(found) == "by NUMA node"


# ---- (d) GeForce cards, NUMA unknown, files missing -----------------------------------------


def test_geforce_cards_with_numa_unknown_and_files_missing(tmp_path) -> None:
    found = _read(tmp_path, _sysfs.geforce_one_socket(tmp_path))
    assert all(f.known and f.numa_node is None for f in found)
    assert all(f.link_speed is None and f.link_width is None and f.link_label() == "unknown" for f in found)
    assert [f.switch_label() for f in found] == ["root port"] * 4
    assert found[3].switches == ()  # its class file is missing: the tree still says where it sits
    assert topology.islands(found) == ((0, 1, 2, 3),)
    assert topology.islands_basis(found) == "flat: one PCI domain, no shared PCIe switch"


def test_ranks_on_one_gpu_form_one_island(tmp_path) -> None:
    gpu = _sysfs.geforce_one_socket(tmp_path)[0]
    assert topology.islands(_read(tmp_path, [gpu] * 4)) == ((0, 1, 2, 3),)


# ---- broken or odd trees --------------------------------------------------------------------


def test_no_sysfs_at_all(tmp_path) -> None:
    found = _read(tmp_path / "no-such-root", ["0000:41:00.0", "0000:42:00.0"])
    assert found == [GpuFabric("0000:41:00.0"), GpuFabric("0000:42:00.0")]
    assert found[0].switch_label() == "unknown" and found[0].link_label() == "unknown"
    assert topology.islands(found) == ((0, 1),)
    assert topology.islands_basis(found) == "flat: the PCIe fabric is unknown"
    assert topology.islands([None, None, None]) == ((0, 1, 2),)
    assert topology.islands([]) == ()


def test_unreadable_and_garbled_files(tmp_path) -> None:
    sysfs = _sysfs.Sysfs(tmp_path)
    bdf = sysfs.device("pci0000:00/0000:00:01.0/0000:01:00.0", numa="lots", speed="Unknown", width="0",
                       max_speed=None, max_width=None)
    device = tmp_path / "sys" / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0"
    (device / "max_link_width").mkdir()  # reading it raises IsADirectoryError
    (device / "max_link_speed").write_bytes(b"\xff\xfe")
    found = fabric_sysfs.read_gpu(bdf, str(tmp_path))
    assert found.known and found.numa_node is None and found.link_speed is None and found.link_width is None
    assert found.max_link_width is None and found.max_link_speed is None and found.root_port == "0000:00:01.0"


def test_a_chain_through_something_else_than_a_bridge_leaves_switches_unknown(tmp_path) -> None:
    sysfs = _sysfs.Sysfs(tmp_path)
    bdfs = [sysfs.device(_sysfs.switch_path(0, "0000:00:01.0", 0x10, p)) for p in range(2)]
    (tmp_path / "sys" / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:10:00.0" / "class").write_text("0x058000\n")
    found = _read(tmp_path, bdfs)
    assert found[0].switches is None and found[0].switch_label() == "unknown" and found[0].numa_node == 0
    assert topology.islands(found) == ((0, 1),)
    assert topology.islands_basis(found) == "flat: one NUMA node, PCIe switches unknown"


def test_an_entry_that_is_not_a_link_into_the_device_tree(tmp_path) -> None:
    _sysfs.Sysfs(tmp_path)
    entry = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:01:00.0"
    entry.mkdir()
    (entry / "numa_node").write_text("1\n")
    found = fabric_sysfs.read_gpu("0000:01:00.0", str(tmp_path))
    assert found.known and found.numa_node == 1 and found.switches is None and found.host_bridge is None
    os.symlink("/proc", tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:02:00.0")
    assert fabric_sysfs.read_gpu("0000:02:00.0", str(tmp_path)).switches is None


def test_one_rank_without_sysfs_keeps_the_others_from_splitting(tmp_path) -> None:
    found = _read(tmp_path, _sysfs.two_sockets_no_switch(tmp_path))
    found[7] = GpuFabric(found[7].bus_id)  # that rank's container shows no /sys
    assert topology.islands(found) == (tuple(range(8)),)


def test_numa_unknown_on_one_rank_falls_back_to_the_pci_domain(tmp_path) -> None:
    found = _read(tmp_path, _sysfs.two_switches_one_socket(tmp_path))
    found[0] = GpuFabric(**{**found[0].__dict__, "numa_node": None})
    assert topology.islands(found) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topology.islands_basis(found) == "by PCIe switch"


@pytest.mark.parametrize("cuda, sysfs", [
    ("00000000:41:00.0", "0000:41:00.0"), ("0000:C1:00.0", "0000:c1:00.0"), ("00010000:E1:00.0", "10000:e1:00.0"),
    ("0000:41:00.0", "0000:41:00.0"), ("weird", "weird"),
])
def test_cuda_bus_ids_name_the_sysfs_entry(cuda: str, sysfs: str) -> None:
    assert fabric_sysfs.sysfs_bus_id(cuda) == sysfs


def test_cuda_bus_id_finds_the_entry(tmp_path) -> None:
    _sysfs.two_sockets_no_switch(tmp_path)
    assert fabric_sysfs.read_gpu("00000000:01:00.0", str(tmp_path)).numa_node == 0
    assert fabric_sysfs.read_gpu("0000:A1:00.0", str(tmp_path)).host_bridge == "pci0000:a0"


def test_to_dict_is_json_able(tmp_path) -> None:
    import json

    found = _read(tmp_path, _sysfs.two_switches_one_socket(tmp_path))[0]
    data = json.loads(json.dumps(found.to_dict()))
    assert data["switch"] == "0000:10:00.0" and data["switches"] == ["0000:10:00.0"] and data["numa_node"] == 0


def test_fabric_of_prefers_what_each_rank_read(tmp_path) -> None:
    gpus = _sysfs.two_sockets_no_switch(tmp_path)
    carried = GpuFabric(gpus[0], known=True, numa_node=5)
    placements = [topology.RankPlacement(0, "h", gpus[0], carried), topology.RankPlacement(1, "h", gpus[4])]
    assert topology.fabric_of(placements, str(tmp_path)) == [carried, fabric_sysfs.read_gpu(gpus[4], str(tmp_path))]


# ---- PCIE_AR_ISLANDS ------------------------------------------------------------------------


@pytest.mark.parametrize("text, world, want", [
    ("0-3;4-7", 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("0,1,2,3;4,5,6,7", 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("0-3,4-7", 8, ((0, 1, 2, 3), (4, 5, 6, 7))),       # only ranges, no ';': one island per range
    ("4-7;0-3", 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
    (" 0-1, 4-5 ; 2-3,6-7 ", 8, ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("3,1,2,0", 4, ((0, 1, 2, 3),)),
    ("0-7", 8, (tuple(range(8)),)),
    ("0;1", 2, ((0,), (1,))),
    ("0-1,2", 3, ((0, 1, 2),)),                          # a rank among the ranges: one island
])
def test_islands_override_syntax(text: str, world: int, want: topology.Islands) -> None:
    assert topology.parse_islands(text, world) == want
    assert topology.parse_islands(topology.format_islands(want), world) == want


@pytest.mark.parametrize("text, message", [
    ("", "PCIE_AR_ISLANDS='': no islands given (write e.g. '0-3;4-7')"),
    ("0-3;", "PCIE_AR_ISLANDS='0-3;': island 2 is empty"),
    ("0-3;;4-7", "island 2 is empty"),
    ("0-3;3-7", "rank 3 is in islands 1 and 2: every rank must be in exactly one island"),
    ("0,0,1-7", "rank 0 is twice in island 1"),
    ("0-2;4-7", "rank 3 is in no island: each of the ranks 0-7 must be in exactly one"),
    ("0-1;4-5", "ranks 2-3,6-7 are in no island"),
    ("0-8", "rank 8 is out of range: the group has 8 ranks (0-7)"),
    ("0-3;4-7;8", "rank 8 is out of range"),
    ("a;0-7", "'a' is not a rank or a range of ranks (N or N-M)"),
    ("-1,0-7", "'-1' is not a rank or a range of ranks"),
    ("0-3;4-x", "'4-x' is not a rank or a range of ranks"),
    ("0,,1-7", "an empty entry (two commas in a row, or one at an end)"),
    ("7-4;0-3", "the range '7-4' runs backwards"),
])
def test_islands_override_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        topology.parse_islands(text, 8)
    assert message in str(info.value) and str(info.value).startswith(f"PCIE_AR_ISLANDS={text!r}: ")


def test_islands_override_from_the_environment() -> None:
    assert topology.islands_override(8, {}) is None
    assert topology.islands_override(8, {"PCIE_AR_ISLANDS": "  "}) is None
    assert topology.islands_override(4, {"PCIE_AR_ISLANDS": "0,1;2,3"}) == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match="rank 4 is out of range"):
        topology.islands_override(4, {"PCIE_AR_ISLANDS": "0-4"})
