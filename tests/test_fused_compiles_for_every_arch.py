"""Every fused kernel variant the library launches compiles for each GPU architecture the package
is built for (``_archs.DEFAULT_ARCHS``), on a machine without a GPU.

The GPU suites compile and run sm_90 only; the PCIe cards this library is for (A100/A10 sm_80,
3090 sm_86, L40S/4090 sm_89, RTX PRO 6000 sm_120) are never on the testbed. Here the kernels go
through Triton's own compiler and the ptxas bundled with it, for every architecture, with the
arguments the library's compile-only path (``fused.path.launch`` / ``add_rmsnorm`` with
``compile_only``) hands to Triton for a few shapes of each kernel: a kernel a card cannot compile
(an instruction it lacks, the dependent launch below sm_90) or that runs out of registers would
otherwise first show on a user's server. The variants every 16-byte aligned call takes must also
spill nothing; the element-wise variants for tensors off that boundary may (their programs of 512
threads cap registers at 128).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

import pytest
import torch

from pcie_allreduce import _archs
from tests import _interpreted
from tests._workspace import compile_only_view

triton = pytest.importorskip("triton")
path = pytest.importorskip("pcie_allreduce.fused.path")
protocol = pytest.importorskip("pcie_allreduce.fused.protocol")

HIDDEN = 7168
# (kernel, tokens) at W = 2 and 8: the lines, the full payload (16-byte quads at W = 2, the wide
# shape at W = 8), the flag-based one-shot and the token-split two-shot.
CALLS = (("oneshot_ll", 1), ("oneshot_full", 4), ("oneshot", 32), ("twoshot", 64))
WORLDS = (2, 8)
FAST_VARIANT = {"ALIGNED": True, "VECTOR": True, "PAIRED": True}  # what a 16-byte aligned call launches
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _recorded_compiles(monkeypatch: pytest.MonkeyPatch, dependent: bool) -> list[tuple[Any, tuple, dict]]:
    """(kernel, positional arguments, keyword arguments) of every compile the library asks of
    Triton for the CALLS and the add + RMSNorm kernel (``dependent``: launched as the previous
    kernel's programmatic dependent, as on sm_90 and later)."""
    asked: list[tuple[Any, tuple, dict]] = []
    monkeypatch.setattr(path, "compile_and_load", lambda kernel, *args, grid, **kw: asked.append((kernel, args, kw)))
    monkeypatch.setattr(protocol, "interpreting", lambda: False)
    for world in WORLDS:
        view, keep = compile_only_view(world)
        for algo, tokens in CALLS:
            x, residual, normed, residual_out = (torch.empty(tokens, HIDDEN, dtype=torch.bfloat16) for _ in range(4))
            weight = torch.empty(HIDDEN, dtype=torch.bfloat16)
            path.launch(view, algo, x, residual, weight, 1e-6, normed, residual_out, interpret=False,
                        compile_only=True, dependent=dependent)
    y, residual, normed, new_residual = (torch.empty(4, HIDDEN, dtype=torch.bfloat16) for _ in range(4))
    path.add_rmsnorm(y, residual, torch.empty(HIDDEN, dtype=torch.bfloat16), 1e-6, normed, new_residual,
                     compile_only=True, after_all_reduce=dependent)
    return asked


def _source(kernel: Any, args: tuple, kwargs: dict) -> Any:
    """Triton's compile input for one recorded launch: the positional arguments typed as Triton's
    launcher types them (tensors as pointers, Python ints as i32 or i64, floats as fp32), the
    keywords and every unset parameter's default as constexprs."""
    from triton.compiler import ASTSource

    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if i < len(args):
            a = args[i]
            signature[name] = (POINTER_TYPES[a.dtype] if isinstance(a, torch.Tensor) else "fp32"
                               if isinstance(a, float) else "i32" if -2**31 <= a < 2**31 else "i64")
        else:
            signature[name] = "constexpr"
            constexprs[(i,)] = kwargs[name] if name in kwargs else kernel.params[i].default
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs)


def _stack_bytes(cubin: bytes) -> int:
    """The per-thread stack of the compiled kernel (spilled registers), from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    stacks = [int(s) for s in re.findall(r"STACK:(\d+)", usage)]
    assert stacks, f"cuobjdump -res-usage gave no STACK figure:\n{usage}"
    return max(stacks)


@pytest.mark.skipif(_interpreted.interpreting(), reason="TRITON_INTERPRET is set: the kernels are interpreted here, "
                    "not compiled")
@pytest.mark.skipif(not all(os.access(os.path.join(_BIN, tool), os.X_OK) for tool in ("ptxas", "cuobjdump")),
                    reason="this Triton has no bundled ptxas / cuobjdump to compile for a GPU with")
@pytest.mark.parametrize("arch", _archs.DEFAULT_ARCHS)
def test_every_fused_kernel_compiles_for_the_arch_and_its_aligned_variants_do_not_spill(
        monkeypatch: pytest.MonkeyPatch, arch: int) -> None:
    from triton.backends.compiler import GPUTarget

    asked = _recorded_compiles(monkeypatch, dependent=arch >= 90)
    names = {kernel.fn.__name__ for kernel, _, _ in asked}
    assert names == {"_fused_oneshot_ll_kernel", "_fused_oneshot_full_quads_kernel", "_fused_oneshot_kernel",
                     "_fused_twoshot_kernel", "_add_rmsnorm_kernel"}, names
    assert any(kw.get("PDL") for _, _, kw in asked) == (arch >= 90)
    spilled = []
    for kernel, args, kwargs in asked:
        options = {"num_warps": kwargs["num_warps"]}
        constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "launch_pdl")}
        variant = {k: v for k, v in constexprs.items() if k in FAST_VARIANT}
        compiled = triton.compile(_source(kernel, args, constexprs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
        stack = _stack_bytes(compiled.asm["cubin"])
        if stack and all(FAST_VARIANT[k] == v for k, v in variant.items()):
            spilled.append(f"{kernel.fn.__name__} {constexprs} num_warps={options['num_warps']}: {stack} bytes")
    assert not spilled, f"sm_{arch}: aligned variants spill:\n" + "\n".join(spilled)
