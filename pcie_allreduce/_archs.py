"""CUDA architecture-list parsing for the build.

Pure functions with no imports beyond the standard library: ``setup.py`` loads
this file by path (importing the package would import torch), and the tests
exercise it without a GPU or nvcc.

An architecture is an integer ``major * 10 + minor`` (``90`` is sm_90).
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

#: Environment variable that overrides the architectures to compile for.
ENV_VAR = "PCIE_AR_CUDA_ARCHS"

#: Ampere (A100, A10/3090), Ada (L40/4090), Hopper, Blackwell datacenter and
#: consumer. SM120 needs CUDA 12.8+, which is why that is the minimum toolkit.
DEFAULT_ARCHS: tuple[int, ...] = (80, 86, 89, 90, 100, 120)

# "90", "9.0", "sm_90", "compute_90", "SM90". Arch-specific suffixes ("90a") are
# refused: the kernels use nothing that needs them, and "a" SASS would not run
# on any later GPU.
_TOKEN = re.compile(r"^(?:(?:sm|compute)_?)?(\d{1,3})(?:\.(\d))?$", re.IGNORECASE)
_NVCC_LINE = re.compile(r"\b(?:sm|compute)_(\d+)([a-z]?)\b")


class ArchError(ValueError):
    """An architecture list that cannot be used for the build."""


def parse_arch(token: str) -> int:
    """Parse one architecture token (``"90"``, ``"9.0"``, ``"sm_90"``) to an int."""
    text = token.strip()
    match = _TOKEN.match(text)
    if not match:
        raise ArchError(
            f"invalid CUDA architecture {token!r}: expected a number such as "
            f"'90' or '9.0' (no 'native', 'all' or arch-specific 'a' suffix)"
        )
    major, minor = match.group(1), match.group(2)
    if minor is not None:
        value = int(major) * 10 + int(minor)
    else:
        value = int(major)
    if value < 50:
        raise ArchError(f"invalid CUDA architecture {token!r}: below sm_50")
    return value


def parse_arch_list(text: str) -> list[int]:
    """Parse a list such as ``"80;86 ,9.0"`` to sorted unique ints.

    Separators are semicolons, commas and whitespace, in any mix.
    Raises :class:`ArchError` for an empty list or a bad token.
    """
    tokens = [t for t in re.split(r"[;,\s]+", text) if t]
    if not tokens:
        raise ArchError(f"empty CUDA architecture list in {ENV_VAR}={text!r}")
    return sorted({parse_arch(t) for t in tokens})


def parse_nvcc_arch_list(output: str) -> set[int]:
    """Archs in ``nvcc --list-gpu-arch`` / ``--list-gpu-code`` output.

    Arch-specific/family entries (``sm_90a``, ``sm_100f``) are ignored: the
    plain arch next to them is what the build compiles for.
    """
    return {int(num) for num, suffix in _NVCC_LINE.findall(output) if not suffix}


def select_archs(requested: Optional[str], supported: Optional[Iterable[int]]) -> list[int]:
    """Decide which architectures to build.

    ``requested`` is the env var's value (``None`` or blank: use the defaults).
    ``supported`` is what nvcc can compile for (``None``: unknown, trust the list).
    An explicit request for an arch nvcc lacks is an error, because silently
    dropping it would ship a library that does not run where the user asked;
    the defaults are instead trimmed to what nvcc supports.
    """
    supported_set = set(supported) if supported is not None else None
    if requested is not None and requested.strip():
        archs = parse_arch_list(requested)
        if supported_set is not None:
            missing = [a for a in archs if a not in supported_set]
            if missing:
                raise ArchError(
                    f"{ENV_VAR} asks for {_fmt(missing)}, which this nvcc cannot "
                    f"compile for (it supports {_fmt(sorted(supported_set))})"
                )
        return archs
    if supported_set is None:
        return list(DEFAULT_ARCHS)
    archs = [a for a in DEFAULT_ARCHS if a in supported_set]
    if not archs:
        raise ArchError(
            f"this nvcc supports none of the default CUDA architectures "
            f"{_fmt(DEFAULT_ARCHS)}; install CUDA 12.8 or newer, or set {ENV_VAR}"
        )
    return archs


def cmake_architectures(archs: Sequence[int]) -> str:
    """CMAKE_CUDA_ARCHITECTURES value: SASS for every arch, PTX for the highest.

    ``"80-real;90-real;120"`` — the bare last entry means SASS + PTX, so newer
    GPUs can JIT the PTX.
    """
    if not archs:
        raise ArchError("no CUDA architectures to build for")
    ordered = sorted(set(archs))
    return ";".join([f"{a}-real" for a in ordered[:-1]] + [str(ordered[-1])])


def _fmt(archs: Iterable[int]) -> str:
    return ", ".join(f"sm_{a}" for a in archs)
