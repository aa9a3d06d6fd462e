"""The fused Triton kernels of another checkout, loaded beside this one's, for an A/B in one process.

Two builds timed in two runs differ by more than two kernels do: each run starts its ranks, its
MPS clients and its GPU clock afresh, and the same kernel's figure has moved up to 2x between
runs of one call. :func:`load` imports the Triton modules of ``pcie_allreduce/fused`` from another
checkout as a set of their own (each imports the others from that checkout, the rest of the
library from this one), and :func:`swapped` makes the fused path launch them while it is open, so
a timing loop can alternate the two kernels row by row on the same ranks and workspace.

Only kernel bodies may differ: the launches are this checkout's (its shapes, signatures and
arguments), so the other checkout's kernels must take the same arguments. Nothing here is part
of the library; it reaches the path's module lookup (``path._triton``) as a harness may.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import ModuleType
from typing import Iterator, Mapping

#: The modules the fused path looks its kernels up in (``fused.path._TritonSide``).
MODULES = ("protocol", "oneshot_ll", "oneshot_quads", "rmsnorm", "add_rmsnorm")
_PACKAGE = "pcie_allreduce.fused"


def load(checkout: str) -> dict[str, ModuleType]:
    """The Triton modules of ``checkout``'s ``pcie_allreduce/fused`` (by name, as MODULES), imported
    with that folder as the package's path, then this checkout's modules and package put back as
    they were. Raises ValueError where the folder lacks one of them."""
    folder = os.path.join(os.path.abspath(checkout), *_PACKAGE.split("."))
    missing = [name for name in MODULES if not os.path.isfile(os.path.join(folder, f"{name}.py"))]
    if missing:
        raise ValueError(f"{checkout!r}: no {', '.join(f'{m}.py' for m in missing)} in {folder} (expected a checkout "
                         f"of pcie_allreduce)")
    package = importlib.import_module(_PACKAGE)
    names = [f"{_PACKAGE}.{name}" for name in MODULES]
    kept_modules = {name: sys.modules.get(name) for name in names}
    kept_attributes = {name: package.__dict__.get(name) for name in MODULES}
    kept_path = list(package.__path__)
    try:
        package.__path__[:] = [folder]
        for name in names:
            sys.modules.pop(name, None)
        return {name: importlib.import_module(f"{_PACKAGE}.{name}") for name in MODULES}
    finally:
        package.__path__[:] = kept_path
        for name, module in kept_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name, module in kept_attributes.items():
            if module is None:
                package.__dict__.pop(name, None)
            else:
                setattr(package, name, module)


@contextlib.contextmanager
def swapped(modules: Mapping[str, ModuleType]) -> Iterator[None]:
    """While open, the fused path launches the kernels of ``modules`` (:func:`load`) instead of this
    checkout's; its own are back on exit, whatever happened."""
    from pcie_allreduce.fused import path

    side = path._triton()  # noqa: SLF001 - the harness swaps what the path looks up
    kept = {name: getattr(side, name) for name in modules}
    try:
        for name, module in modules.items():
            setattr(side, name, module)
        yield
    finally:
        for name, module in kept.items():
            setattr(side, name, module)
