"""CPU tests of the unfused pair's programmatic dependent launch ($PCIE_AR_PDL): who turns it on,
and what the norm kernel's launch then asks of Triton (the launch itself needs a Hopper GPU:
tests/test_fused_gpu.py runs the pair both ways)."""

from __future__ import annotations

import pytest
import torch

from pcie_allreduce import rendezvous

norm = pytest.importorskip("pcie_allreduce.fused.add_rmsnorm")  # the kernel's module (Triton)
protocol = pytest.importorskip("pcie_allreduce.fused.protocol")
from pcie_allreduce.fused import path  # noqa: E402


@pytest.mark.parametrize(("env", "major", "on"), [
    (None, 9, True), (None, 8, False), ("1", 9, True), ("1", 12, True), ("1", 8, False), ("0", 9, False), ("yes", 9, True),
    (" 1 ", 10, True), ("true", 9, True), ("On", 9, True), ("off", 9, False), ("", 9, False),
])
def test_the_switch_needs_the_setting_and_a_gpu_that_has_it(monkeypatch, env: str | None, major: int,
                                                            on: bool) -> None:
    if env is None:
        monkeypatch.delenv(rendezvous.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(rendezvous.PDL_ENV, env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    assert rendezvous.dependent_launch(torch.device("cuda", 0)) is on


class _Kernel:
    """Stands in for the Triton kernel: records each launch's grid and keyword arguments."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple):
        def launch(*args, **kwargs) -> None:
            self.launches.append((grid, kwargs))
        return launch


@pytest.mark.parametrize("after", [False, True])
def test_the_norm_kernel_is_launched_as_a_dependent_only_after_an_all_reduce(monkeypatch, after: bool) -> None:
    kernel = _Kernel()
    monkeypatch.setattr(norm, "_add_rmsnorm_kernel", kernel)
    monkeypatch.setattr(protocol, "interpreting", lambda: False)
    y = torch.zeros(3, 64, dtype=torch.bfloat16)
    res, w = torch.zeros_like(y), torch.ones(64, dtype=torch.bfloat16)
    path.add_rmsnorm(y, res, w, 1e-6, y, res, after_all_reduce=after)
    ((grid, kwargs),) = kernel.launches
    assert grid == (3,)
    assert kwargs.get("launch_pdl", False) is after and kwargs.get("PDL", False) is after


def test_under_the_interpreter_the_kernel_never_waits_for_a_dependency(monkeypatch) -> None:
    kernel = _Kernel()
    monkeypatch.setattr(norm, "_add_rmsnorm_kernel", kernel)
    monkeypatch.setattr(protocol, "interpreting", lambda: True)
    y = torch.zeros(2, 64, dtype=torch.float16)
    path.add_rmsnorm(y, torch.zeros_like(y), torch.ones(64, dtype=torch.float16), 1e-6, y, y.clone(),
                     after_all_reduce=True)
    ((_, kwargs),) = kernel.launches
    assert "launch_pdl" not in kwargs and "PDL" not in kwargs
