"""CPU tests of the build's arch list and of the compiled extension's contents.

The arch-list parsing of ``pcie_allreduce/_archs.py`` (what setup.py compiles for), and the built
``pcie_allreduce/_C*.so`` read as an ELF file (no GPU, no CUDA driver needed): SASS for every
arch and PTX for the highest, no link to the CUDA driver, cudart or torch, and that it loads
without a GPU. The extension tests skip with a reason when it is not built; set
PCIE_AR_REQUIRE_BUILD=1 (CI does) to make a missing build a failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_archs() -> ModuleType:
    # By path, as setup.py does: the package __init__ imports torch.
    spec = importlib.util.spec_from_file_location(
        "_pcie_ar_archs_under_test", ROOT / "pcie_allreduce" / "_archs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


archs = _load_archs()

NVCC_13_0_LIST = "\n".join(
    f"compute_{a}" for a in (75, 80, 86, 87, 88, 89, 90, 100, 110, 103, 120, 121)
)
NVCC_12_6_LIST = "\n".join(f"sm_{a}" for a in (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90)) + "\nsm_90a"


# --------------------------------------------------------------------------- arch parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90", [90]),
        ("80;86;89;90;100;120", [80, 86, 89, 90, 100, 120]),
        ("120,80 , 90", [80, 90, 120]),
        ("  86\t89\n", [86, 89]),
        ("9.0", [90]),
        ("8.6;12.0;10.0", [86, 100, 120]),
        ("sm_90;compute_100;SM80", [80, 90, 100]),
        ("90;9.0;sm_90;", [90]),
    ],
)
def test_parse_arch_list_valid(text: str, expected: list[int]) -> None:
    assert archs.parse_arch_list(text) == expected


@pytest.mark.parametrize(
    "text", ["", " ;, ", "native", "all", "90a", "sm_90a", "9.0.1", "8.10", "abc", "30", "9", "90+PTX"]
)
def test_parse_arch_list_invalid(text: str) -> None:
    with pytest.raises(archs.ArchError):
        archs.parse_arch_list(text)


def test_arch_error_is_value_error_naming_the_token() -> None:
    with pytest.raises(ValueError, match="native"):
        archs.parse_arch_list("90;native")


def test_parse_nvcc_arch_list() -> None:
    assert archs.parse_nvcc_arch_list(NVCC_13_0_LIST) == {75, 80, 86, 87, 88, 89, 90, 100, 110, 103, 120, 121}
    # Arch-specific entries are not archs of their own.
    assert 90 in archs.parse_nvcc_arch_list(NVCC_12_6_LIST)
    assert archs.parse_nvcc_arch_list("sm_100a\nsm_100f\n") == set()
    assert archs.parse_nvcc_arch_list("") == set()


def test_select_defaults_filtered_by_nvcc() -> None:
    assert archs.select_archs(None, archs.parse_nvcc_arch_list(NVCC_13_0_LIST)) == list(archs.DEFAULT_ARCHS)
    # An nvcc without Blackwell keeps the rest.
    assert archs.select_archs("", archs.parse_nvcc_arch_list(NVCC_12_6_LIST)) == [80, 86, 89, 90]
    # Unknown support: trust the defaults.
    assert archs.select_archs(None, None) == list(archs.DEFAULT_ARCHS)
    assert archs.DEFAULT_ARCHS == (80, 86, 89, 90, 100, 120)


def test_select_explicit_request() -> None:
    supported = archs.parse_nvcc_arch_list(NVCC_13_0_LIST)
    assert archs.select_archs("9.0", supported) == [90]
    assert archs.select_archs("120;90", None) == [90, 120]
    with pytest.raises(archs.ArchError, match="sm_120"):
        archs.select_archs("90;120", archs.parse_nvcc_arch_list(NVCC_12_6_LIST))
    with pytest.raises(archs.ArchError, match="native"):
        archs.select_archs("native", supported)


def test_select_nothing_supported() -> None:
    with pytest.raises(archs.ArchError, match="12.8"):
        archs.select_archs(None, {50, 52})


def test_cmake_architectures_sass_for_all_ptx_for_highest() -> None:
    assert archs.cmake_architectures([90]) == "90"
    assert archs.cmake_architectures([120, 80, 90, 90]) == "80-real;90-real;120"
    with pytest.raises(archs.ArchError):
        archs.cmake_architectures([])


# --------------------------------------------------------------------------- ELF reading

_FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX, _KIND_ELF = 1, 2


def _elf_sections(data: bytes) -> list[tuple[str, int, int, int]]:
    """(name, file offset, size, sh_link) of each section of a little-endian ELF64 file."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a little-endian ELF64 file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = headers[shstrndx][4]

    def name(at: int) -> str:
        return data[str_off + at : data.index(b"\0", str_off + at)].decode()

    return [(name(h[0]), h[4], h[5], h[6]) for h in headers]


def _section(data: bytes, wanted: str) -> tuple[int, int, int]:
    for name, offset, size, link in _elf_sections(data):
        if name == wanted:
            return offset, size, link
    raise AssertionError(f"no {wanted} section")


