"""CPU tests of ``python -m bench topo``'s measurements: the matrices from per-rank figures, their
printed and JSON forms, the command with a fake probe, and the probe kernels under the Triton
CPU interpreter (in the TRITON_INTERPRET=1 child of tests/conftest.py)."""

from __future__ import annotations

import argparse
import csv
import io
import json

import pytest
import torch

from bench import __main__ as bench_cli
from bench import plot, topo, topo_files, topo_probe
from tests._interpreted import interpreted


def _per_rank(world: int) -> list[dict]:
    ranks = []
    for r in range(world):
        ranks.append({"rtt_us": {j: 1.0 + r + j for j in range(r + 1, world)},
                      "write_gbps": {j: 20.0 + j for j in range(world) if j != r},
                      "read_gbps": {j: 40.0 + j for j in range(world) if j != r},
                      "one_to_one_gbps": 25.0 + r, "all_to_all_gbps": 10.0 if r else None,
                      "all_to_all_read_gbps": 30.0 + r})
    return ranks


def test_assemble_matrices() -> None:
    data = topo_probe.assemble(3, _per_rank(3))
    assert data["rtt_us"] == [[None, 2.0, 3.0], [2.0, None, 4.0], [3.0, 4.0, None]]  # symmetric
    assert data["write_gbps"][0] == [None, 21.0, 22.0] and data["write_gbps"][2][1] == 21.0
    assert data["one_to_one"] == {"min": 25.0, "mean": 26.0}
    assert data["all_to_all"] == {"min": 10.0, "mean": 10.0}
    assert data["all_to_all_over_one_to_one"] == pytest.approx(10 / 26)
    assert data["read_gbps"][0] == [None, 41.0, 42.0] and data["read_gbps"][2][0] == 40.0  # row: the reader
    assert data["all_to_all_read"] == {"min": 30.0, "mean": 31.0}
    assert "cross_write" not in data  # no islands, no cross-island rates
    crossing = [{**d, "cross_write_gbps": 5.0 + r, "cross_read_gbps": 7.0} for r, d in enumerate(_per_rank(3))]
    both = topo_probe.assemble(3, crossing)
    assert both["cross_write"] == {"min": 5.0, "mean": 6.0} and both["cross_read"] == {"min": 7.0, "mean": 7.0}
    assert json.loads(json.dumps(data))["rtt_us"][0][1] == 2.0
    assert topo_probe.pairs(3) == [(0, 1), (0, 2), (1, 2)] and len(topo_probe.ordered_pairs(4)) == 12
    assert topo_probe.gbps(1 << 30, 0.0) is None and topo_probe.gbps(10**9, 0.5) == 2.0


def test_format_probe() -> None:
    data = {**topo_probe.assemble(2, _per_rank(2)), "nbytes": 16 << 20, "pingpong_iters": 2000}
    text = topo.format_probe(2, "emulation: 2 ranks on one GPU under MPS", data)
    lines = text.splitlines()
    assert lines[0] == "# measured between W=2 ranks (emulation: 2 ranks on one GPU under MPS); rN = rank N"
    assert "# flag round-trip latency (us), 2000 round trips per pair" in text
    rtt = lines.index("# flag round-trip latency (us), 2000 round trips per pair")
    assert lines[rtt + 1].split() == ["r0", "r1"] and lines[rtt + 2].split() == ["r0", "X", "2.00"]
    assert "row rank writes 16 MiB into column rank, alone" in text
    assert "one-to-one writes (rank r -> r+1):" in text and "mean 25.5" in text
    assert "all-to-all / one-to-one writes: 0.39" in text
    assert "row rank reads 16 MiB from column rank, alone" in text
    reads = lines.index(next(line for line in lines if "one-way read bandwidth" in line))
    assert lines[reads + 2].split() == ["r0", "X", "41.0"]
    assert "all-to-all reads (1/(W-1) from each):  mean 30.5" in text and "all-to-all reads / writes: 3.05" in text
    assert "cross-island" not in text
    crossing = [{**d, "cross_write_gbps": 5.0, "cross_read_gbps": 9.0} for d in _per_rank(2)]
    text = topo.format_probe(2, "two GPUs", {**topo_probe.assemble(2, crossing), "nbytes": 1 << 20})
    assert "cross-island writes (partner in the next island): mean 5.0" in text
    assert "cross-island reads (partner in the next island): mean 9.0" in text


