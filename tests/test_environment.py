"""``pcie-allreduce env`` and the no-GPU message, on any machine (CPU-only included)."""

from __future__ import annotations

import json

import pytest

import pcie_allreduce
from pcie_allreduce import _ext, environment


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
    from pcie_allreduce import cli

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