def _needed_libraries(data: bytes) -> list[str]:
    """DT_NEEDED entries of the ELF's .dynamic section (what readelf -d shows)."""
    dyn_off, dyn_size, link = _section(data, ".dynamic")
    dynstr_off = _elf_sections(data)[link][1]
    needed = []
    for at in range(dyn_off, dyn_off + dyn_size, 16):
        tag, value = struct.unpack_from("<qQ", data, at)
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            start = dynstr_off + value
            needed.append(data[start : data.index(b"\0", start)].decode())
    return needed


def _fatbins(data: bytes) -> list[list[tuple[int, int]]]:
    """The (kind, sm) entries of every fatbinary in .nv_fatbin, one list per .cu file.

    Layout (as read by cuobjdump): a 16-byte header {u32 magic 0xBA55ED50, u16 version,
    u16 header size, u64 payload size}, then entries {u16 kind (1 PTX, 2 ELF), u16 version,
    u32 header size, u64 payload size, ..., u32 sm at offset 28}.
    """
    offset, size, _ = _section(data, ".nv_fatbin")
    blob = data[offset : offset + size]
    found, pos = [], 0
    while pos + 16 <= len(blob):
        magic, _ver, header, payload = struct.unpack_from("<IHHQ", blob, pos)
        if magic != _FATBIN_MAGIC:
            pos += 8  # fatbins are 8-byte aligned; skip padding
            continue
        entries, at, end = [], pos + header, pos + header + payload
        while at < end:
            kind, _v, entry_header, entry_size = struct.unpack_from("<HHIQ", blob, at)
            (sm,) = struct.unpack_from("<I", blob, at + 28)
            entries.append((kind, sm))
            at += entry_header + entry_size
        found.append(entries)
        pos = end
    return found


# --------------------------------------------------------------------------- built extension


def _built_extension() -> Path:
    """The built _C next to the sources, else in an installed copy; skip if none."""
    # Looked up by file, not imported: importing the package would import torch, and
    # ./pcie_allreduce (no .so after a non-editable install) shadows site-packages.
    dirs = [ROOT / "pcie_allreduce"] + [Path(entry or ".") / "pcie_allreduce" for entry in sys.path]
    for directory in dirs:
        hits = sorted(directory.glob("_C*.so"))
        if hits:
            return hits[0]
    reason = "pcie_allreduce._C is not built (pip install -e . or python setup.py build_ext --inplace)"
    if os.environ.get("PCIE_AR_REQUIRE_BUILD") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def _find_tool(name: str) -> str | None:
    """A CUDA tool next to the nvcc setup.py would pick, else on PATH."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    cudacxx = os.environ.get("CUDACXX")
    candidates = [str(Path(cudacxx).parent / name)] if cudacxx else []
    candidates += [str(Path(h) / "bin" / name) for h in homes if h]
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which(name)


def _expected_archs() -> list[int]:
    """What the build should contain: PCIE_AR_CUDA_ARCHS, else the defaults nvcc supports."""
    nvcc = _find_tool("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: cannot tell which archs the build should contain")
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    return archs.select_archs(os.environ.get(archs.ENV_VAR), archs.parse_nvcc_arch_list(out))


def test_extension_has_sass_for_every_arch_and_ptx_for_highest() -> None:
    data = _built_extension().read_bytes()
    expected = _expected_archs()
    fatbins = _fatbins(data)
    assert fatbins, "no fatbinary found in .nv_fatbin"
    for entries in fatbins:  # one per .cu file
        sass = sorted(sm for kind, sm in entries if kind == _KIND_ELF)
        ptx = sorted(sm for kind, sm in entries if kind == _KIND_PTX)
        assert sass == expected, (
            f"SASS for {sass}, expected {expected}; a build made with {archs.ENV_VAR} set "
            f"must be tested with the same {archs.ENV_VAR} exported"
        )
        assert ptx == [max(expected)], f"PTX for {ptx}, expected only sm_{max(expected)}"


def test_cuobjdump_lists_sass_for_every_arch() -> None:
    so = _built_extension()
    cuobjdump = _find_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (the fatbin parser test covers the same ground)")
    out = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
    listed = {int(m) for m in re.findall(r"\.sm_(\d+)[a-z]?\.cubin", out)}
    assert listed == set(_expected_archs())


def test_extension_links_no_cuda_driver_cudart_or_torch() -> None:
    so = _built_extension()
    needed = _needed_libraries(so.read_bytes())
    assert needed, "no DT_NEEDED entries read"
    banned = ("libcuda.", "libcudart.", "libtorch", "libc10", "libpython")
    assert not [lib for lib in needed if lib.startswith(banned)], needed
    readelf = shutil.which("readelf")
    if readelf:  # cross-check the parser
        out = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True).stdout
        assert re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out) == needed


def test_extension_loads_without_gpu() -> None:
    # In a child process: loading the module a second time under another name in this
    # process would re-register its pybind11 types. By path, so the torch-importing
    # package __init__ stays out; static cudart does nothing until called, so this
    # works on a machine without libcuda.
    so = _built_extension()
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('_C', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print('loaded', module.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(so)], capture_output=True, text=True)
    assert result.returncode == 0 and "loaded _C" in result.stdout, result.stderr