def test_partners_across_islands_and_the_islands_probed(monkeypatch) -> None:
    halves = ((0, 1, 2, 3), (4, 5, 6, 7))
    assert [topo_probe.partner_across(halves, r) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [topo_probe.partner_across(((0, 1), (2, 3), (4, 5)), r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert topo_probe.partner_across(((0, 1, 2, 3),), 1) is None and topo_probe.partner_across((), 0) is None
    monkeypatch.delenv("PCIE_AR_ISLANDS", raising=False)
    assert topo._probe_islands(8, 8, [[0, 1, 2, 3], [4, 5, 6, 7]]) == halves  # one rank per GPU: detected
    assert topo._probe_islands(8, 1, [[0]]) == ()  # ranks sharing a GPU: none unless set
    monkeypatch.setenv("PCIE_AR_ISLANDS", "0-1;2-3")
    assert topo._probe_islands(4, 1, None) == ((0, 1), (2, 3))
    monkeypatch.setenv("PCIE_AR_ISLANDS", "0-2")  # wrong for W = 4: measure no cross-island rate
    assert topo._probe_islands(4, 1, None) == ()


def test_topo_options(capsys) -> None:
    parser = bench_cli.build_parser()
    args = parser.parse_args(["topo", "--world", "2", "4", "--bytes", "4M", "--iters", "100", "--no-probe"])
    assert args.world == [2, 4] and args.bytes == 4 << 20 and args.iters == 100 and args.no_probe
    with pytest.raises(SystemExit):
        parser.parse_args(["topo", "--world", "17"])
    assert "--world" in capsys.readouterr().err


class _FakeExt:
    def pci_bus_id(self, device: int) -> str:
        return f"00000000:{0x19 + device * 0x20:02X}:00.0"

    def can_access_peer(self, device: int, peer: int) -> bool:
        return True


def test_topo_command_with_a_fake_probe(monkeypatch, capsys, tmp_path) -> None:
    from pcie_allreduce import _ext
    from pcie_allreduce.tools import ranks

    monkeypatch.setattr(ranks, "skip_reason_no_gpu", lambda: None)
    monkeypatch.setattr(ranks, "gpu_count", lambda: 1)
    monkeypatch.setattr(_ext, "load", lambda: _FakeExt())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: argparse.Namespace(name="NVIDIA H200"))
    monkeypatch.setattr(topo, "_nvidia_smi_topo", lambda: "")
    jobs = []

    def fake_probe(world: int, job: topo_probe.ProbeJob) -> dict:
        jobs.append((world, job))
        if world == 8:
            raise RuntimeError("hung: rank 3 made no progress for 60 s in pingpong (killed by the bench watchdog)")
        return {**topo_probe.assemble(world, _per_rank(world)), "nbytes": job.nbytes, "pingpong_iters": 10,
                "mps": True}

    monkeypatch.setattr(topo_probe, "run_probe", fake_probe)
    status = bench_cli.main(["topo", "--world", "2", "8", "--bytes", "1000", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 1  # one world's measurement failed
    assert [w for w, _ in jobs] == [2, 8] and jobs[0][1].nbytes == 992  # whole 16-byte units
    assert "# measured between W=2 ranks (emulation: 2 ranks on one GPU under MPS)" in out
    assert "# W=8: measurement failed: hung: rank 3" in out
    data = json.loads((tmp_path / "topo.json").read_text())
    assert data["gpus"][0]["name"] == "NVIDIA H200" and data["measured"]["2"]["rtt_us"][0][1] == 2.0
    assert data["measure_errors"] == {"8": "hung: rank 3 made no progress for 60 s in pingpong (killed by the "
                                           "bench watchdog)"}
    text = (tmp_path / "topo.txt").read_text()
    assert "# measured between W=2 ranks" in text and "# W=8: measurement failed" in text
    rows = list(csv.DictReader(io.StringIO((tmp_path / "topo.csv").read_text())))
    assert {(r["kind"], r["sender"], r["receiver"]) for r in rows} == {
        ("pair", "0", "1"), ("pair", "1", "0"), ("one_to_one", "0", "1"), ("one_to_one", "1", "0"),
        ("all_to_all", "0", "*"), ("all_to_all", "1", "*")}
    assert float(next(r for r in rows if r["kind"] == "pair")["rtt_us"]) == 2.0
    if _has_matplotlib():
        assert (tmp_path / "topo.png").stat().st_size > 0
        assert bench_cli.main(["plot", str(tmp_path / "topo.json"), "--out", str(tmp_path / "again.png")]) == 0
        assert (tmp_path / "again.png").stat().st_size > 0
    assert bench_cli.main(["topo", "--no-probe", "--json"]) == 0
    assert "measured" not in json.loads(capsys.readouterr().out)


def _has_matplotlib() -> bool:
    from bench.plot import pyplot

    return pyplot()[0] is not None


def test_topo_files_from_a_document_without_measurements(tmp_path) -> None:
    document = {"gpus": [], "peer_access": [], "nvidia_smi_topo": ""}
    assert topo_files.is_topo_document(document) and not topo_files.is_topo_document({"results": []})
    assert topo_files.csv_text(document).strip() == ",".join(topo_files.CSV_COLUMNS)
    assert "no measurements" in (plot.write_topo_png(document, str(tmp_path / "x.png")) or "")


# ---------------------------------------------------------------------------- kernels, interpreted

needs_interpreter = interpreted


@needs_interpreter
def test_push_kernel_copies_a_slice_to_every_peer() -> None:
    from bench import probe_kernels

    words = 3000
    src = torch.arange(3 * words, dtype=torch.int64)
    dsts = [torch.zeros(words + 2, dtype=torch.int64) for _ in range(3)]
    addrs = torch.tensor([d.data_ptr() for d in dsts], dtype=torch.int64)
    probe_kernels.push(src, addrs, words, programs_per_peer=2)
    for p, d in enumerate(dsts):
        assert torch.equal(d[:words], src[p * words:(p + 1) * words]) and d[words:].eq(0).all()


@needs_interpreter
def test_pull_kernel_reads_a_slice_from_every_peer() -> None:
    from bench import probe_kernels

    words = 3000
    srcs = [torch.arange(words + 2, dtype=torch.int64) * (p + 1) for p in range(3)]
    addrs = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.int64)
    dst = torch.zeros(3 * words + 5, dtype=torch.int64)
    probe_kernels.pull(dst, addrs, words, programs_per_peer=2)
    for p, t in enumerate(srcs):
        assert torch.equal(dst[p * words:(p + 1) * words], t[:words])
    assert dst[3 * words:].eq(0).all()


@needs_interpreter
def test_pingpong_and_fill_kernels() -> None:
    from bench import probe_kernels

    flags = torch.full((4,), 7, dtype=torch.int64)
    probe_kernels.fill(flags.data_ptr(), 2)
    assert flags.tolist() == [0, 0, 7, 7]
    out = torch.zeros(2, dtype=torch.int64)
    mine, theirs = flags.data_ptr(), flags.data_ptr() + 8
    flags[0] = 50  # the peer already answered every round: the initiator runs through
    probe_kernels.pingpong(mine, theirs, out, 20, 10**9, initiator=True)
    assert out[0] == 1 and flags[1] == 20
    flags.zero_()  # no peer: the wait gives up (spin limit under the interpreter) and reports it
    probe_kernels.pingpong(mine, theirs, out, 20, 10**9, initiator=False)
    assert out[0] == 0 and flags[1] == 0


class _FabricExt:
    """Eight GPUs under two PCIe switches (tests/_sysfs.py), as CUDA names them."""

    def __init__(self, bus_ids: list[str]) -> None:
        self.bus_ids = bus_ids

    def pci_bus_id(self, device: int) -> str:
        return "0000" + self.bus_ids[device].upper()

    def can_access_peer(self, device: int, peer: int) -> bool:
        return True


def test_topo_shows_the_fabric_and_the_islands(tmp_path, monkeypatch) -> None:
    from tests import _sysfs

    monkeypatch.delenv("PCIE_AR_ISLANDS", raising=False)
    bus_ids = _sysfs.two_switches_one_socket(tmp_path)
    found = topo.probe(_FabricExt(bus_ids), ["RTX PRO 6000"] * 8, sysfs_root=str(tmp_path / "sys/bus/pci/devices"),
                       fabric_root=str(tmp_path))
    assert [g.pci_bus_id for g in found.gpus] == bus_ids and {g.numa_node for g in found.gpus} == {0}
    text = topo.format_topology(found)
    assert "\n# PCIe fabric (from sysfs)\n" in text
    assert "\n# islands, for one rank per GPU in index order:\n  0-3;4-7 (by PCIe switch)\n" in text
    row = [line for line in text.splitlines() if "0000:35:00.0" in line][-1]  # the fabric table's
    assert row.split()[:4] == ["7", "0000:35:00.0", "0", "0000:30:00.0"] and "32.0 GT/s x16" in row
    data = json.loads(json.dumps(found.to_dict()))
    assert data["fabric"]["islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert data["fabric"]["gpus"][4]["switch"] == "0000:30:00.0"
    assert topo_files.is_topo_document(data)
