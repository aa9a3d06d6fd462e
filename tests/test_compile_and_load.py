"""The first fused call of a shape readies every kernel variant it can launch before the ranks
meet: compiled, launcher built, module loaded (``pcie_allreduce.fused.path.compile_and_load``).

Triton's ``warmup`` compiles only; the launcher (a C module built with the host's compiler) and
the module load come with the first launch, which follows the meeting while peers already spin
in the kernel. These tests run on the CPU with stand-ins for the Triton kernel objects: they
check what is asked of Triton, not Triton itself (the GPU suites run the real thing).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._workspace import compile_only_view

path = pytest.importorskip("pcie_allreduce.fused.path")
fused = pytest.importorskip("pcie_allreduce.fused.rmsnorm")
ll = pytest.importorskip("pcie_allreduce.fused.oneshot_ll")
quads_module = pytest.importorskip("pcie_allreduce.fused.oneshot_quads")
norm = pytest.importorskip("pcie_allreduce.fused.add_rmsnorm")
protocol = pytest.importorskip("pcie_allreduce.fused.protocol")


class Compiled:
    """What ``warmup`` returns: a compiled kernel whose handles are not yet initialised."""

    def __init__(self) -> None:
        self.initialised = 0

    def _init_handles(self) -> None:
        self.initialised += 1


class CompiledWithoutInitHandles:
    """A Triton whose compiled kernel initialises its handles when ``run`` is first read."""

    def __init__(self) -> None:
        self.initialised = 0

    @property
    def run(self) -> Any:
        self.initialised += 1
        return lambda *args: None


class Kernel:
    """A stand-in for a ``triton.jit`` function: records warmups, refuses launches."""

    def __init__(self, compiled_type: type = Compiled) -> None:
        self.compiled_type = compiled_type
        self.warmups: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.compiled: list[Any] = []

    def warmup(self, *args: Any, grid: tuple[int, ...], **kwargs: Any) -> Any:
        self.warmups.append((args, dict(kwargs, grid=grid)))
        self.compiled.append(self.compiled_type())
        return self.compiled[-1]

    def __getitem__(self, grid: Any) -> Any:
        raise AssertionError("compile_only launched a kernel")


@pytest.mark.parametrize("compiled_type", [Compiled, CompiledWithoutInitHandles])
def test_compile_and_load_compiles_then_initialises_the_handles_once(compiled_type: type) -> None:
    kernel = Kernel(compiled_type)
    path.compile_and_load(kernel, 3, "a", grid=(5,), K=7)
    assert kernel.warmups == [((3, "a"), {"K": 7, "grid": (5,)})]
    assert [c.initialised for c in kernel.compiled] == [1]


def _tensors(tokens: int, hidden: int) -> tuple[torch.Tensor, ...]:
    x, residual, normed, residual_out = (torch.randn(tokens, hidden).to(torch.bfloat16) for _ in range(4))
    return x, residual, torch.randn(hidden).to(torch.bfloat16), normed, residual_out


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_a_flag_based_fused_kernels_first_call_readies_both_alignment_variants(
        monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    kernel = Kernel()
    monkeypatch.setattr(fused, "_fused_oneshot_kernel" if algo == "oneshot" else "_fused_twoshot_kernel", kernel)
    view, keep = compile_only_view(4)
    x, residual, weight, normed, residual_out = _tensors(5, 7168)
    path.launch(view, algo, x, residual, weight, 1e-6, normed, residual_out, interpret=False, compile_only=True)
    assert sorted(kw["ALIGNED"] for _, kw in kernel.warmups) == [False, True]
    assert [c.initialised for c in kernel.compiled] == [1, 1]


@pytest.mark.parametrize("algo, hidden, world, variant", [
    ("oneshot_ll", 7168, 2, "PAIRED"), ("oneshot_full", 7166, 2, "PAIRED"), ("oneshot_full", 7168, 2, "VECTOR"),
    ("oneshot_full", 7168, 4, "VECTOR"), ("oneshot_full", 7168, 8, "PAIRED")])
def test_a_data_as_flag_fused_kernels_first_call_readies_both_alignment_variants(
        monkeypatch: pytest.MonkeyPatch, algo: str, hidden: int, world: int, variant: str) -> None:
    """The word kernel's pairings, or where the full payload takes 16-byte quads (rows of a
    multiple of 8 elements in wide enough programs for the world: fused_shapes.takes_quads) the
    quads kernel's vector and element variants, and no other."""
    words, quads = Kernel(), Kernel()
    monkeypatch.setattr(ll, "_fused_oneshot_ll_kernel", words)
    monkeypatch.setattr(quads_module, "_fused_oneshot_full_quads_kernel", quads)
    view, keep = compile_only_view(world)
    x, residual, weight, normed, residual_out = _tensors(4, hidden)
    path.launch(view, algo, x, residual, weight, 1e-6, normed, residual_out, interpret=False, compile_only=True)
    kernel, other = (quads, words) if variant == "VECTOR" else (words, quads)
    assert sorted(kw[variant] for _, kw in kernel.warmups) == [False, True] and other.warmups == []
    assert [c.initialised for c in kernel.compiled] == [1, 1]


def test_the_add_rmsnorm_kernels_first_call_readies_both_alignment_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = Kernel()
    monkeypatch.setattr(norm, "_add_rmsnorm_kernel", kernel)
    monkeypatch.setattr(protocol, "interpreting", lambda: False)
    x, residual, weight, normed, residual_out = _tensors(3, 4096)
    path.add_rmsnorm(x, residual, weight, 1e-6, normed, residual_out, compile_only=True)
    assert sorted(kw["ALIGNED"] for _, kw in kernel.warmups) == [False, True]
    assert [c.initialised for c in kernel.compiled] == [1, 1]
