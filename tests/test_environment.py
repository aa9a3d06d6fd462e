"""``pcie-allreduce env`` and the no-GPU message, on any machine (CPU-only included)."""

from __future__ import annotations

import json

import pytest

import pcie_allreduce
from pcie_allreduce import _ext
from pcie_allreduce.tools import environment


def test_env_report_is_json_and_names_every_section() -> None:
    report = environment.collect()
    json.dumps(report)  # the --json output
    for key in ("package", "build", "runtime", "torch", "triton", "gpus", "peer_access", "mps", "settings",
                "unavailable_reason"):
        assert key in report
    assert report["package"]["version"] == pcie_allreduce.__version__
    assert report["unavailable_reason"] == pcie_allreduce.unavailable_reason()
    text = environment.format_report(report)
    assert text.splitlines()[0].startswith("pcie_allreduce")
    assert ("ready" in text) == pcie_allreduce.is_available()


def test_env_report_lists_the_compiled_archs_when_built() -> None:
    ext = _ext.load()
    if ext is None:
        pytest.skip(f"needs the built extension ({_ext.unavailable_reason()})")
    report = environment.collect()
    assert report["build"]["compiled_archs"] == [f"sm_{a // 10}" for a in ext.compiled_archs()]
    assert report["build"]["compiled_archs"]
    assert "compiled archs" in environment.format_report(report)


def test_env_command_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from pcie_allreduce.tools import cli

    assert cli.main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["package"]["version"] == pcie_allreduce.__version__


class _FakeExt:
    """The extension's runtime queries, as they read on machines we cannot boot here."""

    def __init__(self, driver: int, status: str, runtime: int = 13000) -> None:
        self.driver, self.status, self.runtime = driver, status, runtime

    def runtime_version(self) -> int:
        return self.runtime

    def driver_version(self) -> int:
        return self.driver

    def runtime_status(self) -> str:
        return self.status


@pytest.mark.parametrize("fake, needles", [
    (_FakeExt(0, "CUDA runtime reports cudaErrorInsufficientDriver: CUDA driver version is insufficient"),
     ("no NVIDIA driver", "CUDA 13.0 runtime", "driver 580 or newer")),
    (_FakeExt(12080, "CUDA runtime reports cudaErrorInsufficientDriver: ...", runtime=12090),
     ("supports CUDA 12.8 only", "driver 575 or newer")),
    (_FakeExt(13000, "no CUDA device is visible"), ("no CUDA GPU is visible",)),
    (_FakeExt(13000, "CUDA runtime reports cudaErrorNoDevice: no CUDA-capable device is detected"),
     ("no CUDA GPU is visible",)),
    (_FakeExt(13000, "CUDA runtime reports cudaErrorUnknown: unknown error"), ("CUDA cannot start",)),
])
def test_unavailable_reason_names_the_missing_piece(monkeypatch: pytest.MonkeyPatch, fake: _FakeExt,
                                                    needles: tuple[str, ...]) -> None:
    monkeypatch.setattr(_ext, "_import", lambda: (fake, None))
    reason = _ext.unavailable_reason()
    assert reason is not None
    for needle in needles:
        assert needle in reason


def test_gpu_reason_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    monkeypatch.setattr(_ext, "load", lambda: None)

    def no_driver(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert _ext.gpu_unavailable_reason() == _ext.NO_DRIVER


# ---- the PCIe fabric and the islands --------------------------------------------------------


def test_env_report_shows_the_fabric_and_the_islands(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import _sysfs

    bus_ids = _sysfs.two_sockets_no_switch(tmp_path)
    section = environment.fabric_section(bus_ids, str(tmp_path), {})
    assert section["islands"] == section["detected"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert section["basis"] == "by NUMA node" and section["override"] is None
    assert section["gpus"][4]["numa_node"] == 1 and section["gpus"][4]["switch"] is None
    lines = environment.fabric_lines(section)
    assert lines[0] == "PCIe fabric (from sysfs)"
    assert lines[2].split() == ["0", "0000:01:00.0", "0", "root", "port", "32.0", "GT/s", "x16", "(max", "32.0",
                                "GT/s", "x16)"]
    assert lines[-2:] == ["islands, for one rank per GPU in index order:", "  0-3;4-7 (by NUMA node)"]
    json.dumps(section)
    report = environment.collect()
    report.update(gpus=[{"index": i, "pci_bus_id": b, "numa_node": i // 4} for i, b in enumerate(bus_ids)],
                  peer_access=[[True] * 8] * 8, fabric=section)
    assert "\n".join(lines) in environment.format_report(report)


def test_env_report_names_the_islands_override(tmp_path) -> None:
    from tests import _sysfs

    bus_ids = _sysfs.two_switches_one_socket(tmp_path)
    section = environment.fabric_section(bus_ids, str(tmp_path), {"PCIE_AR_ISLANDS": "0,2,4,6;1,3,5,7"})
    assert section["islands"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and section["detected"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert environment.fabric_lines(section)[-1] == (
        "  0,2,4,6;1,3,5,7 (set by $PCIE_AR_ISLANDS; detected: 0-3;4-7 (by PCIe switch))")
    wrong = environment.fabric_section(bus_ids, str(tmp_path), {"PCIE_AR_ISLANDS": "0-3"})
    assert wrong["islands"] == wrong["detected"] and "ranks 4-7 are in no island" in wrong["override_error"]
    assert "$PCIE_AR_ISLANDS is wrong, a Communicator would refuse it: " in environment.fabric_lines(wrong)[-1]


def test_env_fabric_without_sysfs(tmp_path) -> None:
    section = environment.fabric_section(["00000000:41:00.0"], str(tmp_path / "none"), {})
    assert section["gpus"][0]["bus_id"] == "0000:41:00.0" and section["gpus"][0]["known"] is False
    assert environment.fabric_lines(section)[2].split() == ["0", "0000:41:00.0", "?", "unknown", "unknown"]
    assert environment.fabric_lines(environment.fabric_section([], str(tmp_path), {})) == []
